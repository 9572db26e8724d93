"""Time as the daemon's policy reads it: wall time, monotonic time, sleeps and timers, behind
one small interface given at construction to the engine (TTLs, idle timeouts, the reaper) and
the trajectory log (entry times, started rows held back, key expiry by retention).

``REAL`` is the default. ``ManualClock`` stands still until a test advances it: time-based
behaviour is then tested by moving the clock, not by sleeping (tests/unit)."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time as _time
from collections.abc import Callable
from typing import Protocol


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    def time(self) -> float:
        """Wall-clock seconds since the epoch (what is stored and shown)."""

    def monotonic(self) -> float:
        """Seconds that only go forward (intervals)."""

    async def sleep(self, seconds: float) -> None: ...

    def call_later(self, delay: float, callback: Callable[[], object]) -> Timer:
        """Run ``callback`` on the running event loop ``delay`` seconds of this clock from
        now; call it from the loop."""


class RealClock:
    """The host's clocks and the event loop's timers."""

    time = staticmethod(_time.time)
    monotonic = staticmethod(_time.monotonic)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def call_later(self, delay: float, callback: Callable[[], object]) -> Timer:
        return asyncio.get_running_loop().call_later(delay, callback)


REAL: Clock = RealClock()


class _ManualTimer:
    __slots__ = ("when", "callback", "cancelled")

    def __init__(self, when: float, callback: Callable[[], object]) -> None:
        self.when, self.callback, self.cancelled = when, callback, False

    def cancel(self) -> None:
        self.cancelled = True


class ManualClock:
    """A clock that moves only when ``advance`` is called: both readings move together, and
    the timers and sleeps that come due fire in order, each with the clock set to its due
    time. Sleepers are woken through their futures: their code runs at the loop's next turns.
    ``armed`` is an event set whenever a timer or sleep is armed (a test waits on it before
    advancing past a sleep that a task has not reached yet)."""

    def __init__(self, wall: float = 1_800_000_000.0, mono: float = 1_000.0) -> None:
        self._wall = wall
        self._mono = mono
        self._timers: list[tuple[float, int, _ManualTimer]] = []
        self._order = itertools.count()
        self._armed: asyncio.Event | None = None

    def time(self) -> float:
        return self._wall

    def monotonic(self) -> float:
        return self._mono

    def call_later(self, delay: float, callback: Callable[[], object]) -> Timer:
        t = _ManualTimer(self._mono + max(0.0, delay), callback)
        heapq.heappush(self._timers, (t.when, next(self._order), t))
        if self._armed is not None:
            self._armed.set()
        return t

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def wake() -> None:
            if not fut.done():
                fut.set_result(None)

        timer = self.call_later(seconds, wake)
        try:
            await fut
        finally:
            timer.cancel()

    @property
    def armed(self) -> asyncio.Event:
        """Set when a timer or sleep is armed; clear it, then wait for the next one."""
        if self._armed is None:
            self._armed = asyncio.Event()
            if self.pending():
                self._armed.set()
        return self._armed

    def pending(self) -> int:
        """Timers and sleeps armed and not yet fired or cancelled."""
        return sum(1 for _, _, t in self._timers if not t.cancelled)

    def next_due(self) -> float | None:
        """Seconds until the next timer or sleep is due (None: none is armed)."""
        for when, _, t in sorted(self._timers):
            if not t.cancelled:
                return max(0.0, when - self._mono)
        return None

    def advance(self, seconds: float) -> int:
        """Move the clock forward; fire what comes due meanwhile, in order. How many fired."""
        if seconds < 0:
            raise ValueError("a clock does not go back")
        end = self._mono + seconds
        fired = 0
        while self._timers and self._timers[0][0] <= end:
            when, _, t = heapq.heappop(self._timers)
            if t.cancelled:
                continue
            self._set(when)
            t.cancelled = True
            t.callback()
            fired += 1
        self._set(end)
        return fired

    def _set(self, mono: float) -> None:
        if mono > self._mono:
            self._wall += mono - self._mono
            self._mono = mono
