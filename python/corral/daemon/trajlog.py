"""The durable trajectory log: per sandbox, an ordered record of every exec and file operation.

Two tiers, one contract: a call's record is durable *before* the call's result is returned.

* The journal (``corral.daemon.journal``) is the commit point. A finished call's entry is one
  JSON line, copied on the event loop into the current journal file, mapped shared, before
  the call answers: no system call. The copy is in the kernel's page cache at once, so it
  survives the daemon's death (kill -9, a crash, the OOM killer), the same durability as a
  ``write()`` or a SQLite WAL frame under ``synchronous=NORMAL``. No SQLite, no thread
  hand-off, no wake-up on the call's path. The request is encoded while the call runs.
* The database, ``<state_dir>/trajlog.db`` (SQLite, WAL mode), is what readers query. An
  ingester thread takes the journal's new lines every ``CORRAL_TRAJLOG_FLUSH_MS`` (100 ms)
  and inserts them in one transaction: the entries by multi-row ``INSERT``s (one
  ``sqlite3_step`` each, so the thread takes the GIL back once per statement, not per row),
  at nice ``INGEST_NICE``. It checkpoints the WAL every ``CHECKPOINT_EVERY`` records. The journal's
  files are deleted once what they hold is in the database.

Reads see both tiers: an idempotency key is looked up among the entries not yet ingested
(``_unbound``, in memory) before the database, and a read of a log (``entries``) first waits
for the ingester to catch up (a barrier). At a start, the records of the journal that the
database lacks (``log_meta`` ``journal``: the number of the last one ingested, committed with
them) are ingested before anything else, then the journal is removed: a daemon that died
loses nothing a client has seen. Only a power cut or kernel crash can lose the last records
(nothing is fsynced on the call's path); ``CORRAL_TRAJLOG_SYNC=full`` makes every call wait
until its record is in the database with an fsync.

One b-tree per entry: the per-sandbox index is a table (``entries_by_sandbox``) filled every
``INDEX_EVERY`` entries by one statement in a batch's transaction, not a SQL index updated on
every insert; readers add the unindexed tail (``seq`` past the ``log_meta`` watermark) with a
rowid range scan. Entry numbers (``seq``) are given on the loop, in journal order, so the
ingester writes them in increasing order.

Calls in flight: a mutating call (every op in ``STARTED_OPS``) also gets a *started* row. A
keyed one (``KEYED_START_OPS``) journals it before the call runs (one line copied into the
journal's mapping: durable against the daemon's death, no system call, nothing waited for),
so its key is known to have started. An unkeyed one never waits for it: a timer on the event
loop journals the row once the call has run ``CORRAL_TRAJLOG_START_MS`` (default 20 ms); a
call that ends sooner cancels the timer and is written once, finished (the common case). A
call's finished entry replaces its started row (same ``seq``: it keeps its place in the log).
At the next start of the daemon, started rows still open are marked ``interrupted`` with the
error ``step_interrupted`` (infra): their outcome is unknown (the command may have run, in
whole or in part; their callers got ``daemon_restarted``). An unkeyed call in flight for less
than the hold time at a crash can be missing from the log (its caller saw no result either).

Idempotency: a mutating call may carry the HTTP header ``Idempotency-Key``. Its scope is the
sandbox (``create`` keys are global). A key already logged returns the logged result (or error)
without running anything; the same key with a different request is ``replay_divergence``;
concurrent duplicates wait for the one that runs. Infrastructure errors (``infra``) are logged
but do not bind the key, so a retry after one runs for real. An interrupted row binds its key
to its ``step_interrupted`` error (a kill's does not: a kill runs again), so a retry after a
crash never runs the call a second time.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import math
import os
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from corral.daemon.journal import Journal
from corral.daemon.locks import try_lock
from corral.errors import (
    CorralError,
    InternalError,
    InvalidRequest,
    ReplayDivergence,
    SandboxNotFound,
    StepInterrupted,
    Unsupported,
    error_from_payload,
)

log = logging.getLogger("corral.trajlog")

KEY_HEADER = "Idempotency-Key"
MAX_KEY_LEN = 256
DB_NAME = "trajlog.db"
LOCK_NAME = "trajlog.lock"
PRUNE_EVERY_S = 60.0
# Sandboxes whose bound keys are kept in memory (``TrajLog._bound``); past it, the database.
MAX_BOUND_SETS = 100_000
# Records journaled and not yet in the database beyond which calls wait for the ingester (a
# disk slower than the calls): memory stays bounded, the journal does not outrun SQLite.
MAX_PENDING = 50_000
# The ingester thread's nice value (Linux: per thread): on a busy machine it yields to the
# calls it trails; MAX_PENDING bounds how far behind that lets it fall.
INGEST_NICE = 10
# After a failed ingest (the records stay in the journal and in memory), the next try.
INGEST_RETRY_S = 1.0
# Entries per statement when a start ingests what a dead daemon left in the journal.
RECOVER_CHUNK = 10_000
# Records between two WAL checkpoints (by the ingester: one or two pages each, so the WAL
# stays under ~10 MB).
CHECKPOINT_EVERY = 1000
# Entries between two updates of the per-sandbox index (``entries_by_sandbox``): an insert
# writes one b-tree (the row) instead of two; every INDEX_EVERY entries one batch also
# indexes the ones since the last time. Readers find the rest, the unindexed tail, by a short
# rowid range scan.
INDEX_EVERY = 64
# Ops that change a sandbox: they get a started row (create does not: its id is not known
# before it ends, and a half-made sandbox is removed at restart anyway).
STARTED_OPS = frozenset({"exec", "write", "upload", "mkdir", "remove", "rename", "snapshot",
                         "fork", "restore", "pause", "resume", "kill"})
# Keyed ops whose started row is journaled before they run: a retry of one that never
# finished answers step_interrupted instead of running again. Not kill: running a kill twice
# is harmless, and a retried kill must end the sandbox.
KEYED_START_OPS = STARTED_OPS - {"kill"}
# entries.status: NULL for a finished call (every row of older logs), else one of these.
STARTED, INTERRUPTED = "started", "interrupted"
# The rows that bind their key: finished ones, and interrupted ones but a kill's.
_BINDS = "(status IS NULL OR (status='interrupted' AND op<>'kill'))"


def interrupted_error(sid: str, op: str, key: str | None, started_at: float,
                      seq: int) -> dict[str, Any]:
    """The error an interrupted row carries (and a retry of its key raises)."""
    return StepInterrupted(
        "the daemon died while this call was in flight: it may have run, in whole or in part "
        "(its key is not run again)",
        details={"interrupted": True, "sandbox_id": sid, "op": op, "key": key,
                 "started_at": started_at, "seq": seq}).to_payload()

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

# Journal records (JSON arrays; ``corral.daemon.journal``): [number, kind, *fields], the fields
# being the parameters of the kind's statement below. Objects (request, result, error,
# snapshot ids) are fields as JSON text, exactly what the database stores.
#   e   an entry (a finished call, or a started row; a call's end replaces its start)
#   d   a started row dropped (the call was not logged after all)
#   sc  a sandbox created;  se  a sandbox ended
# The ingester writes the records of a batch in journal order, a run of one kind at a time:
# entries by multi-row INSERTs of a power of two each, up to ENTRIES_PER_STATEMENT (one
# sqlite3_step, so the thread gives up and takes back the GIL once per statement, not once
# per row), the other kinds by ``executemany``. Bound and stepped in C: no JSON parsing in
# SQLite or Python.
_J_ENTRIES = ("INSERT OR REPLACE INTO entries (seq, sandbox_id, op, idem_key, fingerprint, "
              "request, result, error, started_at, ended_at, snapshot_ids, status) VALUES ")
_J_ROW = "(?,?,?,?,?,?,?,?,?,?,?,?)"
ENTRIES_PER_STATEMENT = 512  # 6,144 parameters (SQLite allows 32,766); a power of two
_J_SQL: dict[str, tuple[str, ...]] = {
    "e": (_J_ENTRIES + _J_ROW,),
    "d": ("DELETE FROM entries WHERE seq=?1 AND sandbox_id=?2",
          "DELETE FROM entries_by_sandbox WHERE seq=?1 AND sandbox_id=?2"),
    "sc": ("INSERT OR REPLACE INTO sandboxes (sandbox_id, spec, created_at) VALUES (?,?,?)",),
    "se": ("UPDATE sandboxes SET ended_at=?2, reason=?3 WHERE sandbox_id=?1 AND "
           "ended_at IS NULL",),
}


_ENTRIES_SQL: dict[int, str] = {}


def _entries_sql(n: int) -> str:
    """The INSERT of ``n`` entries, ``n`` a power of two (a batch is cut into such chunks:
    ten statement texts in all, each prepared once and kept in the statement cache)."""
    sql = _ENTRIES_SQL.get(n)
    if sql is None:
        sql = _ENTRIES_SQL[n] = _J_ENTRIES + ",".join([_J_ROW] * n)
    return sql


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fingerprint(op: str, request: dict[str, Any]) -> str:
    """The request's identity under an idempotency key: the hash of
    ``json.dumps([op, request], sort_keys=True)``'s compact text."""
    return keyed_text(op, request)[1]


