"""The trajectory log alone (writer, ingester, idempotency, reader) on a manual clock: entry
times, started rows held back, replay and fast-forward of keyed calls, interrupted calls and
key expiry by retention. A real SQLite database and journal in a private dir."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from corral.daemon import ops
from corral.daemon.clock import ManualClock
from corral.daemon.trajlog import TrajLog
from corral.errors import (
    FileNotFound,
    InfraError,
    QuotaExceeded,
    ReplayDivergence,
    SandboxNotRunning,
    StepInterrupted,
)
from corral.models import ExecRequest

from .unitkit import engine_on, run, settle, spec


@contextlib.asynccontextmanager
async def opened(state: str, clock: ManualClock, **kw: Any) -> AsyncIterator[TrajLog]:
    kw.setdefault("flush_ms", 0)
    tl = TrajLog(state, clock=clock, **kw)
    tl.open(asyncio.get_running_loop())
    try:
        yield tl
    finally:
        tl.close()


class Counted:
    """A call that counts its runs and takes ``dt`` seconds of the clock."""

    def __init__(self, clock: ManualClock, result: Any = None, dt: float = 0.0,
                 error: BaseException | None = None) -> None:
        self.clock, self.result, self.dt, self.error, self.runs = clock, result, dt, error, 0

    async def __call__(self) -> Any:
        self.runs += 1
        self.clock.advance(self.dt)
        if self.error is not None:
            raise self.error
        return self.result


def test_entries_carry_the_clocks_times_in_order(state, clock):
    async def go():
        async with opened(state, clock) as tl:
            tl.sandbox_created("sb-1", {"image": "host"}, clock.time())
            t0 = clock.time()
            await tl.run("sb-1", "exec", {"cmd": "a"}, None, Counted(clock, {"exit_code": 0}, 2))
            await tl.run("sb-1", "mkdir", {"path": "/x"}, None, Counted(clock, {"ok": True}, 1))
            clock.advance(5)
            tl.sandbox_ended("sb-1", "killed")
            await tl.flushed()
            sandbox, entries = tl.read("sb-1")
            assert [e["op"] for e in entries] == ["exec", "mkdir"]
            assert [(e["started_at"], e["ended_at"], e["duration_s"]) for e in entries] == [
                (t0, t0 + 2, 2.0), (t0 + 2, t0 + 3, 1.0)]
            assert sandbox["ended_at"] == t0 + 8 and sandbox["reason"] == "killed"
            assert tl.read("sb-other") is None
    run(go())


def test_a_key_runs_once_and_replays_its_result(state, clock):
    async def go():
        async with opened(state, clock) as tl:
            call = Counted(clock, {"exit_code": 0, "stdout": "first"})
            req = {"cmd": "echo first"}
            assert await tl.run("sb-1", "exec", req, "k1", call) == call.result
            call.result = {"exit_code": 0, "stdout": "second"}
            assert (await tl.run("sb-1", "exec", req, "k1", call))["stdout"] == "first"
            assert call.runs == 1
            await tl.flushed()  # in the database now, not only in the journal
            assert (await tl.run("sb-1", "exec", req, "k1", call))["stdout"] == "first"
            assert call.runs == 1
            with pytest.raises(ReplayDivergence):  # same key, another request
                await tl.run("sb-1", "exec", {"cmd": "echo other"}, "k1", call)
            await tl.run("sb-2", "exec", req, "k1", call)  # a key's scope is its sandbox
            assert call.runs == 2
    run(go())


def test_a_task_error_binds_the_key_an_infra_error_does_not(state, clock):
    async def go():
        async with opened(state, clock) as tl:
            bad = Counted(clock, error=FileNotFound("no /x", details={"path": "/x"}))
            for _ in range(2):
                with pytest.raises(FileNotFound):
                    await tl.run("sb-1", "remove", {"path": "/x"}, "k", bad)
            assert bad.runs == 1  # the logged error is replayed
            flaky = Counted(clock, error=InfraError("node trouble"))
            with pytest.raises(InfraError):
                await tl.run("sb-1", "mkdir", {"path": "/y"}, "k2", flaky)
            flaky.error, flaky.result = None, {"ok": True}
            assert await tl.run("sb-1", "mkdir", {"path": "/y"}, "k2", flaky) == {"ok": True}
            assert flaky.runs == 2  # a retry after an infra error runs for real
    run(go())


def test_concurrent_duplicates_wait_for_the_one_that_runs(state, clock):
    async def go():
        async with opened(state, clock) as tl:
            gate = asyncio.Event()
            runs = 0

            async def slow() -> Any:
                nonlocal runs
                runs += 1
                await gate.wait()
                return {"ok": runs}

            req = {"path": "/d"}
            first = asyncio.ensure_future(tl.run("sb-1", "mkdir", req, "k", slow))
            dups = [asyncio.ensure_future(tl.run("sb-1", "mkdir", req, "k", slow))
                    for _ in range(3)]
            await settle(clock)
            assert runs == 1 and not any(d.done() for d in dups)
            gate.set()
            assert await asyncio.gather(first, *dups) == [{"ok": 1}] * 4
            assert runs == 1
    run(go())


def test_an_unkeyed_calls_started_row_waits_for_the_clock(state, clock):
    """A mutating call gets a started row only once it has run ``start_ms`` on the log's
    clock; its finished entry then takes the row's place (one entry, same seq)."""
    async def go():
        async with opened(state, clock, start_ms=20) as tl:
            gate = asyncio.Event()

            async def long() -> Any:
                await gate.wait()
                return {"exit_code": 0}

            task = asyncio.ensure_future(tl.run("sb-1", "exec", {"cmd": "x"}, None, long))
            await settle(clock)  # the call is held: its timer armed on the clock
            assert tl.stats["started_rows"] == 0
            clock.advance(0.019)
            assert tl.stats["started_rows"] == 0
            clock.advance(0.002)
            assert tl.stats["started_rows"] == 1
            await tl.flushed()
            _, rows = tl.read("sb-1")
            assert [(r["status"], r["ended_at"]) for r in rows] == [("started", None)]
            gate.set()
            await task
            await tl.flushed()
            _, rows2 = tl.read("sb-1")
            assert [(r["status"], r["seq"]) for r in rows2] == [("done", rows[0]["seq"])]

            quick = Counted(clock, {"exit_code": 0}, 0.001)  # ends before the hold
            await tl.run("sb-1", "exec", {"cmd": "y"}, None, quick)
            clock.advance(1)
            assert tl.stats["started_rows"] == 1  # never journaled as started
    run(go())


