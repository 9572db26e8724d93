"""A node's side of trajectory-log shipping: what the gateway's copy lacks, read from the
node's own log database (``<state dir>/trajlog.db``), on the supervisor, never on corrald.

corrald writes the database (its ingester, behind the calls); this only reads it, on its own
connection (WAL: a reader never blocks the writer). Entry numbers (``seq``) are given in
journal order and the ingester commits the journal in order, so everything up to the highest
committed ``seq`` is there: a cursor on ``seq`` misses nothing new. The only rows that change
after they are written are started rows (a call in flight: its end replaces the row under the
same ``seq``, or drops it) and the sandboxes' rows (their end); the gateway names those it
holds open (``recheck``, ``sandboxes``), and gets the started rows that ended and the
sandboxes' rows again. An answer's bytes are bounded, whatever a tenant keeps in flight.
"""

from __future__ import annotations

import os
import sqlite3
from typing import Any

from corral.daemon.trajlog.keys import STARTED
from corral.daemon.trajlog.schema import DB_NAME

ENTRY_COLS = ("seq, sandbox_id, op, idem_key, fingerprint, request, result, error, "
              "started_at, ended_at, snapshot_ids, status")
SANDBOX_COLS = "sandbox_id, spec, created_at, ended_at, reason, net"
CHUNK = 256


class LogSource:
    """Reads one node's log database for the gateway's copy (corral.cluster.trajship)."""

    def __init__(self, state_dir: str) -> None:
        self.path = os.path.join(state_dir, DB_NAME)
        self._conn: sqlite3.Connection | None = None

    def _db(self) -> sqlite3.Connection | None:
        if self._conn is None:
            if not os.path.exists(self.path):
                return None  # corrald has not made it yet (or the log is off)
            conn = sqlite3.connect(self.path, isolation_level=None, timeout=5,
                                   check_same_thread=False)
            conn.execute("PRAGMA query_only=1")
            self._conn = conn
        return self._conn

    def since(self, after: int, recheck: list[int], sandboxes: list[str],
              max_bytes: int) -> dict[str, Any]:
        """Entries past ``after`` (in ``seq`` order), those of the ``recheck`` seqs that ended
        (``gone``: those no longer there; a row still started has not changed), and the rows
        of the sandboxes named in either plus ``sandboxes``. Each of the three parts stops
        past about ``max_bytes`` (a sandbox's row counted with its first entry), so an answer
        holds at most about three times that; what a part leaves out is asked for again
        (``more``). One read transaction: one snapshot."""
        conn = self._db()
        out: dict[str, Any] = {"entries": [], "gone": [], "sandboxes": [], "top": 0,
                               "more": False}
        if conn is None:
            return out
        srows: dict[str, tuple[Any, ...] | None] = {}

        def sandbox(sid: str) -> int:
            """Sandbox ``sid``'s row taken into the answer: its bytes (0 if taken already)."""
            if sid in srows:
                return 0
            srows[sid] = conn.execute(f"SELECT {SANDBOX_COLS} FROM sandboxes WHERE "
                                      "sandbox_id=?", (sid,)).fetchone()
            return _size(srows[sid])

        conn.execute("BEGIN")
        try:
            out["top"] = conn.execute("SELECT max(seq) FROM entries").fetchone()[0] or 0
            rows: list[tuple[Any, ...]] = []
            size, last = 0, after
            while size < max_bytes:
                got = conn.execute(f"SELECT {ENTRY_COLS} FROM entries WHERE seq > ? "
                                   "ORDER BY seq LIMIT ?", (last, CHUNK)).fetchall()
                for r in got:
                    rows.append(r)
                    size += _size(r) + sandbox(r[1])
                    last = r[0]
                    if size >= max_bytes:
                        break
                if len(got) < CHUNK:
                    break
            out["more"] = last < out["top"]
            if recheck:
                marks = ",".join("?" * len(recheck))
                now = dict(conn.execute(f"SELECT seq, status FROM entries WHERE seq IN "
                                        f"({marks})", recheck).fetchall())
                out["gone"] = [s for s in recheck if s not in now]
                size = 0
                for seq in sorted(s for s, st in now.items() if st != STARTED):
                    if size >= max_bytes:
                        out["more"] = True
                        break
                    r = conn.execute(f"SELECT {ENTRY_COLS} FROM entries WHERE seq=?",
                                     (seq,)).fetchone()
                    rows.append(r)
                    size += _size(r) + sandbox(r[1])
            size = 0
            for sid in sandboxes:  # the open ones, for their end: the rotor comes back
                if size >= max_bytes:
                    break
                size += sandbox(sid)
            out["entries"] = rows
            out["sandboxes"] = [r for r in srows.values() if r is not None]
        finally:
            conn.execute("COMMIT")
        return out

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _size(row: tuple[Any, ...] | None) -> int:
    return sum(len(v) for v in row or () if isinstance(v, (str, bytes)))
