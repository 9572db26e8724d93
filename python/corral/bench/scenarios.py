"""The scenarios (churn, latency, exec, density, snapshot; the trajectory log's
overhead scenario is in corral.bench.trajlog). Each repeats ``--runs`` times; within a run every
system is measured back to back (so they share the machine's noise), ratios are taken within
a run, and the report quotes the median over runs. Each returns (report section, samples for
the plots)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from corral.bench import host, profile, sdk_runs
from corral.bench.execpath import execpath
from corral.bench.fleet import fleet
from corral.bench.gvisor import gvisor
from corral.bench.images import images
from corral.bench.keyedreads import keyedreads
from corral.bench.network import network
from corral.bench.results import OpResult
from corral.bench.runcode import run_code
from corral.bench.session import Session
from corral.bench.stats import median, median_tree, ratio
from corral.bench.trajlog import trajlog

Section = dict[str, Any]
Samples = dict[str, Any]


def _summarize(runs: list[dict[str, OpResult]], ratio_pairs: list[tuple[str, str]],
               metric: Callable[[OpResult], float | None] = lambda r: r.ops_per_s) -> Section:
    """Per-run JSON, the median of each figure over runs, and the median of the per-run
    ratios ``a/b`` for each (a, b) in ratio_pairs."""
    per_run = [{k: v.to_json() for k, v in res.items()} for res in runs]
    ratios = {}
    for a, b in ratio_pairs:
        vals = [ratio(metric(res[a]), metric(res[b])) for res in runs if a in res and b in res]
        m = median(vals)
        if m is not None:
            ratios[f"{a}/{b}"] = round(m, 3)
    return {"median": median_tree(per_run), "ratios": ratios, "runs": per_run}


# ---- churn ----------------------------------------------------------------------------------
def churn(s: Session) -> tuple[Section, Samples]:
    assert s.raw is not None
    n, conc, R = s.opts.n("churn"), s.opts.concurrency, s.opts.runs
    ep = s.daemon.endpoint
    runs: list[dict[str, OpResult]] = []
    prof: dict[str, Any] = {}
    prof_b: dict[str, Any] = {}
    for r in range(R):
        tag = f"churn {r + 1}/{R}"
        res: dict[str, OpResult] = {}
        with s.ui.task(f"{tag} raw", None), host.CpuMeter(children=True) as cpu:
            res["raw"] = s.raw.churn(n, conc, netns=False, system="raw")
        res["raw"].extra["cpu_ms_per_op"] = cpu.per_op_ms(n)
        with s.ui.task(f"{tag} raw +netns", None), host.CpuMeter(children=True) as cpu:
            res["raw-netns"] = s.raw.churn(n, conc, netns=True, system="raw-netns")
        res["raw-netns"].extra["cpu_ms_per_op"] = cpu.per_op_ms(n)
        if "disabled" in s.opts.networks:
            with s.ui.task(f"{tag} raw disabled", None), \
                    host.CpuMeter(children=True) as cpu:
                res["raw-disabled"] = s.raw.churn(n, conc, netns=False, system="raw-disabled",
                                                  disabled=True)
            res["raw-disabled"].extra["cpu_ms_per_op"] = cpu.per_op_ms(n)
        for net in s.opts.networks:
            name = sdk_runs.system_name(net)
            pool0 = s.daemon.pool_counts()
            with s.ui.task(f"{tag} {name}", n) as adv, \
                    _profiled(s, r == 0 and net == s.opts.networks[0], prof), \
                    host.CpuMeter(s.daemon.pid, client=True) as cpu:
                res[name] = sdk_runs.churn(ep, n, conc, adv, net)  # type: ignore[arg-type]
            res[name].extra["cpu_ms_per_op"] = cpu.per_op_ms(n)
            res[name].extra["pool_hit_ratio"] = _hit_ratio(pool0, s.daemon.pool_counts())
        if s.opts.churn_batch > 0:  # the same ops (network none) through the batch calls
            b, fl = s.opts.churn_batch, s.opts.batches_in_flight
            pool0 = s.daemon.pool_counts()
            with s.ui.task(f"{tag} corral batch {b} x{fl}", n) as adv, \
                    _profiled(s, r == 0, prof_b, "churn-batch"), \
                    host.CpuMeter(s.daemon.pid, client=True) as cpu:
                res["corral-batch"] = sdk_runs.churn_batch(ep, n, b, fl, adv)
            res["corral-batch"].extra["cpu_ms_per_op"] = cpu.per_op_ms(n)
            res["corral-batch"].extra["pool_hit_ratio"] = _hit_ratio(pool0,
                                                                     s.daemon.pool_counts())
        if s.peers is not None:
            for peer in s.peer_names():
                pn = s.opts.n_peers()
                with s.ui.task(f"{tag} {peer}", pn) as adv, host.CpuMeter(children=True) as cpu:
                    res[peer] = s.peers.churn(peer, pn, conc, adv)
                res[peer].extra["cpu_ms_per_op"] = cpu.per_op_ms(pn)
        runs.append(res)
    mine = [sdk_runs.system_name(net) for net in s.opts.networks]
    if s.opts.churn_batch > 0:
        mine.append("corral-batch")
    others = [k for k in runs[0] if k not in mine]
    sec = _summarize(runs, [(c, o) for c in mine for o in others])
    sec.update(n=n, concurrency=conc, peer_n=s.opts.n_peers() if s.peers else None,
               unavailable=s.peer_errors or None, networks=s.opts.networks,
               matching=_matching(s.opts.networks), batch=s.opts.churn_batch or None,
               batches_in_flight=s.opts.batches_in_flight if s.opts.churn_batch else None)
    if prof:
        sec["profile"] = prof
    if prof_b:
        sec["profile_batch"] = prof_b
    # Per-op latencies only (corral-batch's phases are per batch of sandboxes).
    samples = {k: v.phases.get("total", []) for k, v in runs[-1].items() if k != "corral-batch"}
    return sec, samples


def _matching(networks: list[str]) -> dict[str, str]:
    """corral's system for each network mode -> the raw baseline doing the same kernel work
    (raw-disabled: one shared netns and the Landlock scope, like corral's "disabled")."""
    return {sdk_runs.system_name(n): "raw-netns" if n == "none" else "raw-disabled"
            for n in networks}


def _hit_ratio(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    """Share of creates served by a warm pool between two /metrics readings."""
    hits, misses = after[0] - before[0], after[1] - before[1]
    return round(hits / (hits + misses), 3) if hits + misses > 0 else None


@contextmanager
def _profiled(s: Session, enabled: bool, into: dict[str, Any],
              name: str = "churn") -> Iterator[None]:
    """py-spy the daemon for the duration of the block (first run only, with --profile)."""
    if not (enabled and s.opts.profile and s.daemon.pid):
        yield
        return
    out = Path(s.opts.plots_dir or s.root) / f"{name}-daemon-pyspy.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        sampler = profile.Sampler(s.daemon.pid, out)
    except FileNotFoundError as e:
        into["error"] = str(e)
        yield
        return
    try:
        yield
    finally:
        sampler.stop()
        into.update(profile.summarize(out) if out.exists() else {"error": "no py-spy output"})
        into["raw_stacks"] = str(out)


# ---- latency --------------------------------------------------------------------------------
def latency(s: Session) -> tuple[Section, Samples]:
    assert s.raw is not None
    n, R = s.opts.n("latency"), s.opts.runs
    runs: list[dict[str, OpResult]] = []
    for r in range(R):
        tag = f"latency {r + 1}/{R}"
        res: dict[str, OpResult] = {}
        with s.ui.task(f"{tag} raw +netns", None):
            res["raw-netns"] = _raw_latency(s, n, netns=True)
        with s.ui.task(f"{tag} raw", None):
            res["raw"] = _raw_latency(s, n, netns=False)
        # Cold: a spec with an explicit hostname is never served from a warm pool (daemon.md);
        # the hit ratio below checks that it stays so. Warm: the default spec, pools on.
        pool0 = s.daemon.pool_counts()
        with s.ui.task(f"{tag} corral cold", n) as adv:
            res["corral-cold"] = sdk_runs.latency(s.daemon.endpoint, n, adv,
                                                  hostname="bench-cold")
        pool1 = s.daemon.pool_counts()
        with s.ui.task(f"{tag} corral warm pool", n) as adv:
            res["corral"] = sdk_runs.latency(s.daemon.endpoint, n, adv)
        res["corral-cold"].extra["pool_hit_ratio"] = _hit_ratio(pool0, pool1)
        res["corral"].extra["pool_hit_ratio"] = _hit_ratio(pool1, s.daemon.pool_counts())
        with s.ui.task(f"{tag} corral exec round trip", n) as adv:
            res["corral"].phases["exec"] = sdk_runs.exec_sync(s.daemon.endpoint, n,
                                                              adv).phases["exec"]
        runs.append(res)

    def p50(phase: str) -> Callable[[OpResult], float | None]:
        def f(r: OpResult) -> float | None:
            return median(r.phases.get(phase, []))
        return f

    sec = _summarize(runs, [])
    sec["ratios"] = {  # latency ratios: corral p50 / raw p50 (lower is better; 1.0 = raw)
        f"{c}/raw-netns {ph}_p50": median([ratio(p50(ph)(res[c]),
                                                 p50(ph if ph != "first_exec" else "exec")(
                                                     res["raw-netns"])) for res in runs])
        for c in ("corral", "corral-cold") for ph in ("create", "first_exec", "ttfr", "destroy")}
    sec.update(n=n)
    last = runs[-1]
    samples = {"corral " + k: v for k, v in last["corral"].phases.items()}
    samples["corral-cold create"] = last["corral-cold"].phases["create"]
    samples.update({"raw+netns " + k: v for k, v in last["raw-netns"].phases.items()
                    if k in ("create", "exec", "ttfr")})
    return sec, samples


def _raw_latency(s: Session, n: int, netns: bool) -> OpResult:
    assert s.raw is not None
    r = s.raw.churn(n, 1, netns=netns, system="raw-netns" if netns else "raw")
    r.phases["ttfr"] = [c + e for c, e in zip(r.phases["create"], r.phases["exec"], strict=True)
                        if c >= 0 and e >= 0]
    r.phases.pop("total", None)
    return r


# ---- exec -----------------------------------------------------------------------------------
def exec_(s: Session) -> tuple[Section, Samples]:
    assert s.raw is not None
    n, conc, R = s.opts.n("exec"), s.opts.concurrency, s.opts.runs
    ep = s.daemon.endpoint
    runs: list[dict[str, OpResult]] = []
    prof: dict[str, Any] = {}
    for r in range(R):
        tag = f"exec {r + 1}/{R}"
        res: dict[str, OpResult] = {}
        with s.ui.task(f"{tag} raw", None):
            with host.CpuMeter(children=True) as cpu:
                res["raw-seq"] = s.raw.exec(n, 1, system="raw-seq")
            res["raw-seq"].extra["cpu_ms_per_op"] = cpu.per_op_ms(n)
            res["raw-conc"] = s.raw.exec(n, conc, system="raw-conc")
        with _profiled(s, r == 0, prof, "exec"):
            with s.ui.task(f"{tag} corral sync", n) as adv, \
                    host.CpuMeter(s.daemon.pid, client=True) as cpu:
                res["corral-seq"] = sdk_runs.exec_sync(ep, n, adv)
            res["corral-seq"].extra["cpu_ms_per_op"] = cpu.per_op_ms(n)
            with s.ui.task(f"{tag} corral async x{conc}", n) as adv:
                res["corral-conc"] = sdk_runs.exec_async(ep, n, conc, adv)
        runs.append(res)
    sec = _summarize(runs, [("corral-seq", "raw-seq"), ("corral-conc", "raw-conc")])
    sec.update(n=n, concurrency=conc)
    if prof:
        sec["profile"] = prof
    return sec, {k: v.phases["exec"] for k, v in runs[-1].items()}


# ---- density --------------------------------------------------------------------------------
def density(s: Session) -> tuple[Section, Samples]:
    n, R = s.opts.n("density"), s.opts.runs
    runs: list[dict[str, Any]] = []
    curves: dict[str, list[tuple[int, float]]] = {}
    for r in range(R):
        tag = f"density {r + 1}/{R}"
        res: dict[str, Any] = {}
        for net in s.opts.networks:
            name = sdk_runs.system_name(net)
            res[name], curves[name] = _density_corral(s, n, tag, net)
        # The raw floor gets the cgroups corral's idle sandboxes have (corral may make some
        # only at a sandbox's first exec); v2 (one dir) and unknown: all of them.
        ctls = next(iter(res.values())).get("controllers") or None
        # Each mode's matching baseline only (at 50,000 one raw fill takes minutes and raw+netns
        # alone ~12 GiB); plain raw (no netns, no Landlock) as a reference with "none".
        if "none" in s.opts.networks:
            res["raw-netns"], curves["raw-netns"] = _density_raw(s, n, True, tag, ctls)
            res["raw"], curves["raw"] = _density_raw(s, n, False, tag, ctls)
        if "disabled" in s.opts.networks:
            res["raw-disabled"], curves["raw-disabled"] = _density_raw(s, n, False, tag, ctls,
                                                                       disabled=True)
        runs.append(res)
    matching = _matching(s.opts.networks)
    sec: Section = {"n": n, "median": median_tree(runs), "runs": runs, "ratios": {},
                    "networks": s.opts.networks, "matching": matching}
    pairs = list(matching.items())
    if "corral" in matching:
        pairs.append(("corral", "raw"))
    for a, b in pairs:
        vals = [ratio(x[a].get("memcg_kib_per_sandbox"), x[b].get("memcg_kib_per_sandbox"))
                for x in runs]
        if (m := median(vals)) is not None:
            sec["ratios"][f"{a}/{b} memory (memcg)"] = round(m, 3)
        vals = [ratio(x[a].get("memcg_nocache_kib_per_sandbox"),
                      x[b].get("memcg_nocache_kib_per_sandbox")) for x in runs]
        if (m := median(vals)) is not None:
            sec["ratios"][f"{a}/{b} memory (memcg without page cache)"] = round(m, 3)
        vals = [ratio(x[a].get("kib_per_sandbox"), x[b].get("kib_per_sandbox")) for x in runs]
        if (m := median(vals)) is not None:
            sec["ratios"][f"{a}/{b} memory (MemAvailable)"] = round(m, 3)
    return sec, {"curves": curves}


def _mem_delta(before: dict[str, Any], after: dict[str, Any], n: int) -> dict[str, float]:
    """Per-sandbox KiB: charged to the system's memory cgroups (the sandboxes, and the daemon
    or raw process itself: its RSS, the clone-time kernel objects, pooled netns), what
    MemAvailable lost (host-wide: other load on the machine shows up in it), and the
    kernel counters behind them."""
    out = {"kib_per_sandbox": round((before["MemAvailable"] - after["MemAvailable"]) / n, 1)}
    if before.get("memcg") is not None and after.get("memcg") is not None:
        out["memcg_kib_per_sandbox"] = round((after["memcg"] - before["memcg"]) / n, 1)
        if before.get("memcg_file") is not None and after.get("memcg_file") is not None:
            # without page cache (reclaimable: state files, the trajectory log, dir blocks)
            out["memcg_nocache_kib_per_sandbox"] = round(
                ((after["memcg"] - after["memcg_file"]) - (before["memcg"] - before["memcg_file"]))
                / n, 1)
    for k in ("Slab", "SUnreclaim", "KernelStack", "PageTables", "Shmem", "Percpu"):
        if k in before and k in after:
            out[f"{k.lower()}_kib"] = round((after[k] - before[k]) / n, 1)
    return out


def _mem(cgroups: list[str]) -> dict[str, Any]:
    """meminfo, plus ``memcg``: KiB charged to the system's memory cgroups (the sandboxes'
    parent and the daemon's / raw's own), None if not readable."""
    m: dict[str, Any] = dict(host.meminfo())
    usage = [host.memcg_usage_kib(c) for c in cgroups]
    m["memcg"] = None if any(u is None for u in usage) else sum(u for u in usage if u)
    files = [host.memcg_file_kib(c) for c in cgroups]
    m["memcg_file"] = None if any(f is None for f in files) else sum(f for f in files if f)
    return m


def _rate_points(create_ms: list[float], window: int) -> list[tuple[int, float]]:
    """Sequential create latencies -> (live count at window start, creates/s in the window)."""
    pts = []
    for i in range(0, len(create_ms) - window + 1, window):
        total_s = sum(create_ms[i:i + window]) / 1000
        if total_s > 0:
            pts.append((i, window / total_s))
    return pts


def _rate_summary(pts: list[tuple[int, float]]) -> dict[str, float | None]:
    """Create rate with few alive vs with nearly all alive (first/last 10% of the fill)."""
    if not pts:
        return {}
    k = max(1, len(pts) // 10)
    first = median([p[1] for p in pts[:k]])
    last = median([p[1] for p in pts[-k:]])
    return {"create_rate_empty": round(first or 0, 1), "create_rate_full": round(last or 0, 1),
            "full/empty": ratio(last, first)}


def _density_corral(s: Session, n: int, tag: str,
                    network: str = "none", image: str = "host") -> tuple[dict[str, Any], list]:
    ep = s.daemon.endpoint
    cg = [s.daemon.cgroup_name, s.prefix + "dproc"]
    host.settle()
    before, rss0 = _mem(cg), s.daemon.rss_kib() or 0
    inits0 = len(s.daemon.sandbox_pids())  # warm-pool sandboxes already there
    name = sdk_runs.system_name(network)
    with s.ui.task(f"{tag} {name} create", n) as adv:
        ids, pts, wall, err = sdk_runs.fill(ep, n, s.opts.batch, adv,
                                            network, image)  # type: ignore[arg-type]
    try:
        host.settle()
        after, rss1 = _mem(cg), s.daemon.rss_kib() or 0
        pids = sorted(s.daemon.sandbox_pids())
        controllers = host.sandbox_controllers(s.daemon.cgroup_name)
        # Per sandbox = per init added: live ones plus whatever the warm pool added meanwhile.
        added = max(1, len(pids) - inits0)
        out: dict[str, Any] = {"made": len(ids), "pooled_extra": added - len(ids),
                               "controllers": controllers,
                               "create_s": round(wall, 3),
                               **_mem_delta(before, after, added),
                               "daemon_rss_mib": round(rss1 / 1024, 1),
                               "daemon_rss_kib_per_sandbox": round((rss1 - rss0) / max(1, len(ids)),
                                                                   2),

                               "init_pss_kib": median([host.pss_kib(p) for p in pids[:20]]),
                               **_rate_summary(pts)}
        if err:
            out["error"] = err
    finally:
        with s.ui.task(f"{tag} {name} destroy", len(ids)) as adv:
            dwall = sdk_runs.destroy_all(ep, ids, s.opts.batch, adv)
    out["destroy_per_s"] = round(len(ids) / dwall, 1) if dwall > 0 else None
    host.settle()
    out["baseline"] = _back_to_baseline(
        s, before, cg, int(s.daemon.metrics().get("corral_pool_ready", 0)))
    return out, pts


def _density_raw(s: Session, n: int, netns: bool, tag: str,
                 controllers: list[str] | None,
                 disabled: bool = False) -> tuple[dict[str, Any], list]:
    assert s.raw is not None
    name = "raw +netns" if netns else "raw disabled" if disabled else "raw"
    cg = [s.raw.cgroup_name, s.prefix + "rawproc"]
    for c in cg:  # both exist before the first reading
        host.make_memcg(c)
    host.settle()
    before = _mem(cg)
    with s.ui.task(f"{tag} {name} (create, hold)", None):
        with s.raw.idle(n, netns, own_memcg=cg[1], controllers=controllers,
                        disabled=disabled) as info:
            host.settle()
            after = _mem(cg)
            pss = median([host.pss_kib(p) for p in info.get("pids", [])[:20]])
    made = info.get("made", 0)
    create_ms = [x / 1000 for x in info.get("create_us", [])]
    pts = _rate_points(create_ms, max(1, s.opts.batch))
    out: dict[str, Any] = {"made": made, "controllers": controllers or "all",
                           "create_s": info.get("wall_s"),
                           **_mem_delta(before, after, max(1, made)), "init_pss_kib": pss,
                           **_rate_summary(pts)}
    if info.get("destroy_s"):
        out["destroy_per_s"] = round(made / info["destroy_s"], 1)
    out["baseline"] = _back_to_baseline(s, before, cg)
    return out, pts


def _back_to_baseline(s: Session, before: dict[str, Any], cgroups: list[str],
                      pooled: int = 0) -> dict[str, Any]:
    """After destroying everything: memory (vs before), sandbox cgroups and processes left
    under the system's cgroup name beyond ``pooled`` warm-pool sandboxes (host mounts never
    grow: every mount is in the sandboxes' own namespaces)."""
    host.settle()
    now = _mem(cgroups)
    names = {os.path.basename(d) for d in host.cgroup_children(cgroups[0], exact=True)}
    # ".spare-*"/".cooling-*": emptied memory cgroups kept for the next sandbox (a bounded
    # cache, removed at a graceful stop), not sandboxes: counted apart.
    ids = {n for n in names if not n.startswith(".")}
    memcg = (round((now["memcg"] - before["memcg"]) / 1024, 1)
             if now["memcg"] is not None and before.get("memcg") is not None else None)
    return {"mem_available_delta_mib": round((now["MemAvailable"] - before["MemAvailable"]) / 1024,
                                             1),
            "memcg_delta_mib": memcg,
            "pooled": pooled,
            "memcg_spares": len(names) - len(ids),
            "cgroups_left": max(0, len(ids) - pooled),
            "processes_left": max(0, len(host.cgroup_pids(cgroups[0], exact=True)
                                         - {s.daemon.pid}) - pooled)}


# ---- snapshot / restore / fork ------------------------------------------------------------
SNAPSHOT_TARGETS_MS = {"snapshot": 10.0, "restore": 5.0, "fork": 100.0}


def snapshot(s: Session) -> tuple[Section, Samples]:
    """Snapshot with ``--snapshot-mb`` MB changed, restore in place, fork of ``--fork``
    children, all through the SDK on the private daemon (sdk_runs.snapshots)."""
    n, R, mb, fork_n = s.opts.n("snapshot"), s.opts.runs, s.opts.snapshot_mb, s.opts.fork
    fork_reps = max(3, n // 3)
    fork_key = f"fork{fork_n}"
    runs: list[dict[str, OpResult]] = []
    for r in range(R):
        with s.ui.task(f"snapshot {r + 1}/{R} ({mb} MB, fork {fork_n})", n + fork_reps) as adv:
            runs.append({"corral": sdk_runs.snapshots(
                s.daemon.endpoint, n, mb, fork_n, fork_reps, adv,
                sandboxes_dir=s.daemon.state_dir / "sandboxes")})
    sec = _summarize(runs, [])
    m = sec["median"]["corral"]
    targets = {"snapshot": SNAPSHOT_TARGETS_MS["snapshot"],
               "restore": SNAPSHOT_TARGETS_MS["restore"], fork_key: SNAPSHOT_TARGETS_MS["fork"]}
    sec.update(n=n, fork_reps=fork_reps, mb=mb, fork_n=fork_n, targets_ms=targets,
               met={k: (m.get(f"{k}_ms", {}).get("p50") is not None
                        and m[f"{k}_ms"]["p50"] <= t) for k, t in targets.items()},
               left=_snapshot_leftovers(s))
    return sec, {f"corral {k}": v for k, v in runs[-1]["corral"].phases.items()}


def _snapshot_leftovers(s: Session, timeout: float = 10.0) -> dict[str, int]:
    """What the scenario left on the daemon: snapshot records, and layer dirs once the
    background deletes of their last references are done (the scenario deletes everything)."""
    left = sdk_runs.leftovers(s.daemon.endpoint)
    layers = s.daemon.state_dir / "layers"
    deadline = time.monotonic() + timeout
    while True:
        n = len(os.listdir(layers)) if layers.is_dir() else 0
        if n == 0 or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    left["layers"] = n
    return left


RUNNERS: dict[str, Callable[[Session], tuple[Section, Samples]]] = {
    "churn": churn, "latency": latency, "exec": exec_, "density": density,
    "snapshot": snapshot, "trajlog": trajlog, "execpath": execpath,
    "keyedreads": keyedreads, "run-code": run_code, "gvisor": gvisor, "images": images,
    "network": network, "fleet": fleet}