def test_a_keyed_call_cut_by_a_crash_is_interrupted_not_run_again(state, clock):
    async def go():
        gate = asyncio.Event()

        async def never() -> Any:
            await gate.wait()

        tl = TrajLog(state, clock=clock, flush_ms=0)
        tl.open(asyncio.get_running_loop())
        task = asyncio.ensure_future(tl.run("sb-1", "exec", {"cmd": "x"}, "k", never))
        await settle(clock)
        assert tl.stats["started_rows"] == 1  # keyed: journaled before the call ran
        tl.close()  # the daemon dies with the call in flight
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        async with opened(state, clock) as tl2:
            assert tl2.interrupted == 1
            again = Counted(clock, {"exit_code": 0})
            with pytest.raises(StepInterrupted) as e:
                await tl2.run("sb-1", "exec", {"cmd": "x"}, "k", again)
            assert again.runs == 0 and e.value.details["key"] == "k"
    run(go())


def test_keys_expire_with_the_log_retention(state, clock):
    """An ended sandbox's keys are bound until its log is pruned, ``retention_s`` after it
    ended on the clock; then the key runs again."""
    async def go():
        async with opened(state, clock, retention_s=3600) as tl:
            tl.sandbox_created("sb-1", {}, clock.time())
            call = Counted(clock, {"ok": True})
            await tl.run("sb-1", "mkdir", {"path": "/a"}, "k", call)
            tl.sandbox_ended("sb-1", "killed")
            clock.advance(3599)
            assert await tl.prune() == 0
            await tl.run("sb-1", "mkdir", {"path": "/a"}, "k", call)
            assert call.runs == 1
            clock.advance(2)
            assert await tl.prune() == 1
            assert tl.read("sb-1") is None
            await tl.run("sb-1", "mkdir", {"path": "/a"}, "k", call)
            assert call.runs == 2
    run(go())


def test_trajectory_finds_its_sandbox_and_next_step(state, clock):
    async def go():
        async with opened(state, clock) as tl:
            made = {"id": "sb-7", "state": "running"}
            await tl.run("", "create", {"image": "host"}, "T:create", Counted(clock, made))
            for step in range(3):
                await tl.run("sb-7", "exec", {"cmd": str(step)}, f"T:{step}",
                             Counted(clock, {"exit_code": 0}))
            assert await tl.trajectory("T") == ("sb-7", 3)
            assert await tl.trajectory("nope") is None
            again = Counted(clock, {"id": "sb-other"})  # a replayed create: the same sandbox
            assert (await tl.run("", "create", {"image": "host"}, "T:create", again))["id"] \
                == "sb-7"
            assert again.runs == 0
    run(go())