def keyed_text(op: str, request: dict[str, Any]) -> tuple[str, str]:
    """(the request as logged, its fingerprint) from one encoding: the sorted text, made by a
    C encoder built once (json.dumps builds one per call), is both the logged request and,
    wrapped in ``[op, ...]`` (an op is a bare word), what the fingerprint hashes."""
    if _FP_ENCODE is None:
        text = json.dumps(request, sort_keys=True, separators=(",", ":"))
    else:
        text = "".join(_FP_ENCODE(request, 0))
    fp = sha256(f'["{op}",{text}]'.encode())
    if "NaN" in text or "Infinity" in text:  # maybe a non-JSON float: logged by _dumps
        text = _dumps(request)
    return text, fp


def body_request(size: int, digest: str, data: bytes | None, **fields: Any) -> dict[str, Any]:
    """A request with a raw body (file write, tar upload): its size and hash always, the bytes
    themselves (base64) when the whole body was kept (it fit the log's cap), so that replay
    can send them again."""
    req = dict(fields, size=size, sha256=digest)
    if data is not None:
        req["data_b64"] = base64.b64encode(data).decode()
    return req


def data_result(data: bytes, keep: int = -1, **fields: Any) -> dict[str, Any]:
    """What a read logs: size and hash of what the client got; the bytes themselves (base64)
    only if they fit ``keep`` (a keyed read: its replay returns them)."""
    res = dict(fields, size=len(data), sha256=sha256(data))
    if len(data) <= keep:
        res["data_b64"] = base64.b64encode(data).decode()
    return res


# A keyed listing logs its entries up to this many (its replay returns them).
LIST_KEEP = 4096


def listing_result(entries: list[dict[str, Any]], keep: bool) -> dict[str, Any]:
    """What a listing logs: the count and a hash of its sorted ``name type size`` lines; for a
    keyed one also the entries (up to LIST_KEEP), which its replay returns."""
    lines = sorted(f"{e['name']}\t{e['type']}\t{e['size'] if e['type'] == 'file' else 0}"
                   for e in entries)
    res = data_result("\n".join(lines).encode(), count=len(entries))
    if keep and len(entries) <= LIST_KEEP:
        res["entries"] = entries
    return res


async def replayed_read(logged: dict[str, Any],
                        now: Callable[[], Awaitable[tuple[bytes, bool]]]) -> tuple[bytes, bool]:
    """What a fast-forwarded keyed read returns: the logged bytes; if they were over the log's
    cap, the file as it is now, provided it is still what was read then."""
    truncated = bool(logged.get("truncated"))
    if "data_b64" in logged:
        return base64.b64decode(logged["data_b64"]), truncated
    data, truncated = await now()
    if sha256(data) != logged.get("sha256"):
        raise ReplayDivergence("the file read under this key was over the log's cap and has "
                               "changed since: its logged content cannot be returned",
                               details={"sha256": logged.get("sha256")})
    return data, truncated


async def replayed_listing(logged: dict[str, Any],
                           now: Callable[[], Awaitable[list[Any]]]) -> list[Any]:
    """What a fast-forwarded keyed listing returns: the logged entries, or (a listing over
    LIST_KEEP) the directory now, provided it is still what was listed then."""
    if "entries" in logged:
        return list(logged["entries"])
    entries = await now()
    if listing_result(entries, False)["sha256"] != logged.get("sha256"):
        raise ReplayDivergence("the directory listed under this key was too long to log and "
                               "has changed since", details={"sha256": logged.get("sha256")})
    return entries


