"""The durable trajectory log: per sandbox, an ordered record of every exec and file operation.

Storage: one SQLite database, ``<state_dir>/trajlog.db``, WAL mode. Every record is committed
*before* the call's result is returned to the client (see ``TrajLog.run``). Two ways in:

* inline, on the event loop (the common case): when nothing is queued for the writer thread
  and it is idle, a call's entry is written and committed right there, one statement in
  autocommit (~16 us: one WAL frame ``pwrite()``, no fsync). No thread hand-off, no future, no
  ``call_soon_threadsafe`` wake-up back: those cost several times the commit itself. A call
  that ends while other calls are in flight joins the entries of the same turn of the loop,
  committed together at its end (one commit for the calls that end together).
* the writer thread (group commit): when it is busy (or has a backlog), a record is queued
  and the call waits; the thread takes every record queued since its last commit and writes
  them in one transaction, so N concurrent calls cost one commit, not N. There is no timer:
  while a commit runs, the next batch accumulates (``CORRAL_TRAJLOG_FLUSH_MS`` adds an
  optional wait to make batches bigger, at the cost of latency).

Both use one connection, never at once: the loop commits inline only while the writer's
backlog (records handed to it, not yet committed) is zero, and only the loop adds to it, so
records reach the database in the order they were submitted either way. A commit on the loop
stalls every call, so it is bounded: one that takes longer than ``INLINE_SLOW_S`` (disk
pressure: a ``write()`` blocked by dirty-page throttling) sends the commits of the next
``INLINE_BACKOFF_S`` (doubled while it happens again) to the writer thread. Checkpoints
never run inline (``wal_autocheckpoint=0`` on the writing connection): a checkpointer thread
copies the WAL into the database every ``CHECKPOINT_EVERY`` records, on its own connection (a
passive checkpoint does not block writers). ``CORRAL_TRAJLOG_SYNC=full`` (an fsync per
commit) never commits inline.

One b-tree per commit: the per-sandbox index is a table (``entries_by_sandbox``) filled every
``INDEX_EVERY`` entries by one statement in that commit's transaction, not a SQL index
updated on every insert (a second WAL page per commit); readers add the unindexed tail
(``seq`` past the ``log_meta`` watermark) with a rowid range scan.

A create's sandbox row (``sandboxes``) is not a commit of its own: it joins the next inline
commit (the create's entry, same turn of the loop) or goes to the writer just ahead of what
is queued next. So a create, like any call, answers only once its entry is committed.

Durability: ``synchronous=NORMAL`` (``CORRAL_TRAJLOG_SYNC=full`` for an fsync per batch). In WAL
mode a commit is a ``write()`` into the WAL: once it returns, the record survives the daemon's
death (kill -9, OOM kill, a crash) because the kernel holds the page. Only a power cut or kernel
crash can lose the last transactions (the database stays consistent; NORMAL syncs the WAL at
checkpoints). So a daemon crash loses nothing a client has seen: a result is only sent after
its record is committed.

Calls in flight: a mutating call (every op in ``STARTED_OPS``) also gets a *started* row, and
never waits for it (no second commit on the call's path). A timer on the event loop queues that
row for the writer once the call has run ``CORRAL_TRAJLOG_START_MS`` (default 20 ms); a call
that ends sooner cancels the timer and is written once, finished (no extra row, thread wake-up
or commit: the common case). A longer call has its started row committed by the next group
commit, and finished in place when it ends. At the next start of the daemon, started rows
still open are marked ``interrupted``: their outcome is unknown (the command may or may not
have run; their callers got ``daemon_restarted``). A call in flight for less than the hold
time at a crash can be missing from the log (its caller saw no result either).

Idempotency: a mutating call may carry the HTTP header ``Idempotency-Key``. Its scope is the
sandbox (``create`` keys are global). A key already logged returns the logged result (or error)
without running anything; the same key with a different request is ``replay_divergence``;
concurrent duplicates wait for the one that runs. Infrastructure errors (``infra``) are logged
but do not bind the key, so a retry after one runs for real; neither do interrupted rows: a
retry after a crash runs the call for real, and the log keeps both rows (the interrupted one
and the retry), so a reader can see the call may have run twice.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import os
import queue
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from corral.errors import (
    CorralError,
    InternalError,
    ReplayDivergence,
    SandboxNotFound,
    Unsupported,
    error_from_payload,
)

log = logging.getLogger("corral.trajlog")

KEY_HEADER = "Idempotency-Key"
MAX_KEY_LEN = 256
DB_NAME = "trajlog.db"
PRUNE_EVERY_S = 60.0
# An inline commit (on the event loop) slower than this sends the next commits to the writer
# thread for a while: INLINE_BACKOFF_S, doubled for every slow inline commit in a row (up to
# INLINE_BACKOFF_MAX_S), back to the minimum after a fast one. A slow disk then stalls the
# loop a few times, then rarely; a one-off (this process preempted on a busy machine) costs
# only a short spell of thread hand-offs.
INLINE_SLOW_S = 0.002
INLINE_BACKOFF_S = 0.05
INLINE_BACKOFF_MAX_S = 5.0
# Records between two WAL checkpoints (run by the checkpointer thread, never inline): one or
# two pages each, so the WAL stays under ~10 MB.
CHECKPOINT_EVERY = 1000
# Entries between two updates of the per-sandbox index (``entries_by_sandbox``): a commit
# writes one b-tree (the row) instead of two; every INDEX_EVERY entries one commit also
# indexes the ones since the last time (a handful of index pages for all of them). Readers
# find the rest, the unindexed tail, by a short rowid range scan.
INDEX_EVERY = 64
# Ops that change a sandbox: they get a started row (create does not: its id is not known
# before it ends, and a half-made sandbox is removed at restart anyway).
STARTED_OPS = frozenset({"exec", "write", "upload", "mkdir", "remove", "rename", "snapshot",
                         "fork", "restore", "pause", "resume", "kill"})
# entries.status: NULL for a finished call (every row of older logs), else one of these.
STARTED, INTERRUPTED = "started", "interrupted"
INTERRUPTED_ERROR = {"error": {
    "code": "daemon_restarted",
    "message": "the daemon died while this call was in flight: its outcome is unknown (it may "
               "or may not have run)",
    "details": {"interrupted": True}}}

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    seq INTEGER PRIMARY KEY,
    sandbox_id TEXT NOT NULL,
    op TEXT NOT NULL,
    idem_key TEXT,
    fingerprint TEXT,
    request TEXT NOT NULL,
    result TEXT,
    error TEXT,
    started_at REAL NOT NULL,
    ended_at REAL NOT NULL,
    snapshot_ids TEXT,
    status TEXT
);
CREATE INDEX IF NOT EXISTS entries_key ON entries (idem_key) WHERE idem_key IS NOT NULL;
-- A sandbox's entries, filled in batches (INDEX_EVERY) up to log_meta 'indexed' (a seq):
-- the entries after it (the tail) are found by scanning seq > indexed.
CREATE TABLE IF NOT EXISTS entries_by_sandbox (
    sandbox_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    PRIMARY KEY (sandbox_id, seq)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS log_meta (k TEXT PRIMARY KEY, v INTEGER) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS sandboxes (
    sandbox_id TEXT PRIMARY KEY,
    spec TEXT,
    created_at REAL,
    ended_at REAL,
    reason TEXT
);
"""
# After the status column exists (logs written before it had none: added by _migrate).
_STARTED_INDEX = ("CREATE INDEX IF NOT EXISTS entries_started ON entries (seq) "
                  "WHERE status = 'started'")
