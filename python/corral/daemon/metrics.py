"""The daemon's Prometheus metrics (``GET /metrics``), through ``prometheus_client``.

One registry per app (never the process-wide default): two daemons in one process (tests) or
an app rebuilt keep their own numbers. Two kinds of metric live in it:

* measured here: latency histograms of the API's create / exec / snapshot calls and counters
  of the errors the API answered, by code, and of the infra ones among them;
* read at scrape time from the engine (``Engine.metrics()``): its counters (created, crashed,
  lost, pool hits, trajectory log ...) as ``corral_<name>_total`` and its gauges (live
  sandboxes, capacity, pool_ready, clients waiting), so the names stay the ones users know.

docs/observability.md lists them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from corral.errors import CorralError

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Seconds: a pooled create or an exec of `true` is ~1 ms, a cold create tens of ms, a
# snapshot of a big tree seconds.
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
           10.0, 30.0)
TIMED = ("create", "exec", "snapshot")
GAUGES = frozenset({"pool_ready"})  # engine.metrics() values that are gauges, not counters


class _EngineCollector(Collector):
    """The engine's numbers, read at each scrape (no copy to keep in sync)."""

    def __init__(self, read: Callable[[], dict[str, Any]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        snap = self._read()
        for name in ("sandboxes", "capacity", "api_waiting"):
            yield GaugeMetricFamily(f"corral_{name}", _HELP[name], value=snap[name])
        states = GaugeMetricFamily("corral_sandboxes_by_state", "live sandboxes by state and "
                                   "substrate", labels=["state", "substrate"])
        for (state, substrate), n in sorted(snap["by_state"].items()):
            states.add_metric([state, substrate], n)
        yield states
        yield GaugeMetricFamily("corral_pools", "warm pools (one per substrate, image and "
                                "limits asked for)", value=snap["pool_count"])
        pooled = GaugeMetricFamily("corral_pool_sandboxes", "warm-pool sandboxes by substrate, "
                                   "image and state (ready, making)",
                                   labels=["substrate", "image", "state"])
        for (substrate, image), (ready, making) in sorted(snap["pools"].items()):
            pooled.add_metric([substrate, image, "ready"], ready)
            pooled.add_metric([substrate, image, "making"], making)
        yield pooled
        for name, value in sorted(snap["engine"].items()):
            if name in GAUGES:
                yield GaugeMetricFamily(f"corral_{name}", _HELP.get(name, name), value=value)
            else:
                yield CounterMetricFamily(f"corral_{name}", _HELP.get(name, name), value=value)


_HELP = {
    "sandboxes": "live sandboxes (every state)",
    "capacity": "the most sandboxes this daemon holds (CORRAL_MAX_SANDBOXES)",
    "api_waiting": "API handlers waiting on a process for a client (streams, waits)",
    "pool_ready": "warm-pool sandboxes ready to be taken, all pools together",
    "created": "sandboxes created",
    "create_failed": "creates that failed",
    "crashed": "sandboxes whose init died of the sandbox's own doing",
    "lost": "sandboxes lost to the infrastructure (init killed from outside, daemon restart)",
    "pool_hits": "creates served from a warm pool",
    "pool_misses": "creates a pool could have served but found empty",
    "pool_failures": "pool refills that failed",
    "snapshots_exported": "snapshot exports streamed to another node",
    "snapshots_imported": "snapshots stored from another node's export",
    "network_slots_recycled": "ended networked sandboxes' links and namespaces reused (nothing "
                              "of the sandbox showed there)",
    "network_slots_not_recycled": "ended networked sandboxes' links and namespaces released "
                                  "(a trace of the sandbox, or no room)",
    "network_slots_retired": "networked slots never handed out again: the removal of their "
                             "sandbox's rules failed",
}


class Metrics:
    """The registry of one app and the metrics measured by the API layer."""

    def __init__(self, read: Callable[[], dict[str, Any]] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.latency = {op: Histogram(f"corral_{op}_seconds", f"latency of an API {op}, "
                                      "success or failure", buckets=BUCKETS,
                                      registry=self.registry) for op in TIMED}
        self.errors = Counter("corral_errors", "errors the API answered, by code and category",
                              ["code", "category"], registry=self.registry)
        self.infra = Counter("corral_infra_failures", "errors the API answered whose cause is "
                             "the infrastructure (category infra: mask the rollout)", ["code"],
                             registry=self.registry)
        if read is not None:
            self.registry.register(_EngineCollector(read))

    @contextmanager
    def timed(self, op: str) -> Iterator[None]:
        """Observe the duration of ``op`` (create, exec or snapshot); others pass through."""
        hist = self.latency.get(op)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if hist is not None:
                hist.observe(time.perf_counter() - t0)

    def error(self, err: CorralError) -> None:
        self.errors.labels(err.code, err.category).inc()
        if err.infra:
            self.infra.labels(err.code).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def histograms(self) -> dict[str, dict[str, Any]]:
        """The latency histograms as JSON (the dashboard): cumulative counts by upper bound."""
        out: dict[str, dict[str, Any]] = {}
        for op, hist in self.latency.items():
            buckets: list[list[Any]] = []
            total = count = 0.0
            for metric in hist.collect():
                for s in metric.samples:
                    if s.name.endswith("_bucket"):
                        buckets.append([s.labels["le"], s.value])
                    elif s.name.endswith("_sum"):
                        total = s.value
                    elif s.name.endswith("_count"):
                        count = s.value
            out[op] = {"buckets": buckets, "sum": total, "count": count}
        return out

    def infra_total(self) -> float:
        return sum(s.value for m in self.infra.collect() for s in m.samples
                   if s.name.endswith("_total"))

    def error_counts(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for metric in self.errors.collect():
            for s in metric.samples:
                if s.name.endswith("_total"):
                    out[s.labels["code"]] = out.get(s.labels["code"], 0) + s.value
        return out
