"""The ``trajlog`` scenario: exec throughput with the trajectory log on vs off (issue 4's
target: logging costs <= 5% of it).

Two private daemons, identical but for ``CORRAL_TRAJLOG=1`` / ``=0`` (and, with
``--trajlog-baseline DIR``, a third one, log on, running the corral package found in DIR: a
change to the log measured against the code before it, under the same load). One client, one
sandbox per daemon; a run is N execs of ``true`` per daemon sequentially (sync client), then N
with C in flight (async client), in blocks of ``BLOCK`` execs (times C) that take turns across
the daemons, in ABBA order. This machine's speed swings by +-20 % over seconds: interleaving
at the block's scale (tens of milliseconds) makes every swing hit each daemon alike, where
rounds of a second each left per-run ratios scattered over 0.83-1.01. A daemon's figure for a
run is its execs over the wall time of its blocks; the report quotes medians over ``--runs``
and the median of the per-run on/off ratios.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from corral.bench import host, sdk_runs
from corral.bench.daemon import PrivateDaemon
from corral.bench.results import OpResult
from corral.bench.session import Session
from corral.bench.stats import median, median_tree, ratio
from corral.errors import CorralError
from corral.sdk import AsyncSandbox, Sandbox

TARGET = 0.95  # on/off exec throughput: logging costs <= 5%
MODES = ("seq", "conc")
# Execs per block (times the concurrency in the concurrent mode): the daemons take turns every
# block, so the machine's drift (seconds-long swings of +-20 % here) hits each alike.
BLOCK = 20
WARMUP = 5


def _daemons(s: Session) -> dict[str, PrivateDaemon]:
    envs: dict[str, dict[str, str]] = {"on": {"CORRAL_TRAJLOG": "1"},
                                       "off": {"CORRAL_TRAJLOG": "0"}}
    if s.opts.trajlog_baseline:
        envs["baseline"] = {"CORRAL_TRAJLOG": "1",
                            "PYTHONPATH": os.path.abspath(s.opts.trajlog_baseline)}
    # Cgroup names under the session's prefix: its leak check and sweep cover them.
    return {k: PrivateDaemon(s.root / f"trajlog-{k}", f"{s.prefix}tl-{k}", 100, env=env)
            for k, env in envs.items()}


class _Tally:
    """One daemon's share of one run in one mode: its blocks' execs, wall time, latencies,
    errors and CPU time (all its threads, plus the commands it reaped)."""

    def __init__(self) -> None:
        self.n = 0
        self.wall = 0.0
        self.cpu = 0.0
        self.cpu_ok = True
        self.lat: list[float] = []
        self.errors: list[str] = []

    def note(self, r: Any, t0: float) -> None:
        """One exec's outcome (started at ``t0``)."""
        if r.exit_code == 0:
            self.lat.append((time.perf_counter() - t0) * 1e3)
        else:
            self.errors.append(f"exit {r.exit_code}")

    @contextlib.contextmanager
    def block(self, d: PrivateDaemon, m: int) -> Iterator[None]:
        """Account one block of ``m`` execs on daemon ``d``: its wall time and CPU."""
        c0 = _cpu(d)
        t0 = time.perf_counter()
        yield
        self.wall += time.perf_counter() - t0
        c1 = _cpu(d)
        if c0 is None or c1 is None:
            self.cpu_ok = False
        else:
            self.cpu += c1 - c0
        self.n += m

    def to_json(self, mode: str) -> dict[str, Any]:
        out = OpResult(mode, self.n, self.wall, len(self.errors), {"exec": self.lat}).to_json()
        if self.n and self.cpu_ok:
            out["daemon_cpu_us_per_exec"] = round(self.cpu * 1e6 / self.n, 1)
        if self.errors:
            out["first_errors"] = self.errors[:3]
        return out


def _cpu(d: PrivateDaemon) -> float | None:
    if not d.pid:
        return None
    try:
        u, st = host.proc_cpu_s(d.pid)
    except OSError:
        return None
    return u + st


