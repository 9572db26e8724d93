"""Where a new sandbox goes: power-of-k choices over the nodes' load reports.

Sampling k nodes and taking the least loaded of them spreads nearly as evenly as asking every
node, at a cost independent of the cluster's size, and without herding: gateways (or one
gateway between two reports) do not all pick the same "best" node. Pure functions, no Ray.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from corral.errors import CapacityExceeded, InvalidRequest

REPORT_MAX_AGE_S = 3.0  # an older report means the node stopped answering: place elsewhere
# A node that has the image already (no pull, its layers in the page cache) wins over one that
# has not unless it is this much fuller (a fraction of capacity): locality, but no hot spot.
IMAGE_BONUS = 0.25
_RNG = random.Random()


@dataclass
class NodeLoad:
    """A node as the gateway sees it: its last report plus what was placed since."""

    node: str
    endpoint: str
    live: int = 0
    capacity: int = 0
    mem_free_mb: int = 0
    cpu_busy: float = 0.0      # the node's CPU use since its last report, 0..1
    images: frozenset[str] = frozenset()  # images present on the node
    labels: dict[str, str] = field(default_factory=dict)
    reported_at: float = 0.0   # monotonic seconds on the gateway
    # Creates the report may not count yet: those in flight, and those that finished after
    # the report was asked for (their times; see ``took_report``).
    inflight: int = 0
    finished: list[float] = field(default_factory=list)

    @property
    def placed(self) -> int:
        return self.inflight + len(self.finished)

    @property
    def used(self) -> int:
        return self.live + self.placed

    def took_report(self, asked_at: float, now: float) -> None:
        """A report asked for at ``asked_at`` counts every create finished before then."""
        self.finished = [t for t in self.finished if t >= asked_at]
        self.reported_at = now

    @property
    def load(self) -> float:
        return self.used / self.capacity if self.capacity > 0 else 1.0

    def matches(self, selector: Mapping[str, str] | None) -> bool:
        return not selector or all(self.labels.get(k) == v for k, v in selector.items())


def choose(nodes: Sequence[NodeLoad], now: float, *, k: int = 2,
           selector: Mapping[str, str] | None = None, image: str | None = None,
           rng: random.Random | None = None) -> NodeLoad:
    """The least loaded of ``k`` nodes sampled among the fresh ones with room that match
    ``selector`` (label -> value); when some have ``image``, one of the k is drawn from those,
    and it counts ``IMAGE_BONUS`` less loaded. Raises CapacityExceeded when none has room."""
    if k < 1:
        raise InvalidRequest("power-of-k placement needs k >= 1")
    fresh = [n for n in nodes if now - n.reported_at <= REPORT_MAX_AGE_S]
    matching = [n for n in fresh if n.matches(selector)]
    room = [n for n in matching if n.used < n.capacity]
    if not room:
        why = ("no node answers" if not fresh else
               f"no node has the labels {dict(selector or {})}" if not matching else
               "every node is full")
        raise CapacityExceeded(f"the cluster cannot place a sandbox: {why}",
                               details={"nodes": len(nodes), "fresh": len(fresh),
                                        "matching": len(matching)})
    rng = rng or _RNG
    having = [n for n in room if image in n.images] if image else []
    if having:
        first = rng.choice(having)
        rest = [n for n in room if n is not first]
        sample = [first, *rng.sample(rest, min(k - 1, len(rest)))]
    else:
        sample = rng.sample(room, min(k, len(room)))

    def score(n: NodeLoad) -> tuple[float, float, int]:
        bonus = IMAGE_BONUS if image and image in n.images else 0.0
        return (n.load - bonus, n.cpu_busy, -n.mem_free_mb)
    return min(sample, key=score)
