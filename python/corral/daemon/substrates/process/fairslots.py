"""A pool's free slots, handed to waiting requests by turns of their tenants.

One queue of waiters in arrival order let a tenant with a thousand requests queued hold every
other tenant's next request behind all of them (a run_code batch of 1,084 snippets of up to
300 s each). Here each tenant has its own queue, and a slot that comes free goes to the first
waiter of the tenant whose turn it is; a tenant with more waiters goes to the back of the
turns. A request waits behind at most one request of each other tenant waiting at once,
whatever they have queued.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Hashable
from typing import Generic, TypeVar

Slot = TypeVar("Slot")


class FairSlots(Generic[Slot]):
    def __init__(self) -> None:
        self.free: collections.deque[Slot] = collections.deque()
        self.queues: dict[Hashable, collections.deque[asyncio.Future[Slot]]] = {}
        self.turns: collections.deque[Hashable] = collections.deque()

    def qsize(self) -> int:
        """Free slots (none while any request waits)."""
        return len(self.free)

    def waiters(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def put_nowait(self, slot: Slot) -> None:
        """A slot comes free: to the next waiter by turns, else kept."""
        while self.turns:
            who = self.turns.popleft()
            q = self.queues[who]
            while q and q[0].done():  # cancelled, its task not yet back to take itself out
                q.popleft()
            if not q:
                del self.queues[who]
                continue
            fut = q.popleft()
            if q:
                self.turns.append(who)
            else:
                del self.queues[who]
            fut.set_result(slot)
            return
        self.free.append(slot)

    async def get(self, who: Hashable) -> Slot:
        """A free slot for a request of ``who`` (its tenant), waiting its turn if none is."""
        if self.free and not self.turns:
            return self.free.popleft()
        fut: asyncio.Future[Slot] = asyncio.get_running_loop().create_future()
        q = self.queues.get(who)
        if q is None:
            q = self.queues[who] = collections.deque()
            self.turns.append(who)
        q.append(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.put_nowait(fut.result())  # handed a slot as it was cancelled: pass it on
            else:
                q = self.queues.get(who)
                if q is not None and fut in q:
                    q.remove(fut)
                    if not q:
                        del self.queues[who]
                        self.turns.remove(who)
            raise
