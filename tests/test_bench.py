"""``corral bench`` at tiny sizes: the report's structure and that nothing is left behind.

No timed assertion anywhere: these machines are noisy, the benchmark's numbers are for
docs/benchmarks.md, not for pass/fail.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess

import pytest
from typer.testing import CliRunner

from corral.bench import host
from corral.bench.runner import run
from corral.bench.session import Options
from corral.cli.bench import parse_networks, parse_scenarios
from corral.cli.main import app

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("cc") is None,
    reason="the benchmark needs root and a C compiler (the raw baseline is built at run time)")

N = 20


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """One tiny run of every scenario (no peers), in process."""
    plots = tmp_path_factory.mktemp("bench-out")
    rep = run(Options(runs=1, count=N, concurrency=2, batch=5, churn_batch=8, plots_dir=str(plots),
                      snapshot_mb=1, fork=4, progress=False))
    rep["_plots_dir"] = str(plots)
    return rep


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def test_everything_cleaned_up(report):
    assert report["cleanup"]["clean"], report["cleanup"]
    prefix = f"corral-bench-run{os.getpid()}-"
    assert host.cgroup_tops(prefix) == []
    assert host.cgroup_pids(prefix) == set()
    assert not os.path.exists(report["state_root"])  # daemon state, raw dirs: all removed


def test_report_header(report):
    for key in ("version", "command", "host", "options", "scenarios", "cleanup", "duration_s"):
        assert key in report
    assert report["host"]["cpus"] >= 1
    assert set(report["scenarios"]) == {"churn", "latency", "exec", "density", "snapshot",
                                        "trajlog", "execpath", "keyedreads", "run-code",
                                        "gvisor", "network"}
    for name, sec in report["scenarios"].items():
        assert "error" not in sec, (name, sec)
        if sec.get("skipped"):  # gvisor on a host where runsc cannot run
            continue
        assert len(sec["runs"]) == 1


def test_churn_section(report):
    sec = report["scenarios"]["churn"]
    assert sec["n"] == N
    for system in ("corral", "raw", "raw-netns"):
        m = sec["median"][system]
        assert m["n"] == N and m["errors"] == 0
        assert _is_num(m["ops_per_s"]) and m["ops_per_s"] > 0
        for phase in ("create", "exec", "destroy", "total"):
            s = m[f"{phase}_ms"]
            assert s["n"] == N
            assert s["p50"] <= s["p90"] <= s["p99"] <= s["max"]
    assert set(sec["ratios"]) == {"corral/raw", "corral/raw-netns", "corral-batch/raw",
                                  "corral-batch/raw-netns"}
    assert all(_is_num(v) and v > 0 for v in sec["ratios"].values())
    # The batched row: the same N sandboxes in batches of 8 (8, 8, 4): phases are per batch.
    b = sec["median"]["corral-batch"]
    assert b["n"] == N and b["errors"] == 0 and b["batch"] == 8 and _is_num(b["ops_per_s"])
    assert b["total_ms"]["n"] == 3
    assert sec["batch"] == 8


def test_latency_section(report):
    m = report["scenarios"]["latency"]["median"]
    for phase in ("create", "first_exec", "ttfr", "destroy"):
        assert m["corral"][f"{phase}_ms"]["n"] == N
        assert m["corral-cold"][f"{phase}_ms"]["n"] == N
    assert m["corral"]["exec_ms"]["n"] == N
    assert m["corral-cold"]["pool_hit_ratio"] in (None, 0)  # cold means never from a pool
    for phase in ("create", "exec", "ttfr", "destroy"):
        assert m["raw-netns"][f"{phase}_ms"]["n"] == N


def test_exec_section(report):
    sec = report["scenarios"]["exec"]
    for system in ("corral-seq", "corral-conc", "raw-seq", "raw-conc"):
        assert sec["median"][system]["errors"] == 0
        assert sec["median"][system]["exec_ms"]["n"] == N
    assert set(sec["ratios"]) == {"corral-seq/raw-seq", "corral-conc/raw-conc"}


def test_density_section(report):
    sec = report["scenarios"]["density"]
    for system in ("corral", "raw-netns", "raw"):
        m = sec["median"][system]
        assert m["made"] == N
        for key in ("memcg_kib_per_sandbox", "memcg_nocache_kib_per_sandbox", "kib_per_sandbox",
                    "slab_kib", "create_rate_empty", "create_rate_full"):
            assert _is_num(m[key]), (system, key)
        # Destroyed everything: no cgroup, no process of that system is left.
        assert m["baseline"]["cgroups_left"] == 0
        assert m["baseline"]["processes_left"] == 0
    assert _is_num(sec["median"]["corral"]["daemon_rss_mib"])


def test_snapshot_section(report):
    """Snapshot / restore / fork latencies with their targets; everything it made is gone."""
    sec = report["scenarios"]["snapshot"]
    assert (sec["n"], sec["mb"], sec["fork_n"]) == (N, 1, 4)
    m = sec["median"]["corral"]
    assert m["errors"] == 0
    for key, n in (("snapshot", N), ("restore", N), ("fork4", sec["fork_reps"])):
        s = m[f"{key}_ms"]
        assert s["n"] == n
        assert 0 < s["p50"] <= s["p90"] <= s["p99"] <= s["max"]
        assert sec["targets_ms"][key] > 0 and isinstance(sec["met"][key], bool)
    assert sec["left"] == {"snapshots": 0, "layers": 0}
    assert "snapshot_records" not in report["cleanup"]["leaks"]
    assert "layers" not in report["cleanup"]["leaks"]


def test_keyedreads_section(report):
    """read, stat and list with and without a key: every call answered, both medians, their
    ratio and the paired cost in the section."""
    sec = report["scenarios"]["keyedreads"]
    assert sec["n"] == N and sec["target"] == "keyed/unkeyed >= 0.95"
    assert set(sec["median"]) == {"read", "stat", "list"} and isinstance(sec["met"], bool)
    for op, m in sec["median"].items():
        assert m["errors"] == 0, sec["runs"]
        assert m["keyed_p50_us"] > 0 and m["unkeyed_p50_us"] > 0 and m["ratio"] > 0
        assert _is_num(m["key_cost_us"])
        assert sec["ratios"][f"{op} keyed/unkeyed"] == m["ratio"]


def test_trajlog_section(report):
    """Log on vs off: both daemons measured in both modes, the ratios and the target in the
    section, the log's own counters, and both daemons gone without a trace."""
    sec = report["scenarios"]["trajlog"]
    assert sec["n"] == N and sec["target"] == "on/off >= 0.95"
    for daemon in ("on", "off"):
        for mode in ("seq", "conc"):
            m = sec["median"][daemon][mode]
            assert m["n"] == N and m["errors"] == 0  # N per daemon per run, interleaved
            assert _is_num(m["ops_per_s"]) and m["ops_per_s"] > 0
    assert set(sec["ratios"]) == {"on/off seq", "on/off conc", "reads keyed/unkeyed",
                                  "reads unkeyed/off", "reads keyed/off"}
    for variant in ("keyed", "unkeyed", "off"):  # files.read with and without keys
        m = sec["reads"]["median"][variant]
        assert m["n"] == N and m["errors"] == 0 and m["ops_per_s"] > 0
    assert isinstance(sec["reads_met"], bool)
    assert sec["block"] > 0 and set(sec["log_cpu_us_per_exec"]) == {"on seq", "on conc"}
    assert isinstance(sec["met"], bool)
    st = sec["log_stats"]["on"]
    assert st["records"] >= 2 * N and st["records_per_commit"] >= 1
    assert st["ingest_cpu_us_per_record"] > 0 and st["journal_bytes_per_record"] > 100
    assert sec["cleanup"] == {"clean": True, "leaks": {}}
    assert not any(os.path.exists(report["state_root"] + f"/trajlog-{k}") for k in ("on", "off"))


