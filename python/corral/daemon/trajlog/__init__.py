"""The durable trajectory log: per sandbox, an ordered record of every exec and file operation.

Modules: ``schema`` (tables, statements, migrations), ``keys`` (idempotency keys,
fingerprints, step_interrupted, logged results), ``base`` (state, the queue to the ingester),
``ingest`` (the ingester thread), ``writer`` (journaling on the loop), ``idempotency`` (keyed
calls), ``reader`` (queries).

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
  at nice ``INGEST_NICE``. It checkpoints the WAL every ``CHECKPOINT_EVERY`` records or
  ``CHECKPOINT_BYTES`` of them (the WAL cut back to ``WAL_SIZE_LIMIT``). The journal's
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


from .base import SnapIds
from .idempotency import Idempotency
from .keys import (
    KEY_HEADER,
    KEYED_START_OPS,
    MAX_KEY_LEN,
    STARTED_OPS,
    _dumps,
    body_request,
    data_result,
    fingerprint,
    interrupted_error,
    keyed_text,
    listing_result,
    replayed_listing,
    replayed_read,
    sha256,
)
from .reader import Reader
from .schema import _SCHEMA, DB_NAME, LOCK_NAME


class TrajLog(Idempotency, Reader):
    """The log: written by ``writer`` (journal) and ``ingest`` (SQLite), keyed calls run by
    ``idempotency``, read by ``reader``."""


__all__ = ["DB_NAME", "KEYED_START_OPS", "KEY_HEADER", "LOCK_NAME", "MAX_KEY_LEN", "STARTED_OPS",
           "SnapIds", "TrajLog", "_SCHEMA", "_dumps", "body_request", "data_result", "fingerprint",
           "interrupted_error", "keyed_text", "listing_result", "replayed_listing",
           "replayed_read", "sha256"]
