"""A node's creates and ends per second as ``corral cluster status`` shows them
(corral.cluster.rates), from a stream of load reports."""

from __future__ import annotations

import pytest

from corral.cluster.rates import NodeRates


def test_no_rate_before_two_reports():
    r = NodeRates()
    assert r.per_s() == (0.0, 0.0)
    r.add(1.0, 5, 5)
    assert r.per_s() == (0.0, 0.0)


def test_creates_and_ends_over_the_window():
    r = NodeRates(window_s=10.0)
    # 0.5 s reports: 20 creates a second; from t=5, 10 of them end a second.
    for i in range(41):
        t = i * 0.5
        created = 10 * i
        ended = max(0, 5 * (i - 10))
        r.add(t, created, created - ended)
    creates, ends = r.per_s()
    assert creates == pytest.approx(20.0)
    assert ends == pytest.approx(10.0)


def test_the_window_slides():
    r = NodeRates(window_s=4.0)
    for i in range(20):  # 100 creates a second, none ending, for 10 s
        r.add(i * 0.5, 50 * i, 50 * i)
    for i in range(20, 41):  # then no create: 10 end every report, 20 a second
        r.add(i * 0.5, 950, 950 - 10 * (i - 19))
    creates, ends = r.per_s()
    assert creates == 0.0
    assert ends == pytest.approx(20.0)


def test_a_restarted_node_starts_over():
    r = NodeRates()
    r.add(0.0, 100, 10)
    r.add(1.0, 200, 10)
    r.add(2.0, 3, 3)  # corrald restarted: its count is back near 0
    assert r.per_s() == (0.0, 0.0)
    r.add(3.0, 13, 13)
    assert r.per_s() == (pytest.approx(10.0), 0.0)