def test_a_keyed_exec_fast_forwards_after_its_sandbox_is_gone(state, clock):
    """Through the engine and the dispatcher: a repeated key answers from the log, even once
    the sandbox has ended; an unkeyed call on it gets the ending's error."""
    async def go():
        async with engine_on(state, clock) as (eng, sub):
            sb = await eng.create(spec())
            op = ops.Exec(sid=sb.id, key="T:0", req=ExecRequest(cmd="echo $$", cwd="/tmp"))
            first = await ops.dispatch(eng, op)
            assert first["exit_code"] == 0
            await eng.kill(sb.id, key="T:1")
            again = await ops.dispatch(eng, op)
            assert again["stdout"] == first["stdout"] and eng.counters["execs"] == 1
            with pytest.raises(SandboxNotRunning):
                await ops.dispatch(eng, ops.Exec(sid=sb.id, key=None, req=op.req))
    run(go())


def _tenant_bytes(path: str) -> dict[str, tuple[int, int]]:
    """tenant_log as stored, and what its sandboxes' entries hold (counted from scratch)."""
    import sqlite3

    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("BEGIN")  # one snapshot for both: the ingester may commit meanwhile
        kept = {t: (b, live) for t, b, live in conn.execute(
            "SELECT tenant, bytes, live FROM tenant_log WHERE bytes <> 0 OR live <> 0")}
        counted = {t: (b, live) for t, b, live in conn.execute(
            "SELECT s.tenant, sum(length(e.request) + ifnull(length(e.result), 0) + "
            "ifnull(length(e.error), 0)), sum(CASE WHEN s.ended_at IS NULL THEN "
            "length(e.request) + ifnull(length(e.result), 0) + ifnull(length(e.error), 0) "
            "ELSE 0 END) FROM entries e JOIN sandboxes s USING (sandbox_id) "
            "WHERE s.tenant IS NOT NULL GROUP BY s.tenant")}
        return {"kept": kept, "counted": counted}  # type: ignore[dict-item]
    finally:
        conn.close()


