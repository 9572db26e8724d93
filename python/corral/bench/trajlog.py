"""The ``trajlog`` scenario: exec throughput with the trajectory log on vs off (the
target: logging costs <= 5% of it), and the cost of keyed reads over unkeyed ones.

Two private daemons, identical but for ``CORRAL_TRAJLOG=1`` / ``=0`` (and, with
``--trajlog-baseline DIR``, a third one, log on, running the corral package found in DIR: a
change to the log measured against the code before it, under the same load). One client, one
sandbox per daemon; a run is N execs of ``true`` per daemon sequentially (sync client), then N
with C in flight (async client), in blocks of ``BLOCK`` execs (times C) that take turns across
the daemons, in ABBA order (corral.bench.interleave). Then N sequential ``files.read`` of a
small file in three interleaved variants: through a trajectory handle on the log-on daemon
(``keyed``: each read carries a key and its entry logs the bytes), a plain handle on the same
daemon (``unkeyed``: the read is logged with its size and hash only) and on the log-off
daemon. The report quotes medians over ``--runs`` and the median of the per-run ratios.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from corral.bench import sdk_runs
from corral.bench.daemon import PrivateDaemon
from corral.bench.interleave import BLOCK, run_conc, run_reads, run_seq, stop_and_check
from corral.bench.session import Session
from corral.bench.stats import median, median_tree, ratio

TARGET = 0.95  # on/off exec throughput: logging costs <= 5%
MODES = ("seq", "conc")


def _daemons(s: Session) -> dict[str, PrivateDaemon]:
    envs: dict[str, dict[str, str]] = {"on": {"CORRAL_TRAJLOG": "1"},
                                       "off": {"CORRAL_TRAJLOG": "0"}}
    if s.opts.trajlog_baseline:
        envs["baseline"] = {"CORRAL_TRAJLOG": "1",
                            "PYTHONPATH": os.path.abspath(s.opts.trajlog_baseline)}
    # Cgroup names under the session's prefix: its leak check and sweep cover them.
    return {k: PrivateDaemon(s.root / f"trajlog-{k}", f"{s.prefix}tl-{k}", 100, env=env)
            for k, env in envs.items()}


def trajlog(s: Session) -> tuple[dict[str, Any], dict[str, Any]]:
    n, conc, R = s.opts.n("trajlog"), s.opts.concurrency, s.opts.runs
    daemons = _daemons(s)
    names = list(daemons)
    runs: list[dict[str, Any]] = []
    reads: list[dict[str, Any]] = []
    metrics: dict[str, dict[str, float]] = {}
    try:
        for d in daemons.values():
            d.start()
        for k, d in daemons.items():  # warm-up: image skeleton, pools, first connections
            sdk_runs.exec_sync(d.endpoint, 20)
            sdk_runs.exec_async(d.endpoint, 20, conc)
            metrics[k] = d.metrics()
        for r in range(R):
            with s.ui.task(f"trajlog {r + 1}/{R} sequential", n * len(names)) as adv:
                seq = run_seq(daemons, n, adv)
            with s.ui.task(f"trajlog {r + 1}/{R} {conc} in flight", n * len(names)) as adv:
                cc = asyncio.run(run_conc(daemons, n, conc, adv))
            variants = {"keyed": (daemons["on"], True), "unkeyed": (daemons["on"], False),
                        "off": (daemons["off"], False)}
            with s.ui.task(f"trajlog {r + 1}/{R} reads", n * len(variants)) as adv:
                rd = run_reads(variants, n, adv)
            runs.append({k: {"seq": seq[k].to_json("seq"), "conc": cc[k].to_json("conc")}
                         for k in names})
            reads.append({k: t.to_json("reads") for k, t in rd.items()})
        stats = {k: _trajlog_stats(metrics.get(k, {}), d.metrics()) for k, d in daemons.items()
                 if k != "off"}
    finally:
        cleanup = stop_and_check(daemons)
    sec: dict[str, Any] = {"n": n, "concurrency": conc, "block": BLOCK,
                           "target": f"on/off >= {TARGET}",
                           "median": median_tree(runs), "runs": runs, "ratios": {},
                           "log_stats": stats, "cleanup": cleanup}
    pairs = [("on", "off")]
    if "baseline" in daemons:
        pairs += [("baseline", "off"), ("on", "baseline")]
    for a, b in pairs:
        for m in MODES:
            vals = [ratio(x[a][m].get("ops_per_s"), x[b][m].get("ops_per_s")) for x in runs]
            if (v := median(vals)) is not None:
                sec["ratios"][f"{a}/{b} {m}"] = round(v, 3)
    # The log's CPU per exec (daemon, all threads): steadier than throughput on a loaded host.
    for a in [k for k in daemons if k != "off"]:
        for m in MODES:
            vals = [None if x[a][m].get("daemon_cpu_us_per_exec") is None
                    or x["off"][m].get("daemon_cpu_us_per_exec") is None
                    else x[a][m]["daemon_cpu_us_per_exec"] - x["off"][m]["daemon_cpu_us_per_exec"]
                    for x in runs]
            if (v := median(vals)) is not None:
                sec.setdefault("log_cpu_us_per_exec", {})[f"{a} {m}"] = round(v, 1)
    sec["met"] = all(sec["ratios"].get(f"on/off {m}", 0) >= TARGET for m in MODES)
    sec["reads"] = {"median": median_tree(reads), "runs": reads}
    for a, b in (("keyed", "unkeyed"), ("unkeyed", "off"), ("keyed", "off")):
        vals = [ratio(x[a].get("ops_per_s"), x[b].get("ops_per_s")) for x in reads]
        if (v := median(vals)) is not None:
            sec["ratios"][f"reads {a}/{b}"] = round(v, 3)
    sec["reads_met"] = sec["ratios"].get("reads keyed/unkeyed", 0) >= TARGET
    if not cleanup["clean"]:
        raise RuntimeError(f"trajlog: left behind: {cleanup['leaks']}")
    return sec, {}


def _trajlog_stats(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """How the log wrote during the measured rounds (/metrics deltas): entries journaled,
    journal bytes per entry, entries per ingest transaction and the ingester thread's CPU per
    entry (of those ingested by the time of the read: the ingester trails by up to
    CORRAL_TRAJLOG_FLUSH_MS), checkpoints."""
    d = {k: after.get(f"corral_trajlog_{k}_total", 0.0) - before.get(f"corral_trajlog_{k}_total",
                                                                      0.0)
         for k in ("journaled", "records", "commits", "ingest_cpu_us", "journal_bytes",
                   "checkpoints")}
    if not d["journaled"] or "corral_trajlog_journal_bytes_total" not in after:
        return {}  # an older daemon (baseline) without these counters
    n, ingested = d["journaled"], max(1.0, d["records"])
    return {"records": int(n), "records_per_commit": round(ingested / max(1.0, d["commits"]), 2),
            "ingest_cpu_us_per_record": round(d["ingest_cpu_us"] / ingested, 1),
            "journal_bytes_per_record": int(d["journal_bytes"] / n),
            "checkpoints": int(d["checkpoints"])}