# A sandbox's entries (seqs): the indexed ones and the tail (one statement: one snapshot).
_SANDBOX_SEQS = ("SELECT seq FROM entries_by_sandbox WHERE sandbox_id=:sid UNION ALL "
                 "SELECT seq FROM entries WHERE seq > (SELECT v FROM log_meta WHERE "
                 "k='indexed') AND sandbox_id=:sid")
_INSERT_SANDBOX = ("INSERT OR REPLACE INTO sandboxes (sandbox_id, spec, created_at) "
                   "VALUES (?,?,?)")
_ENDED = "UPDATE sandboxes SET ended_at=?, reason=? WHERE sandbox_id=? AND ended_at IS NULL"
_INSERT = ("INSERT INTO entries (sandbox_id, op, idem_key, fingerprint, request, result, "
           "error, started_at, ended_at, snapshot_ids, status) VALUES (?,?,?,?,?,?,?,?,?,?,?)")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fingerprint(op: str, request: dict[str, Any]) -> str:
    return sha256(json.dumps([op, request], sort_keys=True, separators=(",", ":")).encode())


def body_request(data: bytes, cap: int, **fields: Any) -> dict[str, Any]:
    """A request with a raw body (file write, tar upload): its size and hash always, the bytes
    themselves (base64) when they fit the cap, so that replay can send them again."""
    req = dict(fields, size=len(data), sha256=sha256(data))
    if len(data) <= cap:
        req["data_b64"] = base64.b64encode(data).decode()
    return req


def data_result(data: bytes, **fields: Any) -> dict[str, Any]:
    """What a read logs: size and hash of what the client got, not the bytes."""
    return dict(fields, size=len(data), sha256=sha256(data))


# json.dumps(obj, separators=...) builds a JSONEncoder and a C encoder per call: build the C
# encoder once (compact, no circular-reference check: requests and results are trees).
_ENCODE = (json.encoder.c_make_encoder(  # type: ignore[attr-defined]
    None, json.JSONEncoder().default, json.encoder.encode_basestring_ascii, None, ":", ",",
    False, False, True) if json.encoder.c_make_encoder is not None else None)  # type: ignore[attr-defined]


def _dumps(obj: Any) -> str:
    if _ENCODE is None:  # no C accelerator
        return json.dumps(obj, separators=(",", ":"))
    return "".join(_ENCODE(obj, 0))


class _Pending:
    """A record queued for the writer; ``fut`` resolves once it is committed."""

    __slots__ = ("kind", "args", "fut")

    def __init__(self, kind: str, args: tuple[Any, ...], fut: asyncio.Future[Any] | None):
        self.kind = kind
        self.args = args
        self.fut = fut


class _Start:
    """The started row of a call in flight. Lives on the loop (``TrajLog._held``) until the
    call has run ``start_ms``; then it is queued for the writer (``queued``). A call that ends
    sooner is written once, finished. ``rowid`` is set by the writer once the row is in the
    database (its end then updates it in place)."""

    __slots__ = ("sid", "op", "request", "key", "fp", "started_at", "t", "queued", "rowid")

    kind = "start"
    fut = None

    def __init__(self, sid: str, op: str, request: dict[str, Any], started_at: float,
                 key: str | None, fp: str | None) -> None:
        self.sid, self.op, self.request, self.started_at = sid, op, request, started_at
        self.key, self.fp = key, fp
        self.t = time.monotonic()
        self.queued = False
        self.rowid: int | None = None

    @property
    def args(self) -> tuple[Any, ...]:
        return (self.sid, self.op, self.key, self.fp, _dumps(self.request), None, None,
                self.started_at, self.started_at, None, STARTED)


SnapIds = list[str] | Callable[[Any], list[str]] | None


