"""Where a new sandbox goes: power-of-k choices over the nodes' load reports.

Sampling k nodes and taking the least loaded of them spreads nearly as evenly as asking every
node, at a cost independent of the cluster's size, and without herding: gateways (or one
gateway between two reports) do not all pick the same "best" node. Pure functions, no Ray.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from corral.cluster.rates import NodeRates
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
    snapshots: frozenset[str] = frozenset()  # ids of the snapshots the node holds
    labels: dict[str, str] = field(default_factory=dict)
    reported_at: float = 0.0   # monotonic seconds on the gateway
    # Creates the report may not count yet: those in flight, and those that finished after
    # the report was asked for (their times; see ``took_report``), less ``credit``: creates
    # the node's reports counted that are still among them.
    inflight: int = 0
    finished: list[float] = field(default_factory=list)
    created: int | None = None  # the node's count of creates at its last report
    credit: int = 0
    rates: NodeRates = field(default_factory=NodeRates, compare=False, repr=False)

    @property
    def placed(self) -> int:
        return max(0, self.inflight + len(self.finished) - self.credit)

    @property
    def used(self) -> int:
        return self.live + self.placed

    def took_report(self, asked_at: float, now: float, created: int | None = None) -> None:
        """A report asked for at ``asked_at`` counts every create finished before then. With
        ``created`` (the node's count of creates) it also tells how many creates the node made
        since its last report: those are in its ``live`` however the report crossed the
        gateway's creates (made while a batch was still in flight, or finished while the
        report travelled), and are not counted again (else the node whose report came at the
        wrong moment looks fuller by a batch's share and the next batch shuns it). Creates
        made on the node without the gateway (a fork) may be taken for the gateway's: that
        undercounts while a batch is in flight there, never past the next report."""
        if created is not None and self.created is not None and created >= self.created:
            self.credit += created - self.created
        else:  # a first report, or a restarted node: the time rule alone
            self.credit = 0
        self.created = created
        done = sum(1 for t in self.finished if t < asked_at)  # finished is in time order
        done = max(done, min(self.credit, len(self.finished)))
        del self.finished[:done]
        # What is left of the credit is the in-flight creates the node made already.
        self.credit = min(max(0, self.credit - done), self.inflight)
        self.reported_at = now

    @property
    def load(self) -> float:
        return self.used / self.capacity if self.capacity > 0 else 1.0

    def matches(self, selector: Mapping[str, str] | None) -> bool:
        return not selector or all(self.labels.get(k) == v for k, v in selector.items())


def choose(nodes: Sequence[NodeLoad], now: float, *, k: int = 2,
           selector: Mapping[str, str] | None = None, image: str | None = None,
           rng: random.Random | None = None,
           by_image: Mapping[str, Sequence[NodeLoad]] | None = None,
           exclude: Collection[str] = (), group: Mapping[str, int] | None = None) -> NodeLoad:
    """The least loaded of ``k`` nodes sampled among the fresh ones with room that match
    ``selector`` (label -> value) and are not in ``exclude`` (node ids); when some have
    ``image``, one of the k is drawn from those, and it counts ``IMAGE_BONUS`` less loaded.
    ``group`` (node id -> sandboxes of the caller's group placed there: a spread batch)
    comes before load: of the k, the node holding the fewest of the group wins.
    Raises CapacityExceeded when none has room.

    ``by_image`` (image -> the nodes that have it, kept by the caller as reports come) makes
    the cost independent of the number of nodes: the k are drawn at random and redrawn when
    not eligible, and only when that fails (most nodes full, stale or unmatched) are all the
    nodes looked at. Without it, every call looks at every node."""
    if k < 1:
        raise InvalidRequest("power-of-k placement needs k >= 1")
    rng = rng or _RNG

    def eligible(n: NodeLoad) -> bool:
        return (now - n.reported_at <= REPORT_MAX_AGE_S and n.used < n.capacity
                and n.node not in exclude and n.matches(selector))

    if len(nodes) > SCAN_MAX and (not image or by_image is not None):
        having = by_image.get(image, ()) if image and by_image is not None else ()
        first = _draw(having, 1, eligible, rng) if having else []
        if having and not first:  # unlucky draws, or none of them eligible: look at them all
            ok = [n for n in having if eligible(n)]
            first = [rng.choice(ok)] if ok else []
        rest = _draw(nodes, k - len(first),
                     lambda n: eligible(n) and all(n is not f for f in first), rng)
        if len(first) + len(rest) == k:
            return min([*first, *rest], key=_scorer(image, group))
    # The exact path: every node looked at.
    fresh = [n for n in nodes if now - n.reported_at <= REPORT_MAX_AGE_S]
    matching = [n for n in fresh if n.matches(selector)]
    room = [n for n in matching if n.used < n.capacity and n.node not in exclude]
    if not room:
        why = ("no node answers" if not fresh else
               f"no node has the labels {dict(selector or {})}" if not matching else
               "every node is full" if not exclude else
               "every node is full, or was tried and full or not answering")
        raise CapacityExceeded(f"the cluster cannot place a sandbox: {why}",
                               details={"nodes": len(nodes), "fresh": len(fresh),
                                        "matching": len(matching)})
    having_room = [n for n in room if image in n.images] if image else []
    if having_room:
        pick = rng.choice(having_room)
        others = [n for n in room if n is not pick]
        sample = [pick, *rng.sample(others, min(k - 1, len(others)))]
    else:
        sample = rng.sample(room, min(k, len(room)))
    return min(sample, key=_scorer(image, group))


SCAN_MAX = 16      # up to this many nodes, looking at all of them costs no more than drawing
DRAWS_PER_PICK = 4  # random draws per node wanted before the exact path takes over


def _draw(pool: Sequence[NodeLoad], want: int, ok: Callable[[NodeLoad], bool],
          rng: random.Random) -> list[NodeLoad]:
    """Up to ``want`` distinct nodes of ``pool`` that are ``ok``, drawn uniformly (a draw
    that is not ok, or already drawn, is redrawn): a uniform sample of the ok nodes, as
    ``rng.sample`` of them would be, in O(want) draws while most nodes are ok."""
    got: list[NodeLoad] = []
    if want <= 0 or not pool:
        return got
    seen: set[int] = set()
    for _ in range(DRAWS_PER_PICK * want + 4):
        i = rng.randrange(len(pool))
        if i in seen:
            continue
        seen.add(i)
        if ok(pool[i]):
            got.append(pool[i])
            if len(got) == want:
                break
    return got


def _scorer(image: str | None, group: Mapping[str, int] | None = None
            ) -> Callable[[NodeLoad], tuple[int, float, float, int]]:
    def score(n: NodeLoad) -> tuple[int, float, float, int]:
        bonus = IMAGE_BONUS if image and image in n.images else 0.0
        return (group.get(n.node, 0) if group else 0, n.load - bonus, n.cpu_busy,
                -n.mem_free_mb)
    return score
