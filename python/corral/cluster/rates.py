"""A node's creates and ends per second, from its load reports (``corral cluster status``).

A report carries the node's count of creates since its corrald started and its live count;
the rates are their changes over the reports of the last ``WINDOW_S`` seconds. Sandboxes that
ended are the creates less the growth of the live count.
"""

from __future__ import annotations

from collections import deque

WINDOW_S = 10.0


class NodeRates:
    """The last ``window_s`` seconds of one node's reports: (time, created, live)."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._reports: deque[tuple[float, int, int]] = deque()

    def add(self, at: float, created: int, live: int) -> None:
        if self._reports and created < self._reports[-1][1]:
            self._reports.clear()  # a restarted corrald counts from 0 again
        self._reports.append((at, created, live))
        # Keep one report at or before the window's start: the rates span the whole window.
        while len(self._reports) > 2 and self._reports[1][0] <= at - self.window_s:
            self._reports.popleft()

    def per_s(self) -> tuple[float, float]:
        """(creates per second, ends per second) over the window; 0 before two reports."""
        if len(self._reports) < 2:
            return 0.0, 0.0
        t0, created0, live0 = self._reports[0]
        t1, created1, live1 = self._reports[-1]
        span = t1 - t0
        if span <= 0:
            return 0.0, 0.0
        created = created1 - created0
        ended = created - (live1 - live0)
        return created / span, max(0, ended) / span
