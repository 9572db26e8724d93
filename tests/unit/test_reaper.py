"""TTLs and idle timeouts, enforced by the reaper, tested by moving a manual clock: the
reaper task sleeps on the engine's clock, so nothing here waits for real time to pass."""

from __future__ import annotations

import pytest

from corral.errors import SandboxExpired

from .unitkit import REAPER_S, engine_on, run, spec, tick


def test_ttl_expires_on_the_reapers_pass(state, clock):
    async def go():
        async with engine_on(state, clock) as (eng, sub):
            sb = await eng.create(spec(timeout=10))
            await tick(clock, 9.9)
            assert sb.state == "running" and sb.id in sub.boxes
            await tick(clock, 0.2 + REAPER_S)  # the first pass at or after the deadline
            await sb.stopping
            with pytest.raises(SandboxExpired) as e:
                eng.get(sb.id)
            assert e.value.details["reason"] == "expired"
            assert sb.id in sub.destroyed and eng.counters["expired"] == 1
    run(go())


def test_idle_timeout_counts_from_the_last_call(state, clock):
    async def go():
        async with engine_on(state, clock) as (eng, sub):
            sb = await eng.create(spec(timeout=1000, idle_timeout=5))
            await tick(clock, 4)
            eng.get(sb.id)  # activity: the idle clock starts again
            await tick(clock, 4)
            assert sb.state == "running"
            await tick(clock, 1 + REAPER_S)
            await sb.stopping
            with pytest.raises(SandboxExpired) as e:
                eng.get(sb.id)
            assert e.value.details["reason"] == "idle_timeout"
    run(go())


def test_a_followed_process_keeps_the_sandbox_from_idling(state, clock):
    async def go():
        async with engine_on(state, clock) as (eng, sub):
            sb = await eng.create(spec(timeout=1000, idle_timeout=5))
            with eng.following(sb):  # a client is streaming a process's output
                await tick(clock, 60)
                assert sb.state == "running"
            eng.get(sb.id)
            await tick(clock, 5 + REAPER_S)
            assert sb.stopping is not None
            await sb.stopping
            assert sb.reason == "idle_timeout"
    run(go())


def test_set_timeout_moves_the_deadline(state, clock):
    async def go():
        async with engine_on(state, clock) as (eng, sub):
            sb = await eng.create(spec(timeout=10))
            await tick(clock, 5)
            eng.set_timeout(sb.id, 30)  # from now: t=35
            assert sb.expires_at == clock.time() + 30
            await tick(clock, 25)
            assert sb.state == "running"
            await tick(clock, 5 + REAPER_S)
            await sb.stopping
            assert sb.reason == "expired"
    run(go())


@pytest.mark.parametrize("pause_ttl", ["count", "stop"])
def test_pause_ttl(state, clock, pause_ttl):
    """``count``: a paused sandbox's TTL runs on; ``stop``: it stands still until resumed."""
    async def go():
        async with engine_on(state, clock) as (eng, sub):
            sb = await eng.create(spec(timeout=10, pause_ttl=pause_ttl))
            await eng.pause(sb.id)
            await tick(clock, 50)
            if pause_ttl == "count":
                assert sb.stopping is not None
                await sb.stopping
                assert sb.reason == "expired"
                return
            assert sb.state == "paused"
            await eng.resume(sb.id)
            assert sb.expires_at == clock.time() + 10  # 10 s of TTL were left at the pause
            await tick(clock, 9)
            assert sb.state == "running"
            await tick(clock, 1 + REAPER_S)
            await sb.stopping
            assert sb.reason == "expired"
    run(go())


def test_reap_is_policy_on_the_given_time(state, clock):
    """``reap(now)`` alone, without the task: stale heap entries (a deadline moved earlier,
    a killed sandbox) are skipped, each sandbox ends once."""
    async def go():
        async with engine_on(state, clock) as (eng, sub):
            a = await eng.create(spec(timeout=100))
            b = await eng.create(spec(timeout=100))
            eng.set_timeout(a.id, 10)  # a second, earlier heap entry for a
            await eng.kill(b.id)
            now = clock.time()
            eng.reap(now + 50)
            assert a.reason == "expired" and b.reason == "killed"
            await a.stopping
            eng.reap(now + 200)  # a's later entry is stale now
            assert eng.counters["expired"] == 1
    run(go())


def test_the_reaper_drives_log_retention(state, clock):
    """The reaper's pass also prunes the trajectory log (at most every PRUNE_EVERY_S): an
    ended sandbox's log goes once the retention has passed on the clock."""
    async def go():
        async with engine_on(state, clock, log_retention_s=3600) as (eng, sub):
            sb = await eng.create(spec())
            await eng.kill(sb.id)
            await eng.trajlog.flushed()
            assert await eng.trajlog.knows(sb.id)
            await tick(clock, 3000)
            assert await eng.trajlog.knows(sb.id)
            await tick(clock, 700)  # past the retention, and a prune is due
            assert not await eng.trajlog.knows(sb.id)
    run(go())


def test_heap_entries_of_ended_sandboxes_are_compacted(state, clock):
    """Killed sandboxes leave their heap entries until their deadline (up to a week away):
    under churn the reaper rebuilds the heap from the live ones, and those still expire."""
    async def go():
        async with engine_on(state, clock, max_sandboxes=2000) as (eng, sub):
            live = await eng.create(spec(timeout=50))
            churn = await eng.create_many(1100, spec(timeout=86400))
            await eng.kill_many([sb.id for sb in churn])
            assert len(eng._heap) == 1101
            eng.reap(clock.time())
            assert [sid for _, sid in eng._heap] == [live.id]
            await tick(clock, 50 + REAPER_S)
            await live.stopping
            assert live.reason == "expired"
    run(go())
