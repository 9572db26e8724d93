"""The engine's policy over a fake substrate: the lifecycle state machine, admission,
ending reasons, pause, recovery. No root, no daemon (see conftest)."""

from __future__ import annotations

import errno
import json
import os

import pytest

from corral.errors import (
    CapacityExceeded,
    DaemonRestarted,
    InternalError,
    SandboxCrashed,
    SandboxKilled,
    SandboxLost,
    SandboxNotFound,
    SandboxNotRunning,
    Unsupported,
)
from corral.models import ExecRequest

from .unitkit import engine_on, run, spec


def test_create_records_and_kill_tombstones(state, clock):
    async def go():
        async with engine_on(state, clock) as (eng, sub):
            t0 = clock.time()
            sb = await eng.create(spec(timeout=30))
            assert sb.state == "running"
            assert (sb.created_at, sb.expires_at) == (t0, t0 + 30)
            meta = json.load(open(os.path.join(state, "sandboxes", sb.id, "meta.json")))
            assert meta["runtime"]["sandbox_id"] == sb.id and meta["expires_at"] == t0 + 30
            assert sub.boxes[sb.id].alive
            clock.advance(7)
            assert eng.get(sb.id).last_active == t0 + 7  # any call refreshes the idle clock
            assert await eng.kill(sb.id) is True
            assert sb.id in sub.destroyed and sb.id not in eng.sandboxes
            assert not os.path.exists(os.path.join(state, "sandboxes", sb.id))
            with pytest.raises(SandboxNotRunning) as e:
                eng.get(sb.id)
            assert e.value.details["reason"] == "killed"
            assert await eng.kill(sb.id) is False  # already ended: a no-op, not an error
            with pytest.raises(SandboxNotFound):
                await eng.kill("sb-nope")
            assert eng.counters["created"] == 1 and eng.counters["killed"] == 1
    run(go())


def test_admission_caps_sandboxes_and_batches(state, clock):
    async def go():
        async with engine_on(state, clock, max_sandboxes=3) as (eng, sub):
            made = await eng.create_many(2, spec())
            assert len(made) == 2
            with pytest.raises(CapacityExceeded) as e:
                await eng.create_many(2, spec())
            assert e.value.details == {"in_use": 2, "capacity": 3}
            assert len(sub.created) == 2  # refused before anything was made
            await eng.create(spec())
            with pytest.raises(CapacityExceeded):
                await eng.create(spec())
            await eng.kill(made[0].id)
            await eng.create(spec())  # a killed one frees its place
            assert eng.sandbox_count() == 3
    run(go())


def test_failed_create_leaves_nothing(state, clock):
    async def go():
        async with engine_on(state, clock) as (eng, sub):
            sub.fail_create = OSError(errno.ENOMEM, "no memory")
            with pytest.raises(CapacityExceeded):  # the host is out of resources
                await eng.create(spec())
            sub.fail_create = RuntimeError("substrate bug")
            with pytest.raises(InternalError):
                await eng.create(spec())
            assert eng.sandboxes == {} and sub.boxes == {}
            assert os.listdir(os.path.join(state, "sandboxes")) == []
            assert eng.counters["create_failed"] == 2
    run(go())


def test_batch_create_is_all_or_nothing(state, clock):
    async def go():
        async with engine_on(state, clock) as (eng, sub):
            real = sub.create
            calls = []

            def third_fails(sid, sp, image):  # type: ignore[no-untyped-def]
                calls.append(sid)
                if len(calls) == 3:
                    raise RuntimeError("the third create fails")
                return real(sid, sp, image)

            sub.create = third_fails  # type: ignore[method-assign]
            with pytest.raises(InternalError):
                await eng.create_many(5, spec())
            assert eng.sandboxes == {} and sub.boxes == {}
            assert set(sub.destroyed) <= set(calls) and len(sub.destroyed) >= 2
    run(go())


def test_ending_reasons_map_to_stable_errors(state, clock):
    async def go():
        async with engine_on(state, clock) as (eng, sub):
            a = await eng.create(spec())
            b = await eng.create(spec())
            c = await eng.create(spec(), trajectory="T")
            sub.kill_init(a.id)  # nothing in the sandbox explains it: lost (infra)
            sub.kill_init(b.id, cause={"cause": "oom"})  # its own OOM kill: crashed
            await a.stopping
            await b.stopping
            with pytest.raises(SandboxLost):
                eng.get(a.id)
            with pytest.raises(SandboxCrashed) as e:
                eng.get(b.id)
            assert e.value.details["cause"] == "oom"
            # A kill of a trajectory's sandbox without one of its keys is an operator's.
            await eng.kill(c.id, key=None)
            with pytest.raises(SandboxKilled):
                eng.get(c.id)
            d = await eng.create(spec(), trajectory="U")
            await eng.kill(d.id, key="U:3")  # its own trajectory's step: the client's kill
            with pytest.raises(SandboxNotRunning) as e2:
                eng.get(d.id)
            assert e2.value.details["reason"] == "killed"
            assert eng.counters["lost"] == 1 and eng.counters["crashed"] == 1
    run(go())


