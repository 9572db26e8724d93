"""Output the daemon reads but does not keep: past a stream's cap (thrown away, or sent to a
client following the stream), or after its command is done (read so that a background writer
never gets SIGPIPE). Reading and hashing a `yes` at its full speed held ~95 % of the daemon's
core; within this budget, shared by every stream of the loop, a writer that fast waits on its
full pipe instead."""

from __future__ import annotations

import asyncio
import time
import weakref
from typing import Protocol

# Bytes a second over every stream of the event loop, and the burst.
DISCARD_RATE = 64 * 1024 * 1024
DISCARD_BURST = 16 * 1024 * 1024
# The most one read takes: what a refill leaves a held stream to read at once.
CHUNK = 256 * 1024


class Holdable(Protocol):
    """A stream read on the loop that can stop being read (``hold``) until released."""

    def hold(self, who: object) -> None: ...

    def release(self, who: object) -> None: ...


class DiscardBudget:
    """The bytes a second the loop spends reading output it does not keep (DISCARD_RATE), for
    every stream together. A stream with none left is held (not read) until the budget has
    refilled; reads may overdraw it by a chunk, which the wait then repays."""

    _of: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, DiscardBudget] = \
        weakref.WeakKeyDictionary()

    def __init__(self, loop: asyncio.AbstractEventLoop, rate: float = DISCARD_RATE,
                 burst: float = DISCARD_BURST) -> None:
        self.loop, self.rate, self.burst = loop, rate, burst
        self.tokens = burst
        self.stamp = time.monotonic()
        self.waiting: list[Holdable] = []
        self.timer: asyncio.TimerHandle | None = None

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> DiscardBudget:
        b = cls._of.get(loop)
        if b is None:
            b = cls._of[loop] = cls(loop)
        return b

    def admit(self, stream: Holdable) -> bool:
        """True: ``stream`` may read a chunk now (and ``spend`` what it throws away); False: it
        is held until the budget has refilled."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens > 0:
            return True
        stream.hold(self)
        self.waiting.append(stream)
        if self.timer is None:
            self.timer = self.loop.call_later((CHUNK - self.tokens) / self.rate,
                                              self._refilled)
        return False

    def spend(self, n: int) -> None:
        self.tokens -= n

    def _refilled(self) -> None:
        self.timer = None
        waiting, self.waiting = self.waiting, []
        for stream in waiting:
            stream.release(self)
