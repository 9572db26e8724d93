"""Cluster placement (corral.cluster.placement): power-of-k choices over load reports."""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import overload

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


def test_a_create_that_ends_while_the_report_travels_is_counted_once():
    """The node's count of creates says whether a report has the creates that finished
    while it was on its way: counted in it, they are forgotten (not counted twice until the
    next report); not counted, they stay."""
    n = nodes(1)[0]
    n.took_report(0.0, 1.0, created=10)
    n.finished = [0.5, 2.5, 2.5, 2.5]   # one before the next report was asked, three during
    n.took_report(2.0, 3.0, created=14)  # the node made all four before it answered
    assert n.finished == []
    n.finished = [3.5, 4.5, 4.5]
    n.took_report(4.0, 5.0, created=15)  # it answered before the two made while asking
    assert n.finished == [4.5, 4.5]
    n.took_report(6.0, 7.0, created=3)   # a restarted node: the time rule alone
    assert n.finished == [] and n.created == 3


def test_a_report_taken_mid_batch_does_not_count_the_share_twice():
    """The node made 50 of its share of 83 when it reported: they are in its live count and
    in the gateway's in-flight count; counted once, before and after the share ends."""
    n = nodes(1)[0]
    n.took_report(0.0, 1.0, created=0)
    n.inflight = 83
    n.live = 50
    n.took_report(1.0, 2.0, created=50)
    assert n.used == 83
    n.inflight, n.finished = 0, [3.0] * 83  # the share ends
    assert n.used == 83
    n.live = 83
    n.took_report(4.0, 5.0, created=83)
    assert n.used == 83 and n.finished == [] and n.credit == 0
    n.live = 93                            # ten made on the node itself (a fork)
    n.took_report(6.0, 7.0, created=93)
    assert n.used == 93 and n.credit == 0  # no credit outlives the gateway's creates


def test_batches_spread_evenly_whenever_the_reports_come():
    """Batches of 250 over 3 nodes; each batch, one node reports while its share is half
    made, another after its share ended but before the gateway saw the end, the third after:
    counted once each, the nodes stay within 10% of even."""
    from corral.cluster.batch import split

    ns, per = nodes(3, capacity=600), Counter[str]()
    for n in ns:
        n.took_report(0.0, time.monotonic(), created=0)
    for b in range(4):
        t = 100.0 + b
        shares = split(ns, 250, 2, {}, "host")
        mid, late, after = (ns[(b + j) % 3] for j in range(3))
        for s in shares:
            per[s.node.node] += len(s.indexes)
        made = {s.node.node: len(s.indexes) for s in shares}
        truth = {n.node: per[n.node] - made.get(n.node, 0) for n in ns}  # made before

        def report(n: NodeLoad, asked: float, truth: dict[str, int] = truth) -> None:
            n.live = truth[n.node]
            n.took_report(asked, time.monotonic(), created=truth[n.node])
        truth[mid.node] += made.get(mid.node, 0) // 2  # half its share made when it reports
        report(mid, t - 0.5)
        truth[late.node] += made.get(late.node, 0)     # all made, the gateway not told yet
        report(late, t - 0.5)
        for s in shares:                               # the shares end
            s.node.inflight -= len(s.indexes)
            s.node.finished.extend(t for _ in s.indexes)
        truth.update(per)
        report(after, t + 0.5)
        assert {n.node: n.used for n in ns} == dict(per), (b, ns)
    assert max(abs(c - 1000 / 3) for c in per.values()) <= 0.1 * 1000 / 3, per


def test_a_spread_group_goes_to_the_node_with_fewest_of_it():
    """A spread batch fills the nodes evenly though one of them is much less loaded, and
    without spread the same batch goes by load."""
    from corral.cluster.batch import split

    ns = nodes(3, capacity=100, now=time.monotonic())
    ns[0].live = 0
    ns[1].live = ns[2].live = 40
    shares = {s.node.node: len(s.indexes) for s in split(ns, 6, 2, {}, "host", spread=True)}
    assert shares == {"n0": 2, "n1": 2, "n2": 2}, shares
    for n in ns:
        n.inflight = 0
    shares = {s.node.node: len(s.indexes) for s in split(ns, 6, 3, {}, "host")}
    assert shares == {"n0": 6}, shares


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
    ns[2].inflight = 0  # room on n2, which the caller tried already
    with pytest.raises(CapacityExceeded, match="was tried"):
        choose(ns, 100.0, exclude={"n2"})


