"""The database's schema, its statements and migrations."""

from __future__ import annotations

import sqlite3

DB_NAME = "trajlog.db"
LOCK_NAME = "trajlog.lock"


# The rows that bind their key: finished ones, and interrupted ones but a kill's.
_BINDS = "(status IS NULL OR (status='interrupted' AND op<>'kill'))"


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
    reason TEXT,
    net TEXT,
    tenant TEXT,
    log_bytes INTEGER NOT NULL DEFAULT 0
);
-- Per tenant: the bytes of its sandboxes' logs (``log_bytes``), and of its live ones.
CREATE TABLE IF NOT EXISTS tenant_log (
    tenant TEXT PRIMARY KEY,
    bytes INTEGER NOT NULL DEFAULT 0,
    live INTEGER NOT NULL DEFAULT 0
) WITHOUT ROWID;
"""


# After _migrate (a log written before them lacks the columns). The triggers keep tenant_log
# the sum of its sandboxes' log_bytes in the same transaction as the rows it counts, so the
# accounting survives a crash exactly as the entries do (a journal replayed at the next start
# adds its entries' bytes again, through the same statements).
_TENANT_SCHEMA = """
CREATE INDEX IF NOT EXISTS sandboxes_ended ON sandboxes (ended_at) WHERE ended_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS sandboxes_tenant ON sandboxes (tenant, ended_at)
    WHERE tenant IS NOT NULL;
CREATE TRIGGER IF NOT EXISTS tenant_log_add AFTER UPDATE OF log_bytes ON sandboxes
    WHEN NEW.tenant IS NOT NULL BEGIN
    INSERT INTO tenant_log (tenant, bytes, live) VALUES (NEW.tenant,
        NEW.log_bytes - OLD.log_bytes,
        CASE WHEN NEW.ended_at IS NULL THEN NEW.log_bytes - OLD.log_bytes ELSE 0 END)
    ON CONFLICT (tenant) DO UPDATE SET bytes = bytes + excluded.bytes,
                                       live = live + excluded.live;
END;
CREATE TRIGGER IF NOT EXISTS tenant_log_ended AFTER UPDATE OF ended_at ON sandboxes
    WHEN NEW.tenant IS NOT NULL AND OLD.ended_at IS NULL AND NEW.ended_at IS NOT NULL BEGIN
    UPDATE tenant_log SET live = live - NEW.log_bytes WHERE tenant = NEW.tenant;
END;
CREATE TRIGGER IF NOT EXISTS tenant_log_gone AFTER DELETE ON sandboxes
    WHEN OLD.tenant IS NOT NULL BEGIN
    UPDATE tenant_log SET bytes = bytes - OLD.log_bytes,
        live = live - CASE WHEN OLD.ended_at IS NULL THEN OLD.log_bytes ELSE 0 END
    WHERE tenant = OLD.tenant;