# json.dumps(obj, separators=...) builds a JSONEncoder and a C encoder per call: build the C
# encoder once (compact, ASCII, no circular-reference check: requests and results are trees).
# No NaN or Infinity: they are not JSON, and SQLite's JSON functions would refuse the batch
# (such a float is written as its repr string instead: ``_finite``).
_ENCODE = (json.encoder.c_make_encoder(  # type: ignore[attr-defined]
    None, json.JSONEncoder().default, json.encoder.encode_basestring_ascii, None, ":", ",",
    False, False, False) if json.encoder.c_make_encoder is not None else None)  # type: ignore[attr-defined]

# The same text as json.dumps([op, request], sort_keys=True, separators=(",", ":")).
_FP_ENCODE = (json.encoder.c_make_encoder(  # type: ignore[attr-defined]
    None, json.JSONEncoder().default, json.encoder.encode_basestring_ascii, None, ":", ",",
    True, False, True) if json.encoder.c_make_encoder is not None else None)  # type: ignore[attr-defined]


def _dumps(obj: Any) -> str:
    try:
        if _ENCODE is None:  # no C accelerator
            return json.dumps(obj, separators=(",", ":"), allow_nan=False)
        return "".join(_ENCODE(obj, 0))
    except ValueError:
        return json.dumps(_finite(obj), separators=(",", ":"), allow_nan=False)