def _order(names: list[str], b: int) -> list[str]:
    """The daemons' order in block ``b``: rotated each block, reversed every other one (ABBA:
    each daemon is as often first as last, so a drift within a pair of blocks cancels)."""
    k = (b // 2) % len(names)
    order = names[k:] + names[:k]
    return order[::-1] if b % 2 else order


def _one(sb: Sandbox, tally: _Tally) -> None:
    t = time.perf_counter()
    try:
        r = sb.exec(sdk_runs.TRUE)
    except CorralError as e:
        tally.errors.append(sdk_runs._err(e))
        return
    tally.note(r, t)


def _seq(daemons: dict[str, PrivateDaemon], n: int, adv: Any) -> dict[str, _Tally]:
    """``n`` sequential execs per daemon, in blocks of BLOCK interleaved across the daemons
    (one sync client, one sandbox per daemon)."""
    names = list(daemons)
    tallies = {k: _Tally() for k in names}
    boxes = {k: Sandbox("host", endpoint=d.endpoint, timeout=sdk_runs.TTL_S)
             for k, d in daemons.items()}
    try:
        for sb in boxes.values():
            for _ in range(WARMUP):
                sb.exec(sdk_runs.TRUE)
        for b in range(-(-n // BLOCK)):
            m = min(BLOCK, n - b * BLOCK)
            for k in _order(names, b):
                tally, sb = tallies[k], boxes[k]
                with tally.block(daemons[k], m):
                    for _ in range(m):
                        _one(sb, tally)
                adv(m)
    finally:
        for sb in boxes.values():
            sb.kill()
    return tallies


async def _conc_async(daemons: dict[str, PrivateDaemon], n: int, conc: int,
                      adv: Any) -> dict[str, _Tally]:
    names = list(daemons)
    tallies = {k: _Tally() for k in names}
    boxes = {k: AsyncSandbox("host", endpoint=d.endpoint, timeout=sdk_runs.TTL_S)
             for k, d in daemons.items()}
    try:
        for sb in boxes.values():
            await sb.__aenter__()
            await asyncio.gather(*(sb.exec(sdk_runs.TRUE) for _ in range(conc)))

        async def worker(sb: AsyncSandbox, tally: _Tally, todo: Any) -> None:
            for _ in todo:
                t = time.perf_counter()
                try:
                    r = await sb.exec(sdk_runs.TRUE)
                except CorralError as e:
                    tally.errors.append(sdk_runs._err(e))
                    continue
                tally.note(r, t)

        per = BLOCK * conc
        for b in range(-(-n // per)):
            m = min(per, n - b * per)
            for k in _order(names, b):
                tally, sb = tallies[k], boxes[k]
                todo = iter(range(m))  # shared: each exec taken once
                with tally.block(daemons[k], m):
                    await asyncio.gather(*(worker(sb, tally, todo) for _ in range(conc)))
                adv(m)
    finally:
        for sb in boxes.values():
            await sb.__aexit__(None, None, None)
    return tallies


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
            sdk_runs.exec_sync(d.endpoint, 20)
            sdk_runs.exec_async(d.endpoint, 20, conc)
            metrics[k] = d.metrics()
        for r in range(R):
            with s.ui.task(f"trajlog {r + 1}/{R} sequential", n * len(names)) as adv:
                seq = _seq(daemons, n, adv)
            with s.ui.task(f"trajlog {r + 1}/{R} {conc} in flight", n * len(names)) as adv:
                cc = asyncio.run(_conc_async(daemons, n, conc, adv))
            runs.append({k: {"seq": seq[k].to_json("seq"), "conc": cc[k].to_json("conc")}
                         for k in names})
        stats = {k: _trajlog_stats(metrics.get(k, {}), d.metrics()) for k, d in daemons.items()
                 if k != "off"}
    finally:
        cleanup = _stop(daemons)
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
