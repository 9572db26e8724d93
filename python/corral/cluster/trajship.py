"""The gateway's copies of its nodes' trajectory logs, so a lost node's episodes can still be
read (``corral log``) and replayed on another node (``corral replay``).

Each node's log is shipped continuously, not at its death (a machine that vanishes ships
nothing then): every ``SHIP_INTERVAL_S`` the gateway asks each node's supervisor for the rows
its copy lacks (corral.cluster.trajsource: entries past the copy's highest ``seq``, the rows
it holds open again) and writes them into ``<gateway state dir>/nodes/<node>/trajlog.db``, a
database of the node log's own schema, so the daemon's reader answers from it unchanged.
Pulled by the gateway, at least once, idempotent: rows are stored under their ``seq``
(``INSERT OR REPLACE``), and the cursor is the copy's own content, committed with the rows,
so a gateway started again goes on from what it has: no gap, nothing stored twice. What a
lost node's copy can lack: what the node logged in its last shipping interval (plus the
node's own ingest delay, ``CORRAL_TRAJLOG_FLUSH_MS``).

All SQLite work runs on one thread of its own, never on the gateway's event loop.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from corral.cluster.trajsource import ENTRY_COLS, SANDBOX_COLS
from corral.daemon.tenants import TENANT_LABEL
from corral.daemon.trajlog import _SCHEMA, DB_NAME, Reader, interrupted_error
from corral.daemon.trajlog.keys import _dumps
from corral.daemon.trajlog.schema import _SANDBOX_SEQS, _STARTED_INDEX, _migrate, prune_ended

SHIP_INTERVAL_S = 0.5
PRUNE_EVERY_S = 600.0  # how often the copies drop what the nodes' retention drops
SHIP_MAX_BYTES = 4 << 20     # per node and call: a call stays short, a backlog takes several
OPEN_SANDBOXES_PER_CALL = 256  # open sandboxes whose end is asked for, in turn, per call


class LogCopies:
    """Per node, a copy of its trajectory log (``<root>/nodes/<node>/trajlog.db``)."""

    def __init__(self, root: str, retention_s: float = 7 * 86400) -> None:
        self.root = root
        self.retention_s = retention_s  # an ended sandbox's rows, as on the nodes
        os.makedirs(os.path.join(root, "nodes"), mode=0o700, exist_ok=True)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="trajship")
        self._conns: dict[str, sqlite3.Connection] = {}
        self._rotor: dict[str, str] = {}  # node -> the last open sandbox asked about
        self._mu = threading.Lock()
        self.sealed: set[str] = set()  # lost nodes: nothing more is stored for them
        # Per node: rows past the cursor received, rows received again (open ones), calls.
        self.stats: dict[str, dict[str, int]] = {}

    def dir_of(self, node: str) -> str:
        return os.path.join(self.root, "nodes", node)

    def nodes(self) -> list[str]:
        d = os.path.join(self.root, "nodes")
        return sorted(n for n in os.listdir(d) if os.path.exists(os.path.join(d, n, DB_NAME)))

    def _db(self, node: str) -> sqlite3.Connection:
        conn = self._conns.get(node)
        if conn is None:
            os.makedirs(self.dir_of(node), mode=0o700, exist_ok=True)
            conn = sqlite3.connect(os.path.join(self.dir_of(node), DB_NAME),
                                   isolation_level=None, check_same_thread=False, timeout=30)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.executescript(_SCHEMA)
            _migrate(conn)
            conn.execute(_STARTED_INDEX)  # the rows held open, asked again every call
            self._conns[node] = conn
        return conn

    # ---- on the shipping thread ------------------------------------------------------------
    def cursor(self, node: str) -> dict[str, Any]:
        """What to ask node ``node`` for: entries past ``after``, the started rows held open
        (``recheck``), a slice of the sandboxes not known to have ended (``sandboxes``)."""
        conn = self._db(node)
        after = _shipped(conn)
        recheck = [r[0] for r in conn.execute(
            "SELECT seq FROM entries WHERE status='started' ORDER BY seq LIMIT 4096")]
        last = self._rotor.get(node, "")
        ids = [r[0] for r in conn.execute(
            "SELECT sandbox_id FROM sandboxes WHERE ended_at IS NULL AND sandbox_id > ? "
            "ORDER BY sandbox_id LIMIT ?", (last, OPEN_SANDBOXES_PER_CALL))]
        self._rotor[node] = ids[-1] if len(ids) == OPEN_SANDBOXES_PER_CALL else ""
        return {"after": after, "recheck": recheck, "sandboxes": ids}

    def apply(self, node: str, after: int, got: dict[str, Any]) -> int:
        """Store a node's answer in one transaction; the number of rows past ``after``."""
        if node in self.sealed:
            return 0  # an answer that arrived after the node was lost: the seal stands
        conn = self._db(node)
        entries = [tuple(r) for r in got.get("entries") or ()]
        fresh = sum(1 for r in entries if r[0] > after)
        conn.execute("BEGIN")
        try:
            if entries:
                conn.executemany(f"INSERT OR REPLACE INTO entries ({ENTRY_COLS}) VALUES "
                                 f"({','.join('?' * 12)})", entries)
                conn.executemany("INSERT OR IGNORE INTO entries_by_sandbox (sandbox_id, seq) "
                                 "VALUES (?, ?)", [(r[1], r[0]) for r in entries])
            for seq in got.get("gone") or ():
                conn.execute("DELETE FROM entries WHERE seq=?", (seq,))
                conn.execute("DELETE FROM entries_by_sandbox WHERE seq=?", (seq,))
            rows = [tuple(r) for r in got.get("sandboxes") or ()]
            if rows:
                conn.executemany(f"INSERT OR REPLACE INTO sandboxes ({SANDBOX_COLS}) VALUES "
                                 "(?,?,?,?,?,?)", rows)
            # Every row is indexed as it comes: the reader's unindexed tail is empty.
            conn.execute("UPDATE log_meta SET v=(SELECT coalesce(max(seq), 0) FROM entries) "
                         "WHERE k='indexed'")
            # The cursor, kept apart from the rows: pruning them does not move it back.
            conn.execute("INSERT OR REPLACE INTO log_meta (k, v) VALUES ('shipped', ?)",
                         (max(_shipped(conn), after),))
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        with self._mu:
            st = self.stats.setdefault(node, {"rows": 0, "again": 0, "calls": 0})
            st["rows"] += fresh
            st["again"] += len(entries) - fresh
            st["calls"] += 1
        return fresh

    def seal(self, node: str, reason: str = "lost") -> int:
        """Node ``node`` is gone: its calls in flight are interrupted (as a daemon's restart
        marks them) and its sandboxes ended (``reason``). The number of sandboxes ended."""
        self.sealed.add(node)
        conn = self._db(node)
        now = time.time()
        conn.execute("BEGIN")
        try:
            rows = conn.execute("SELECT seq, sandbox_id, op, idem_key, started_at FROM entries "
                                "WHERE status='started'").fetchall()
            conn.executemany("UPDATE entries SET status='interrupted', error=? WHERE seq=?",
                             [(_dumps(interrupted_error(r[1], r[2], r[3], r[4], r[0])), r[0])
                              for r in rows])
            n = conn.execute("UPDATE sandboxes SET ended_at=?, reason=? WHERE ended_at IS NULL",
                             (now, reason)).rowcount
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        return int(n)

    def prune(self, node: str, now: float, live: bool) -> int:
        """Drop from node ``node``'s copy what its own log drops (the sandboxes that ended
        more than ``retention_s`` ago); a copy of a node gone (not ``live``) that is left
        empty is removed. The number of sandboxes pruned."""
        conn = self._db(node)
        conn.execute("BEGIN")
        try:
            n = prune_ended(conn, now - self.retention_s)
            conn.execute("UPDATE log_meta SET v=(SELECT coalesce(max(seq), 0) FROM entries) "
                         "WHERE k='indexed'")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        if not live and not conn.execute("SELECT 1 FROM sandboxes UNION ALL SELECT 1 FROM "
                                          "entries LIMIT 1").fetchone():
            conn.close()
            del self._conns[node]
            shutil.rmtree(self.dir_of(node), ignore_errors=True)
            self.sealed.discard(node)
        return n

    def find(self, sid: str) -> str | None:
        """The node whose copy has sandbox ``sid``."""
        for node in self.nodes():
            if self._db(node).execute("SELECT 1 FROM sandboxes WHERE sandbox_id=? UNION ALL "
                                      "SELECT 1 FROM entries_by_sandbox WHERE sandbox_id=? "
                                      "LIMIT 1", (sid, sid)).fetchone():
                return node
        return None

    def trajectory(self, nodes: list[str], tid: str) -> dict[str, Any] | None:
        """Where trajectory ``tid`` stands in the copies of ``nodes`` (lost ones), as a node
        answers it: its sandbox id, the next step, the sandbox as its create logged it (state
        ``dead``), and the node whose copy has it."""
        for node in nodes:
            got = Reader(self.dir_of(node))._trajectory(tid)
            if got is None:
                continue
            sid, step = got
            row = self._db(node).execute(  # by the sandbox's seqs: no scan of every entry
                f"SELECT result FROM entries WHERE seq IN ({_SANDBOX_SEQS}) AND op='create' "
                "AND status IS NULL AND result IS NOT NULL ORDER BY seq LIMIT 1",
                {"sid": sid}).fetchone()
            info = dict(json.loads(row[0]) if row else {"id": sid}, state="dead")
            return {"trajectory_id": tid, "sandbox_id": sid, "step": step, "sandbox": info,
                    "node": node}
        return None

    def owner_of(self, node: str, sid: str) -> tuple[bool, str | None]:
        """(whether node ``node``'s copy has sandbox ``sid``'s log, the tenant it belongs to),
        from its sandbox row and its first entry: never the whole log (a tenant's calls on
        a lost sandbox must not each load it)."""
        conn = self._db(node)
        srow = conn.execute("SELECT spec FROM sandboxes WHERE sandbox_id=?", (sid,)).fetchone()
        first = conn.execute(f"SELECT op, request FROM entries WHERE seq IN ({_SANDBOX_SEQS}) "
                             "ORDER BY seq LIMIT 1", {"sid": sid}).fetchone()
        if srow is None and first is None:
            return False, None
        head: dict[str, Any] = {
            "sandbox": {"spec": json.loads(srow[0]) if srow and srow[0] else None},
            "entries": [{"op": first[0], "request": json.loads(first[1])}] if first else []}
        return True, owner(head)

    def stream(self, node: str, sid: str, jsonl: bool, more: bytes = b""
               ) -> Any:
        """Sandbox ``sid``'s log from node ``node``'s copy as pages of pieces (the node's
        own ``Reader.stream``): the gateway holds one page, never the whole log."""
        return Reader(self.dir_of(node)).stream(sid, jsonl=jsonl, more=more)

    def read(self, node: str, sid: str) -> dict[str, Any] | None:
        """Sandbox ``sid``'s log from node ``node``'s copy, as the node answers it."""
        got = Reader(self.dir_of(node)).read(sid)
        if got is None:
            return None
        sandbox, entries = got
        return {"sandbox_id": sid, "sandbox": sandbox, "entries": entries}

    def top(self, node: str) -> int:
        return int(self._db(node).execute("SELECT max(seq) FROM entries").fetchone()[0] or 0)

    def close(self) -> None:
        def shut() -> None:
            for c in self._conns.values():
                c.close()
            self._conns.clear()
        self.pool.submit(shut).result(timeout=30)
        self.pool.shutdown()


def _shipped(conn: sqlite3.Connection) -> int:
    """A copy's cursor: the highest ``seq`` it received (a copy from before the cursor was
    kept apart: its highest row)."""
    row = conn.execute("SELECT v FROM log_meta WHERE k='shipped'").fetchone()
    top = conn.execute("SELECT coalesce(max(seq), 0) FROM entries").fetchone()[0]
    return max(int(row[0]) if row else 0, int(top))


def owner(log: dict[str, Any]) -> str | None:
    """The tenant a logged sandbox belongs to (None: the admin's)."""
    spec = (log.get("sandbox") or {}).get("spec") or {}
    labels = spec.get("labels") if isinstance(spec, dict) else None
    if not labels and log.get("entries"):
        first = log["entries"][0]
        labels = (first.get("request") or {}).get("labels") if first["op"] == "create" else None
    return labels.get(TENANT_LABEL) if isinstance(labels, dict) else None
