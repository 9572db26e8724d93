"""The writer: records journaled on the event loop (finished entries, started rows, the
sandboxes' lifecycle), open and close."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

from corral.daemon.journal import Journal
from corral.daemon.locks import try_lock
from corral.daemon.outputmem import OutputText
from corral.daemon.tenants import TENANT_LABEL
from corral.errors import InternalError

from .base import BIG_AT_ONCE, PRUNE_EVERY_S, _committed, _Control, _Start
from .ingest import WAL_SIZE_LIMIT, Ingester
from .keys import INTERRUPTED, STARTED, _dumps, _plain, interrupted_error, sha256
from .schema import (
    _SANDBOX_SEQS,
    _SCHEMA,
    _STARTED_INDEX,
    LOCK_NAME,
    _index_tail,
    _meta,
    _migrate,
)

log = logging.getLogger("corral.trajlog")

# A tenant at half its log budget or more: characters of each output its entries keep, at
# the start and (``stdout_tail``) at the end.
COMPACT_KEEP = 4096


class Writer(Ingester):
    def open(self, loop: asyncio.AbstractEventLoop) -> None:
        """Open the database, ingest what a dead daemon left in the journal, mark its calls
        in flight interrupted, start a new journal and the ingester."""
        if not self.enabled:
            return
        self._loop = loop
        self._big_slots = asyncio.Semaphore(BIG_AT_ONCE)  # this loop's
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        # One writer per state dir: a second one would take the first's journal for a dead
        # daemon's and remove it under its feet.
        lock = try_lock(os.path.join(self.state_dir, LOCK_NAME))
        if lock is None:
            raise InternalError(f"the trajectory log in {self.state_dir} is open in another "
                                "process")
        self._lock = lock
        journal = Journal(self.state_dir)
        # The ingester's connection; it checkpoints by itself every CHECKPOINT_EVERY records
        # or CHECKPOINT_BYTES, and a WAL started over is cut back to WAL_SIZE_LIMIT.
        # No statement cache: a cached statement keeps the copies of the values last bound
        # to it (sqlite3_reset keeps bindings), and the entries' INSERTs bind up to 512
        # results of up to ~12 MiB each (1 Mi characters an output, JSON): 48 commands
        # printing binary kept ~450 MiB of them alive. A prepare costs microseconds a batch.
        conn = self._connect(autocheckpoint=0, cached=0)
        conn.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT}")
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
            conn.execute("BEGIN")
            self._over = self._budgets(conn)  # before any call: a tenant over its budget
            conn.execute("COMMIT")
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

    def _write_entry(self, sid: str, op: str, request: dict[str, Any],
                     result: dict[str, Any] | None, error: dict[str, Any] | None,
                     started_at: float, ended_at: float, key: str | None, fp: str | None,
                     snapshot_ids: list[str] | None, start: _Start | None,
                     scope: str | None = None, req_text: str | None = None,
                     status: str | None = None,
                     result_texts: tuple[str, str] | None = None) -> int:
        """Journal a finished call (replacing its started row if it had one); its seq.
        ``result_texts``: ``result`` encoded before (keys.encoded)."""
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
            result_text: str | None = None
            encoded: dict[int, str] | None = None
            if result_texts is not None:
                result_text, encoded = result_texts[0], {6: result_texts[1]}
            elif result is not None:
                result_text = _dumps(result)
            self._append("e", (seq, sid, op, key, fp,
                               _dumps(_plain(request)) if req_text is None else req_text,
                               result_text,
                               None if error is None else _dumps(error), started_at, ended_at,
                               _dumps(snapshot_ids) if snapshot_ids else None, status), slot,
                         encoded)
        except InternalError:
            if slot is not None:
                self._unbound.pop(slot, None)
            raise
        return seq

    async def _settled(self) -> None:
        """After journaling on a call's path: wait for the ingester only when asked to
        (``sync=full``) or when it is far behind (``_behind``)."""
        if self._behind():
            await self.flushed()

    def _note_tenant(self, sid: str, spec: dict[str, Any]) -> None:
        tenant = (spec.get("labels") or {}).get(TENANT_LABEL)
        if isinstance(tenant, str):
            self._tenant[sid] = tenant

    def sandbox_created(self, sid: str, spec: dict[str, Any], created_at: float) -> None:
        self._live.add(sid)
        self._note_tenant(sid, spec)
        if self.enabled:
            self._sandbox_write("sc", (sid, _dumps(spec), created_at))

    def sandbox_ended(self, sid: str, reason: str,
                      net: dict[str, Any] | None = None) -> None:
        """``net``: a networked sandbox's counters as it ended (sent, received, denied and
        to where, refused names), kept in its sandbox row."""
        self._live.discard(sid)
        self._bound.pop(sid, None)
        self._tenant.pop(sid, None)
        if self.enabled:
            self._sandbox_write("se", (sid, self.clock.time(), reason))
            if net is not None:
                self._sandbox_write("sn", (sid, _dumps(net)))

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
        for sid, spec, _, _ in boxes:
            self._note_tenant(sid, spec)
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
                                  created_at, self.clock.time(), None, None,
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
            self._control(_Control("ended_except", (self.clock.time(), sorted(live)), None))

    def maybe_prune(self, now: float) -> None:
        if self.enabled and now - self._last_prune >= PRUNE_EVERY_S:
            self._last_prune = now
            self._control(_Control("prune", (now - self.retention_s,), None))

    async def prune(self, now: float | None = None) -> int:
        if not self.enabled:
            return 0
        assert self._loop is not None
        fut = self._loop.create_future()
        self._control(_Control("prune", ((now or self.clock.time()) - self.retention_s,), fut),
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
                self._tick = self.clock.call_later(
                    max(0.0, c.t + self.start_hold_s - self.clock.monotonic()), self._queue_due)

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
        due = self.clock.monotonic() - self.start_hold_s
        while self._held:
            s = next(iter(self._held))
            if s.t > due:  # the rest are younger (oldest first)
                assert self._loop is not None
                self._tick = self.clock.call_later(s.t - due, self._queue_due)
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
            self._write_entry(sid, op, request, result, None, started_at, self.clock.time(), None,
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

    def exec_result(self, res: dict[str, Any], compact: bool = False) -> dict[str, Any]:
        """An exec's result as logged: outputs cut to the log's cap, with hashes of the full
        output (``_sha``, added by the engine) and the sizes. ``compact`` (a tenant at half
        its log budget): each output cut to its first COMPACT_KEEP characters instead, with
        its last COMPACT_KEEP as ``stdout_tail`` / ``stderr_tail`` (``log_budget``)."""
        sha = res.pop("_sha", None)
        out = dict(res)
        if sha is not None:
            out["stdout_sha256"], out["stderr_sha256"] = sha
        cap = COMPACT_KEEP if compact else self.output_cap
        for name in ("stdout", "stderr"):
            text = out.get(name)
            if isinstance(text, OutputText):  # past 64 KiB: its first cap characters only
                if sha is None:
                    out[f"{name}_sha256"] = text.sha256()
                out[name], more = text.prefix(cap)
                if more:
                    out["log_truncated"] = True
                    if compact:
                        out[f"{name}_tail"] = _tail(text.slices(), COMPACT_KEEP)
                        out["log_budget"] = True
            elif isinstance(text, str) and (sha is None or len(text) > cap):
                if sha is None:
                    out[f"{name}_sha256"] = sha256(text.encode("utf-8", "surrogateescape"))
                if len(text) > cap:
                    out[name] = text[:cap]
                    out["log_truncated"] = True
                    if compact:
                        out[f"{name}_tail"] = text[-COMPACT_KEEP:]
                        out["log_budget"] = True
        return out


def _tail(slices: Iterator[str], n: int) -> str:
    """The last ``n`` characters of a text given in slices (never the whole text at once)."""
    tail = ""
    for s in slices:
        tail = (tail + s)[-n:] if len(s) < n else s[-n:]
    return tail
