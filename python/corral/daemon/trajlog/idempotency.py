"""Calls under an idempotency key: run once, replay the logged result, wait out a
duplicate in flight."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from corral.daemon.jsonbody import text_size
from corral.daemon.tenants import TENANT_LABEL
from corral.errors import (
    CorralError,
    InternalError,
    InvalidRequest,
    QuotaExceeded,
    ReplayDivergence,
    SandboxNotFound,
    Unsupported,
    error_from_payload,
)

from .base import MAX_BOUND_SETS, SnapIds, _Start
from .keys import (
    BIG_ENTRY,
    INTERRUPTED,
    KEY_HEADER,
    KEYED_START_OPS,
    MAX_KEY_LEN,
    STARTED_OPS,
    _plain,
    encoded,
    interrupted_error,
    is_text,
    keyed_text,
)
from .schema import _BINDS, _SANDBOX_SEQS
from .writer import Writer

# What a tenant's entries leave out once its live sandboxes' logs hold half its budget (the
# replay of such a key then follows the rule for what is past the log's cap: docs/trajectory.md
# "Retention"): a write's or upload's bytes, a read's bytes, a listing's entries.
_BULKY_REQ = ("data_b64",)
_BULKY_RES = ("data_b64", "entries")


def _compacted(result: dict[str, Any]) -> dict[str, Any]:
    if not any(k in result for k in _BULKY_RES):
        return result
    out = {k: v for k, v in result.items() if k not in _BULKY_RES}
    out["log_budget"] = True
    return out


class _Stored:
    """A logged result in the database, not read yet: its entry's seq."""

    __slots__ = ("seq",)

    def __init__(self, seq: int) -> None:
        self.seq = seq


