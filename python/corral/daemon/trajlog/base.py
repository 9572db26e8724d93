"""The trajectory log's state and the primitives every part uses: the queue to the
ingester (records and control items) and the barrier."""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import threading
from collections.abc import Callable
from typing import Any

from corral.daemon.clock import REAL, Clock, Timer
from corral.daemon.diskguard import DISK_FULL
from corral.daemon.journal import Journal
from corral.errors import CorralError, InternalError

from .keys import _dumps
from .schema import DB_NAME

PRUNE_EVERY_S = 60.0
# Sandboxes whose bound keys are kept in memory (``TrajLog._bound``); past it, the database.
MAX_BOUND_SETS = 100_000
# Records journaled and not yet in the database beyond which calls wait for the ingester (a
# disk slower than the calls): memory stays bounded, the journal does not outrun SQLite.
MAX_PENDING = 50_000
# ...or bytes of them, counting the batch the ingester is writing: an exec's entry carries up
# to output_cap characters of each stream (JSON: up to ~12 MiB for 1 Mi characters each), and
# 48 commands flooding their output grew the daemon by ~450 MiB of entries the ingester (nice
# 10) had not written yet.
MAX_PENDING_BYTES = 64 << 20

log = logging.getLogger("corral.trajlog")


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
                 key: str | None, fp: str | None, t: float) -> None:
        self.sid, self.op, self.request, self.started_at = sid, op, request, started_at
        self.key, self.fp = key, fp
        self.t = t  # the log's clock, monotonic
        self.rowid: int | None = None
        self.req_text: str | None = None  # the request as logged (JSON)
        self.over = False  # the call has returned


SnapIds = list[str] | Callable[[Any], list[str]] | None


def write_error(e: BaseException) -> InternalError:
    """The API's error for a log write that failed: ``internal`` (infra), which the log's
    callers catch; a full disk says so (``details.disk: state_dir``), the daemon's own."""
    full = (isinstance(e, OSError) and e.errno in DISK_FULL) or (
        isinstance(e, sqlite3.OperationalError) and "full" in str(e))
    if full:
        return InternalError(f"could not write the trajectory log: the daemon's disk is full "
                             f"({e})", details={"disk": "state_dir"})
    return InternalError(f"could not write the trajectory log: {e}")


async def _committed(fut: asyncio.Future[Any]) -> Any:
    """Wait for the commit of a queued (or coalesced) entry; its seq (None if coalesced)."""
    try:
        return await asyncio.shield(fut)
    except CorralError:
        raise
    except Exception as e:  # noqa: BLE001
        raise write_error(e) from e


def _resolve(results: list[tuple[asyncio.Future[Any], Any, BaseException | None]]) -> None:
    for fut, value, exc in results:
        if fut.done():
            continue
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(value)


# Big entries (keys.BIG_ENTRY) encoded or parsed at once in the whole daemon. Their pieces
# let the loop go, so without a bound every command ending together would hold its entry's
# text at once (32 commands with 4 MiB of binary output kept: +640 MiB).
BIG_AT_ONCE = 2


