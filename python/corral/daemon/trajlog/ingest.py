"""The ingester: a thread that moves the journal's records into SQLite in batches."""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import threading
import time
from typing import Any

from .base import _Base, _Control, _Line, _resolve, write_error
from .keys import STARTED
from .schema import (
    _J_SQL,
    ENTRIES_PER_STATEMENT,
    _entries_sql,
    _index_tail,
    _watermark,
    prune_ended,
    prune_tenant,
)

# The ingester thread's nice value (Linux: per thread): on a busy machine it yields to the
# calls it trails; MAX_PENDING(_BYTES) bounds how far behind that lets it fall.
INGEST_NICE = 10
# After a failed ingest (the records stay in the journal and in memory), the next try.
INGEST_RETRY_S = 1.0
# Entries per statement when a start ingests what a dead daemon left in the journal.
RECOVER_CHUNK = 10_000
# Records between two WAL checkpoints (by the ingester: one or two pages each, so the WAL
# stays under ~10 MB)...
CHECKPOINT_EVERY = 1000
# ...or bytes of them: an exec's entry is up to ~12 MiB of JSON (a sandbox's binary output),
# and 1000 of those made a WAL of GBs on the state dir's disk (a passive checkpoint never
# shrinks the file: WAL_SIZE_LIMIT does, when SQLite starts the WAL over).
CHECKPOINT_BYTES = 64 << 20
# The WAL file is cut back to this when it is started over after a checkpoint.
WAL_SIZE_LIMIT = 64 << 20
# Entries between two updates of the per-sandbox index (``entries_by_sandbox``): an insert
# writes one b-tree (the row) instead of two; every INDEX_EVERY entries one batch also
# indexes the ones since the last time. Readers find the rest, the unindexed tail, by a short
# rowid range scan.
INDEX_EVERY = 64

# A multi-row INSERT of entries binds at most CHUNK_TEXT characters of their texts (request,
# result, error): SQLite copies each bound text until the statement is done, and a batch is
# up to MAX_PENDING_BYTES of entries (an exec's with binary output: ~12 MiB of JSON), so one
# statement for all of them held a second copy of the whole batch. A bigger one goes alone.
CHUNK_TEXT = 1 << 20

log = logging.getLogger("corral.trajlog")


def _text_len(row: tuple[Any, ...]) -> int:
    return len(row[5] or "") + len(row[6] or "") + len(row[7] or "")


def _chunk(rows: list[tuple[Any, ...]], k: int) -> int:
    """Rows from ``k`` for one multi-row INSERT: a power of two, at most
    ENTRIES_PER_STATEMENT, their texts at most CHUNK_TEXT (or the one row ``k``)."""
    limit = min(ENTRIES_PER_STATEMENT, len(rows) - k)
    n = text = 0
    while n < limit:
        text += _text_len(rows[k + n])
        if text > CHUNK_TEXT:
            break
        n += 1
    return 1 << (n.bit_length() - 1) if n else 1


class Ingester(_Base):
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
            with self._mu:
                batch, self._pending = self._pending, []
                size, self._pending_bytes = self._pending_bytes, 0  # bounded by the waits
                self._ingesting_bytes = size
            if batch:
                if not self._ingest(conn, batch, size):
                    lines = [it for it in batch if type(it) is tuple]
                    with self._mu:  # again, ahead of anything newer (the journal has them)
                        self._pending[:0] = lines
                        self._pending_bytes += sum(len(f) for it in lines for f in it[2]
                                                   if isinstance(f, str))
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

    def _ingest(self, conn: sqlite3.Connection, batch: list[_Line | _Control],
                size: int = 0) -> bool:
        """One transaction for the batch (``size``: its lines' journal bytes): its lines (by
        kind, ``_ingest_lines``) and control items in order, and the journal watermark.
        Resolves the waiters; False if it failed (nothing of it is in the database)."""
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
            over = self._budgets(conn)
            conn.execute("COMMIT")
        except Exception as e:  # noqa: BLE001 - reported to every waiter; the journal keeps all
            log.exception("trajectory log ingest failed (its records stay in the journal)")
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            self.stats["ingest_errors"] += 1
            err = write_error(e)
            self._ingesting_bytes = 0  # back in _pending (the caller): counted there
            self._resolve_soon([(it.fut, None, err) for it in batch
                                if isinstance(it, _Control) and it.fut is not None])
            return False
        self._over = over
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
        self._since_ckpt_bytes += size
        if self._since_ckpt >= CHECKPOINT_EVERY or self._since_ckpt_bytes >= CHECKPOINT_BYTES:
            self._since_ckpt = self._since_ckpt_bytes = 0
            try:
                conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                st["checkpoints"] += 1
            except sqlite3.Error:
                log.exception("trajectory log checkpoint failed")
        self._ingesting_bytes = 0  # before the waiters wake: they check it
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
                    size = _chunk(rows, k)
                    chunk = rows[k:k + size]
                    conn.execute(_entries_sql(size), [v for r in chunk for v in r])
                    k += size
                # Each sandbox's log bytes (a tenant's budget: tenant_log, by trigger): the
                # JSON texts of its finished entries. A started row is counted by the entry
                # that replaces it (one the daemon's death leaves interrupted is not).
                added: dict[str, int] = {}
                for it in seg[i:j]:
                    r = it[2]
                    if r[11] != STARTED:
                        added[r[1]] = (added.get(r[1], 0) + len(r[5]) + len(r[6] or "")
                                       + len(r[7] or ""))
                conn.executemany("UPDATE sandboxes SET log_bytes = log_bytes + ?2 WHERE "
                                 "sandbox_id = ?1", added.items())
                self._unindexed += j - i
                self.stats["records"] += j - i
                i = j
                continue
            for sql in _J_SQL[kind]:
                conn.executemany(sql, rows)
            if kind == "d":
                self._lower_watermark(conn)
            i = j

    def _budgets(self, conn: sqlite3.Connection) -> dict[str, tuple[int, int, int]]:
        """In the batch's transaction: each tenant's log against its budget
        (``tenant_log_budget``). A tenant past it loses its ended sandboxes' logs, the longest
        ended first, until it is within it. The tenants whose live sandboxes' logs hold half
        their budget or more: tenant -> (bytes, live bytes, budget), for the loop
        (``_over``: their entries are kept compact, and at the budget their calls are
        refused)."""
        budget_of = self.tenant_log_budget
        if budget_of is None:
            return {}
        over: dict[str, tuple[int, int, int]] = {}
        pruned = False
        for tenant, total, live in conn.execute(
                "SELECT tenant, bytes, live FROM tenant_log").fetchall():
            limit = budget_of(tenant)
            if limit is None:
                continue
            if total > limit and total > live:
                freed = prune_tenant(conn, tenant, total - limit)
                if freed:
                    pruned = True
                    self.stats["budget_pruned_bytes"] += freed
                    total -= freed
            if live * 2 >= limit:
                over[tenant] = (total, live, limit)
        if pruned:
            self._lower_watermark(conn)
        return over

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
            n = prune_ended(conn, p.args[0])
            self._lower_watermark(conn)
            return n
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
