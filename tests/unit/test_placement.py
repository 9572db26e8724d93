"""Cluster placement (corral.cluster.placement): power-of-k choices over load reports."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from corral.cluster.placement import REPORT_MAX_AGE_S, NodeLoad, choose
from corral.errors import CapacityExceeded, InvalidRequest


def nodes(n: int, capacity: int = 1000, now: float = 100.0) -> list[NodeLoad]:
    return [NodeLoad(node=f"n{i}", endpoint=f"http://127.0.0.1:{9000 + i}", capacity=capacity,
                     mem_free_mb=4096, reported_at=now) for i in range(n)]


def test_spread_is_within_ten_percent_of_even():
    """1,000 creates over 8 nodes with reports arriving every 50 placements."""
    ns, rng = nodes(8), random.Random(7)
    per = Counter[str]()
    for i in range(1000):
        n = choose(ns, 100.0, k=2, rng=rng)
        n.finished.append(float(i))
        per[n.node] += 1
        if i % 50 == 49:  # a report round asked for 10 placements ago
            for m in ns:
                m.live = sum(1 for t in m.finished if t < i - 10) + m.live
                m.took_report(i - 10, 100.0)
    even = 1000 / 8
    assert max(abs(c - even) for c in per.values()) <= 0.1 * even, per


def test_a_report_forgets_only_the_creates_it_counts():
    n = nodes(1)[0]
    n.finished = [1.0, 2.0, 3.0]
    n.inflight = 1
    n.took_report(2.0, 50.0)
    assert n.finished == [2.0, 3.0] and n.placed == 3 and n.reported_at == 50.0


def test_k1_is_random_and_k_all_is_least_loaded():
    ns = nodes(4)
    ns[0].live, ns[1].live, ns[2].live, ns[3].live = 10, 5, 7, 9
    assert choose(ns, 100.0, k=4).node == "n1"
    with pytest.raises(InvalidRequest):
        choose(ns, 100.0, k=0)


def test_stale_full_and_unlabelled_nodes_are_skipped():
    ns = nodes(3, capacity=2)
    ns[0].reported_at = 100.0 - REPORT_MAX_AGE_S - 1   # stopped reporting
    ns[1].live = 2                                       # full
    ns[2].labels = {"pool": "a"}
    for _ in range(5):
        assert choose(ns, 100.0, k=2).node == "n2"
    assert choose(ns, 100.0, selector={"pool": "a"}).node == "n2"
    with pytest.raises(CapacityExceeded, match="labels"):
        choose(ns, 100.0, selector={"pool": "b"})
    ns[2].inflight = 2
    with pytest.raises(CapacityExceeded, match="full"):
        choose(ns, 100.0)
    with pytest.raises(CapacityExceeded, match="no node answers"):
        choose(ns, 200.0)