END;
"""


# The tenant label of a sandbox's spec (corral.daemon.tenants.TENANT_LABEL), in SQL.
_TENANT_OF_SPEC = "json_extract({spec}, '$.labels.\"corral.tenant\"')"


# A sandbox's log bytes (as the ingester counts them: the JSON texts of its entries).
_ENTRY_BYTES = "length(request) + ifnull(length(result), 0) + ifnull(length(error), 0)"


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
#   sc  a sandbox created;  se  a sandbox ended;  sn  its network counters as it ended
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
    # An upsert, not a replace: the row's log_bytes are counted in tenant_log.
    "sc": ("INSERT INTO sandboxes (sandbox_id, spec, created_at, tenant) VALUES (?1,?2,?3,"
           + _TENANT_OF_SPEC.format(spec="?2") + ") ON CONFLICT (sandbox_id) DO UPDATE SET "
           "spec=excluded.spec, created_at=excluded.created_at",),
    "se": ("UPDATE sandboxes SET ended_at=?2, reason=?3 WHERE sandbox_id=?1 AND "
           "ended_at IS NULL",),
    "sn": ("UPDATE sandboxes SET net=?2 WHERE sandbox_id=?1",),
}


_ENTRIES_SQL: dict[int, str] = {}


def _entries_sql(n: int) -> str:
    """The INSERT of ``n`` entries, ``n`` a power of two (a batch is cut into such chunks:
    ten statement texts in all, each prepared once and kept in the statement cache)."""
    sql = _ENTRIES_SQL.get(n)
    if sql is None:
        sql = _ENTRIES_SQL[n] = _J_ENTRIES + ",".join([_J_ROW] * n)
    return sql


def _migrate(conn: sqlite3.Connection) -> None:
    """Bring a log written by an older daemon up to this schema."""
    cols = {r[1] for r in conn.execute("PRAGMA table_info(entries)")}
    if "status" not in cols:
        conn.execute("ALTER TABLE entries ADD COLUMN status TEXT")
    scols = {r[1] for r in conn.execute("PRAGMA table_info(sandboxes)")}
    if "net" not in scols:
        conn.execute("ALTER TABLE sandboxes ADD COLUMN net TEXT")
    if "log_bytes" not in scols:
        # Entries an older daemon wrote are not counted: summing them reads the whole log
        # (~30 s for 1.7 GB here) before the daemon can serve. They leave with retention.
        conn.execute("ALTER TABLE sandboxes ADD COLUMN tenant TEXT")
        conn.execute("ALTER TABLE sandboxes ADD COLUMN log_bytes INTEGER NOT NULL DEFAULT 0")
        conn.execute("UPDATE sandboxes SET tenant = " + _TENANT_OF_SPEC.format(spec="spec"))
    conn.executescript(_TENANT_SCHEMA)
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


def _drop_sandbox(conn: sqlite3.Connection, sid: str) -> None:
    """In the caller's transaction: a sandbox's whole log (the caller lowers the
    watermark)."""
    conn.execute(f"DELETE FROM entries WHERE seq IN ({_SANDBOX_SEQS})", {"sid": sid})
    conn.execute("DELETE FROM entries_by_sandbox WHERE sandbox_id=?", (sid,))
    conn.execute("DELETE FROM sandboxes WHERE sandbox_id=?", (sid,))


def prune_tenant(conn: sqlite3.Connection, tenant: str, need: int) -> int:
    """In the caller's transaction: the logs of ``tenant``'s ended sandboxes, the longest
    ended first, until ``need`` bytes are freed or none is left; the bytes freed. The caller
    lowers the watermark."""
    freed = 0
    rows = conn.execute("SELECT sandbox_id, log_bytes FROM sandboxes WHERE tenant=? AND "
                        "ended_at IS NOT NULL ORDER BY ended_at", (tenant,))
    for sid, n in rows.fetchall():
        if freed >= need:
            break
        _drop_sandbox(conn, sid)
        freed += n
    return freed


def prune_ended(conn: sqlite3.Connection, cutoff: float) -> int:
    """In the caller's transaction: the log of every sandbox that ended before ``cutoff``,
    and the entries older than it of ids with no sandbox row (a call on a sandbox of an older
    state dir, say). The number of sandboxes pruned. The caller lowers the watermark.

    It runs every minute on the ingester's thread, so it reads indexes and the entries'
    leading columns only: a column after ``request`` (``ended_at``) is read of no entry but
    an id's without a sandbox row, because reaching it reads the overflow pages of the
    outputs before it (the whole file, for a log of big outputs)."""
    old = [r[0] for r in conn.execute(
        "SELECT sandbox_id FROM sandboxes WHERE ended_at IS NOT NULL AND ended_at < ?",
        (cutoff,)).fetchall()]
    for sid in old:
        _drop_sandbox(conn, sid)
    for sid in _ids_without_a_sandbox(conn):
        gone = [(sid, r[0]) for r in conn.execute(
            f"SELECT seq FROM entries WHERE seq IN ({_SANDBOX_SEQS}) AND ended_at < :cutoff",
            {"sid": sid, "cutoff": cutoff})]
        conn.executemany("DELETE FROM entries WHERE seq=?", [(seq,) for _, seq in gone])
        conn.executemany("DELETE FROM entries_by_sandbox WHERE sandbox_id=? AND seq=?", gone)
    return len(old)


def _ids_without_a_sandbox(conn: sqlite3.Connection) -> list[str]:
    """The ids that have entries but no sandbox row: from the by-sandbox index and the
    entries after it (their ``sandbox_id``, the row's second column)."""
    return [r[0] for r in conn.execute(
        "SELECT DISTINCT sandbox_id FROM (SELECT sandbox_id FROM entries_by_sandbox UNION ALL "
        "SELECT sandbox_id FROM entries WHERE seq > (SELECT v FROM log_meta WHERE "
        "k='indexed')) WHERE sandbox_id NOT IN (SELECT sandbox_id FROM sandboxes)")]
