"""Percentiles and medians: the only statistics the report uses (no timing assertions)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def percentile(sorted_xs: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); ``p`` in 0..100."""
    if not sorted_xs:
        return math.nan
    k = (len(sorted_xs) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    if lo == hi:
        return float(sorted_xs[lo])
    return float(sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (k - lo))


def summary(samples: Iterable[float]) -> dict[str, float]:
    """n, mean, p50, p90, p99, max of latency samples (same unit in and out)."""
    xs = sorted(x for x in samples if x is not None and x >= 0)
    if not xs:
        return {"n": 0}
    return {
        "n": len(xs),
        "mean": round(statistics.fmean(xs), 4),
        "p50": round(percentile(xs, 50), 4),
        "p90": round(percentile(xs, 90), 4),
        "p99": round(percentile(xs, 99), 4),
        "max": round(xs[-1], 4),
    }


def median(xs: Iterable[float | None]) -> float | None:
    vals = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return statistics.median(vals) if vals else None


def median_tree(trees: Sequence[Any]) -> Any:
    """Element-wise median of equally shaped JSON-like trees (dicts of numbers / dicts).
    Non-numeric leaves come from the first tree; keys missing in some trees are skipped there."""
    trees = [t for t in trees if t is not None]
    if not trees:
        return None
    first = trees[0]
    if isinstance(first, Mapping):
        keys = list(first)
        return {k: median_tree([t[k] for t in trees if isinstance(t, Mapping) and k in t])
                for k in keys}
    if isinstance(first, bool) or not isinstance(first, (int, float)):
        return first
    m = median(trees)
    if m is None:
        return None
    return round(m, 4) if isinstance(m, float) else m


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return round(a / b, 3)
