"""One measured batch of operations, as every system (corral, raw, peers) reports it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from corral.bench.stats import summary


@dataclass
class OpResult:
    """``n`` operations by ``system``; ``phases`` maps a phase name (create, exec, destroy,
    total...) to per-op latencies in milliseconds. ``ops_per_s`` is n / wall time."""

    system: str
    n: int
    wall_s: float
    errors: int = 0
    phases: dict[str, list[float]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    skipped: str | None = None

    @property
    def ops_per_s(self) -> float | None:
        ok = self.n - self.errors
        return round(ok / self.wall_s, 2) if self.wall_s > 0 and ok > 0 else None

    def to_json(self) -> dict[str, Any]:
        if self.skipped:
            return {"skipped": self.skipped}
        out: dict[str, Any] = {"n": self.n, "errors": self.errors, "wall_s": round(self.wall_s, 4),
                               "ops_per_s": self.ops_per_s}
        for name, xs in self.phases.items():
            out[f"{name}_ms"] = summary(xs)
        out.update(self.extra)
        return out

    @classmethod
    def skip(cls, system: str, why: str) -> OpResult:
        return cls(system=system, n=0, wall_s=0.0, skipped=why)


def with_total(phases: dict[str, list[float]], parts: tuple[str, ...]) -> dict[str, list[float]]:
    """Add a ``total`` phase: the per-op sum of ``parts`` (ops with a failed part are dropped)."""
    cols = [phases[p] for p in parts if p in phases]
    if not cols:
        return phases
    total = [sum(v) for v in zip(*cols, strict=True) if all(x >= 0 for x in v)]
    return {**phases, "total": total}
