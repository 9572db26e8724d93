"""The end-of-run tables (rich), with the targets next to the figures."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

# The targets shown next to the figures (the snapshot ones: scenarios.SNAPSHOT_TARGETS_MS).
CHURN_TARGETS = {"raw": ">= 0.8", "raw-netns": ">= 0.8", "bwrap": ">= 4", "crun": ">= 10"}
LATENCY_TARGETS = {"create": "p50 <= 1 (warm), <= 3 (cold); p99 <= 10",
                   "exec": "p50 <= 1.5", "ttfr": "p50 <= 3"}


def _f(x: Any, nd: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.{nd}f}"
    return f"{x:,}" if isinstance(x, int) else str(x)


def _get(d: Any, *path: str) -> Any:
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d


def _cpu(c: dict[str, float] | None) -> str:
    """CPU ms per op summed over the parties measured (daemon + client, or the process)."""
    if not c:
        return "-"
    user = sum(v for k, v in c.items() if k.endswith("_user"))
    sys_ = sum(v for k, v in c.items() if k.endswith("_sys"))
    return f"{user:.2f}+{sys_:.2f}"


def churn_table(sec: dict[str, Any]) -> Table:
    t = Table(title=f"churn: create -> exec true -> destroy  (N={sec['n']}, "
                    f"{sec['concurrency']} in flight, median of {len(sec['runs'])} runs)")
    if sec.get("batch"):
        t.caption = (f"corral-batch: create_many({sec['batch']}) -> exec_many -> kill_many, "
                     f"{sec.get('batches_in_flight')} batches in flight; its p50/p99 are per "
                     "batch")
    for c in ("system", "sandboxes/s", "p50 ms", "p99 ms", "CPU ms/op user+sys",
              "corral / system", "corral-batch / system", "target"):
        t.add_column(c, justify="left" if c in ("system", "target") else "right")
    med = sec["median"]
    matching = sec.get("matching") or {"corral": "raw-netns"}
    first = next(iter(matching))
    for name, m in med.items():
        if m.get("skipped"):
            t.add_row(name, "skipped", "", "", "", "", "", m["skipped"][:40])
            continue
        # a corral row: against the raw baseline doing its kernel work; others: first corral
        r = (sec["ratios"].get(f"{name}/{matching[name]}") if name in matching
             else sec["ratios"].get(f"{first}/{name}"))
        rb = sec["ratios"].get(f"corral-batch/{name}")  # the batch row (network none)
        target = (f"{CHURN_TARGETS['raw']} x {matching[name]}" if name in matching
                  else CHURN_TARGETS.get(name, ""))
        if name == "corral-batch":  # network none, like "corral": against raw-netns
            r = sec["ratios"].get("corral-batch/raw-netns")
            target = f"{CHURN_TARGETS['raw']} x raw-netns"
        t.add_row(name, _f(m.get("ops_per_s")), _f(_get(m, "total_ms", "p50"), 2),
                  _f(_get(m, "total_ms", "p99"), 2), _cpu(m.get("cpu_ms_per_op")),
                  _f(r, 3) if r else "", _f(rb, 3) if rb else "", target)
    for name, why in (sec.get("unavailable") or {}).items():
        t.add_row(name, "unavailable", "", "", "", "", why[:40])
    return t


def latency_table(sec: dict[str, Any]) -> Table:
    t = Table(title=f"latency: one client, no other load  (N={sec['n']}, ms, "
                    f"median of {len(sec['runs'])} runs)")
    for c in ("phase", "corral p50", "p90", "p99", "raw+netns p50", "raw p50", "target"):
        t.add_column(c, justify="left" if c in ("phase", "target") else "right")
    c, cc, rn, r = (sec["median"].get(k, {}) for k in ("corral", "corral-cold", "raw-netns",
                                                       "raw"))
    hit = (f"{c.get('pool_hit_ratio', 0) * 100:.0f}%" if c.get("pool_hit_ratio") is not None
           else "-")
    rows = ((f"create, warm pool ({hit} hits)", c, "create", "create"),
            ("create, cold (never pooled)", cc, "create", "create"),
            ("first exec", c, "first_exec", "exec"), ("exec round trip", c, "exec", "exec"),
            ("time to first result, warm", c, "ttfr", "ttfr"),
            ("time to first result, cold", cc, "ttfr", "ttfr"),
            ("destroy", c, "destroy", "destroy"))
    for label, src, ph, raw_ph in rows:
        cm = src.get(f"{ph}_ms", {})
        t.add_row(label, _f(cm.get("p50"), 2), _f(cm.get("p90"), 2), _f(cm.get("p99"), 2),
                  _f(_get(rn, f"{raw_ph}_ms", "p50"), 2), _f(_get(r, f"{raw_ph}_ms", "p50"), 2),
                  LATENCY_TARGETS.get(ph, ""))
    return t


def exec_table(sec: dict[str, Any]) -> Table:
    t = Table(title=f"exec `true` on one live sandbox  (N={sec['n']}, median of "
                    f"{len(sec['runs'])} runs)")
    for c in ("mode", "corral exec/s", "raw exec/s", "corral / raw", "corral p50 ms",
              "raw p50 ms"):
        t.add_column(c, justify="left" if c == "mode" else "right")
    m = sec["median"]
    for label, a, b in (("sequential (sync client)", "corral-seq", "raw-seq"),
                        (f"{sec['concurrency']} in flight (async client)", "corral-conc",
                         "raw-conc")):
        t.add_row(label, _f(_get(m, a, "ops_per_s")), _f(_get(m, b, "ops_per_s")),
                  _f(sec["ratios"].get(f"{a}/{b}"), 3), _f(_get(m, a, "exec_ms", "p50"), 2),
                  _f(_get(m, b, "exec_ms", "p50"), 2))
    return t


def density_table(sec: dict[str, Any]) -> Table:
    t = Table(title=f"density: {sec['n']:,} idle sandboxes alive  (median of "
                    f"{len(sec['runs'])} runs; KiB per sandbox)")
    for c in ("system", "alive", "memcg", "memcg -cache", "MemAvail", "slab", "init PSS KiB",
              "create/s 0", "create/s N", "N/0", "destroy/s", "after destroy: memcg, cg, pids"):
        t.add_column(c, justify="left" if c in ("system", "after destroy") else "right")
    for name, m in sec["median"].items():
        b = m.get("baseline", {})
        base = (f"{_f(b.get('memcg_delta_mib'))} MiB, {b.get('cgroups_left')}, "
                f"{b.get('processes_left')}" + (f" (+{b['pooled']} pooled)"
                                                 if b.get("pooled") else ""))
        alive = _f(m.get("made")) + (f" +{m['pooled_extra']} pooled"
                                     if m.get("pooled_extra") else "")
        t.add_row(name, alive, _f(m.get("memcg_kib_per_sandbox")),
                  _f(m.get("memcg_nocache_kib_per_sandbox")),
                  _f(m.get("kib_per_sandbox")), _f(m.get("slab_kib")), _f(m.get("init_pss_kib")),
                  _f(m.get("create_rate_empty")),
                  _f(m.get("create_rate_full")), _f(m.get("full/empty"), 2),
                  _f(m.get("destroy_per_s")), base)
    return t


def snapshot_table(sec: dict[str, Any]) -> Table:
    t = Table(title=f"snapshot / restore / fork through the SDK  ({sec['n']} cycles, "
                    f"{sec['fork_reps']} forks per run, ms, median of {len(sec['runs'])} runs)")
    for c in ("operation", "p50", "p90", "p99", "max", "target (p50)", "met"):
        t.add_column(c, justify="left" if c in ("operation", "target (p50)") else "right")
    m = _get(sec, "median", "corral") or {}
    labels = {"snapshot": f"snapshot, {sec['mb']} MB changed",
              "restore": f"restore in place ({sec['mb']} MB rolled back)",
              f"fork{sec['fork_n']}": f"fork of {sec['fork_n']} children (one call)"}
    for key, label in labels.items():
        s = m.get(f"{key}_ms", {})
        met = sec.get("met", {}).get(key)
        t.add_row(label, _f(s.get("p50"), 2), _f(s.get("p90"), 2), _f(s.get("p99"), 2),
                  _f(s.get("max"), 2), f"<= {sec['targets_ms'][key]:.0f}",
                  "-" if met is None else ("[green]yes[/green]" if met else "[red]NO[/red]"))
    return t


def trajlog_table(sec: dict[str, Any]) -> Table:
    m, rt = sec["median"], sec["ratios"]
    base = "baseline" in m
    t = Table(title=f"trajlog: exec `true`, trajectory log on vs off  (N={sec['n']} per daemon, "
                    f"blocks of {sec.get('block', '?')} interleaved ABBA, median of "
                    f"{len(sec['runs'])} runs)")
    cols = ["mode", "log on exec/s", "log off exec/s", "on/off", "target",
            "daemon CPU us/exec on", "off"]
    if base:
        cols[3:3] = ["baseline exec/s", "baseline/off", "on/baseline"]
        cols.append("baseline")
    for c in cols:
        t.add_column(c, justify="left" if c in ("mode", "target") else "right")
    for mode, label in (("seq", "sequential (sync client)"),
                        ("conc", f"{sec['concurrency']} in flight (async client)")):
        row = [label, _f(_get(m, "on", mode, "ops_per_s")), _f(_get(m, "off", mode, "ops_per_s"))]
        if base:
            row += [_f(_get(m, "baseline", mode, "ops_per_s")),
                    _f(rt.get(f"baseline/off {mode}"), 3), _f(rt.get(f"on/baseline {mode}"), 3)]
        row += [_f(rt.get(f"on/off {mode}"), 3), ">= 0.95"]
        row += [_f(_get(m, k, mode, "daemon_cpu_us_per_exec"), 0)
                for k in ("on", "off", "baseline") if k != "baseline" or base]
        t.add_row(*row)
    return t


def keyedreads_table(sec: dict[str, Any]) -> Table:
    t = Table(title=f"keyedreads: files calls with and without an idempotency key  (N={sec['n']} "
                    f"per op and variant, interleaved call by call ABBA, median of "
                    f"{len(sec['runs'])} runs)")
    for c in ("op", "keyed p50 us", "unkeyed p50 us", "ratio of p50s",
              "key's cost us (median pair)", "keyed/unkeyed (paired)", "target"):
        t.add_column(c, justify="left" if c in ("op", "target") else "right")
    for op, m in sec["median"].items():
        t.add_row(op, _f(m["keyed_p50_us"], 0), _f(m["unkeyed_p50_us"], 0),
                  _f(m["p50_ratio"], 3), _f(m["key_cost_us"], 1), _f(m["ratio"], 3), ">= 0.95")
    return t


def execpath_table(sec: dict[str, Any]) -> Table:
    m, rt = sec["median"], sec["ratios"]
    t = Table(title=f"execpath: commands started by the sandbox's init vs by the daemon "
                    f"(N={sec['n']} per daemon and mode, {sec['n_first']} first results; "
                    f"median of {len(sec['runs'])} runs)")
    for c in ("mode", "init ops/s", "daemon ops/s", "init/daemon", "init p50 ms",
              "daemon p50 ms", "init/daemon p50"):
        t.add_column(c, justify="left" if c == "mode" else "right")
    for mode, label in (("seq", "exec round trip (sync client)"),
                        ("conc", f"exec, {sec['concurrency']} in flight (async client)"),
                        ("first", "create -> exec (first result)")):
        t.add_row(label, _f(_get(m, "init", mode, "ops_per_s")),
                  _f(_get(m, "daemon", mode, "ops_per_s")), _f(rt.get(f"throughput {mode}"), 3),
                  _f(_get(m, "init", mode, "exec_ms", "p50"), 3),
                  _f(_get(m, "daemon", mode, "exec_ms", "p50"), 3), _f(rt.get(f"p50 {mode}"), 3))
    return t


def profile_table(scenario: str, prof: dict[str, Any]) -> Table:
    t = Table(title=f"corrald during corral's {scenario} (run 1): py-spy, "
                    f"{prof['samples']:,} samples, % of non-idle samples")
    t.add_column("self %", justify="right")
    t.add_column("frame (self, with line)")
    t.add_column("incl %", justify="right")
    t.add_column("corral function (inclusive)")
    for a, b in zip(prof["top_self"], prof["top_inclusive"], strict=False):
        t.add_row(_f(a["pct"]), a["function"], _f(b["pct"]), b["function"])
    return t


def runcode_table(sec: dict[str, Any]) -> Table:
    t = Table(title=f"run-code: run_code vs python3 -c in a fresh container sandbox vs a "
                    f"subprocess-per-request server  (N={sec['n']} per corral row, "
                    f"{sec['cpus']} CPUs, median of {len(sec['runs'])} runs)")
    t.caption = (f"-conc rows: {sec['concurrency']} calls in flight (asyncio client); "
                 "corral-batch: run_code_many of 100, p50 per batch; calls/s target: the "
                 "better of corral-conc and corral-batch")
    floor, run = sec.get("fork_floor"), sec.get("print_floor")
    if floor:
        t.caption += (f"; fork floor: a fork + exit of the zygote's interpreter, running "
                      f"nothing, costs {_f(floor['cpu_ms'], 3)} ms of CPU here, so no "
                      f"fork-per-request design exceeds {_f(floor['calls_per_s_cap'])} calls/s "
                      f"on {sec['cpus']} CPUs")
    if run:
        t.caption += (f"; print floor: the same child running print(1), without isolation "
                      f"or a daemon, {_f(run['cpu_ms'], 3)} ms ({_f(run['calls_per_s_cap'])} "
                      "calls/s)")
    for c in ("system", "code", "in flight", "calls/s", "p50 ms", "p99 ms"):
        t.add_column(c, justify="left" if c in ("system", "code") else "right")
    for name, m in sec["median"].items():
        ph = m.get("call_ms") or m.get("batch_ms") or {}
        code = "import numpy" if "numpy" in name else "print(1)"
        flight = m.get("in_flight") or m.get("batch")
        t.add_row(name, code, _f(int(flight) if flight else None), _f(m.get("ops_per_s")),
                  _f(ph.get("p50"), 3), _f(ph.get("p99"), 3))
    for k, v in (sec.get("targets") or {}).items():
        op = ">=" if k == "calls_per_s" else "<="
        # The figure judged, beside the verdict: for calls/s it is the median over the runs
        # of each run's better row, which the rows' own medians need not show.
        got = _f(v["got"], 2)
        if v.get("runs"):
            got += f"; runs {' / '.join(_f(x, 1) for x in v['runs'])}"
        t.add_row(f"target {k}", "", "", "", f"{op} {v['target']}",
                  f"[green]met ({got})[/green]" if v["met"] else f"[red]NOT met ({got})[/red]")
    return t


def gvisor_table(sec: dict[str, Any]) -> Table:
    t = Table(title=f"gvisor vs container vs `runsc do true`  (N={sec['n']}, ms, median of "
                    f"{len(sec['runs'])} runs; cold creates)"
                    + (f": skipped, {sec['skipped']}" if sec.get("skipped") else ""))
    for c in ("system", "create p50", "first exec p50", "exec round trip p50",
              "create+exec p50", "destroy p50", "churn /s"):
        t.add_column(c, justify="left" if c == "system" else "right")
    for name in ("container", "gvisor", "runsc-do"):
        m = sec["median"].get(name, {})
        t.add_row(name, *(_f(m.get(k), 1) for k in (
            "create_p50_ms", "first_exec_p50_ms", "exec_p50_ms", "ttfr_p50_ms",
            "destroy_p50_ms", "churn_per_s")))
    return t


def _cache_kib(d: dict[str, Any]) -> float | None:
    """Page cache charged per sandbox: near 0 when the image's files are cached once for
    all of them."""
    a, b = d.get("memcg_kib_per_sandbox"), d.get("memcg_nocache_kib_per_sandbox")
    return None if a is None or b is None else a - b


def images_table(sec: dict[str, Any]) -> Table:
    pulls = ", ".join(f"{k} {_f(v, 0)} ms" for k, v in (sec.get("pull_ms") or {}).items())
    t = Table(title=f"a pulled {sec.get('layers')}-layer OCI image (EROFS layers; "
                    f"image-dir: plain directories; image-40: 40 layers) vs the host image  "
                    f"(N={sec['n']}, ms, median of {len(sec['runs'])} runs; cold creates; "
                    f"pull: {pulls})"
                    + (f": skipped, {sec['skipped']}" if sec.get("skipped") else ""))
    for c in ("image", "create p50", "first exec p50", "create+exec p50", "destroy p50"):
        t.add_column(c, justify="left" if c == "image" else "right")
    for name in ("host", "image", "image-dir", "image-40"):
        m = sec["median"].get(name, {})
        t.add_row(name, *(_f(m.get(k), 2) for k in (
            "create_p50_ms", "first_exec_p50_ms", "ttfr_p50_ms", "destroy_p50_ms")))
    dens = sec.get("density") or {}
    big = sec.get("pull_big")
    if dens:
        t.caption = (t.caption or "") + "; ".join(
            f"{k}: {v.get('made')} live, {_f(v.get('kib_per_sandbox'), 0)} KiB/sandbox "
            f"(MemAvailable), {_f(v.get('memcg_nocache_kib_per_sandbox'), 0)} KiB memcg "
            f"w/o cache, {_f(_cache_kib(v), 0)} KiB page cache charged"
            for k, v in dens.items()) + ". "
    if big:
        t.caption = (t.caption or "") + ("pull of a {} MB, {}-layer image (ms, median): ".format(
            big["mb"], big["layers"]) + ", ".join(
            f"{k} {_f(v, 0)}" for k, v in big["median_ms"].items()) + "; " + ", ".join(
            f"{k} = {_f(v, 2)}" for k, v in big["ratios"].items())
            + f"; first command on a cold node (pull, create, exec) "
              f"{_f(big.get('first_command_cold_ms'), 0)} ms")
    return t


def network_table(sec: dict[str, Any]) -> Table:
    if sec.get("skipped"):
        return Table(title=f"network: skipped, {sec['skipped']}")
    m, rt = sec["median"], sec["ratios"]
    t = Table(title=f"network: a sandbox's data path vs a plain netns + veth routed and NATed "
                    f"alike (bulk {sec['mb']} MiB, {sec['n_rr']} connects + 64-byte echo, "
                    f"{sec['n_create']} creates per mode, churn {sec['n_churn']} with "
                    f"{sec['concurrency']} in flight; median of {len(sec['runs'])} runs)")
    for c in ("system", "bulk MB/s", "/plain", "connect+rr p50 us", "p90 us", "added us",
              "create p50 ms", "churn /s", "churn /raw", "raw"):
        t.add_column(c, justify="left" if c == "system" else "right")
    create_of = {"corral": "none", "corral-internet": "internet",
                 "corral-allowlist": "allowlist"}
    match = sec.get("matching") or {}
    for name in ("plain", "raw-netns", "raw-veth-internet", "raw-veth-allowlist", "corral",
                 "corral-internet", "corral-allowlist"):
        p = _get(m, "path", name) or {}
        ch = _get(m, "churn", name) or {}
        base = match.get(name)
        t.add_row(name, _f(p.get("bulk_mb_s")), _f(rt.get(f"{name}/plain bulk MB/s"), 3),
                  _f(_get(p, "connect_rr_us", "p50")), _f(_get(p, "connect_rr_us", "p90")),
                  _f(sec["added_us"].get(name)),
                  _f(_get(m, "create_ms", create_of.get(name, "-"), "p50"), 2),
                  _f(ch.get("ops_per_s")), _f(rt.get(f"churn {name}/{base}"), 3), base or "")
    cold = _get(m, "create_ms", "none-cold", "p50")
    t.caption = (f"/plain and added us: paired round by round (median of the rounds' MB/s "
                 f"ratios, of the rounds' p50 differences); create p50 none cold (never "
                 f"pooled) {_f(cold, 2)} ms; raw-veth: raw +netns plus a veth pair and the "
                 f"sandbox's nftables elements (corral's ruleset)")
    return t


def network_curve(sec: dict[str, Any]) -> Table:
    t = Table(title="network: the data path with N live networked sandboxes (half internet, "
                    "half an allowlist of their own); connect+rr p50 us / refused connect p50 "
                    "us / bulk MB/s")
    for c in ("live", "plain", "corral-internet", "corral-allowlist", "added us internet",
              "added us allowlist", "fill /s", "MemAvailable MiB"):
        t.add_column(c, justify="right")
    for p in sec.get("scale") or []:
        def cell(k: str, p: dict[str, Any] = p) -> str:
            return (f"{_f(_get(p, k, 'connect_rr_us', 'p50'))} / "
                    f"{_f(_get(p, k, 'deny_us', 'p50'))} / {_f(_get(p, k, 'bulk_mb_s'))}")

        avail = _get(p, "host", "MemAvailable")
        t.add_row(_f(p["live"]), cell("plain"), cell("corral-internet"),
                  cell("corral-allowlist"), _f(_get(p, "corral-internet", "added_us")),
                  _f(_get(p, "corral-allowlist", "added_us")), _f(p.get("fill_per_s")),
                  _f(avail / 1024 if avail is not None else None))
    lf = sec.get("scale_last_first") or {}
    notes = [f"{k}: rr {_f(v.get('connect_rr_p50'), 3)}, refused {_f(v.get('deny_p50'), 3)}, "
             f"bulk {_f(v.get('bulk'), 3)}" for k, v in lf.items()]
    cap = ("last/first: " + "; ".join(notes)) if notes else ""
    if sec.get("scale_per_sandbox"):
        cap += f"; per live sandbox: {sec['scale_per_sandbox']}"
    if sec.get("scale_stopped"):
        cap += f"; stopped: {sec['scale_stopped']}"
    t.caption = cap
    return t


def fleet_table(sec: dict[str, Any]) -> Table:
    c = sec["node_cost"]
    t = Table(title=f"fleet: the cluster gateway (its own process) in front of {sec['nodes']} "
                    f"simulated nodes (each: create {_f(c['create_ms'], 2)} ms, "
                    f"{_f(c['batch_per_s'])} creates/s, as this machine's corrald), filled to "
                    f"{sec['live']:,} live")
    for col in ("creates", "n", "creates/s", "gateway CPU ms/create", "less polling",
                "gateway cores", "nodes' cores", "p50 ms/call", "p99 ms/call", "errors"):
        t.add_column(col, justify="left" if col == "creates" else "right")
    for name in ("single", "batch_small", "batch"):
        r = sec[name]
        label = (f"single x{r.get('clients')}" if name == "single"
                 else f"batch {r.get('batch')} x{r.get('in_flight')}")
        t.add_row(label, _f(r["made"]), _f(r["creates_per_s"]),
                  _f(r["gateway_cpu_ms_per_create"], 4),
                  _f(r["gateway_cpu_ms_per_create_less_poll"], 4),
                  _f(r["gateway_cores_busy"], 2), _f(r.get("nodes_cores_busy"), 2),
                  _f(r["latency_ms"]["p50"], 1),
                  _f(r["latency_ms"]["p99"], 1), _f(r["errors"]))
    pl, idle, pr = sec["placement"], sec["idle"], sec["projection"]
    t.caption = (f"placement: {_f(pl['live_total'])} live on {pl['nodes']} nodes, max/min "
                 f"{_f(pl['max/min'], 3)} ({_f(pl['live_max'])}/{_f(pl['live_min'])}); "
                 f"polling: {_f(idle['poll_cpu_ms_per_node_per_s'], 4)} ms CPU per node per s, "
                 f"{_f(idle['rss_kib_per_node'], 1)} KiB RSS per node. One gateway core: "
                 + ", ".join(f"{k} {_f(v)}" for k, v in pr["creates_per_s_per_core"].items())
                 + f" creates/s; polling alone fills it at "
                 f"{_f(pr.get('nodes_whose_polling_fills_a_core'))} nodes; every node "
                 f"creating at {_f(pr['node_creates_per_s'])}/s fills it at "
                 + ", ".join(f"{k} {_f(v)}" for k, v in pr["nodes_at_gateway_bound"].items())
                 + f" nodes ({pr.get('bound_by')}); "
                 f"left: {sec['left']}")
    return t


TABLES = {"churn": churn_table, "latency": latency_table, "exec": exec_table,
          "density": density_table, "snapshot": snapshot_table, "trajlog": trajlog_table,
          "execpath": execpath_table, "keyedreads": keyedreads_table,
          "run-code": runcode_table, "gvisor": gvisor_table, "images": images_table,
          "network": network_table, "fleet": fleet_table}


def print_report(report: dict[str, Any], console: Console) -> None:
    for name, sec in report["scenarios"].items():
        if "error" in sec:
            console.print(f"[red]{name}: {sec['error']}[/red]")
            continue
        console.print(TABLES[name](sec))
        if sec.get("ratios"):
            console.print("  ratios (median of per-run ratios): " + ", ".join(
                f"{k} = {v}" for k, v in sec["ratios"].items()))
        if name == "network" and not sec.get("skipped"):
            console.print(network_curve(sec))
            console.print("  targets: " + "; ".join(
                f"{k}: {'met' if v else 'NOT met'}" for k, v in sec["met"].items())
                + f"; cleaned up: {sec['cleanup']['clean']}")
        if name == "snapshot" and any(sec.get("left", {}).values()):
            console.print(f"[red]  snapshot scenario left behind: {sec['left']}[/red]")
        if name == "execpath" and sec.get("paths"):
            console.print("  commands started (all runs): " + "; ".join(
                f"{k} daemon: {v['init']:,} by the init, {v['daemon']:,} by the daemon"
                for k, v in sec["paths"].items()))
        if name == "trajlog":
            rm = (sec.get("reads") or {}).get("median") or {}
            if rm:
                console.print("  files.read/s (sequential): " + ", ".join(
                    f"{k} {_f(_get(rm, k, 'ops_per_s'))}" for k in rm)
                    + "; target keyed/unkeyed >= 0.95")
            for k, st in (sec.get("log_stats") or {}).items():
                if st and "ingest_cpu_us_per_record" in st:
                    console.print(f"  log {k}: {st['records']:,} entries, journaled on the "
                                  f"loop ({st['journal_bytes_per_record']} bytes each), "
                                  f"ingested {st['records_per_commit']} per transaction at "
                                  f"{st['ingest_cpu_us_per_record']} us of the ingester's "
                                  f"CPU each, {st['checkpoints']} checkpoints")
            cpu = sec.get("log_cpu_us_per_exec") or {}
            if cpu:
                console.print("  the log's daemon CPU per exec (vs off, median of per-run "
                              "differences): " + ", ".join(f"{k} {v:+.0f} us"
                                                           for k, v in cpu.items()))
            console.print(f"  target {'met' if sec.get('met') else 'NOT met'}; daemons "
                          f"cleaned up: {sec.get('cleanup', {}).get('clean')}")
        systems = list(sec.get("matching") or {"corral": "raw-netns"})
        for c in systems:
            hit = _get(sec, "median", c, "pool_hit_ratio")
            if name == "churn" and hit is not None:
                console.print(f"  {c} creates served by a warm pool: {hit * 100:.0f}%")
            if name == "density":
                d = _get(sec, "median", c) or {}
                console.print(f"  corrald RSS with {_f(d.get('made'))} alive ({c}): "
                              f"{_f(d.get('daemon_rss_mib'))} MiB "
                              f"({_f(d.get('daemon_rss_kib_per_sandbox'), 2)} KiB per sandbox)")
    for scen in ("churn", "exec"):
        prof = _get(report, "scenarios", scen, "profile")
        if prof and prof.get("top_self"):
            console.print(profile_table(scen, prof))
    h = report.get("host", {})
    p0, p1 = h.get("cpu_pressure") or {}, h.get("cpu_pressure_at_end") or {}
    if p0 or p1:
        console.print(f"  CPU pressure (PSI some, avg60): {_f(p0.get('avg60'))}% before the run "
                      f"(other load on the machine), {_f(p1.get('avg60'))}% at its end (the "
                      f"bench's own load included); workdir on {h.get('workdir_fs')}")
    mc = h.get("memcg")
    if mc:
        console.print(f"  host memory cgroups: mkdir {_f(mc.get('mkdir_ms_p50'), 2)} ms and "
                      f"{_f(mc.get('kmalloc_1k_per_memcg'))} KiB of kmalloc-1k each, "
                      f"{_f(mc.get('dying'))} dying, SUnreclaim {_f(mc.get('sunreclaim_mib'))} "
                      "MiB (the host's history: docs/benchmarks.md, dying memory cgroups)")
    for n in report.get("notes", []):
        console.print(f"  note: {n}")
    c = report.get("cleanup", {})
    if c.get("clean"):
        console.print("[green]cleanup: nothing left behind (processes, cgroups, mounts, "
                      "dirs)[/green]")
    else:
        console.print(f"[red]cleanup: left behind: {c.get('leaks')}[/red]")
    for p in report.get("plots", []):
        console.print(f"  plot: {p}")
