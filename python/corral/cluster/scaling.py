"""Autoscaling through Ray's autoscaler: sandbox demand becomes resource requests.

corral's sandboxes use no Ray resources (the supervisor asks for none), so Ray's autoscaler
cannot see them. The gateway tells it: when creates are refused for lack of room
(``capacity_exceeded`` with every matching node full), the nodes the demand needs become a
``ray.autoscaler.sdk.request_resources`` call of ``node_shape`` bundles, one per wanted
node (``node_shape`` is what one node of the type that should hold sandboxes offers, e.g.
``{"CPU": 16}`` or a custom ``{"corral": 1}``). The autoscaler starts nodes; the gateway
adopts each new node (starts its supervisor). Once no create was refused for
``demand_window_s``, the request is withdrawn (an empty request), and a node that held no
sandbox for ``idle_s`` is drained: taken out of placement, its corrald stopped, so that Ray
sees an idle node and its autoscaler releases it. The gateway's own node and the last
``min_nodes`` nodes are never drained.

Pure policy here (``Autoscaler.plan``); the gateway acts on it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from corral.cluster.placement import NodeLoad
from corral.errors import InvalidRequest


@dataclass(frozen=True)
class AutoscaleConfig:
    node_shape: dict[str, float]
    min_nodes: int = 1
    max_nodes: int = 100
    idle_s: float = 300.0
    demand_window_s: float = 30.0

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> AutoscaleConfig:
        try:
            cfg = cls(node_shape={str(k): float(v) for k, v in dict(raw["node_shape"]).items()},
                      min_nodes=int(raw.get("min_nodes", 1)),
                      max_nodes=int(raw.get("max_nodes", 100)),
                      idle_s=float(raw.get("idle_s", 300.0)),
                      demand_window_s=float(raw.get("demand_window_s", 30.0)))
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidRequest(f"bad autoscale settings {raw!r}: {e}") from None
        if not cfg.node_shape or any(v <= 0 for v in cfg.node_shape.values()):
            raise InvalidRequest("autoscale node_shape: resource -> positive amount, one at "
                                 "least (what one corral node offers Ray, e.g. {'CPU': 16})")
        if not 0 <= cfg.min_nodes <= cfg.max_nodes or cfg.max_nodes < 1:
            raise InvalidRequest("autoscale: 0 <= min_nodes <= max_nodes, max_nodes >= 1")
        if cfg.idle_s <= 0 or cfg.demand_window_s <= 0:
            raise InvalidRequest("autoscale: idle_s and demand_window_s are positive")
        return cfg

    def as_dict(self) -> dict[str, Any]:
        return {"node_shape": dict(self.node_shape), "min_nodes": self.min_nodes,
                "max_nodes": self.max_nodes, "idle_s": self.idle_s,
                "demand_window_s": self.demand_window_s}


@dataclass
class Plan:
    request: list[dict[str, float]] | None  # bundles to ask Ray for ([]: withdraw); None: keep
    drain: list[str]                         # node ids to drain now


@dataclass
class Autoscaler:
    cfg: AutoscaleConfig
    unmet: deque[tuple[float, int]] = field(default_factory=deque)  # (when, creates refused)
    asked: int = 0                           # nodes the standing request is for (0: none)
    idle_since: dict[str, float] = field(default_factory=dict)

    def refused(self, now: float, count: int) -> None:
        """``count`` creates were refused because every node was full."""
        self.unmet.append((now, count))

    def demand(self, now: float) -> int:
        while self.unmet and now - self.unmet[0][0] > self.cfg.demand_window_s:
            self.unmet.popleft()
        return sum(c for _, c in self.unmet)

    def plan(self, nodes: list[NodeLoad], now: float, keep: set[str]) -> Plan:
        """What to do now, given the placeable ``nodes``; ``keep``: nodes never drained."""
        unmet = self.demand(now)
        request: list[dict[str, float]] | None = None
        if unmet:
            per_node = max((n.capacity for n in nodes), default=0) or 1
            used = sum(n.used for n in nodes)
            want = min(self.cfg.max_nodes,
                       max(self.cfg.min_nodes, len(nodes) + 1,
                           math.ceil((used + unmet) / per_node)))
            if want != self.asked:
                self.asked = want
                request = [dict(self.cfg.node_shape) for _ in range(want)]
        elif self.asked:
            self.asked = 0
            request = []
        drain: list[str] = []
        for n in nodes:
            if n.used > 0 or n.node in keep:
                self.idle_since.pop(n.node, None)
            else:
                self.idle_since.setdefault(n.node, now)
        if not unmet:
            left = len(nodes)
            for n in sorted(nodes, key=lambda n: self.idle_since.get(n.node, now)):
                since = self.idle_since.get(n.node)
                if left <= self.cfg.min_nodes or since is None or now - since < self.cfg.idle_s:
                    continue
                drain.append(n.node)
                self.idle_since.pop(n.node, None)
                left -= 1
        return Plan(request, drain)


def request_resources(bundles: list[dict[str, float]]) -> None:
    """Ask Ray's autoscaler for ``bundles`` (replacing the standing request; [] withdraws
    it). Blocking: a GCS call."""
    from ray.autoscaler.sdk import request_resources as ray_request

    ray_request(bundles=bundles)