def test_execpath_section(report):
    """The init's exec path vs the daemon's: both daemons measured in every mode, with the
    ratios, and both gone without a trace."""
    sec = report["scenarios"]["execpath"]
    assert sec["n"] == N and sec["n_first"] == 10
    for daemon in ("init", "daemon"):
        for mode in ("seq", "conc", "first"):
            m = sec["median"][daemon][mode]
            assert m["n"] == (10 if mode == "first" else N) and m["errors"] == 0
            assert _is_num(m["ops_per_s"]) and m["ops_per_s"] > 0
            assert _is_num(m["exec_ms"]["p50"]) and m["exec_ms"]["p50"] > 0
    assert set(sec["ratios"]) == {f"{k} {m}" for k in ("throughput", "p50")
                                  for m in ("seq", "conc", "first")}
    # Each daemon's commands took the path it stands for (network "none": the init's path).
    assert sec["paths"]["init"]["init"] >= 2 * N + 10 and sec["paths"]["init"]["daemon"] == 0
    assert sec["paths"]["daemon"]["init"] == 0 and sec["paths"]["daemon"]["daemon"] >= 2 * N
    assert sec["cleanup"] == {"clean": True, "leaks": {}}
    assert not any(os.path.exists(report["state_root"] + f"/execpath-{k}")
                   for k in ("init", "daemon"))