class _Base:
    def __init__(self, state_dir: str, *, enabled: bool = True, retention_s: float = 7 * 86400,
                 output_cap: int = 1 << 20, body_cap: int = 1 << 20, sync: str = "normal",
                 flush_ms: float = 100.0, start_ms: float = 20.0, clock: Clock = REAL) -> None:
        self.enabled = enabled
        # Entry times, started rows held back, retention (key expiry): corral.daemon.clock.
        self.clock = clock
        self.state_dir = state_dir
        self.path = os.path.join(state_dir, DB_NAME)
        self.retention_s = retention_s
        self.output_cap = output_cap
        self.body_cap = body_cap
        self.sync = "FULL" if sync.lower() == "full" else "NORMAL"
        self._full = self.sync == "FULL"  # every call waits for its record's ingest (fsync)
        self.flush_s = max(0.0, flush_ms) / 1000.0
        self.start_hold_s = max(0.0, start_ms) / 1000.0
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
        self._pending_bytes = 0  # journal bytes of the lines in _pending (under _mu)
        self._ingesting_bytes = 0  # ...and of the batch the ingester is writing
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
        self._since_ckpt_bytes = 0
        self._unindexed = 0  # entries ingested since the index was last updated
        self._closing = False
        # Started rows held on the loop, oldest first (a dict: O(1) removal anywhere, O(1)
        # oldest), and the one timer that journals the due ones (armed while any is held).
        self._held: dict[_Start, None] = {}
        self._tick: Timer | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._conn: sqlite3.Connection | None = None  # the ingester's
        self._reader: sqlite3.Connection | None = None  # the loop's (key lookups)
        # (sid, key) -> the future a duplicate waits on (None: no duplicate yet)
        self._inflight: dict[tuple[str, str], asyncio.Future[Any] | None] = {}
        self._last_prune = 0.0
        # A tenant's log budget in bytes (None: no budget), set by the daemon when it has
        # tenants (CORRAL_TENANT_LOG_MB); called on the ingester thread. Sandboxes without a
        # tenant (the admin's) have none.
        self.tenant_log_budget: Callable[[str], int | None] | None = None
        # What the ingester found at its last commit: the tenants whose live sandboxes' logs
        # hold half their budget or more, tenant -> (bytes, live bytes, budget). Replaced
        # whole by the ingester, read by the loop (``Idempotency._budget``).
        self._over: dict[str, tuple[int, int, int]] = {}
        # Live sandboxes' tenants (a sandbox without one is not in it).
        self._tenant: dict[str, str] = {}
        # tenant -> its one big entry encoded or parsed at a time, and the calls that want
        # it (Idempotency._one_big)
        self._encoding: dict[str, tuple[asyncio.Lock, list[int]]] = {}
        # Big entries encoded or parsed at once, whoever's: each holds its text (and the
        # journal line's) whole for a moment, ~6 bytes a byte of binary output.
        self._big_slots = asyncio.Semaphore(BIG_AT_ONCE)
        self.interrupted = 0  # started rows found open (and marked interrupted) at open()
        self.recovered_records = 0  # journal records a dead daemon left, ingested at open()
        # records: entries ingested into SQLite; journaled: entries journaled (the loop's).
        self.stats = {"records": 0, "journaled": 0, "commits": 0, "started_rows": 0,
                      "checkpoints": 0,
                      "journal_bytes": 0, "ingest_us": 0, "ingest_cpu_us": 0,
                      "ingest_errors": 0, "budget_pruned_bytes": 0, "budget_compact": 0,
                      "budget_refused": 0}

    def _connect(self, autocheckpoint: int = 4000, cached: int = 128) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False,
                               timeout=30, cached_statements=cached)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={self.sync}")
        conn.execute(f"PRAGMA wal_autocheckpoint={autocheckpoint}")
        return conn

    def _append(self, kind: str, fields: tuple[Any, ...],
                slot: tuple[str, str] | None = None,
                encoded: dict[int, str] | None = None) -> int:
        """Journal one record: durable when this returns; its number. Then hand it to the
        ingester. Raises InternalError if it could not be written. ``encoded``: the JSON of
        some fields (by index), made before (keys.encoded)."""
        journal = self._journal
        if journal is None:
            raise InternalError("the trajectory log is closed")
        self._jn += 1
        n = self._jn
        if encoded:  # the same text as _dumps of the whole record
            data = ("[" + ",".join([_dumps(n), _dumps(kind)] + [
                encoded[i] if i in encoded else _dumps(v) for i, v in enumerate(fields)])
                + "]").encode()
        else:
            data = _dumps((n, kind, *fields)).encode()
        try:
            journal.append(data, n)
        except (OSError, ValueError) as e:  # ENOSPC making a file; a closed map
            log.error("trajectory log journal write failed", extra={"error": str(e)})
            journal.set_aside()
            raise write_error(e) from e
        st = self.stats
        st["journal_bytes"] += len(data)
        if kind == "e":
            st["journaled"] += 1
        with self._mu:
            first = not self._pending
            self._pending.append((n, kind, fields, slot))
            self._pending_bytes += len(data)
        if first:
            self._wake.set()
        return n

    def _control(self, item: _Control, now: bool = False) -> None:
        with self._mu:
            self._pending.append(item)
        self._wake.set()
        if now:
            self._now.set()

    def _behind(self) -> bool:
        """A call that journaled waits for the ingester (``flushed``): always with
        ``sync=full``, else when it is ``_backlogged``."""
        return self._full or self._backlogged()

    def _backlogged(self) -> bool:
        """What the ingester has not taken is past MAX_PENDING lines, or with what it is
        writing, past MAX_PENDING_BYTES (a disk, or an ingester, slower than the calls)."""
        return (len(self._pending) > MAX_PENDING
                or self._pending_bytes + self._ingesting_bytes > MAX_PENDING_BYTES)

    async def flushed(self) -> None:
        """Return once everything journaled so far is in the database (a reader of the log
        must see every call that answered)."""
        if self.enabled and self._thread is not None and self._loop is not None:
            fut = self._loop.create_future()
            self._control(_Control("barrier", (), fut), now=True)
            await _committed(fut)