class Idempotency(Writer):
    def binds(self, scope: str, key: str) -> bool:
        """A finished call is logged under ``key`` (a retry replays it)."""
        return self.enabled and bool(key) and self._lookup(scope, key) is not None

    def _lookup(self, scope: str, key: str) -> tuple[str | None, str, Any, Any] | None:
        """The finished entry that binds ``key`` (started and interrupted rows do not):
        (fingerprint, sandbox id, result, error), journaled or in the database (then a
        result is a _Stored, read and parsed by ``_parsed``: it can be big)."""
        got = self._unbound.get((scope, key))
        if got is not None:  # checked first: the ingester removes it only once it is in
            return got
        assert self._reader is not None
        if scope:
            if key not in self._bound_keys(scope):
                return None
            sql = ("SELECT fingerprint, sandbox_id, seq, error, result IS NULL FROM entries "
                   f"WHERE idem_key=? AND sandbox_id=? AND {_BINDS} ORDER BY status IS NOT NULL, "
                   "seq LIMIT 1")
            row = self._reader.execute(sql, (key, scope)).fetchone()
        else:
            sql = ("SELECT fingerprint, sandbox_id, seq, error, result IS NULL FROM entries "
                   "WHERE idem_key=? AND op='create' AND status IS NULL ORDER BY seq LIMIT 1")
            row = self._reader.execute(sql, (key,)).fetchone()
        if row is None:
            return None
        return (row[0], row[1], None if row[4] else _Stored(row[2]),
                json.loads(row[3]) if row[3] is not None else None)

    async def _parsed(self, sid: str, row: tuple[str | None, str, Any, Any]
                      ) -> tuple[str | None, str, Any, Any]:
        """``row`` (``_lookup``) with its result read and parsed: after the tenant's others
        before it, in a step of the loop of its own. A big one (an exec's binary output:
        12 MB of JSON) takes the loop ~30 ms to read and parse, and 32 replays of such a key
        at once held it ~1.8 s."""
        fp, logged_sid, result, error = row
        if isinstance(result, _Stored):
            async with self._one_big(sid):
                await asyncio.sleep(0)  # the tenant's others queue behind it
                assert self._reader is not None
                got = self._reader.execute("SELECT result FROM entries WHERE seq=?",
                                           (result.seq,)).fetchone()
                if got is None:  # pruned meanwhile (its sandbox ended long ago): a retry
                    raise InternalError("the logged result was removed while it was read")
                result = None if got[0] is None else json.loads(got[0])
        return fp, logged_sid, result, error

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
        if not key or len(key) > MAX_KEY_LEN or not is_text(key):
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
            return self._replayed(op, key, fp, await self._parsed(sid, row))
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
        compact = False
        if self._over:  # a tenant at half its log budget or more (none: no cost)
            compact = self._budget(sid, op, request)
            if compact and isinstance(request, dict) and any(k in request for k in _BULKY_REQ):
                # A write's or upload's bytes: logged with size and hash only, as a body
                # past the log's cap (a key's fingerprint is still the whole request's).
                request = {k: v for k, v in request.items() if k not in _BULKY_REQ}
                request["log_budget"] = True
                req_text = None
        clock = self.clock
        started = clock.time()
        c = _Start(sid, op, request, started, key, fp, clock.monotonic())
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
            await self.record(sid, op, request, None, e.to_payload(), started, clock.time(),
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
        while self._backlogged():  # before its copy is made: calls ending together (a
            await self.flushed()   # flood of big outputs) add at most the bound between them
        await self._log_result(c, sid, op, request, value, key, fp, to_log, compact,
                               snapshot_ids, ids, start)
        if self._behind():  # (the copy and its texts are let go of by now)
            await self.flushed()
        return value

    async def _log_result(self, c: _Start, sid: str, op: str, request: Any, value: Any,
                          key: str | None, fp: str | None,
                          to_log: Callable[[Any], dict[str, Any]] | None, compact: bool,
                          snapshot_ids: SnapIds, ids: list[str] | None,
                          start: _Start | None) -> None:
        """Journal a call's result (the log's copy of ``value``)."""
        def log_copy() -> Any:
            if compact and getattr(to_log, "__func__", None) is Writer.exec_result:
                return self.exec_result(value, compact=True)  # the outputs' real tails
            copy = to_log(value) if to_log is not None else value
            return _compacted(copy) if compact and isinstance(copy, dict) else copy

        scope = sid  # a create's key is bound globally (scope ""), its entry is the new id's
        written = [False]

        def write(result: Any, texts: tuple[str, str] | None = None) -> None:
            entry_sid, entry_ids = self._entry_ids(op, sid, result, snapshot_ids, ids)
            self._write_entry(entry_sid, op, request, result, None, c.started_at,
                              self.clock.time(), key, fp, entry_ids, start, scope, c.req_text,
                              result_texts=texts)
            written[0] = True

        made = None  # the log's copy, made now if the value is small
        if text_size(value, BIG_ENTRY) <= BIG_ENTRY:
            made = log_copy()
            if text_size(made, BIG_ENTRY) <= BIG_ENTRY:
                write(made)
                return
        # A big one is copied (an output's first megabyte made text), encoded a piece at a
        # time and journaled while its tenant holds a big slot: its commands ending together
        # leave the loop to the others between pieces, and those waiting hold no copy yet.
        copy = log_copy if made is None else (lambda: made)
        job = asyncio.ensure_future(self._write_big(scope, copy, write))
        try:
            await asyncio.shield(job)
        except asyncio.CancelledError:  # the call ran: its entry is written all the same
            job.cancel()
            if not written[0]:
                write(copy())
            raise

    async def _write_big(self, sid: str, copy: Callable[[], Any],
                         write: Callable[[Any, tuple[str, str] | None], None]) -> None:
        """``write`` the log's ``copy`` of a result, encoded a piece at a time, while ``sid``'s
        tenant holds its big slot."""
        async with self._one_big(sid):
            while self._backlogged():  # checked again: the slot may have been a long wait
                await self.flushed()
            result = copy()
            write(result, await encoded(result) if text_size(result, BIG_ENTRY) > BIG_ENTRY
                  else None)

    @staticmethod
    def _entry_ids(op: str, sid: str, result: Any, snapshot_ids: SnapIds,
                   ids: list[str] | None) -> tuple[str, list[str] | None]:
        """The sandbox an entry is of (a create's: the new id) and its snapshot ids."""
        if op == "create" and isinstance(result, dict):
            sid = str(result.get("id", sid))
        if callable(snapshot_ids):
            ids = snapshot_ids(result)
        return sid, ids

    @contextlib.asynccontextmanager
    async def _one_big(self, sid: str) -> AsyncIterator[None]:
        """Held while a big entry of ``sid``'s tenant (of ``sid`` itself once it is gone: no
        tenant is known then) is encoded or parsed: one of a tenant's at a time, and at most
        BIG_AT_ONCE in all."""
        owner = self._tenant.get(sid) or f"sandbox {sid}"
        held = self._encoding.get(owner)
        if held is None:
            held = self._encoding[owner] = (asyncio.Lock(), [0])
        lock, users = held
        users[0] += 1
        try:
            async with lock, self._big_slots:
                yield
        finally:
            users[0] -= 1
            if not users[0]:
                del self._encoding[owner]

    def _budget(self, sid: str, op: str, request: Any) -> bool:
        """A call of a tenant whose live sandboxes' logs hold half its budget or more: True
        (its entry is kept compact). At the budget itself the call is refused,
        ``quota_exceeded`` (infra), before it runs and unlogged; a kill never is (it ends a
        sandbox: its log can then be pruned)."""
        if op == "create":
            labels = request.get("labels") if isinstance(request, dict) else None
            tenant = labels.get(TENANT_LABEL) if isinstance(labels, dict) else None
        else:
            tenant = self._tenant.get(sid)
        got = self._over.get(tenant) if isinstance(tenant, str) else None
        if got is None:
            return False
        total, live, limit = got
        if live >= limit and op != "kill":
            self.stats["budget_refused"] += 1
            raise QuotaExceeded(
                f"trajectory log quota exceeded: tenant {tenant!r}'s live sandboxes' logs "
                f"hold {live} bytes of its {limit} (end some of its sandboxes)",
                details={"tenant": tenant, "resource": "log_bytes", "in_use": live,
                         "limit": limit})
        self.stats["budget_compact"] += 1
        return True
