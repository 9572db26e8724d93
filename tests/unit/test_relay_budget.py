"""The exposed ports' relay budget (corral.daemon.network.expose.RelayBudget), on a clock the
test moves: a burst passes at once, then relays together get the rate between them."""

from __future__ import annotations

import pytest

from corral.daemon.network.expose import RelayBudget


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_passes_then_each_chunk_waits_its_share():
    clock = Clock()
    b = RelayBudget(rate=1000, burst=500, clock=clock)
    assert b.take(200) == 0 and b.take(300) == 0  # the burst
    assert b.take(100) == 0.1  # 100 bytes over: 0.1 s at 1,000 a second
    clock.now += 0.1
    assert b.take(100) == pytest.approx(0.1)  # refilled what it owed, 100 over again
    clock.now += 10  # idle: the bucket refills to the burst, no more
    assert b.take(500) == 0 and b.take(1) > 0


def test_relays_taking_together_stay_within_the_rate():
    """Two relays, each waiting what it is told before its next chunk: what they copy
    together over a simulated 10 s is the rate's worth, plus the burst."""
    clock = Clock()
    b = RelayBudget(rate=1000, burst=500, clock=clock)
    at = [clock.now, clock.now]  # when each relay may read next
    copied = [0, 0]
    end = clock.now + 10
    while min(at) <= end:
        i = at.index(min(at))
        clock.now = at[i]
        copied[i] += 64
        at[i] = clock.now + b.take(64)
    total = sum(copied)
    assert 10 * 1000 <= total <= 10 * 1000 + 500 + 2 * 64
    assert min(copied) > 0.4 * total  # served in turn
