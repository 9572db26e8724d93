"""The ``trajlog`` scenario: exec throughput with the trajectory log on vs off (issue 4's
target: logging costs <= 5% of it).

Two private daemons, identical but for ``CORRAL_TRAJLOG=1`` / ``=0`` (and, with
``--trajlog-baseline DIR``, a third one, log on, running the corral package found in DIR: a
change to the log measured against the code before it, under the same load). Within a run,
rounds go on, off, off, on (ABBA; the baseline takes its turn in the same rotation), so load
from anything else on the machine hits every daemon alike and a linear drift cancels; each
round is N execs of ``true`` sequentially (sync client) and N with C in flight (async client),
each on a fresh sandbox. The per-run figure of a daemon is the mean of its rounds; the report
quotes medians over ``--runs`` and the median of the per-run on/off ratios.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from corral.bench import host, sdk_runs
from corral.bench.daemon import PrivateDaemon
from corral.bench.results import OpResult
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


def _round(d: PrivateDaemon, n: int, conc: int, adv: Any) -> dict[str, OpResult]:
    """Both modes, each with the daemon's CPU time (all its threads: the writer's too)."""
    out = {}
    for mode in MODES:
        t0 = host.proc_cpu_s(d.pid) if d.pid else None
        out[mode] = (sdk_runs.exec_sync(d.endpoint, n, adv) if mode == "seq" else
                     sdk_runs.exec_async(d.endpoint, n, conc, adv))
        t1 = host.proc_cpu_s(d.pid) if d.pid else None
        if t0 and t1:
            out[mode].extra["daemon_cpu_s"] = (t1[0] + t1[1]) - (t0[0] + t0[1])
    return out


def _mean(rounds: list[dict[str, OpResult]], mode: str) -> dict[str, Any]:
    """One daemon's figure for one run: its rounds pooled (ops / total wall time)."""
    rs = [r[mode] for r in rounds]
    n, wall = sum(r.n for r in rs), sum(r.wall_s for r in rs)
    errors = sum(r.errors for r in rs)
    lat = [x for r in rs for x in r.phases.get("exec", [])]
    out = OpResult(mode, n, wall, errors, {"exec": lat}).to_json()
    cpu = [r.extra.get("daemon_cpu_s") for r in rs]
    if n and all(c is not None for c in cpu):
        out["daemon_cpu_us_per_exec"] = round(sum(cpu) * 1e6 / n, 1)  # type: ignore[arg-type]
    return out


def trajlog(s: Session) -> tuple[dict[str, Any], dict[str, Any]]:
    n, conc, R = s.opts.n("trajlog"), s.opts.concurrency, s.opts.runs
    daemons = _daemons(s)
    names = list(daemons)
    runs: list[dict[str, Any]] = []
    metrics: dict[str, dict[str, float]] = {}
    try:
        for d in daemons.values():
            d.start()
        for k, d in daemons.items():  # warm-up: image skeleton, pools, first connections
            _round(d, 20, conc, sdk_runs._noop)
            metrics[k] = d.metrics()
        for r in range(R):
            # ABBA: every daemon at both ends of the run; the rotation shifts per run.
            order = names[r % len(names):] + names[:r % len(names)]
            rounds: dict[str, list[dict[str, OpResult]]] = {k: [] for k in names}
            for k in order + order[::-1]:
                with s.ui.task(f"trajlog {r + 1}/{R} log {k}", 2 * n) as adv:
                    rounds[k].append(_round(daemons[k], n, conc, adv))
            runs.append({k: {m: _mean(v, m) for m in MODES} for k, v in rounds.items()})
        stats = {k: _trajlog_stats(metrics.get(k, {}), d.metrics()) for k, d in daemons.items()
                 if k != "off"}
    finally:
        cleanup = _stop(daemons)
    sec: dict[str, Any] = {"n": n, "concurrency": conc, "target": f"on/off >= {TARGET}",
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
    if not cleanup["clean"]:
        raise RuntimeError(f"trajlog: left behind: {cleanup['leaks']}")
    return sec, {}


def _trajlog_stats(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """How the log wrote during the measured rounds (/metrics deltas): share committed
    inline on the event loop, records per transaction, slow inline commits, checkpoints."""
    d = {k: after.get(f"corral_trajlog_{k}_total", 0.0) - before.get(f"corral_trajlog_{k}_total",
                                                                      0.0)
         for k in ("records", "commits", "inline", "inline_slow", "checkpoints")}
    if not d["records"]:
        return {}  # an older daemon (baseline) without these counters
    return {"records": int(d["records"]), "inline_share": round(d["inline"] / d["records"], 3),
            "records_per_commit": round(d["records"] / max(1.0, d["commits"]), 2),
            "inline_slow": int(d["inline_slow"]), "checkpoints": int(d["checkpoints"])}


def _stop(daemons: dict[str, PrivateDaemon]) -> dict[str, Any]:
    """Stop the daemons, then check each left nothing: no sandbox dir, cgroup or process."""
    leaks: dict[str, Any] = {}
    for k, d in daemons.items():
        try:
            d.stop()
        except Exception as e:  # noqa: BLE001 - the check must still run
            leaks[f"{k}: stop"] = str(e)
        sdir = Path(d.state_dir) / "sandboxes"
        left = {"sandbox_dirs": sorted(os.listdir(sdir)) if sdir.is_dir() else [],
                "cgroups": host.cgroup_children(d.cgroup_name, exact=True),
                "processes": sorted(host.cgroup_pids(d.cgroup_name, exact=True))}
        leaks.update({f"{k}: {what}": v for what, v in left.items() if v})
    return {"clean": not leaks, "leaks": leaks}
