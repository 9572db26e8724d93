"""A run_code pool's free slots go to waiting requests by turns of their tenants
(corral.daemon.substrates.process.fairslots): one tenant's thousand queued requests hold
another's next one behind one of theirs, not all of them; a waiter that leaves takes no slot
with it."""

from __future__ import annotations

import asyncio

from corral.daemon.substrates.process.fairslots import FairSlots


async def _served_order(slots: FairSlots[int], waiters: list[tuple[str, str]]) -> list[str]:
    """Queue ``waiters`` (tenant, name) in order, then free one slot at a time: who got it."""
    order: list[str] = []

    async def wait(who: str, name: str) -> None:
        await slots.get(who)
        order.append(name)

    tasks = [asyncio.create_task(wait(w, n)) for w, n in waiters]
    await asyncio.sleep(0)  # every waiter queued
    for _ in waiters:
        slots.put_nowait(0)
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    return order


def test_a_tenants_request_waits_behind_one_of_each_other_tenants() -> None:
    async def go() -> list[str]:
        waiters = [("a", f"a{i}") for i in range(100)] + [("b", "b0"), ("c", "c0"),
                                                           ("b", "b1")]
        return await _served_order(FairSlots(), waiters)

    order = asyncio.run(go())
    assert order[:6] == ["a0", "b0", "c0", "a1", "b1", "a2"], order[:6]
    assert order[6:] == [f"a{i}" for i in range(3, 100)]


def test_a_free_slot_is_taken_at_once_and_kept_when_nobody_waits() -> None:
    async def go() -> None:
        slots: FairSlots[int] = FairSlots()
        slots.put_nowait(1)
        slots.put_nowait(2)
        assert slots.qsize() == 2
        assert await slots.get("a") == 1 and await slots.get("b") == 2
        assert slots.qsize() == 0 and slots.waiters() == 0

    asyncio.run(go())


def test_a_waiter_that_leaves_takes_no_slot_and_no_turn() -> None:
    async def go() -> None:
        slots: FairSlots[int] = FairSlots()
        gone = asyncio.create_task(slots.get("a"))
        kept = asyncio.create_task(slots.get("b"))
        await asyncio.sleep(0)
        gone.cancel()  # cancelled before any slot came free
        slots.put_nowait(7)
        assert await kept == 7
        await asyncio.gather(gone, return_exceptions=True)
        assert gone.cancelled() and slots.waiters() == 0 and not slots.turns
        # One handed a slot in the same turn it was cancelled passes the slot on.
        first = asyncio.create_task(slots.get("a"))
        second = asyncio.create_task(slots.get("b"))
        await asyncio.sleep(0)
        slots.put_nowait(8)  # first's
        first.cancel()
        assert await second == 8
        await asyncio.gather(first, return_exceptions=True)
        assert slots.qsize() == 0 and slots.waiters() == 0 and not slots.turns

    asyncio.run(go())
