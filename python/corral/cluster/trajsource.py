"""A node's side of trajectory-log shipping: what the gateway's copy lacks, read from the
node's own log database (``<state dir>/trajlog.db``), on the supervisor, never on corrald.

corrald writes the database (its ingester, behind the calls); this only reads it, on its own
connection (WAL: a reader never blocks the writer). Entry numbers (``seq``) are given in
journal order and the ingester commits the journal in order, so everything up to the highest
committed ``seq`` is there: a cursor on ``seq`` misses nothing new. The only rows that change
after they are written are started rows (a call in flight: its end replaces the row under the
same ``seq``, or drops it) and the sandboxes' rows (their end); the gateway names those it
holds open, and gets them again (``recheck``, ``sandboxes``).
"""

from __future__ import annotations

import os
import sqlite3
from typing import Any

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
        """Entries past ``after`` (in ``seq`` order, up to about ``max_bytes``), the current
        rows of the ``recheck`` seqs (``gone``: those no longer there), and the rows of the
        sandboxes named in either plus ``sandboxes``. One read transaction: one snapshot."""
        conn = self._db()
        out: dict[str, Any] = {"entries": [], "gone": [], "sandboxes": [], "top": 0,
                               "more": False}
        if conn is None:
            return out
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
                    size += sum(len(v) for v in r if isinstance(v, str))
                    last = r[0]
                    if size >= max_bytes:
                        break
                if len(got) < CHUNK:
                    break
            out["more"] = last < out["top"]
            if recheck:
                marks = ",".join("?" * len(recheck))
                again = conn.execute(f"SELECT {ENTRY_COLS} FROM entries WHERE seq IN "
                                     f"({marks})", recheck).fetchall()
                have = {r[0] for r in again}
                out["gone"] = [s for s in recheck if s not in have]
                rows += again
            ids = sorted({r[1] for r in rows} | set(sandboxes))
            srows: list[tuple[Any, ...]] = []
            for i in range(0, len(ids), CHUNK):
                part = ids[i:i + CHUNK]
                srows += conn.execute(f"SELECT {SANDBOX_COLS} FROM sandboxes WHERE sandbox_id "
                                      f"IN ({','.join('?' * len(part))})", part).fetchall()
            out["entries"], out["sandboxes"] = rows, srows
        finally:
            conn.execute("COMMIT")
        return out

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
