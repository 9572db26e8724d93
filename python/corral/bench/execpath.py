"""The ``execpath`` scenario: a command started by the sandbox's init (the default, see
docs/isolation.md "Exec through the init") against one started by the daemon itself
(``_core.exec_in``, ``CORRAL_INIT_EXEC=0``), in the same run.

Two private daemons, identical but for ``CORRAL_INIT_EXEC``, trajectory log on in both (the
default). One client; per run: N execs of ``true`` per daemon sequentially (the exec round
trip), N with C in flight, and N/10 (at least 10) create -> exec -> kill (time to the first
result), each in blocks that take turns across the daemons in ABBA order
(corral.bench.interleave). The report quotes medians over ``--runs`` and the median of the
per-run ratios init/daemon: above 1 for throughput, below 1 for latency, means the init's
path is faster.
"""

from __future__ import annotations

import asyncio
from typing import Any

from corral.bench.daemon import PrivateDaemon
from corral.bench.interleave import run_conc, run_first_results, run_seq, stop_and_check
from corral.bench.session import Session
from corral.bench.stats import median, median_tree, ratio

MODES = ("seq", "conc", "first")


def _daemons(s: Session) -> dict[str, PrivateDaemon]:
    # Cgroup names under the session's prefix: its leak check and sweep cover them.
    return {k: PrivateDaemon(s.root / f"execpath-{k}", f"{s.prefix}ep-{k}", 100,
                             env={"CORRAL_INIT_EXEC": v})
            for k, v in (("init", "1"), ("daemon", "0"))}


def execpath(s: Session) -> tuple[dict[str, Any], dict[str, Any]]:
    n, conc, R = s.opts.n("execpath"), s.opts.concurrency, s.opts.runs
    n_first = max(10, n // 10)
    daemons = _daemons(s)
    names = list(daemons)
    runs: list[dict[str, Any]] = []
    paths: dict[str, dict[str, int]] = {}
    try:
        for d in daemons.values():
            d.start()
        with s.ui.task("execpath warm-up", None):
            run_seq(daemons, 20, lambda m: None)
            run_first_results(daemons, 5, lambda m: None)
        for r in range(R):
            tag = f"execpath {r + 1}/{R}"
            with s.ui.task(f"{tag} sequential", n * len(names)) as adv:
                seq = run_seq(daemons, n, adv)
            with s.ui.task(f"{tag} {conc} in flight", n * len(names)) as adv:
                cc = asyncio.run(run_conc(daemons, n, conc, adv))
            with s.ui.task(f"{tag} create -> exec -> kill", n_first * len(names)) as adv:
                first = run_first_results(daemons, n_first, adv)
            runs.append({k: {"seq": seq[k].to_json("seq"), "conc": cc[k].to_json("conc"),
                             "first": first[k].to_json("first")} for k in names})
        for k, d in daemons.items():  # which path each daemon's commands really took
            m = d.metrics()
            paths[k] = {p: int(m.get(f"corral_execs_via_{p}_total", 0))
                        for p in ("init", "daemon")}
    finally:
        cleanup = stop_and_check(daemons)
    sec: dict[str, Any] = {"n": n, "n_first": n_first, "concurrency": conc,
                           "median": median_tree(runs), "runs": runs, "ratios": {},
                           "paths": paths, "cleanup": cleanup}
    for mode in MODES:
        thr = [ratio(x["init"][mode].get("ops_per_s"), x["daemon"][mode].get("ops_per_s"))
               for x in runs]
        p50 = [ratio(x["init"][mode].get("exec_ms", {}).get("p50"),
                     x["daemon"][mode].get("exec_ms", {}).get("p50")) for x in runs]
        if (v := median(thr)) is not None:
            sec["ratios"][f"throughput {mode}"] = round(v, 3)
        if (v := median(p50)) is not None:
            sec["ratios"][f"p50 {mode}"] = round(v, 3)
    if not cleanup["clean"]:
        raise RuntimeError(f"execpath: left behind: {cleanup['leaks']}")
    return sec, {}
