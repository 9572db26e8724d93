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
    net TEXT
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
    "sc": ("INSERT OR REPLACE INTO sandboxes (sandbox_id, spec, created_at) VALUES (?,?,?)",),
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
    if "net" not in {r[1] for r in conn.execute("PRAGMA table_info(sandboxes)")}:
        conn.execute("ALTER TABLE sandboxes ADD COLUMN net TEXT")
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


def prune_ended(conn: sqlite3.Connection, cutoff: float) -> int:
    """In the caller's transaction: the log of every sandbox that ended before ``cutoff``,
    and the entries older than it of ids with no sandbox row (a call on a sandbox of an older
    state dir, say). The number of sandboxes pruned. The caller lowers the watermark."""
    old = [r[0] for r in conn.execute(
        "SELECT sandbox_id FROM sandboxes WHERE ended_at IS NOT NULL AND ended_at < ?",
        (cutoff,)).fetchall()]
    for sid in old:
        conn.execute(f"DELETE FROM entries WHERE seq IN ({_SANDBOX_SEQS})", {"sid": sid})
        conn.execute("DELETE FROM entries_by_sandbox WHERE sandbox_id=?", (sid,))
        conn.execute("DELETE FROM sandboxes WHERE sandbox_id=?", (sid,))
    gone = conn.execute("SELECT sandbox_id, seq FROM entries WHERE ended_at < ? AND "
                        "sandbox_id NOT IN (SELECT sandbox_id FROM sandboxes)",
                        (cutoff,)).fetchall()
    conn.executemany("DELETE FROM entries WHERE seq=?", [(r[1],) for r in gone])
    conn.executemany("DELETE FROM entries_by_sandbox WHERE sandbox_id=? AND seq=?", gone)
    return len(old)
