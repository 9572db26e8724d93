"""``corral bench``: corral against the raw-syscall baseline and its peers.

The work is in ``corral.bench``; this is the command line. Runs as root (namespaces, cgroups)
against a private daemon it starts and stops itself.
"""

from __future__ import annotations

import typer

from corral.cli.output import err

app = typer.Typer()

_SCENARIOS = ("churn", "latency", "exec", "density", "snapshot", "trajlog", "execpath",
              "keyedreads", "run-code", "gvisor", "network")
# Run only when named (not in "all"): images starts a registry (docker-registry, skopeo).
# fleet: the cluster gateway against simulated nodes (minutes at its default size).
_ONLY_NAMED = ("images", "fleet")


def parse_scenarios(value: str) -> list[str]:
    """``all`` or a comma-separated list of churn, latency, exec, density, snapshot,
    trajlog, execpath, keyedreads, run-code, gvisor, network."""
    if value.strip() == "all":
        return list(_SCENARIOS)
    names = [s.strip() for s in value.split(",") if s.strip()]
    bad = [s for s in names if s not in _SCENARIOS and s not in _ONLY_NAMED]
    if bad or not names:
        raise typer.BadParameter(f"unknown scenario {', '.join(bad) or value!r}: use "
                                 f"{', '.join(_SCENARIOS)} or all")
    return names


def parse_networks(value: str) -> list[str]:
    """``none``, ``disabled`` or both, comma-separated (networked modes: bench/network_create.py,
    which needs an uplink of its own)."""
    NETWORK_MODES = ("none", "disabled")  # noqa: N806 - the modes with raw baselines

    names = list(dict.fromkeys(s.strip() for s in value.split(",") if s.strip()))
    bad = [s for s in names if s not in NETWORK_MODES]
    if bad or not names:
        raise typer.BadParameter(f"unknown network mode {', '.join(bad) or value!r}: use "
                                 f"{', '.join(NETWORK_MODES)} (comma-separated for several)")
    return names