def test_capabilities_gate_before_any_side_effect(state, clock):
    async def go():
        async with engine_on(state, clock) as (eng, sub):
            sb = await eng.create(spec())
            with pytest.raises(Unsupported) as e:
                await eng.snapshot(sb.id, None)
            assert e.value.details == {"substrate": "fake", "operation": "snapshot"}
            with pytest.raises(Unsupported):
                await eng.create(spec(snapshot="snap-1"))
            assert list(eng.sandboxes) == [sb.id]
            table = {row["name"]: row for row in eng.substrate_table()}
            assert table["fake"]["operations"] == ["create", "exec", "kill", "files", "pause",
                                                   "resume"]
    run(go())


def test_pause_freezes_and_a_call_resumes(state, clock):
    async def go():
        async with engine_on(state, clock) as (eng, sub):
            sb = await eng.create(spec())
            await eng.pause(sb.id)
            assert sb.state == "paused" and sub.boxes[sb.id].frozen
            assert sb.paused_at == clock.time()
            assert eng.lookup(sb.id).state == "paused"  # info calls do not resume
            eng.get(sb.id)  # any other call does
            assert sb.state == "running" and not sub.boxes[sb.id].frozen
            meta = json.load(open(os.path.join(state, "sandboxes", sb.id, "meta.json")))
            assert meta["paused_at"] is None
    run(go())


def test_exec_runs_and_refreshes_the_idle_clock(state, clock):
    async def go():
        async with engine_on(state, clock) as (eng, sub):
            sb = await eng.create(spec())
            clock.advance(3)
            res = await eng.exec(sb.id, ExecRequest(cmd="echo hi; exit 3", cwd="/tmp"))
            assert (res["stdout"], res["exit_code"]) == ("hi\n", 3)
            assert sb.last_active == clock.time()
            assert eng.counters["execs"] == 1
    run(go())


def test_recovery_readopts_live_sandboxes_and_tombstones_dead_ones(state, clock):
    async def go():
        async with engine_on(state, clock, stop=False) as (eng, sub):
            keep = await eng.create(spec(timeout=100))
            dead = await eng.create(spec())
            paused = await eng.create(spec())
            await eng.pause(paused.id)
        sub.boxes[dead.id].alive = False  # died while no daemon ran
        clock.advance(10)
        async with engine_on(state, clock, sub) as (eng2, _):
            assert eng2.sandboxes[keep.id].expires_at == keep.expires_at
            assert eng2.sandboxes[keep.id].last_active == clock.time()  # the idle clock restarts
            assert eng2.sandboxes[paused.id].state == "paused"
            with pytest.raises(SandboxLost):
                eng2.get(dead.id)
            assert eng2.counters["adopted"] == 2
    run(go())


def test_graceful_stop_answers_daemon_restarted_after(state, clock):
    async def go():
        async with engine_on(state, clock) as (eng, sub):
            sb = await eng.create(spec())
        assert sub.boxes == {}
        async with engine_on(state, clock, sub) as (eng2, _):
            with pytest.raises(DaemonRestarted):
                eng2.get(sb.id)
    run(go())


def test_a_stored_spec_keeps_what_the_request_bounds_would_refuse():
    """The bounds on a create's env, labels and metadata are a request's. A sandbox's record
    read back at a restart (made before a bound existed, or its env merged with an image's)
    must load, or the restart would destroy a live sandbox."""
    import pytest
    from pydantic import ValidationError

    from corral.models import MAX_METADATA, STORED, SandboxSpec

    big = {"metadata": {f"k{i}": "v" for i in range(MAX_METADATA + 1)},
           "labels": {f"l{i}": "v" for i in range(100)},
           "env": {"BIG": "x" * (2 << 20)}}
    spec = SandboxSpec.model_validate(big, context=STORED)
    assert len(spec.metadata) == MAX_METADATA + 1 and len(spec.env["BIG"]) == 2 << 20
    with pytest.raises(ValidationError):
        SandboxSpec.model_validate(big)