class TrajLog:
    def __init__(self, state_dir: str, *, enabled: bool = True, retention_s: float = 7 * 86400,
                 output_cap: int = 1 << 20, body_cap: int = 1 << 20, sync: str = "normal",
                 flush_ms: float = 0.0, start_ms: float = 20.0) -> None:
        self.enabled = enabled
        self.path = os.path.join(state_dir, DB_NAME)
        self.retention_s = retention_s
        self.output_cap = output_cap
        self.body_cap = body_cap
        self.sync = "FULL" if sync.lower() == "full" else "NORMAL"
        self.flush_s = max(0.0, flush_ms) / 1000.0
        self.start_hold_s = max(0.0, start_ms) / 1000.0
        # Tests only (tests/test_crash.py): while this file exists the writer thread holds
        # its batches uncommitted, so a test can kill -9 the daemon with entries queued.
        self._hold_file = os.environ.get("CORRAL_TRAJLOG_TEST_HOLD_FILE") or None
        self._q: queue.SimpleQueue[_Pending | _Start | None] = queue.SimpleQueue()
        # Records handed to the writer and not yet committed. Only the loop adds (under _mu),
        # only the writer subtracts (after its commit): zero means the writer is not using
        # the connection and will not until the loop queues something.
        self._mu = threading.Lock()
        self._backlog = 0
        self._inline = self.sync == "NORMAL"  # FULL: an fsync per commit, never on the loop
        self._inline_after = 0.0  # monotonic: no inline commit before (after a slow one)
        self._backoff = INLINE_BACKOFF_S  # the next slow inline commit's spell
        self._conn: sqlite3.Connection | None = None  # the writing connection (loop + writer)
        self._cur: sqlite3.Cursor | None = None  # its cursor for entries
        self._ckpt = threading.Event()
        self._ckpt_thread: threading.Thread | None = None
        self._since_ckpt = 0
        self._unindexed = 0  # entries inserted since (both threads, never at once)
        self._closing = False
        # Writes to the sandboxes table (a create's row, an end) made on the loop, not yet
        # written: they join the next inline commit (one commit for a create's sandbox row
        # and its entry, a kill's entry and the end) or go to the writer ahead of whatever
        # is queued next (``_enqueue``), or are written at the end of the turn.
        self._sb_rows: list[tuple[str, tuple[Any, ...]]] = []  # (statement, args)
        # Entries of this turn of the loop, committed together at its end, and their future.
        self._turn: tuple[list[tuple[Any, ...]], asyncio.Future[Any]] | None = None
        self._active = 0  # calls in _run_and_log between their start and their entry
        # Started rows held on the loop, oldest first (O(1) removal anywhere, O(1) oldest),
        # and the one timer that queues the due ones (armed while any is held; not per call).
        self._held: OrderedDict[_Start, None] = OrderedDict()
        self._tick: asyncio.TimerHandle | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: sqlite3.Connection | None = None
        self._inflight: dict[tuple[str, str], asyncio.Future[Any]] = {}
        self._last_prune = 0.0
        self.interrupted = 0  # started rows found open (and marked interrupted) at open()
        self.stats = {"records": 0, "commits": 0, "started_rows": 0, "inline": 0,
                      "inline_slow": 0, "inline_us": 0, "checkpoints": 0}

    # ---- lifecycle ---------------------------------------------------------------------------
    def _connect(self, autocheckpoint: int = 4000) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False,
                               timeout=30)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={self.sync}")
        conn.execute(f"PRAGMA wal_autocheckpoint={autocheckpoint}")
        return conn

    def open(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self.enabled:
            return
        self._loop = loop
        os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
        conn = self._connect()
        try:
            conn.executescript(_SCHEMA)
            _migrate(conn)
            conn.execute(_STARTED_INDEX)
            # Entries committed since the last index update (all of them in a log written
            # before entries_by_sandbox existed).
            _index_tail(conn)
            # Before any new call can start: what was in flight when the last daemon died.
            cur = conn.execute("UPDATE entries SET status=?, error=? WHERE status=?",
                               (INTERRUPTED, _dumps(INTERRUPTED_ERROR), STARTED))
            self.interrupted = cur.rowcount
            if self.interrupted:
                log.warning("calls interrupted by the last daemon's death",
                            extra={"count": self.interrupted})
        finally:
            conn.close()
        self._reader = self._connect()
        # Commits on the loop must never run a checkpoint (ms of I/O): the checkpointer does.
        self._conn = self._connect(autocheckpoint=0)
        # One cursor for every entry written (on the loop or by the writer, never at once):
        # ``Connection.execute`` makes and frees a cursor per call.
        self._cur = self._conn.cursor()
        self._closing = False
        self._thread = threading.Thread(target=self._writer, name="trajlog-writer", daemon=True)
        self._thread.start()
        self._ckpt_thread = threading.Thread(target=self._checkpointer,
                                             name="trajlog-checkpoint", daemon=True)
        self._ckpt_thread.start()

    def close(self) -> None:
        """Flush what is queued and stop the writer and the checkpointer."""
        if self._thread is not None:
            if self._sb_rows:
                self._enqueue(_Pending("barrier", (), None))
            self._q.put(None)
            self._thread.join(30)
            self._thread = None
        if self._ckpt_thread is not None:
            self._closing = True
            self._ckpt.set()
            self._ckpt_thread.join(30)
            self._ckpt_thread = None
        if self._conn is not None:
            self._conn.close()  # the last writer: SQLite checkpoints the WAL on close
            self._conn = None
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    # ---- the writer thread (group commit) ----------------------------------------------------
    def _writer(self) -> None:
        conn = self._conn
        assert conn is not None
        stop = False
        while not stop:
            item = self._q.get()
            batch: list[Any] = []
            if item is None:
                stop = True
            else:
                batch.append(item)
                if self.flush_s:
                    time.sleep(self.flush_s)
            while True:
                try:
                    item = self._q.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                else:
                    batch.append(item)
            if batch:
                while self._hold_file and os.path.exists(self._hold_file):
                    time.sleep(0.01)  # tests only: hold the writer to widen a crash window
                self._commit(conn, batch)
                self._committed(len(batch))

    def _checkpointer(self) -> None:
        """Copy the WAL into the database when CHECKPOINT_EVERY records have been committed
        (passive: never waits for, nor blocks, the writing connection)."""
        conn = self._connect(autocheckpoint=0)
        try:
            while True:
                self._ckpt.wait()
                self._ckpt.clear()
                if self._closing:
                    return
                try:
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                    self.stats["checkpoints"] += 1
                except sqlite3.Error:
                    log.exception("trajectory log checkpoint failed")
        finally:
            conn.close()

    def _committed(self, n: int) -> None:
        self._since_ckpt += n  # both threads add: a lost update only delays a checkpoint
        if self._since_ckpt >= CHECKPOINT_EVERY:
            self._since_ckpt = 0
            self._ckpt.set()

    def _commit(self, conn: sqlite3.Connection, batch: list[Any]) -> None:
        results: list[tuple[asyncio.Future[Any], Any, BaseException | None]] = []
        try:
            conn.execute("BEGIN")
            out = [self._apply(conn, p) for p in batch]
            self._unindexed += len(batch)
            self._maybe_index(conn)
            conn.execute("COMMIT")
            self.stats["commits"] += 1
            self.stats["records"] += len(batch)
            results = [(p.fut, v, None) for p, v in zip(batch, out, strict=True)
                       if p.fut is not None]
        except Exception as e:  # noqa: BLE001 - report it to every waiter
            log.exception("trajectory log write failed")
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            for p in batch:
                if p.kind == "start":
                    p.rowid = None  # not in the database: its end inserts a whole row
            results = [(p.fut, None, e) for p in batch if p.fut is not None]
        # Done with the connection: the loop may commit inline again, and does so as soon as
        # the callers it wakes below resume (not one call later).
        with self._mu:
            self._backlog -= len(batch)
        if results and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(_resolve, results)
            except RuntimeError:  # the loop is closed (daemon exiting)
                pass

    def _apply(self, conn: sqlite3.Connection, p: Any) -> Any:
        if p.kind == "start":
            p.rowid = conn.execute(_INSERT, p.args).lastrowid
            self.stats["started_rows"] += 1
            return p.rowid
        if p.kind == "entry":
            assert self._cur is not None
            return _apply_entry(self._cur, p.args)
        if p.kind == "drop":
            start = p.args[0]
            if start.rowid is not None:
                conn.execute("DELETE FROM entries WHERE seq=?", (start.rowid,))
                conn.execute("DELETE FROM entries_by_sandbox WHERE sandbox_id=? AND seq=?",
                             (start.sid, start.rowid))
                self._lower_watermark(conn)
            return None
        if p.kind == "sql":  # a sandboxes-table write made on the loop (``_sb_rows``)
            conn.execute(*p.args)
            return None
        if p.kind == "ended_except":
            live = set(p.args[1])
            now = p.args[0]
            rows = conn.execute("SELECT sandbox_id FROM sandboxes WHERE ended_at IS NULL")
            gone = [(now, r[0]) for r in rows.fetchall() if r[0] not in live]
            conn.executemany("UPDATE sandboxes SET ended_at=?, reason='lost' WHERE "
                             "sandbox_id=?", gone)
            return None
        if p.kind == "barrier":
            return None
        if p.kind == "readopted":
            return self._backfill(conn, p.args[0])
        if p.kind == "prune":
            cutoff = p.args[0]
            old = [r[0] for r in conn.execute(
                "SELECT sandbox_id FROM sandboxes WHERE ended_at IS NOT NULL AND ended_at < ?",
                (cutoff,)).fetchall()]
            for sid in old:
                conn.execute(f"DELETE FROM entries WHERE seq IN ({_SANDBOX_SEQS})",
                             {"sid": sid})
                conn.execute("DELETE FROM entries_by_sandbox WHERE sandbox_id=?", (sid,))
                conn.execute("DELETE FROM sandboxes WHERE sandbox_id=?", (sid,))
            # Entries of ids the log has no sandbox row for (a call on a sandbox of an older
            # state dir, say): by their own age.
            gone = conn.execute("SELECT sandbox_id, seq FROM entries WHERE ended_at < ? AND "
                                "sandbox_id NOT IN (SELECT sandbox_id FROM sandboxes)",
                                (cutoff,)).fetchall()
            conn.executemany("DELETE FROM entries WHERE seq=?", [(r[1],) for r in gone])
            conn.executemany("DELETE FROM entries_by_sandbox WHERE sandbox_id=? AND seq=?",
                             gone)
            self._lower_watermark(conn)
            return len(old)
        raise ValueError(p.kind)

    def _backfill(self, conn: sqlite3.Connection,
                  boxes: list[tuple[str, dict[str, Any], float, dict[str, Any]]]) -> int:
        """Re-adopted sandboxes the log has no create for (their daemon died between the
        sandbox's record and the create's commit, so no client saw it): their sandbox row and
        create entry, from the record; the count written."""
        n = 0
        for sid, spec, created_at, info in boxes:
            if conn.execute("SELECT 1 FROM sandboxes WHERE sandbox_id=?", (sid,)).fetchone() \
                    is None:
                conn.execute(_INSERT_SANDBOX, (sid, _dumps(spec), created_at))
            if conn.execute(f"SELECT 1 FROM entries WHERE seq IN ({_SANDBOX_SEQS}) AND "
                            "op='create' LIMIT 1", {"sid": sid}).fetchone() is not None:
                continue
            snap = info.get("snapshot")
            conn.execute(_INSERT, (sid, "create", None, None, _dumps(spec),
                                   _dumps(dict(info, recovered=True)), None, created_at,
                                   time.time(), json.dumps([snap]) if snap else None, None))
            n += 1
        if n:
            log.warning("re-adopted sandboxes without a create entry: written from their "
                        "records", extra={"count": n})
        return n

    def _enqueue(self, item: _Pending | _Start) -> None:
        """Hand a record to the writer thread (on the loop only: see ``_backlog``), behind
        the sandbox rows not yet written (a sandbox's end must follow its creation)."""
        with self._mu:
            if self._sb_rows:
                self._backlog += len(self._sb_rows)
                for r in self._sb_rows:
                    self._q.put(_Pending("sql", r, None))
                self._sb_rows = []
            self._backlog += 1
            self._q.put(item)

    def _flush_sandboxes(self) -> None:
        """End of the turn a sandbox row was made in: write it if no entry took it along."""
        if not self._sb_rows:
            return
        if self._can_inline():
            try:
                self._commit_inline([])
                return
            except InternalError:
                pass  # logged; the writer tries again (and reports to nobody: no waiter)
        self._enqueue(_Pending("barrier", (), None))

    def _submit(self, kind: str, args: tuple[Any, ...], wait: bool) -> asyncio.Future[Any] | None:
        fut = self._loop.create_future() if (wait and self._loop is not None) else None
        self._enqueue(_Pending(kind, args, fut))
        return fut

    def _maybe_index(self, conn: sqlite3.Connection) -> None:
        """In the current transaction: index the entries since the last time, once there
        are INDEX_EVERY of them (an amortised cost: one page or a few for all of them)."""
        if self._unindexed < INDEX_EVERY:
            return
        _index_tail(conn)  # reads the watermark: one small read every INDEX_EVERY entries
        self._unindexed = 0

    def _lower_watermark(self, conn: sqlite3.Connection) -> None:
        """After a delete: seqs are rowids (no AUTOINCREMENT), so deleting the last entries
        gives their seqs to the next ones; the watermark must stay below them."""
        top = conn.execute("SELECT max(seq) FROM entries").fetchone()[0] or 0
        if top < _watermark(conn):
            conn.execute("UPDATE log_meta SET v=? WHERE k='indexed'", (top,))

    def _can_inline(self) -> bool:
        # _backlog == 0: the writer has committed everything it was given and gets nothing
        # new while the loop commits (only the loop queues): the connection is the loop's.
        return (self._conn is not None and self._inline and self._backlog == 0
                and time.monotonic() >= self._inline_after)

    def _commit_inline(self, rows: list[tuple[Any, ...]]) -> list[int]:
        """Write ``rows`` on the loop, in one transaction (one statement alone: autocommit);
        their seqs. Times the commit: a slow one sends the next ones to the writer."""
        conn, cur = self._conn, self._cur
        assert conn is not None and cur is not None
        sbs, self._sb_rows = self._sb_rows, []
        self._unindexed += len(rows)
        t0 = time.monotonic()
        try:
            if len(rows) == 1 and not sbs and self._unindexed < INDEX_EVERY:
                seqs = [_apply_entry(cur, rows[0])]  # one statement: autocommit
            else:
                conn.execute("BEGIN")
                for sql, args in sbs:
                    conn.execute(sql, args)
                seqs = [_apply_entry(cur, r) for r in rows]
                self._maybe_index(conn)
                conn.execute("COMMIT")
        except Exception as e:  # noqa: BLE001
            log.exception("trajectory log write failed")
            if conn.in_transaction:
                try:
                    conn.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
            self._sb_rows = sbs + self._sb_rows
            raise InternalError(f"could not write the trajectory log: {e}") from e
        dt = time.monotonic() - t0
        st = self.stats
        st["inline"] += len(rows)
        st["inline_us"] += int(dt * 1e6)
        st["commits"] += 1
        st["records"] += len(rows)
        if dt > INLINE_SLOW_S:  # the disk may be slow: spare the loop for a while
            st["inline_slow"] += 1
            self._inline_after = time.monotonic() + self._backoff
            log.info("slow trajectory log commit on the loop: writer thread for a while",
                     extra={"ms": round(dt * 1000, 1), "for_s": self._backoff})
            self._backoff = min(self._backoff * 2, INLINE_BACKOFF_MAX_S)
        else:
            self._backoff = INLINE_BACKOFF_S
        self._committed(len(rows))
        return seqs

    def _write_entry(self, args: tuple[Any, ...], wait: bool = True, coalesce: bool = False
                     ) -> int | asyncio.Future[Any]:
        """Commit one entry inline (its seq) if the writer is idle, else queue it for the
        writer (a future of its seq; with ``wait`` false, no future: 0, and it commits with
        the writer's next batch, before anything queued after it). ``coalesce`` (other calls
        are in flight, and may end in this same turn of the loop): join the entries of this
        turn, committed together at its end (a future of None) - one commit for several."""
        if not self._can_inline():
            fut = self._loop.create_future() if wait else None  # type: ignore[union-attr]
            self._enqueue(_Pending("entry", args, fut))
            return fut if fut is not None else 0
        if not coalesce:
            return self._commit_inline([args])[0]
        if self._turn is None:
            self._turn = ([], self._loop.create_future())  # type: ignore[union-attr]
            self._loop.call_soon(self._flush_turn)  # type: ignore[union-attr]
        self._turn[0].append(args)
        return self._turn[1]

    def _flush_turn(self) -> None:
        assert self._turn is not None
        rows, fut = self._turn
        self._turn = None
        if not self._can_inline():  # the writer got work meanwhile: queue behind it (FIFO)
            for r in rows[:-1]:
                self._enqueue(_Pending("entry", r, None))
            self._enqueue(_Pending("entry", rows[-1], fut))
            return
        try:
            self._commit_inline(rows)
        except InternalError as e:
            fut.set_exception(e)
            fut.exception()  # retrieved: its waiters (shielded) get it
            return
        fut.set_result(None)

    # ---- what the engine and the API call --------------------------------------------------------
    def sandbox_created(self, sid: str, spec: dict[str, Any], created_at: float) -> None:
        if self.enabled:
            self._sandbox_write(_INSERT_SANDBOX, (sid, _dumps(spec), created_at))

    def sandbox_ended(self, sid: str, reason: str) -> None:
        if self.enabled:
            self._sandbox_write(_ENDED, (time.time(), reason, sid))

    def _sandbox_write(self, sql: str, args: tuple[Any, ...]) -> None:
        """Not a commit of its own (on the loop only): it goes with the next entry's commit
        (a create's, a kill's: same turn), else at the end of this turn (``_sb_rows``)."""
        if not self._sb_rows and self._loop is not None:
            self._loop.call_soon(self._flush_sandboxes)
        self._sb_rows.append((sql, args))

    def readopted(self, boxes: list[tuple[str, dict[str, Any], float, dict[str, Any]]]
                  ) -> None:
        """At a restart: (id, spec, created_at, SandboxInfo) of each re-adopted sandbox; those
        whose create the log lacks get it (see ``_backfill``)."""
        if self.enabled and boxes:
            self._submit("readopted", (boxes,), False)

    def recovered(self, live: set[str]) -> None:
        """After a restart: sandboxes the log thought alive but that are not are ended."""
        if self.enabled:
            self._submit("ended_except", (time.time(), sorted(live)), False)

    def maybe_prune(self, now: float) -> None:
        if self.enabled and now - self._last_prune >= PRUNE_EVERY_S:
            self._last_prune = now
            self._submit("prune", (now - self.retention_s,), False)

    async def prune(self, now: float | None = None) -> int:
        if not self.enabled:
            return 0
        fut = self._submit("prune", ((now or time.time()) - self.retention_s,), True)
        assert fut is not None
        return int(await fut)

    def started(self, sid: str, op: str, request: dict[str, Any], started_at: float,
                key: str | None = None, fp: str | None = None) -> _Start:
        """The started row of a call: queued (never waited for) if the call is still running
        ``start_ms`` from now. Held on the loop, not by the writer: a call that ends sooner
        costs no extra row, thread wake-up or commit."""
        s = _Start(sid, op, request, started_at, key, fp)
        self._held[s] = None
        if self._tick is None and self._loop is not None:
            self._tick = self._loop.call_later(self.start_hold_s, self._queue_due)
        return s

    def _queue_due(self) -> None:
        self._tick = None
        due = time.monotonic() - self.start_hold_s
        while self._held:
            s = next(iter(self._held))
            if s.t > due:  # the rest are younger (oldest first)
                assert self._loop is not None
                self._tick = self._loop.call_later(s.t - due, self._queue_due)
                return
            del self._held[s]
            s.queued = True
            self._enqueue(s)

    def _close_start(self, s: _Start) -> _Start | None:
        """The call ended: the start its end must finish in place, or None (never queued)."""
        self._held.pop(s, None)
        return s if s.queued else None

    def drop(self, start: _Start) -> None:
        """The call will not be logged after all (no such sandbox, a daemon bug)."""
        if self._close_start(start) is not None:
            self._enqueue(_Pending("drop", (start,), None))

    def logged(self, sid: str, op: str, request: dict[str, Any],
               result: dict[str, Any] | None, started_at: float,
               snapshot_ids: list[str] | None = None) -> None:
        """Queue a finished entry without waiting (a caller awaiting a later record of the
        same batch, or of a later one, knows this one is committed too: FIFO, one writer)."""
        if not self.enabled:
            return
        self._enqueue(_Pending("entry", self._row(sid, op, request, result, None, started_at,
                                                  time.time(), None, None, snapshot_ids,
                                                  None), None))

    @staticmethod
    def _row(sid: str, op: str, request: dict[str, Any], result: dict[str, Any] | None,
             error: dict[str, Any] | None, started_at: float, ended_at: float,
             key: str | None, fp: str | None, snapshot_ids: list[str] | None,
             start: _Start | None) -> tuple[Any, ...]:
        return (sid, op, key, fp, _dumps(request),
                None if result is None else _dumps(result),
                None if error is None else _dumps(error),
                started_at, ended_at, json.dumps(snapshot_ids) if snapshot_ids else None, start)

    async def record(self, sid: str, op: str, request: dict[str, Any],
                     result: dict[str, Any] | None, error: dict[str, Any] | None,
                     started_at: float, ended_at: float, key: str | None = None,
                     fp: str | None = None, snapshot_ids: list[str] | None = None,
                     start: _Start | None = None, wait: bool = True) -> int:
        """Queue one entry (finishing ``start``'s row if given) and wait until it is
        committed (``wait``; else 0 at once: it is committed with the writer's next batch,
        before anything queued after it)."""
        if start is not None:
            start = self._close_start(start)
        got = self._write_entry(self._row(sid, op, request, result, error, started_at,
                                          ended_at, key, fp, snapshot_ids, start), wait=wait)
        if isinstance(got, int):
            return got
        return int(await _committed(got))

    def _lookup(self, scope: str, key: str) -> tuple[str, str, str | None, str | None] | None:
        """The finished entry that binds ``key`` (started and interrupted rows do not)."""
        assert self._reader is not None
        if scope:
            sql = ("SELECT fingerprint, sandbox_id, result, error FROM entries WHERE "
                   "idem_key=? AND sandbox_id=? AND status IS NULL ORDER BY seq LIMIT 1")
            row = self._reader.execute(sql, (key, scope)).fetchone()
        else:
            sql = ("SELECT fingerprint, sandbox_id, result, error FROM entries WHERE "
                   "idem_key=? AND op='create' AND status IS NULL ORDER BY seq LIMIT 1")
            row = self._reader.execute(sql, (key,)).fetchone()
        return row

    def logged_result(self, sid: str, op: str) -> dict[str, Any] | None:
        """The result of ``sid``'s first finished ``op`` entry (a fork child's create)."""
        assert self._reader is not None
        row = self._reader.execute(
            f"SELECT result FROM entries WHERE seq IN ({_SANDBOX_SEQS}) AND op=:op AND "
            "status IS NULL AND result IS NOT NULL ORDER BY seq LIMIT 1",
            {"sid": sid, "op": op}).fetchone()
        return json.loads(row[0]) if row else None

    async def run(self, sid: str, op: str, request: dict[str, Any], key: str | None,
                  call: Callable[[], Awaitable[Any]],
                  to_log: Callable[[Any], dict[str, Any]] | None = None,
                  snapshot_ids: SnapIds = None) -> Any:
        """Run ``call`` once per idempotency key and log it; return what the client gets.

        ``sid`` is the sandbox (``""`` for a create: its id is known only after).
        ``to_log`` turns the call's value into the logged result dict; when the call is
        fast-forwarded, the *logged* result dict is returned instead of the call's value, so
        callers whose value is not that dict must pass ``to_log`` and handle both.
        ``snapshot_ids``: the snapshots the entry names, or a function of the logged result
        giving them (a snapshot's id is known only once it exists)."""
        if not self.enabled:
            if key is not None:
                raise Unsupported("idempotency keys need the trajectory log, which is off on "
                                  "this daemon (CORRAL_TRAJLOG=0)")
            return await call()
        fp = fingerprint(op, request) if key is not None else None
        if key is not None:
            if not key or len(key) > MAX_KEY_LEN:
                from corral.errors import InvalidRequest

                raise InvalidRequest(f"{KEY_HEADER} must be 1 to {MAX_KEY_LEN} characters")
            slot = (sid, key)
            while True:
                other = self._inflight.get(slot)
                if other is None:
                    break
                try:
                    await asyncio.shield(other)
                except BaseException:  # noqa: BLE001 - the outcome is read from the log
                    pass
            row = self._lookup(sid, key)
            if row is not None:
                return self._replayed(op, key, fp, row)
            self._inflight[slot] = self._loop.create_future()  # type: ignore[union-attr]
        try:
            return await self._run_and_log(sid, op, request, key, fp, call, to_log,
                                           snapshot_ids)
        finally:
            if key is not None:
                done = self._inflight.pop((sid, key), None)
                if done is not None and not done.done():
                    done.set_result(None)

    def _replayed(self, op: str, key: str, fp: str | None,
                  row: tuple[str, str, str | None, str | None]) -> Any:
        logged_fp, logged_sid, result, error = row
        if logged_fp != fp:
            raise ReplayDivergence(
                f"idempotency key {key!r} was used for a different request "
                f"({op} now, logged in sandbox {logged_sid})",
                details={"key": key, "sandbox_id": logged_sid})
        if error is not None:
            raise error_from_payload(json.loads(error))
        return json.loads(result) if result is not None else None

    async def _run_and_log(self, sid: str, op: str, request: dict[str, Any], key: str | None,
                           fp: str | None, call: Callable[[], Awaitable[Any]],
                           to_log: Callable[[Any], dict[str, Any]] | None,
                           snapshot_ids: SnapIds) -> Any:
        started = time.time()
        start = self.started(sid, op, request, started, key, fp) if op in STARTED_OPS else None
        ids = snapshot_ids if not callable(snapshot_ids) else None
        self._active += 1
        try:
            try:
                value = await call()
            finally:
                self._active -= 1
        except CorralError as e:
            if op == "create" or isinstance(e, SandboxNotFound):
                if start is not None:
                    self.drop(start)
                raise  # nothing was made, or no such sandbox: nothing to log
            # A failure of the platform does not bind the key: a retry runs for real.
            logged_key = None if e.infra else key
            await self.record(sid, op, request, None,
                              e.to_payload(), started, time.time(), logged_key,
                              fp if logged_key else None, ids, start)
            raise
        except BaseException:
            if start is not None:  # a daemon bug (the client gets internal): not a call
                self.drop(start)
            raise
        result = to_log(value) if to_log is not None else value
        if op == "create" and isinstance(result, dict):
            sid = str(result.get("id", sid))
        if callable(snapshot_ids):
            ids = snapshot_ids(result)
        if start is not None:
            start = self._close_start(start)
        # Other calls still running: they may end in this same turn of the loop, and then one
        # commit covers them all (alone, commit now: no extra turn of the loop).
        got = self._write_entry(self._row(sid, op, request, result, None, started, time.time(),
                                          key, fp, ids, start),
                                coalesce=self._active > 0 or self._turn is not None)
        if not isinstance(got, int):  # wait for the commit (end of the turn, or the writer)
            await _committed(got)
        return value

    # ---- reading -------------------------------------------------------------------------------
    def read(self, sid: str) -> tuple[dict[str, Any] | None, list[dict[str, Any]]] | None:
        """(sandbox row, entries) of ``sid``; None if the log never heard of it. Runs on its
        own connection (callers use a thread: a log can be long)."""
        if not self.enabled:
            raise Unsupported("the trajectory log is off on this daemon (CORRAL_TRAJLOG=0)")
        conn = self._connect()
        try:
            srow = conn.execute("SELECT spec, created_at, ended_at, reason FROM sandboxes "
                                "WHERE sandbox_id=?", (sid,)).fetchone()
            rows = conn.execute(
                "SELECT seq, op, idem_key, request, result, error, started_at, ended_at, "
                f"snapshot_ids, status FROM entries WHERE seq IN ({_SANDBOX_SEQS}) "
                "ORDER BY seq", {"sid": sid}).fetchall()
        finally:
            conn.close()
        if srow is None and not rows:
            return None
        sandbox = None
        if srow is not None:
            sandbox = {"spec": json.loads(srow[0]) if srow[0] else None,
                       "created_at": srow[1], "ended_at": srow[2], "reason": srow[3]}
        entries = []
        for i, r in enumerate(rows):
            done = r[9] is None
            entries.append({
                "index": i, "seq": r[0], "sandbox_id": sid, "op": r[1],
                "status": r[9] or "done",
                "idempotency_key": r[2], "request": json.loads(r[3]),
                "result": json.loads(r[4]) if r[4] is not None else None,
                "error": json.loads(r[5]) if r[5] is not None else None,
                "started_at": r[6], "ended_at": r[7] if done else None,
                "duration_s": round(max(0.0, r[7] - r[6]), 6) if done else None,
                "snapshot_ids": json.loads(r[8]) if r[8] else [],
            })
        return sandbox, entries

    async def flushed(self) -> None:
        """Return once everything queued so far is committed (creates do not wait for theirs:
        a reader of the log must see them)."""
        if self.enabled:
            fut = self._submit("barrier", (), True)
            if fut is not None:
                await asyncio.shield(fut)

    async def entries(self, sid: str, known: bool) -> dict[str, Any]:
        await self.flushed()
        got = await asyncio.to_thread(self.read, sid)
        if got is None:
            if not known:
                raise SandboxNotFound(f"no sandbox {sid} and no trajectory log for it",
                                      details={"id": sid})
            got = (None, [])
        sandbox, entries = got
        return {"sandbox_id": sid, "sandbox": sandbox, "entries": entries}

    # ---- exec results ----------------------------------------------------------------------------
    def exec_result(self, res: dict[str, Any]) -> dict[str, Any]:
        """An exec's result as logged: outputs cut to the log's cap, with hashes of the full
        output (``_sha``, added by the engine) and the sizes."""
        sha = res.pop("_sha", None)
        out = dict(res)
        if sha is not None:
            out["stdout_sha256"], out["stderr_sha256"] = sha
        cap = self.output_cap
        for name in ("stdout", "stderr"):
            text = out.get(name)
            if isinstance(text, str) and (sha is None or len(text) > cap):
                if sha is None:
                    out[f"{name}_sha256"] = sha256(text.encode("utf-8", "surrogateescape"))
                if len(text) > cap:
                    out[name] = text[:cap]
                    out["log_truncated"] = True
        return out


def _apply_entry(cur: sqlite3.Cursor, args: tuple[Any, ...]) -> int:
    """Write one entry (``TrajLog._row``): its seq. One statement: inline, it commits on its
    own (autocommit); in the writer's batch, inside the batch's transaction."""
    start: _Start | None = args[-1]
    if start is not None and start.rowid is not None:
        # The started row is in: finish it in place (it keeps its place in the log).
        cur.execute("UPDATE entries SET idem_key=?, fingerprint=?, result=?, error=?, "
                    "ended_at=?, snapshot_ids=?, status=NULL WHERE seq=?",
                    (args[2], args[3], args[5], args[6], args[8], args[9], start.rowid))
        return start.rowid
    cur.execute(_INSERT, (*args[:-1], None))
    return int(cur.lastrowid)  # type: ignore[arg-type]


async def _committed(fut: asyncio.Future[Any]) -> Any:
    """Wait for the commit of a queued (or coalesced) entry; its seq (None if coalesced)."""
    try:
        return await asyncio.shield(fut)
    except CorralError:
        raise
    except Exception as e:  # noqa: BLE001
        raise InternalError(f"could not write the trajectory log: {e}") from e


def _migrate(conn: sqlite3.Connection) -> None:
    """Bring a log written by an older daemon up to this schema."""
    cols = {r[1] for r in conn.execute("PRAGMA table_info(entries)")}
    if "status" not in cols:
        conn.execute("ALTER TABLE entries ADD COLUMN status TEXT")
    # The per-row (sandbox_id, seq) index became entries_by_sandbox (filled in batches): the
    # open that follows indexes every entry past the watermark, i.e. all of them.
    conn.execute("INSERT OR IGNORE INTO log_meta (k, v) VALUES ('indexed', 0)")
    conn.execute("DROP INDEX IF EXISTS entries_sandbox")


def _watermark(conn: sqlite3.Connection) -> int:
    row = conn.execute("SELECT v FROM log_meta WHERE k='indexed'").fetchone()
    return int(row[0]) if row else 0


def _index_tail(conn: sqlite3.Connection) -> None:
    """Add the entries after the watermark (read from the database, never cached) to
    entries_by_sandbox and move the watermark to the last entry. Inside the caller's
    transaction, if any (then the index update commits with the entries, or not at all)."""
    since = _watermark(conn)
    top = conn.execute("SELECT max(seq) FROM entries").fetchone()[0] or 0
    if top > since:
        conn.execute("INSERT OR IGNORE INTO entries_by_sandbox (sandbox_id, seq) SELECT "
                     "sandbox_id, seq FROM entries WHERE seq > ? AND seq <= ?", (since, top))
        conn.execute("UPDATE log_meta SET v=? WHERE k='indexed'", (top,))


def _resolve(results: list[tuple[asyncio.Future[Any], Any, BaseException | None]]) -> None:
    for fut, value, exc in results:
        if fut.done():
            continue
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(value)