@app.command()
def bench(
    scenario: str = typer.Argument("all", help="churn, latency, exec, density, snapshot, "
                                               "trajlog, execpath, keyedreads, run-code, "
                                               "gvisor, network, images and fleet (only "
                                               "when named), all, or a comma-separated "
                                               "list."),
    peers: bool = typer.Option(False, "--peers", help="Also run bwrap, crun and runc in the "
                                                      "churn (installed with apt-get if "
                                                      "missing)."),
    runs: int = typer.Option(3, "--runs", "-r", min=1, help="Repeat each scenario; the "
                                                            "report quotes medians."),
    count: int | None = typer.Option(None, "--count", "-n", min=1, help="Operations (or live "
                                     "sandboxes for density, snapshot/restore cycles for "
                                     "snapshot, execs per daemon and mode for trajlog and "
                                     "execpath, calls per row for run-code, the most live "
                                     "networked sandboxes of network's scale curve) per "
                                     "scenario. Default: churn 1000, latency 300, exec 1000, "
                                     "density 1000, snapshot 30, trajlog 1000, execpath 1000, "
                                     "keyedreads 1000 (per op and variant), run-code 500, "
                                     "network 3000."),
    concurrency: int = typer.Option(4, "--concurrency", "-c", min=1, max=64,
                                    help="Operations in flight (churn, async exec), the same "
                                         "for every system."),
    peer_count: int | None = typer.Option(None, "--peer-count", min=1,
                                          help="Operations per peer (default min(N, 300))."),
    batch: int = typer.Option(100, "--batch", min=1, max=10000,
                              help="density: sandboxes per create_many call."),
    churn_batch: int = typer.Option(32, "--churn-batch", min=0, max=10000,
                                    help="churn: sandboxes per batch in the corral-batch row "
                                         "(create_many -> exec_many -> kill_many); 0: no "
                                         "such row."),
    batches_in_flight: int = typer.Option(2, "--batches-in-flight", min=1, max=64,
                                          help="churn: batches in flight in the corral-batch "
                                               "row."),
    snapshot_mb: int = typer.Option(10, "--snapshot-mb", min=1, max=4096,
                                    help="snapshot: MB the sandbox changes before each "
                                         "snapshot."),
    fork: int = typer.Option(64, "--fork", min=1, max=1024,
                             help="snapshot: children per fork (one call)."),
    image_mb: int = typer.Option(100, "--image-mb", min=5, max=8192,
                                 help="images: MB of the image (5 layers of random bytes) "
                                      "whose pull is measured against skopeo copy + tar."),
    network: str = typer.Option("none", "--network",
                                help="churn, density: corral's network mode(s): none (own "
                                     "netns, vs raw+netns), disabled (shared netns, unix "
                                     "sockets only, vs raw --disabled), or none,disabled."),
    scale_to: int | None = typer.Option(None, "--scale-to", min=1, max=60000,
                                        help="network: the most live networked sandboxes "
                                             "of the scale curve (points 0, 100, 1000, "
                                             "3000, 10000 ... below it, and it); default "
                                             "--count."),
    scale_budget: float | None = typer.Option(
        None, "--scale-budget", min=1.0, help="network: seconds of filling for the scale "
                                               "curve, in all; past it the curve ends at "
                                               "the count reached (measured there)."),
    nodes: int = typer.Option(200, "--nodes", min=1, max=2000,
                              help="fleet: simulated nodes behind the real gateway."),
    live: int = typer.Option(400_000, "--live", min=10, max=10_000_000,
                             help="fleet: sandboxes the fleet holds at the end."),
    node_create_ms: float | None = typer.Option(
        None, "--node-create-ms", min=0.0, help="fleet: a simulated node's create latency "
                                                "(default: a real corrald's, measured)."),
    node_rate: float | None = typer.Option(
        None, "--node-rate", min=0.1, help="fleet: a simulated node's creates/s (default: a "
                                           "real corrald's batch throughput, measured)."),
    json_: bool = typer.Option(False, "--json", help="The report as JSON on stdout."),
    plots_dir: str = typer.Option("bench/out", "--plots-dir",
                                  help="Where the PNG plots and report.json go ('' for none)."),
    profile: bool = typer.Option(False, "--profile", help="Sample the daemon with py-spy "
                                                          "during corral's churn; report its "
                                                          "top functions."),
    workdir: str = typer.Option("/var/tmp", "--workdir",
                                help="Parent of the run's private state (daemon state dir, "
                                     "raw baseline dirs, peer bundles); its filesystem "
                                     "matters: ext4 vs tmpfs changes create/destroy cost."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Progress bars on "
                                                                        "stderr."),
    trajlog_baseline: str | None = typer.Option(
        None, "--trajlog-baseline", help="trajlog: also a log-on daemon running the corral "
                                         "package in this dir (the python/ dir of another "
                                         "checkout, with its _core module), in the same "
                                         "rotation."),
) -> None:
    """Benchmark corral against a raw-syscall baseline and (--peers) bwrap, crun, runc.

    Scenarios: churn (create -> exec true -> destroy), latency (one client), exec (one live
    sandbox), density (N idle sandboxes: memory, create rate vs live count), snapshot
    (snapshot with --snapshot-mb MB changed, restore in place, fork of --fork children, with
    their targets), trajlog (exec throughput with the trajectory log on vs off, two private
    daemons, with the overhead target), execpath (commands started by the sandbox's init vs
    by the daemon: exec round trip, throughput, first result; two private daemons),
    keyedreads (files.read/stat/list with and without an idempotency key, call by call),
    run-code (run_code vs python3 -c in a fresh container sandbox and vs a
    subprocess-per-request server: p50, calls/s, import numpy p50, with their targets),
    gvisor (the gvisor substrate vs the container substrate vs `runsc do true`: create, exec
    round trip, churn), network (a sandbox's bulk TCP transfer and connect latency against
    a plain netns + veth routed and NATed alike, create p50 and churn of network none,
    internet and an allowlist (churn against raw with a veth pair and the same nftables
    elements), and the connect latency with 0 .. --count live networked sandboxes, on the
    bench's own uplink namespace), images (only when named: create
    on a pulled 10-layer OCI image vs the host image, and the pull, from a docker-registry on
    loopback), fleet (only when named: the real cluster gateway in front of --nodes
    simulated nodes that cost what this machine's corrald costs, filled to --live
    sandboxes: creations/s, the gateway's CPU per creation, placement evenness, and where one
    gateway stops scaling). Every system
    runs in the same run; ratios are taken within a run, medians over --runs. Exits 1 if a
    scenario failed or anything was left behind."""
    from corral.bench.runner import run
    from corral.bench.session import Options

    opts = Options(scenarios=parse_scenarios(scenario), peers=peers, runs=runs, count=count,
                   concurrency=concurrency, peer_count=peer_count, batch=batch,
                   churn_batch=churn_batch, batches_in_flight=batches_in_flight,
                   plots_dir=plots_dir or None, profile=profile, workdir=workdir,
                   snapshot_mb=snapshot_mb, fork=fork, image_mb=image_mb, scale_to=scale_to,
                   scale_budget_s=scale_budget,
                   progress=progress,
                   trajlog_baseline=trajlog_baseline,
                   networks=parse_networks(network), fleet_nodes=nodes, fleet_live=live,
                   fleet_node_ms=node_create_ms, fleet_node_rate=node_rate)
    try:
        rep = run(opts, json_out=json_)
    except PermissionError as e:
        err.print(f"error: {e}")
        raise typer.Exit(1) from None
    failed = [k for k, v in rep["scenarios"].items() if "error" in v]
    if failed or not rep.get("cleanup", {}).get("clean"):
        raise typer.Exit(1)