def test_a_tenants_log_is_bounded_by_its_budget(state, clock):
    """Alice's sandboxes print 200 KB a command against a 1 MiB log budget. Past the budget her
    ended sandbox's log goes first; once her live ones hold half of it their entries keep 4
    KiB of each output (head and tail, hashes and sizes of the whole); at the budget her calls
    are refused quota_exceeded (log_bytes), unlogged, but a kill and her keys already bound
    still answer. Bob and the admin are untouched; the counts survive a reopen. Before, the
    log took whatever the sandboxes printed."""
    budget = 1 << 20
    big = "".join(chr(65 + i % 26) for i in range(200_000))

    def exec_of(out: str) -> Counted:
        return Counted(clock, {"exit_code": 0, "stdout": out, "stderr": ""})

    async def go():
        async with opened(state, clock) as tl:
            tl.tenant_log_budget = lambda tenant: budget
            for sid, who in (("a-old", "alice"), ("a-live", "alice"), ("b-1", "bob")):
                tl.sandbox_created(sid, {"labels": {"corral.tenant": who}}, clock.time())
            tl.sandbox_created("admin-1", {"labels": {}}, clock.time())
            for i in range(3):
                await tl.run("a-old", "exec", {"cmd": f"old {i}"}, None, exec_of(big),
                             to_log=tl.exec_result)
            tl.sandbox_ended("a-old", "killed")
            first = await tl.run("a-live", "exec", {"cmd": "first"}, "A:0", exec_of(big),
                                 to_log=tl.exec_result)
            refused = None
            for i in range(200):
                await tl.flushed()
                try:
                    await tl.run("a-live", "exec", {"cmd": f"live {i}"}, f"A:{i + 1}",
                                 exec_of(big), to_log=tl.exec_result)
                except QuotaExceeded as e:
                    refused = e
                    break
                await tl.run("b-1", "exec", {"cmd": f"bob {i}"}, None, exec_of("b" * 1000),
                             to_log=tl.exec_result)
            assert refused is not None and refused.infra, "the budget never refused a call"
            assert refused.details["resource"] == "log_bytes"
            assert refused.details["limit"] == budget
            assert tl.read("a-old") is None  # her ended sandbox's log went first
            _, entries = tl.read("a-live")
            full = [e for e in entries if not e["result"].get("log_budget")]
            compact = [e for e in entries if e["result"].get("log_budget")]
            assert full and compact, [e["result"].get("log_budget") for e in entries]
            r = compact[-1]["result"]
            assert r["stdout"] == big[:4096] and r["stdout_tail"] == big[-4096:]
            assert r["stdout_sha256"] == full[0]["result"]["stdout_sha256"]
            assert r["log_truncated"] is True
            n_logged = len(entries)
            # Refused calls are not logged; her bound keys replay (full and compact alike).
            with pytest.raises(QuotaExceeded):
                await tl.run("a-live", "mkdir", {"path": "/x"}, None, Counted(clock, {"ok": 1}))
            again = exec_of("other")
            replayed = await tl.run("a-live", "exec", {"cmd": "first"}, "A:0", again,
                                    to_log=tl.exec_result)
            assert replayed["stdout"] == first["stdout"] == big
            assert not replayed.get("log_truncated")
            key = compact[-1]["idempotency_key"]
            i = int(key.split(":")[1]) - 1
            replayed = await tl.run("a-live", "exec", {"cmd": f"live {i}"}, key, again,
                                    to_log=tl.exec_result)
            assert replayed["stdout"] == big[:4096] and replayed["log_truncated"]
            assert again.runs == 0
            await tl.flushed()
            assert len(tl.read("a-live")[1]) == n_logged
            # Bob's and the admin's calls run and are logged whole.
            out = await tl.run("b-1", "exec", {"cmd": "hi"}, None, exec_of(big),
                               to_log=tl.exec_result)
            assert out == big or out["stdout"] == big
            await tl.run("admin-1", "exec", {"cmd": "hi"}, None, exec_of(big * 5),
                         to_log=tl.exec_result)
            await tl.flushed()
            assert tl.read("b-1")[1][-1]["result"]["stdout"] == big
            assert tl.read("admin-1")[1][-1]["result"]["stdout"] == big * 5
            # A kill is never refused.
            await tl.run("a-live", "kill", {}, "A:kill", Counted(clock, {"killed": True}))
            await tl.flushed()
            bytes_ = _tenant_bytes(tl.path)
            assert bytes_["kept"] == bytes_["counted"], bytes_
            alice_total = bytes_["kept"]["alice"][0]
            assert alice_total <= budget + 2 * len(big) * 2, alice_total
        # Reopened (the daemon restarted): the counts are the database's, and alice is still
        # refused at once.
        async with opened(state, clock) as tl:
            tl.tenant_log_budget = lambda tenant: budget
            tl.readopted([("a-live", {"labels": {"corral.tenant": "alice"}}, clock.time(), {})])
            await tl.flushed()
            assert "alice" in tl._over and "bob" not in tl._over
            with pytest.raises(QuotaExceeded):
                await tl.run("a-live", "exec", {"cmd": "again"}, None, exec_of("x"))
            tl.sandbox_ended("a-live", "killed")
            await tl.flushed()
            await tl.run("b-1", "exec", {"cmd": "hi"}, None, exec_of("x"))
            await tl.flushed()  # alice's only sandbox ended: its log goes, her budget is free
            assert tl.read("a-live") is None and "alice" not in tl._over
            bytes_ = _tenant_bytes(tl.path)
            assert bytes_["kept"] == bytes_["counted"], bytes_
    run(go())


def test_a_tail_read_is_one_state_of_the_log_while_it_grows(state, clock):
    """A read takes the count of a sandbox's entries, then its rows a page at a time. Rows
    logged between the two made a tail of 70 come back with 73: every page stops at the last
    row of the state the count was taken in."""
    async def go() -> None:
        async with opened(state, clock, retention_s=3600) as tl:
            tl.sandbox_created("sb", {"image": "host"}, clock.time())
            for n in range(10):
                await tl.run("sb", "exec", {"cmd": f"echo {n}"}, None,
                             Counted(clock, {"exit_code": 0, "stdout": f"{n}\n"}))
            await tl.flushed()
            pages = tl.stream("sb", tail=4, jsonl=True)
            assert pages is not None
            for n in range(10, 13):  # logged after the read began
                await tl.run("sb", "exec", {"cmd": f"echo {n}"}, None,
                             Counted(clock, {"exit_code": 0, "stdout": f"{n}\n"}))
            await tl.flushed()
            lines = b"".join(b"".join(p) for p in pages).splitlines()
            assert [json.loads(x)["result"]["stdout"] for x in lines] == \
                ["6\n", "7\n", "8\n", "9\n"], lines
    run(go())