class Counting(Sequence[NodeLoad]):
    """The gateway's node list, counting how many nodes placement looks at."""

    def __init__(self, ns: list[NodeLoad]) -> None:
        self.ns, self.looked = ns, 0

    def __len__(self) -> int:
        return len(self.ns)

    @overload
    def __getitem__(self, i: int) -> NodeLoad: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[NodeLoad]: ...

    def __getitem__(self, i: int | slice) -> NodeLoad | Sequence[NodeLoad]:
        self.looked += 1 if isinstance(i, int) else len(self.ns[i])
        return self.ns[i]

    def __iter__(self) -> Iterator[NodeLoad]:
        for n in self.ns:
            self.looked += 1
            yield n


def test_a_create_looks_at_k_nodes_not_all_of_them():
    """5,000 nodes: placing 1,000 creates looks at a few nodes each, not at 5,000."""
    ns = Counting(nodes(5000))
    for _ in range(1000):
        choose(ns, 100.0, k=2, image="host", by_image={}).finished.append(1.0)
    assert ns.looked < 1000 * 20, ns.looked


def test_drawn_placement_is_even_and_only_on_eligible_nodes():
    """200 nodes, of which stale, full, unlabelled and excluded ones: every create lands on an
    eligible node, every eligible node gets some, and the spread stays within 10% of even."""
    ns, rng = nodes(200), random.Random(3)
    for n in ns[:20]:
        n.reported_at = 100.0 - REPORT_MAX_AGE_S - 1
    for n in ns[20:40]:
        n.live = n.capacity
    for n in ns[40:60]:
        n.labels = {"pool": "b"}
    for n in ns[60:]:
        n.labels = {"pool": "a"}
    excluded = {"n60", "n61"}
    per = Counter[str]()
    for i in range(14000):
        n = choose(ns, 100.0, k=2, selector={"pool": "a"}, rng=rng, by_image={},
                   exclude=excluded)
        n.finished.append(float(i))
        per[n.node] += 1
    eligible = {f"n{i}" for i in range(62, 200)}
    assert set(per) == eligible
    even = 14000 / len(eligible)
    assert max(abs(c - even) for c in per.values()) <= 0.1 * even, per


def test_drawn_placement_prefers_the_nodes_with_the_image():
    """100 nodes, one has the image: creates of it go there until it is a quarter fuller."""
    ns = nodes(100, capacity=100)
    ns[7].images = frozenset({"py"})
    got = []
    for _ in range(60):
        n = choose(ns, 100.0, k=2, image="py", by_image={"py": [ns[7]]})
        n.finished.append(1.0)
        got.append(n.node)
    assert got[:25] == ["n7"] * 25
    assert 0 < sum(1 for x in got[25:] if x != "n7") < 35  # a quarter fuller: others too
    ns[7].live = 100  # full: the image's only node is out, creates go elsewhere
    assert choose(ns, 100.0, image="py", by_image={"py": [ns[7]]}).node != "n7"


def test_drawn_placement_falls_back_to_every_node_when_few_are_eligible():
    """Only 2 of 300 nodes have room: found (by looking at all), and a full fleet refuses."""
    ns = nodes(300, capacity=5)
    for n in ns:
        n.live = 5
    ns[100].live = ns[250].live = 0
    got = {choose(ns, 100.0, k=2, by_image={}).node for _ in range(50)}
    assert got <= {"n100", "n250"} and got
    ns[100].live = ns[250].live = 5
    with pytest.raises(CapacityExceeded, match="full"):
        choose(ns, 100.0, by_image={})