def test_runcode_section(report):
    """run_code against a container sandbox and a subprocess server, same run, with targets."""
    sec = report["scenarios"]["run-code"]
    m = sec["median"]
    for name in ("corral", "corral-numpy", "corral-conc", "corral-batch", "server",
                 "server-numpy", "server-conc", "container", "container-conc"):
        assert m[name]["errors"] == 0, (name, m[name])
        assert _is_num(m[name]["ops_per_s"]) and m[name]["ops_per_s"] > 0
    assert m["corral"]["call_ms"]["p50"] < m["container"]["call_ms"]["p50"]
    assert m["corral-numpy"]["call_ms"]["p50"] < m["server-numpy"]["call_ms"]["p50"]
    assert set(sec["targets"]) == {"print_p50_ms", "calls_per_s", "numpy_p50_ms"}
    assert all(isinstance(v["met"], bool) for v in sec["targets"].values())
    # The calls/s judged is the median of each run's better row, and says so.
    rate = sec["targets"]["calls_per_s"]
    best = [max(r["corral-conc"]["ops_per_s"], r["corral-batch"]["ops_per_s"])
            for r in sec["runs"]]
    assert rate["runs"] == [round(x, 1) for x in best]
    assert rate["got"] == statistics.median(best)
    for f in ("fork_floor", "print_floor"):  # CPU per call of the bare fork-per-request floors
        assert _is_num(sec[f]["cpu_ms"]) and sec[f]["cpu_ms"] > 0, sec[f]


def test_network_section(report):
    """The network scenario: the data path of internet and allowlist sandboxes against the
    plain netns, create p50 per mode, churn, the scale curve up to N live networked
    sandboxes; its uplink, plain netns, daemon table and links all gone."""
    sec = report["scenarios"]["network"]
    if sec.get("skipped"):
        pytest.skip(sec["skipped"])
    assert sec["n_fill"] == N and sec["points"] == [0, 6, 20]
    systems = ("plain", "corral-internet", "corral-allowlist")
    run0 = sec["runs"][0]
    for name in systems:
        p = run0["path"][name]
        assert len(p["bulk_mb_s_all"]) == 10 and all(x > 0 for x in p["bulk_mb_s_all"])
        rr = p["connect_rr_us"]
        assert rr["n"] == N and 0 < rr["p50"] <= rr["p90"] <= rr["max"]
        deny = p["deny_us"]  # refused connects: every one ECONNREFUSED, else the client fails
        assert deny["n"] == N and 0 < deny["p50"] <= deny["max"]
    for mode in ("none", "none-cold", "internet", "allowlist"):
        assert run0["create_ms"][mode]["n"] == N
    for name in ("raw-netns", "raw-veth-internet", "raw-veth-allowlist", "corral",
                 "corral-internet", "corral-allowlist"):
        assert run0["churn"][name]["n"] == N and run0["churn"][name]["errors"] == 0
        if name.startswith("corral"):  # two halves around its raw baseline's run
            assert run0["churn"][name]["blocks"] == 2
    for c in systems[1:]:
        assert _is_num(sec["ratios"][f"{c}/plain bulk MB/s"])
        assert _is_num(sec["added_us"][c]) and _is_num(sec["scale_growth_us"][c])
        assert _is_num(sec["ratios"][f"churn {c}/raw-veth-{c.split('-')[1]}"])
    assert _is_num(sec["ratios"]["create allowlist/none p50"])
    assert [p["live"] for p in sec["scale"]] == [0, 6, 20]
    for p in sec["scale"]:
        for name in systems:
            assert p[name]["connect_rr_us"]["n"] > 0 and p[name]["bulk_mb_s"] > 0
            assert p[name]["deny_us"]["n"] > 0
            if name != "plain":  # paired round by round against plain
                assert _is_num(p[name]["added_us"]) and p[name]["bulk_vs_plain"] > 0
        assert p["host"]["links"] > 0 and _is_num(p["host"]["MemAvailable"])
    assert sec["scale_stopped"] is None
    for name in systems:  # the curve's last point over its first
        assert set(sec["scale_last_first"][name]) == {"connect_rr_p50", "deny_p50", "bulk"}
        assert all(_is_num(v) and v > 0 for v in sec["scale_last_first"][name].values())
    assert sec["scale_per_sandbox"]["links"] > 0  # each filler's host end, at least
    assert all(isinstance(v, bool) for v in sec["met"].values()) and len(sec["met"]) == 6
    assert sec["matching"]["corral-internet"] == "raw-veth-internet"
    assert sec["cleanup"] == {"clean": True, "leaks": {}}
    # Nothing of it is left on the host: no namespace, link or table of the bench's.
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
    made = sec["made"]
    assert not set(made["netns"]) & set(ns.split())
    names = [ln.split(":")[1].strip().split("@")[0] for ln in links.splitlines()]
    assert not set(made["links"]) & set(names)
    for pre in made["link_prefixes"]:  # the daemon's and raw --veth's sandboxes' links
        assert not [n for n in names if n.startswith(pre) and n[len(pre):].isdigit()]
    assert not set(made["nft_tables"]) & {ln.split()[-1] for ln in tables.splitlines() if ln}


