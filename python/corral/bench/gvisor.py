"""The gvisor scenario: the gvisor substrate against the container substrate and plain
`runsc do true` (a whole gVisor sandbox per command, no daemon), back to back in each run:
create, first exec, exec round trip on a live sandbox, destroy, and sequential churn
(create -> exec true -> destroy, one call each)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from typing import Any

from corral.bench import sdk_runs
from corral.bench.results import OpResult
from corral.bench.session import Session
from corral.bench.stats import median, ratio
from corral.daemon import kernel
from corral.daemon.substrates.gvisor.probe import detect, find_runsc, kill_under

SYSTEMS = ("container", "gvisor")


def runsc_do(n: int, workdir: str, warmup: int = 2) -> OpResult:
    """`runsc do true` n times: what one command in a fresh gVisor sandbox costs from the
    command line (its own --root, the probed platform, no network)."""
    binary = find_runsc()
    if binary is None:
        return OpResult("runsc-do", n, 0.0, skipped="runsc is not installed")
    work = tempfile.mkdtemp(prefix="runsc-do-", dir=workdir)
    try:
        platform, why = detect(binary, work)
        if platform is None:
            return OpResult("runsc-do", n, 0.0, skipped=why)
        root = os.path.join(work, "root")
        null = kernel.private_null(os.path.join(work, "null"))
        argv = [binary, f"--root={root}", f"--platform={platform}", "--network=none",
                "do", "true"]
        lat: list[float] = []
        errors = 0
        t_start = time.perf_counter()
        for i in range(-warmup, n):
            if i == 0:
                t_start = time.perf_counter()
            t = time.perf_counter()
            with open(null, "r+b") as sink:  # runsc gives its stdio away: not the host's
                r = subprocess.run(argv, stdin=sink, stdout=sink, stderr=sink, cwd=work,
                                   timeout=60)
            if i < 0:
                continue
            if r.returncode == 0:
                lat.append((time.perf_counter() - t) * 1e3)
            else:
                errors += 1
        wall = time.perf_counter() - t_start
        return OpResult("runsc-do", n, wall, errors, {"ttfr": lat}, {"platform": platform})
    finally:
        kill_under(os.path.join(work, "root"))
        shutil.rmtree(work, ignore_errors=True)


def gvisor(s: Session) -> tuple[dict[str, Any], dict[str, Any]]:
    from corral.sdk import admin

    n, R = s.opts.n("gvisor"), s.opts.runs
    ep = s.daemon.endpoint
    rows = {x.name: x for x in admin.substrates(ep)}
    if "gvisor" not in rows or not rows["gvisor"].available:
        why = rows["gvisor"].reason if "gvisor" in rows else "not served"
        return {"skipped": f"gvisor is not available: {why}", "n": n, "median": {},
                "ratios": {}, "runs": []}, {}
    runs: list[dict[str, OpResult]] = []
    for r in range(R):
        tag = f"gvisor {r + 1}/{R}"
        res: dict[str, OpResult] = {}
        for sub in SYSTEMS:
            with s.ui.task(f"{tag} {sub} create/exec/destroy", n) as adv:
                # a hostname: never served from a warm pool (cold creates on both substrates)
                res[sub] = sdk_runs.latency(ep, n, adv, hostname="bench-gvisor",
                                            substrate=sub)
            with s.ui.task(f"{tag} {sub} exec round trip", n) as adv:
                res[sub].phases["exec"] = sdk_runs.exec_sync(ep, n, adv,
                                                             substrate=sub).phases["exec"]
        with s.ui.task(f"{tag} runsc do true", None):
            res["runsc-do"] = runsc_do(n, s.opts.workdir)
        runs.append(res)
    per_run = [{k: v.to_json() for k, v in res.items()} for res in runs]
    med: dict[str, Any] = {}
    for sysname in (*SYSTEMS, "runsc-do"):
        figures: dict[str, Any] = {}
        for ph in ("create", "first_exec", "exec", "ttfr", "destroy"):
            vals = [median(res[sysname].phases.get(ph, [])) for res in runs
                    if not res[sysname].skipped]
            figures[f"{ph}_p50_ms"] = _round(median([v for v in vals if v is not None]))
        figures["churn_per_s"] = _round(median([res[sysname].ops_per_s for res in runs
                                                 if res[sysname].ops_per_s is not None]))
        med[sysname] = figures
    ratios = {
        f"gvisor/container {k}": _round(median([
            ratio(median(res["gvisor"].phases.get(k, [])),
                  median(res["container"].phases.get(k, []))) for res in runs]))
        for k in ("create", "exec", "ttfr")}
    sec = {"n": n, "median": med, "ratios": ratios, "runs": per_run}
    return sec, {}


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 2)