def _plain(request: Any) -> Any:
    """A request as logged: a dict, or a pydantic model dumped to one (the exec handler
    passes its model, so that the dump happens while the command runs, not before)."""
    dump = getattr(request, "model_dump", None)
    return request if dump is None else dump(mode="json")


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else repr(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


class _Control:
    """Work for the ingester besides journal lines (not journaled: nothing to redo after a
    crash), taken in order with them; ``fut`` resolves once its batch is committed."""

    __slots__ = ("kind", "args", "fut")

    def __init__(self, kind: str, args: tuple[Any, ...], fut: asyncio.Future[Any] | None):
        self.kind = kind
        self.args = args
        self.fut = fut


# A journal record waiting for the ingester: (number, kind, fields, key slot or None).
_Line = tuple[int, str, tuple[Any, ...], "tuple[str, str] | None"]


class _Start:
    """A logged call in flight. Its request is encoded, and a mutating call is held on the
    loop (``TrajLog._held``), by ``TrajLog._prep`` while the call runs. A held call still
    running ``start_ms`` later gets its started row journaled and its ``rowid`` (its seq),
    which the call's finished entry replaces. A call that ends sooner is written once,
    finished."""

    __slots__ = ("sid", "op", "request", "key", "fp", "started_at", "t", "rowid", "req_text",
                 "over")

    def __init__(self, sid: str, op: str, request: dict[str, Any], started_at: float,
                 key: str | None, fp: str | None) -> None:
        self.sid, self.op, self.request, self.started_at = sid, op, request, started_at
        self.key, self.fp = key, fp
        self.t = time.monotonic()
        self.rowid: int | None = None
        self.req_text: str | None = None  # the request as logged (JSON)
        self.over = False  # the call has returned


SnapIds = list[str] | Callable[[Any], list[str]] | None


class TrajLog:
    def __init__(self, state_dir: str, *, enabled: bool = True, retention_s: float = 7 * 86400,
                 output_cap: int = 1 << 20, body_cap: int = 1 << 20, sync: str = "normal",
                 flush_ms: float = 100.0, start_ms: float = 20.0) -> None:
        self.enabled = enabled
        self.state_dir = state_dir
        self.path = os.path.join(state_dir, DB_NAME)
        self.retention_s = retention_s
        self.output_cap = output_cap
        self.body_cap = body_cap
        self.sync = "FULL" if sync.lower() == "full" else "NORMAL"
        self._full = self.sync == "FULL"  # every call waits for its record's ingest (fsync)
        self.flush_s = max(0.0, flush_ms) / 1000.0
        self.start_hold_s = max(0.0, start_ms) / 1000.0
        # Tests only (tests/test_crash.py): while the first file exists, a finished call's
        # entry waits before it is journaled (the call does not answer); while the second
        # does, the ingester holds its batches (journaled, not in the database).
        self._hold_file = os.environ.get("CORRAL_TRAJLOG_TEST_HOLD_FILE") or None
        self._hold_ingest = os.environ.get("CORRAL_TRAJLOG_TEST_HOLD_INGEST_FILE") or None
        self._journal: Journal | None = None
        self._lock = -1  # flock on LOCK_NAME while open
        self._jn = 0  # number of the last journal record (the loop's)
        self._ingested = 0  # number of the last record in the database (the ingester's)
        self._seq = 0  # the last entry seq given (the loop's)
        # Lines and control items for the ingester, in order; the loop appends, the ingester
        # takes the whole list (both under _mu). _wake: the list went from empty to not;
        # _now: someone waits (a barrier), do not gather for flush_s.
        self._mu = threading.Lock()
        self._pending: list[_Line | _Control] = []
        self._wake = threading.Event()
        self._now = threading.Event()
        # Entries that bind an idempotency key, journaled and not yet ingested: (scope, key)
        # -> (fingerprint, sandbox id, result, error). The loop adds before journaling, the
        # ingester removes after its commit; a lookup reads this first, then the database.
        self._unbound: dict[tuple[str, str], tuple[str | None, str, Any, Any]] = {}
        # Per running sandbox that had a keyed call: every key its log binds (loaded on its
        # first keyed call, kept up to date by _write_entry, dropped when it ends). A fresh
        # key, the common case, is then known to be unbound without a query on the loop.
        self._bound: dict[str, set[str]] = {}
        self._live: set[str] = set()  # sandboxes created or re-adopted, not ended
        self._since_ckpt = 0
        self._unindexed = 0  # entries ingested since the index was last updated
        self._closing = False
        # Started rows held on the loop, oldest first (a dict: O(1) removal anywhere, O(1)
        # oldest), and the one timer that journals the due ones (armed while any is held).
        self._held: dict[_Start, None] = {}
        self._tick: asyncio.TimerHandle | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._conn: sqlite3.Connection | None = None  # the ingester's
        self._reader: sqlite3.Connection | None = None  # the loop's (key lookups)
        # (sid, key) -> the future a duplicate waits on (None: no duplicate yet)
        self._inflight: dict[tuple[str, str], asyncio.Future[Any] | None] = {}
        self._last_prune = 0.0
        self.interrupted = 0  # started rows found open (and marked interrupted) at open()
        self.recovered_records = 0  # journal records a dead daemon left, ingested at open()
        # records: entries ingested into SQLite; journaled: entries journaled (the loop's).
        self.stats = {"records": 0, "journaled": 0, "commits": 0, "started_rows": 0,
                      "checkpoints": 0,
                      "journal_bytes": 0, "ingest_us": 0, "ingest_cpu_us": 0,
                      "ingest_errors": 0}

    # ---- lifecycle ---------------------------------------------------------------------------
    def _connect(self, autocheckpoint: int = 4000) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False,
                               timeout=30)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={self.sync}")
        conn.execute(f"PRAGMA wal_autocheckpoint={autocheckpoint}")
        return conn

    def open(self, loop: asyncio.AbstractEventLoop) -> None:
        """Open the database, ingest what a dead daemon left in the journal, mark its calls
        in flight interrupted, start a new journal and the ingester."""
        if not self.enabled:
            return
        self._loop = loop
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        # One writer per state dir: a second one would take the first's journal for a dead
        # daemon's and remove it under its feet.
        lock = try_lock(os.path.join(self.state_dir, LOCK_NAME))
        if lock is None:
            raise InternalError(f"the trajectory log in {self.state_dir} is open in another "
                                "process")
        self._lock = lock
        journal = Journal(self.state_dir)
        # The ingester's connection; it checkpoints by itself every CHECKPOINT_EVERY records.
        conn = self._connect(autocheckpoint=0)
        try:
            conn.executescript(_SCHEMA)
            _migrate(conn)
            conn.execute(_STARTED_INDEX)
            done = _meta(conn, "journal")
            records, top, torn = journal.read(after=done)
            if records:
                self.recovered_records, bad = self._recover(conn, records)
                log.warning("journal records of the last daemon ingested",
                            extra={"count": self.recovered_records, "torn": torn,
                                   "unusable": bad})
            # Entries committed since the last index update (all of them in a log written
            # before entries_by_sandbox existed).
            _index_tail(conn)
            self._unindexed = 0
            # Before any new call can start: what was in flight when the last daemon died.
            open_rows = conn.execute("SELECT seq, sandbox_id, op, idem_key, started_at FROM "
                                     "entries WHERE status=?", (STARTED,)).fetchall()
            conn.executemany("UPDATE entries SET status=?, error=? WHERE seq=?",
                             [(INTERRUPTED, _dumps(interrupted_error(r[1], r[2], r[3], r[4],
                                                                     r[0])), r[0])
                              for r in open_rows])
            self.interrupted = len(open_rows)
            if self.interrupted:
                log.warning("calls interrupted by the last daemon's death",
                            extra={"count": self.interrupted})
            self._seq = conn.execute("SELECT max(seq) FROM entries").fetchone()[0] or 0
        except BaseException:
            conn.close()
            os.close(lock)
            self._lock = -1
            raise
        journal.remove_all()  # everything in it is in the database now
        self._jn = self._ingested = max(done, top)
        try:
            journal.start(self._jn + 1)
        except OSError as e:  # a full disk: the first append tries again (and fails, infra)
            log.error("could not make a trajectory log journal file", extra={"error": str(e)})
        self._journal = journal
        self._conn = conn
        self._reader = self._connect()
        self._closing = False
        self._thread = threading.Thread(target=self._ingester, name="trajlog-ingest",
                                        daemon=True)
        self._thread.start()

    def _recover(self, conn: sqlite3.Connection,
                 records: list[tuple[int, str, tuple[Any, ...]]]) -> tuple[int, int]:
        """Ingest a dead writer's journal records in one transaction; (ingested, unusable).
        Records are the daemon's own, but a damaged file must not keep the daemon from
        starting: if the batch fails, each record is tried alone and the ones the database
        refuses are skipped (and counted)."""
        lines: list[_Line] = [(n, k, fields, None) for n, k, fields in records]
        try:
            conn.execute("BEGIN")
            for i in range(0, len(lines), RECOVER_CHUNK):
                self._ingest_lines(conn, lines[i:i + RECOVER_CHUNK])
            conn.execute("UPDATE log_meta SET v=? WHERE k='journal'", (lines[-1][0],))
            conn.execute("COMMIT")
            return len(lines), 0
        except (sqlite3.Error, ValueError, TypeError, OverflowError):
            log.exception("journal records refused as a batch: one by one")
            if conn.in_transaction:
                conn.execute("ROLLBACK")
        done = bad = 0
        for line in lines:
            try:
                conn.execute("BEGIN")
                self._ingest_lines(conn, [line])
                conn.execute("COMMIT")
                done += 1
            except (sqlite3.Error, ValueError, TypeError, OverflowError):
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                bad += 1
        conn.execute("UPDATE log_meta SET v=? WHERE k='journal'", (lines[-1][0],))
        return done, bad

    def close(self) -> None:
        """Ingest what is journaled, stop the ingester; remove the journal if all of it is in
        the database (else the next start ingests the rest)."""
        if self._thread is not None:
            self._closing = True
            self._wake.set()
            self._now.set()
            self._thread.join(30)
            self._thread = None
        if self._journal is not None:
            self._journal.close(remove=self._ingested >= self._jn)
            self._journal = None
        if self._conn is not None:
            self._conn.close()  # the last writer: SQLite checkpoints the WAL on close
            self._conn = None
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        if self._lock >= 0:
            os.close(self._lock)  # releases the flock
            self._lock = -1

    # ---- the journal (the loop) ----------------------------------------------------------------
    def _append(self, kind: str, fields: tuple[Any, ...],
                slot: tuple[str, str] | None = None) -> int:
        """Journal one record: durable when this returns; its number. Then hand it to the
        ingester. Raises InternalError if it could not be written."""
        journal = self._journal
        if journal is None:
            raise InternalError("the trajectory log is closed")
        self._jn += 1
        n = self._jn
        data = _dumps((n, kind, *fields)).encode()
        try:
            journal.append(data, n)
        except (OSError, ValueError) as e:  # ENOSPC making a file; a closed map
            log.error("trajectory log journal write failed", extra={"error": str(e)})
            journal.set_aside()
            raise InternalError(f"could not write the trajectory log: {e}") from e
        st = self.stats
        st["journal_bytes"] += len(data)
        if kind == "e":
            st["journaled"] += 1
        with self._mu:
            first = not self._pending
            self._pending.append((n, kind, fields, slot))
        if first:
            self._wake.set()
        return n

    def _control(self, item: _Control, now: bool = False) -> None:
        with self._mu:
            self._pending.append(item)
        self._wake.set()
        if now:
            self._now.set()

    def _write_entry(self, sid: str, op: str, request: dict[str, Any],
                     result: dict[str, Any] | None, error: dict[str, Any] | None,
                     started_at: float, ended_at: float, key: str | None, fp: str | None,
                     snapshot_ids: list[str] | None, start: _Start | None,
                     scope: str | None = None, req_text: str | None = None,
                     status: str | None = None) -> int:
        """Journal a finished call (replacing its started row if it had one); its seq."""
        if start is not None and start.rowid is not None:
            seq = start.rowid
        else:
            self._seq += 1
            seq = self._seq
        slot = None
        if key is not None:
            slot = (sid if scope is None else scope, key)
            self._unbound[slot] = (fp, sid, result, error)
            bound = self._bound.get(slot[0])
            if bound is not None:
                bound.add(key)
        try:
            self._append("e", (seq, sid, op, key, fp,
                               _dumps(_plain(request)) if req_text is None else req_text,
                               None if result is None else _dumps(result),
                               None if error is None else _dumps(error), started_at, ended_at,
                               _dumps(snapshot_ids) if snapshot_ids else None, status), slot)
        except InternalError:
            if slot is not None:
                self._unbound.pop(slot, None)
            raise
        return seq

    async def _settled(self) -> None:
        """After journaling on a call's path: wait for the ingester only when asked to
        (``sync=full``) or when it is far behind (MAX_PENDING)."""
        if self._full or len(self._pending) > MAX_PENDING:
            await self.flushed()

    # ---- the ingester thread --------------------------------------------------------------------
    def _ingester(self) -> None:
        conn = self._conn
        assert conn is not None
        try:  # behind the calls: the loop, the clients and the sandboxes come first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), INGEST_NICE)
        except OSError:
            pass
        while True:
            self._wake.wait()
            self._wake.clear()
            if not self._closing:
                self._now.wait(self.flush_s)  # gather a batch, unless someone waits
            self._now.clear()
            while (self._hold_ingest and os.path.exists(self._hold_ingest)
                   and not self._closing):
                time.sleep(0.01)  # tests only: journaled, not ingested
            with self._mu:
                batch, self._pending = self._pending, []
            if batch:
                if not self._ingest(conn, batch):
                    lines = [it for it in batch if type(it) is tuple]
                    with self._mu:  # again, ahead of anything newer (the journal has them)
                        self._pending[:0] = lines
                    if self._closing:
                        return  # the next start ingests them from the journal
                    self._now.wait(INGEST_RETRY_S)
                    self._wake.set()
                    continue
            if self._closing:
                with self._mu:
                    if not self._pending:
                        return
                self._wake.set()

    def _ingest(self, conn: sqlite3.Connection, batch: list[_Line | _Control]) -> bool:
        """One transaction for the batch: its lines (by kind, ``_ingest_lines``) and control
        items in order, and the journal watermark. Resolves the waiters; False if it failed
        (nothing of it is in the database)."""
        t0, c0 = time.perf_counter(), time.thread_time()
        results: list[tuple[asyncio.Future[Any], Any, BaseException | None]] = []
        top = 0
        try:
            conn.execute("BEGIN")
            seg: list[_Line] = []
            for it in batch:
                if isinstance(it, tuple):
                    seg.append(it)
                    continue
                if seg:
                    top = seg[-1][0]
                    self._ingest_lines(conn, seg)
                    seg = []
                value = self._apply(conn, it)
                if it.fut is not None:
                    results.append((it.fut, value, None))
            if seg:
                top = seg[-1][0]
                self._ingest_lines(conn, seg)
            if top:
                conn.execute("UPDATE log_meta SET v=? WHERE k='journal'", (top,))
            self._maybe_index(conn)
            conn.execute("COMMIT")
        except Exception as e:  # noqa: BLE001 - reported to every waiter; the journal keeps all
            log.exception("trajectory log ingest failed (its records stay in the journal)")
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            self.stats["ingest_errors"] += 1
            err = InternalError(f"could not write the trajectory log: {e}")
            self._resolve_soon([(it.fut, None, err) for it in batch
                                if isinstance(it, _Control) and it.fut is not None])
            return False
        if top:
            self._ingested = top
            for it in batch:
                if isinstance(it, tuple) and it[3] is not None:
                    self._unbound.pop(it[3], None)
            assert self._journal is not None or self._closing
            if self._journal is not None:
                self._journal.release(top)
        st = self.stats
        st["commits"] += 1
        st["ingest_us"] += int((time.perf_counter() - t0) * 1e6)
        st["ingest_cpu_us"] += int((time.thread_time() - c0) * 1e6)
        n = sum(1 for it in batch if type(it) is tuple)
        self._since_ckpt += n
        if self._since_ckpt >= CHECKPOINT_EVERY:
            self._since_ckpt = 0
            try:
                conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                st["checkpoints"] += 1
            except sqlite3.Error:
                log.exception("trajectory log checkpoint failed")
        self._resolve_soon(results)
        return True

    def _ingest_lines(self, conn: sqlite3.Connection, seg: list[_Line]) -> None:
        """Journal records into the database, in order, a run of one kind at a time: entries
        by multi-row INSERTs, the other kinds by ``executemany`` per statement."""
        i, end = 0, len(seg)
        while i < end:
            kind = seg[i][1]
            j = i + 1
            while j < end and seg[j][1] == kind:
                j += 1
            rows = [it[2] for it in seg[i:j]]
            if kind == "e":
                if len(rows) > 1:  # a started row and its end in one batch: the end only
                    rows = list({r[0]: r for r in rows}.values())  # (in first-seen order)
                k = 0
                while k < len(rows):
                    size = min(ENTRIES_PER_STATEMENT, 1 << ((len(rows) - k).bit_length() - 1))
                    chunk = rows[k:k + size]
                    conn.execute(_entries_sql(size), [v for r in chunk for v in r])
                    k += size
                self._unindexed += j - i
                self.stats["records"] += j - i
                i = j
                continue
            for sql in _J_SQL[kind]:
                conn.executemany(sql, rows)
            if kind == "d":
                self._lower_watermark(conn)
            i = j

    def _apply(self, conn: sqlite3.Connection, p: _Control) -> Any:
        if p.kind == "barrier":
            return None
        if p.kind == "ended_except":
            live = set(p.args[1])
            now = p.args[0]
            rows = conn.execute("SELECT sandbox_id FROM sandboxes WHERE ended_at IS NULL")
            gone = [(now, r[0]) for r in rows.fetchall() if r[0] not in live]
            conn.executemany("UPDATE sandboxes SET ended_at=?, reason='lost' WHERE "
                             "sandbox_id=?", gone)
            return None
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

    def _resolve_soon(self, results: list[tuple[asyncio.Future[Any], Any,
                                                BaseException | None]]) -> None:
        if results and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(_resolve, results)
            except RuntimeError:  # the loop is closed (daemon exiting)
                pass

    def _maybe_index(self, conn: sqlite3.Connection) -> None:
        """In the current transaction: index the entries since the last time, once there
        are INDEX_EVERY of them (an amortised cost: one page or a few for all of them)."""
        if self._unindexed < INDEX_EVERY:
            return
        _index_tail(conn)  # reads the watermark: one small read every INDEX_EVERY entries
        self._unindexed = 0

    def _lower_watermark(self, conn: sqlite3.Connection) -> None:
        """After a delete: the watermark must stay below entries not indexed yet (seqs of
        deleted last entries can be given again by a later daemon: ``max(seq)`` at open)."""
        top = conn.execute("SELECT max(seq) FROM entries").fetchone()[0] or 0
        if top < _watermark(conn):
            conn.execute("UPDATE log_meta SET v=? WHERE k='indexed'", (top,))

    # ---- what the engine and the API call --------------------------------------------------------
    def sandbox_created(self, sid: str, spec: dict[str, Any], created_at: float) -> None:
        self._live.add(sid)
        if self.enabled:
            self._sandbox_write("sc", (sid, _dumps(spec), created_at))

    def sandbox_ended(self, sid: str, reason: str) -> None:
        self._live.discard(sid)
        self._bound.pop(sid, None)
        if self.enabled:
            self._sandbox_write("se", (sid, time.time(), reason))

    def _sandbox_write(self, kind: str, fields: tuple[Any, ...]) -> None:
        """A sandbox row: journaled like an entry (a create's row before the create's entry),
        never failing the create or kill that made it (the error is logged)."""
        try:
            self._append(kind, fields)
        except InternalError:
            pass

    def readopted(self, boxes: list[tuple[str, dict[str, Any], float, dict[str, Any]]]
                  ) -> None:
        """At a restart: (id, spec, created_at, SandboxInfo) of each re-adopted sandbox. Those
        whose create the log lacks (their daemon died between the sandbox's record and the
        create's entry, so no client saw it) get their sandbox row and a create entry from
        the record, marked ``recovered``. Runs after open(): the database has every record."""
        self._live.update(b[0] for b in boxes)
        if not self.enabled or not boxes:
            return
        assert self._reader is not None
        n = 0
        for sid, spec, created_at, info in boxes:
            if self._reader.execute("SELECT 1 FROM sandboxes WHERE sandbox_id=?",
                                    (sid,)).fetchone() is None:
                self._sandbox_write("sc", (sid, _dumps(spec), created_at))
            if self._reader.execute(f"SELECT 1 FROM entries WHERE seq IN ({_SANDBOX_SEQS}) "
                                    "AND op='create' LIMIT 1", {"sid": sid}).fetchone():
                continue
            snap = info.get("snapshot")
            try:
                self._write_entry(sid, "create", spec, dict(info, recovered=True), None,
                                  created_at, time.time(), None, None,
                                  [snap] if snap else None, None)
            except InternalError:
                continue
            n += 1
        if n:
            log.warning("re-adopted sandboxes without a create entry: written from their "
                        "records", extra={"count": n})

    def recovered(self, live: set[str]) -> None:
        """After a restart: sandboxes the log thought alive but that are not are ended."""
        if self.enabled and self._thread is not None:
            self._control(_Control("ended_except", (time.time(), sorted(live)), None))

    def maybe_prune(self, now: float) -> None:
        if self.enabled and now - self._last_prune >= PRUNE_EVERY_S:
            self._last_prune = now
            self._control(_Control("prune", (now - self.retention_s,), None))

    async def prune(self, now: float | None = None) -> int:
        if not self.enabled:
            return 0
        assert self._loop is not None
        fut = self._loop.create_future()
        self._control(_Control("prune", ((now or time.time()) - self.retention_s,), fut),
                      now=True)
        return int(await _committed(fut))

    def _prep(self, c: _Start, held: bool) -> None:
        """Run by the loop while the call runs (scheduled when it starts, so it costs the
        call's path nothing on an idle loop): encode the request, and hold a mutating call
        for its started row, journaled (never waited for) if the call is still running
        ``start_ms`` from its start. A call that ends sooner costs no extra record."""
        if c.over:
            return  # it ended first: its end encoded the request itself
        if c.req_text is None:
            c.req_text = _dumps(_plain(c.request))
        if held:
            self._held[c] = None
            if self._tick is None and self._loop is not None:
                self._tick = self._loop.call_later(
                    max(0.0, c.t + self.start_hold_s - time.monotonic()), self._queue_due)

    def _start_now(self, c: _Start) -> None:
        """Journal a keyed call's started row before the call runs (raises InternalError if it
        cannot be written: then the call does not run)."""
        if c.req_text is None:
            c.req_text = _dumps(_plain(c.request))
        self._seq += 1
        self._append("e", (self._seq, c.sid, c.op, c.key, c.fp, c.req_text, None, None,
                           c.started_at, c.started_at, None, STARTED))
        c.rowid = self._seq
        self.stats["started_rows"] += 1

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
            self._seq += 1
            try:
                self._append("e", (self._seq, s.sid, s.op, s.key, s.fp, s.req_text, None,
                                   None, s.started_at, s.started_at, None, STARTED))
            except InternalError:
                continue  # logged; its end writes a whole entry
            s.rowid = self._seq
            self.stats["started_rows"] += 1

    def _close_start(self, s: _Start) -> _Start | None:
        """The call ended: the start its end must replace, or None (never journaled)."""
        s.over = True
        self._held.pop(s, None)
        return s if s.rowid is not None else None

    def drop(self, start: _Start) -> None:
        """The call will not be logged after all (no such sandbox, a daemon bug)."""
        s = self._close_start(start)
        if s is not None:
            try:
                self._append("d", (s.rowid, s.sid))
            except InternalError:
                pass  # logged; the row stays, marked interrupted at the next start

    def logged(self, sid: str, op: str, request: dict[str, Any],
               result: dict[str, Any] | None, started_at: float,
               snapshot_ids: list[str] | None = None) -> None:
        """Journal a finished entry of a call that was not made through ``run`` (a fork's
        children): durable when this returns."""
        if self.enabled:
            self._write_entry(sid, op, request, result, None, started_at, time.time(), None,
                              None, snapshot_ids, None)

    async def record(self, sid: str, op: str, request: dict[str, Any],
                     result: dict[str, Any] | None, error: dict[str, Any] | None,
                     started_at: float, ended_at: float, key: str | None = None,
                     fp: str | None = None, snapshot_ids: list[str] | None = None,
                     start: _Start | None = None) -> int:
        """Journal one entry (replacing ``start``'s row if it was journaled); its seq."""
        req_text = None
        if start is not None:
            req_text = start.req_text
            start = self._close_start(start)
        seq = self._write_entry(sid, op, request, result, error, started_at, ended_at, key,
                                fp, snapshot_ids, start, req_text=req_text)
        await self._settled()
        return seq

    def _lookup(self, scope: str, key: str) -> tuple[str | None, str, Any, Any] | None:
        """The finished entry that binds ``key`` (started and interrupted rows do not):
        (fingerprint, sandbox id, result, error), journaled or in the database."""
        got = self._unbound.get((scope, key))
        if got is not None:  # checked first: the ingester removes it only once it is in
            return got
        assert self._reader is not None
        if scope:
            if key not in self._bound_keys(scope):
                return None
            sql = ("SELECT fingerprint, sandbox_id, result, error FROM entries WHERE "
                   f"idem_key=? AND sandbox_id=? AND {_BINDS} ORDER BY status IS NOT NULL, "
                   "seq LIMIT 1")
            row = self._reader.execute(sql, (key, scope)).fetchone()
        else:
            sql = ("SELECT fingerprint, sandbox_id, result, error FROM entries WHERE "
                   "idem_key=? AND op='create' AND status IS NULL ORDER BY seq LIMIT 1")
            row = self._reader.execute(sql, (key,)).fetchone()
        if row is None:
            return None
        return (row[0], row[1], json.loads(row[2]) if row[2] is not None else None,
                json.loads(row[3]) if row[3] is not None else None)

    def _bound_keys(self, sid: str) -> set[str]:
        """The keys ``sid``'s log binds (see ``_bound``). Loading it: the journaled keys first,
        then the database's: an entry the ingester takes out of ``_unbound`` meanwhile is
        committed by then, so the query sees it."""
        keys = self._bound.get(sid)
        if keys is None:
            keys = {k for (scope, k) in list(self._unbound) if scope == sid}
            assert self._reader is not None
            keys.update(k for (k,) in self._reader.execute(
                f"SELECT idem_key FROM entries WHERE seq IN ({_SANDBOX_SEQS}) AND idem_key IS "
                f"NOT NULL AND {_BINDS}", {"sid": sid}))
            if sid in self._live and len(self._bound) < MAX_BOUND_SETS:
                self._bound[sid] = keys  # kept while it runs (a gone one's: rare replays)
        return keys

    def logged_result(self, sid: str, op: str) -> dict[str, Any] | None:
        """The result of ``sid``'s first finished ``op`` entry in the database (a fork
        child's create; callers wait for ``flushed`` first)."""
        assert self._reader is not None
        row = self._reader.execute(
            f"SELECT result FROM entries WHERE seq IN ({_SANDBOX_SEQS}) AND op=:op AND "
            "status IS NULL AND result IS NOT NULL ORDER BY seq LIMIT 1",
            {"sid": sid, "op": op}).fetchone()
        return json.loads(row[0]) if row else None

    async def run(self, sid: str, op: str, request: Any, key: str | None,
                  call: Callable[[], Awaitable[Any]],
                  to_log: Callable[[Any], dict[str, Any]] | None = None,
                  snapshot_ids: SnapIds = None) -> Any:
        """Run ``call`` once per idempotency key and log it; return what the client gets.

        ``sid`` is the sandbox (``""`` for a create: its id is known only after).
        ``request``: a dict, or a pydantic model (dumped while the call runs: ``_plain``).
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
        if key is None:
            return await self._run_and_log(sid, op, request, None, None, call, to_log,
                                           snapshot_ids)
        if not key or len(key) > MAX_KEY_LEN or not _utf8(key):
            raise InvalidRequest(f"{KEY_HEADER} must be 1 to {MAX_KEY_LEN} characters of "
                                 "UTF-8 text")
        request = _plain(request)  # dumped and encoded once: the fingerprint and the entry
        req_text, fp = keyed_text(op, request)
        slot = (sid, key)
        while slot in self._inflight:
            # A duplicate of a call in flight: wait for it (its future made by the first
            # duplicate: a call that has none costs no future).
            other = self._inflight[slot]
            if other is None:
                assert self._loop is not None
                other = self._inflight[slot] = self._loop.create_future()
            try:
                await asyncio.shield(other)
            except BaseException:  # noqa: BLE001 - the outcome is read from the log
                pass
        row = self._lookup(sid, key)
        if row is not None:
            return self._replayed(op, key, fp, row)
        self._inflight[slot] = None
        try:
            return await self._run_and_log(sid, op, request, key, fp, call, to_log,
                                           snapshot_ids, req_text)
        finally:
            done = self._inflight.pop(slot, None)
            if done is not None and not done.done():
                done.set_result(None)

    def _replayed(self, op: str, key: str, fp: str | None,
                  row: tuple[str | None, str, Any, Any]) -> Any:
        logged_fp, logged_sid, result, error = row
        if logged_fp != fp:
            raise ReplayDivergence(
                f"idempotency key {key!r} was used for a different request "
                f"({op} now, logged in sandbox {logged_sid})",
                details={"key": key, "sandbox_id": logged_sid})
        if error is not None:
            raise error_from_payload(error)
        return result

    async def _run_and_log(self, sid: str, op: str, request: Any, key: str | None,
                           fp: str | None, call: Callable[[], Awaitable[Any]],
                           to_log: Callable[[Any], dict[str, Any]] | None,
                           snapshot_ids: SnapIds, req_text: str | None = None) -> Any:
        started = time.time()
        c = _Start(sid, op, request, started, key, fp)
        c.req_text = req_text
        early = key is not None and op in KEYED_START_OPS
        if early:
            self._start_now(c)  # before the call runs: a retry never runs it twice
        elif req_text is not None:
            if op in STARTED_OPS:  # encoded already: only the started row to arm
                self._loop.call_soon(self._prep, c, True)  # type: ignore[union-attr]
        else:
            self._loop.call_soon(self._prep, c, op in STARTED_OPS)  # type: ignore[union-attr]
        ids = snapshot_ids if not callable(snapshot_ids) else None
        try:
            value = await call()
        except CorralError as e:
            if op == "create" or isinstance(e, SandboxNotFound):
                self.drop(c)
                raise  # nothing was made, or no such sandbox: nothing to log
            # A failure of the platform does not bind the key: a retry runs for real.
            logged_key = None if e.infra else key
            if self._hold_file:
                await self._wait_hold_file()
            await self.record(sid, op, request, None, e.to_payload(), started, time.time(),
                              logged_key, fp if logged_key else None, ids, c)
            raise
        except BaseException:
            if not early:
                self.drop(c)  # a daemon bug (the client gets internal): not a call
                raise
            # A keyed call that started and did not finish (cancelled at a shutdown, a daemon
            # bug): interrupted, its key bound, as after a crash.
            start = self._close_start(c)
            try:
                self._write_entry(sid, op, request, None,
                                  interrupted_error(sid, op, key, started, c.rowid or 0),
                                  started, started, key, fp, ids, start, req_text=c.req_text,
                                  status=INTERRUPTED)
            except InternalError:
                pass  # the log is closed: its started row is interrupted at the next open
            raise
        start = self._close_start(c)
        result = to_log(value) if to_log is not None else value
        scope = sid  # a create's key is bound globally (scope ""), its entry is the new id's
        if op == "create" and isinstance(result, dict):
            sid = str(result.get("id", sid))
        if callable(snapshot_ids):
            ids = snapshot_ids(result)
        if self._hold_file:
            await self._wait_hold_file()
        self._write_entry(sid, op, request, result, None, started, time.time(), key, fp, ids,
                          start, scope, c.req_text)
        if self._full or len(self._pending) > MAX_PENDING:
            await self.flushed()
        return value

    async def _wait_hold_file(self) -> None:
        """Tests only: a finished call waits here, unjournaled, while the hold file exists."""
        while self._hold_file and os.path.exists(self._hold_file):
            await asyncio.sleep(0.01)

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
        """Return once everything journaled so far is in the database (a reader of the log
        must see every call that answered)."""
        if self.enabled and self._thread is not None and self._loop is not None:
            fut = self._loop.create_future()
            self._control(_Control("barrier", (), fut), now=True)
            await _committed(fut)

    async def knows(self, sid: str) -> bool:
        """Whether the log has sandbox ``sid`` (also long after it is gone, until pruned)."""
        if not self.enabled:
            return False
        await self.flushed()
        assert self._reader is not None
        return self._reader.execute("SELECT 1 FROM sandboxes WHERE sandbox_id=?",
                                    (sid,)).fetchone() is not None

    async def trajectory(self, tid: str) -> tuple[str, int] | None:
        """(sandbox id, next step) of trajectory ``tid``: the sandbox its create (key
        ``{tid}:create``) made, or, for a fork child's ``{parent}/fork{step}/{i}``, child
        ``i`` of that fork; the step after the highest ``{tid}:{n}`` its log binds. None if
        the log has no such trajectory."""
        if not self.enabled:
            raise Unsupported("the trajectory log is off on this daemon (CORRAL_TRAJLOG=0)")
        await self.flushed()
        return await asyncio.to_thread(self._trajectory, tid)

    def _trajectory(self, tid: str) -> tuple[str, int] | None:
        conn = self._connect()
        try:
            sid = self._trajectory_sandbox(conn, tid)
            if sid is None:
                return None
            rows = conn.execute(
                f"SELECT idem_key FROM entries WHERE seq IN ({_SANDBOX_SEQS}) AND {_BINDS} "
                "AND substr(idem_key, 1, :n) = :p",
                {"sid": sid, "n": len(tid) + 1, "p": tid + ":"}).fetchall()
        finally:
            conn.close()
        steps = [int(k[len(tid) + 1:]) for (k,) in rows if k[len(tid) + 1:].isdigit()]
        return sid, (max(steps) + 1 if steps else 0)

    def _trajectory_sandbox(self, conn: sqlite3.Connection, tid: str) -> str | None:
        row = conn.execute("SELECT sandbox_id FROM entries WHERE idem_key=? AND op='create' "
                           "AND status IS NULL ORDER BY seq LIMIT 1",
                           (tid + ":create",)).fetchone()
        if row is not None:
            return str(row[0])
        parent_tid, sep, tail = tid.rpartition("/fork")
        step, _, child = tail.partition("/")
        if not sep or not child.isdigit():
            return None
        parent = self._trajectory_sandbox(conn, parent_tid)
        if parent is None:
            return None
        for key in (f"{parent_tid}:{step}", step):  # a stepped key, or an explicit one
            row = conn.execute(
                f"SELECT result FROM entries WHERE seq IN ({_SANDBOX_SEQS}) AND idem_key="
                ":k AND op='fork' AND status IS NULL AND result IS NOT NULL LIMIT 1",
                {"sid": parent, "k": key}).fetchone()
            if row is not None:
                kids = json.loads(row[0]).get("sandboxes") or []
                return str(kids[int(child)]) if int(child) < len(kids) else None
        return None

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
    # The number of the last journal record in the database (corral.daemon.journal).
    conn.execute("INSERT OR IGNORE INTO log_meta (k, v) VALUES ('journal', 0)")
    conn.execute("DROP INDEX IF EXISTS entries_sandbox")


def _meta(conn: sqlite3.Connection, k: str) -> int:
    row = conn.execute("SELECT v FROM log_meta WHERE k=?", (k,)).fetchone()
    return int(row[0]) if row and row[0] is not None else 0


def _watermark(conn: sqlite3.Connection) -> int:
    return _meta(conn, "indexed")


def _utf8(text: str) -> bool:
    """No lone surrogates (a header can carry them; SQLite's JSON could not store them)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


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