def test_network_scale_points():
    """The scale curve's points: 0, the fixed steps below --scale-to, and --scale-to."""
    from corral.bench.network import _points

    assert _points(10000) == [0, 100, 1000, 3000, 10000]
    assert _points(3000) == [0, 100, 1000, 3000]
    assert _points(5000) == [0, 100, 1000, 3000, 5000]
    assert _points(20) == [0, 6, 20]


def test_trajlog_table_renders():
    """The table, with and without a baseline tree (no daemon needed)."""
    import io

    from rich.console import Console

    from corral.bench.report import print_report

    fig = {"ops_per_s": 500.0}
    sec = {"n": 10, "concurrency": 2, "runs": [{}], "median": {
        k: {"seq": fig, "conc": fig} for k in ("on", "off", "baseline")},
        "ratios": {"on/off seq": 0.97, "on/off conc": 0.96, "baseline/off seq": 0.9,
                   "baseline/off conc": 0.8, "on/baseline seq": 1.1, "on/baseline conc": 1.2},
        "log_stats": {"on": {"records": 40, "records_per_commit": 12.5,
                             "ingest_cpu_us_per_record": 15.2, "journal_bytes_per_record": 560,
                             "checkpoints": 0}, "baseline": {}},
        "met": True, "cleanup": {"clean": True, "leaks": {}}}
    out = io.StringIO()
    print_report({"scenarios": {"trajlog": sec}, "cleanup": {"clean": True}},
                 Console(file=out, width=200))
    text = out.getvalue()
    for s in ("log on exec/s", "baseline/off", "0.970", ">= 0.95", "12.5 per transaction",
              "target met"):
        assert s in text, s


def test_plots_and_json_written(report):
    out = report["_plots_dir"]
    assert {os.path.basename(p) for p in report["plots"]} == {
        "latency_cdf.png", "churn_latency_cdf.png", "churn_rates.png", "density_rate.png",
        "snapshot_cdf.png", "network_scale.png"}
    for p in report["plots"]:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(os.path.join(out, "report.json")) as f:
        assert json.load(f)["scenarios"]["churn"]["n"] == N


def test_cli_json(tmp_path):
    """`corral bench churn --json`: the report on stdout, exit 0, nothing left behind."""
    r = CliRunner().invoke(app, ["bench", "churn", "--count", "8", "--runs", "1",
                                 "--concurrency", "2", "--json", "--no-progress",
                                 "--plots-dir", str(tmp_path)])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert list(rep["scenarios"]) == ["churn"]
    assert rep["scenarios"]["churn"]["median"]["corral"]["n"] == 8
    assert rep["cleanup"]["clean"]


def test_parse_scenarios():
    assert parse_scenarios("all") == ["churn", "latency", "exec", "density", "snapshot",
                                      "trajlog", "execpath", "keyedreads", "run-code",
                                      "gvisor", "network"]
    assert parse_scenarios("network") == ["network"]
    assert parse_scenarios("fleet") == ["fleet"]  # only when named: not in "all"
    assert parse_scenarios("run-code") == ["run-code"]
    assert parse_scenarios("snapshot") == ["snapshot"]
    assert parse_scenarios("trajlog") == ["trajlog"]
    assert parse_scenarios("exec, churn") == ["exec", "churn"]
    with pytest.raises(Exception, match="unknown scenario"):
        parse_scenarios("nope")


