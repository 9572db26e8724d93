"""The manual clock the unit tests drive time with, and the real one's shape."""

from __future__ import annotations

import asyncio

import pytest

from corral.daemon.clock import REAL, ManualClock

from .unitkit import run


def test_timers_fire_in_order_at_their_own_time():
    clock = ManualClock(wall=100.0, mono=10.0)
    seen: list[tuple[str, float, float]] = []
    clock.call_later(2, lambda: seen.append(("b", clock.time(), clock.monotonic())))
    clock.call_later(1, lambda: seen.append(("a", clock.time(), clock.monotonic())))
    dropped = clock.call_later(1.5, lambda: seen.append(("x", 0, 0)))
    dropped.cancel()
    assert clock.pending() == 2 and clock.next_due() == 1
    assert clock.advance(1.9) == 1
    assert seen == [("a", 101.0, 11.0)] and clock.time() == pytest.approx(101.9)
    assert clock.advance(5) == 1
    assert seen[1] == ("b", 102.0, 12.0) and clock.monotonic() == pytest.approx(16.9)
    assert clock.pending() == 0 and clock.next_due() is None
    with pytest.raises(ValueError):
        clock.advance(-1)


def test_a_sleep_ends_when_the_clock_passes_it():
    async def go():
        clock = ManualClock()
        woke: list[float] = []

        async def sleeper() -> None:
            await clock.sleep(30)
            woke.append(clock.monotonic())

        task = asyncio.ensure_future(sleeper())
        await clock.armed.wait()
        clock.advance(29)
        await asyncio.sleep(0)
        assert not woke
        clock.advance(1)
        await task
        assert woke == [1030.0]
        task = asyncio.ensure_future(sleeper())  # a cancelled sleep leaves no timer
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert clock.pending() == 0

    run(go())


def test_the_real_clock_reads_the_host():
    import time

    assert abs(REAL.time() - time.time()) < 5
    assert REAL.monotonic() <= time.monotonic()

    async def go():
        fired = asyncio.Event()
        REAL.call_later(0, fired.set)
        await asyncio.wait_for(fired.wait(), 5)
        await REAL.sleep(0)

    run(go())