def test_network_modes_churn_and_density(tmp_path):
    """`--network none,disabled`: both of corral's modes, each against its matching raw
    baseline (own netns -> raw-netns, shared netns -> raw), nothing left behind."""
    r = CliRunner().invoke(app, ["bench", "churn,density", "--count", "6", "--runs", "1",
                                 "--concurrency", "2", "--batch", "3", "--json",
                                 "--no-progress", "--network", "none,disabled",
                                 "--plots-dir", str(tmp_path)])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert "--network none,disabled" in rep["command"]
    for name in ("churn", "density"):
        sec = rep["scenarios"][name]
        assert sec["matching"] == {"corral": "raw-netns", "corral-disabled": "raw-disabled"}
        assert sec["median"]["raw-disabled"].get("errors", 0) == 0
        assert sec["median"]["corral-disabled"].get("errors", 0) == 0
    assert "corral-disabled/raw-disabled" in rep["scenarios"]["churn"]["ratios"]
    dens = rep["scenarios"]["density"]
    assert dens["median"]["corral-disabled"]["made"] == 6
    assert dens["median"]["corral-disabled"]["baseline"]["cgroups_left"] == 0
    assert dens["median"]["raw-disabled"]["made"] == 6
    assert "corral-disabled/raw-disabled memory (memcg)" in dens["ratios"]
    assert rep["cleanup"]["clean"]
    with pytest.raises(Exception, match="unknown network mode"):
        parse_networks("host")


def test_gvisor_section(report):
    """The gvisor scenario: container, gvisor and `runsc do true` measured in the same run."""
    sec = report["scenarios"]["gvisor"]
    if sec.get("skipped"):
        pytest.skip(sec["skipped"])
    assert sec["n"] == N
    for system in ("container", "gvisor"):
        m = sec["median"][system]
        for k in ("create_p50_ms", "first_exec_p50_ms", "exec_p50_ms", "destroy_p50_ms",
                  "churn_per_s"):
            assert _is_num(m[k]) and m[k] > 0, (system, k, m)
    assert _is_num(sec["median"]["runsc-do"]["ttfr_p50_ms"])
    run0 = sec["runs"][0]
    assert run0["gvisor"]["errors"] == 0 and run0["container"]["errors"] == 0
    assert sec["ratios"]["gvisor/container create"] > 1  # a sentry boots: never cheaper


def test_fleet_cli(tmp_path):
    """`corral bench fleet --nodes 5 --live 500`: the real gateway in its own process in front
    of 5 simulated nodes, filled to 500 live through single creates and batches; the report's
    figures, and the gateway, the node agents and all their ports gone after."""
    r = CliRunner().invoke(app, ["bench", "fleet", "--nodes", "5", "--live", "500", "--runs",
                                 "1", "--json", "--no-progress", "--plots-dir", str(tmp_path)])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert "--nodes 5 --live 500" in rep["command"]
    sec = rep["scenarios"]["fleet"]
    assert sec["nodes"] == 5 and sec["live"] == 500
    cost = sec["node_cost"]  # measured on the session's real corrald
    assert _is_num(cost["create_ms"]) and cost["create_ms"] > 0 and cost["batch_per_s"] > 0
    assert cost["info_bytes"] > 100
    made = 0
    for name in ("single", "batch_small", "batch"):
        ph = sec[name]
        assert ph["errors"] == 0, ph["first_error"]
        made += ph["made"]
        assert _is_num(ph["creates_per_s"]) and ph["creates_per_s"] > 0
        # CPU in clock ticks (10 ms): a phase of 90 creates may take less than one
        for k in ("gateway_cpu_ms_per_create", "gateway_cores_busy", "nodes_cores_busy"):
            assert _is_num(ph[k]) and ph[k] >= 0, (name, k, ph)
        lat = ph["latency_ms"]
        assert 0 < lat["p50"] <= lat["p99"] <= lat["max"]
    assert sec["single"]["made"] > 0 and sec["batch"]["made"] > 0
    assert made == 500
    pl = sec["placement"]
    assert pl["nodes"] == 5 and pl["live_total"] == 500
    assert pl["live_min"] > 0 and pl["max/min"] >= 1
    assert _is_num(sec["idle"]["poll_cpu_ms_per_node_per_s"])
    pr = sec["projection"]
    assert set(pr["creates_per_s_per_core"]) == {"single", "batch_1000", "batch_10000"}
    assert all(v is None or (_is_num(v) and v > 0)
               for v in pr["nodes_at_gateway_bound"].values())
    assert pr["bound_by"].startswith("cpu")
    # Nothing left: the two processes and every port they listened on.
    assert sec["left"] == {"processes": 0, "listening_ports": 0}
    assert len(sec["pids"]) == 2 and len(sec["ports"]) == 6
    for pid in sec["pids"]:
        assert not os.path.exists(f"/proc/{pid}")
    for port in sec["ports"]:
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0
    assert rep["cleanup"]["clean"]
