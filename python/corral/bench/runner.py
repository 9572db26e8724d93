"""Run a benchmark from start to finish: set up, run the scenarios, tear down (always), check
for leaks, then the table, the JSON and the plots."""

from __future__ import annotations

import json
import shlex
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console

from corral.bench import host, plots, report, scenarios
from corral.bench.session import Options, Session
from corral.bench.ui import UI


def run(opts: Options, json_out: bool = False) -> dict[str, Any]:
    ui = UI(enabled=opts.progress)
    started = time.time()
    rep: dict[str, Any] = {
        "version": 1,
        "command": _command(opts),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "git": host.git_rev(Path(__file__).resolve().parent),  # None when not a checkout
        "host": {**host.host_info(), "workdir_fs": host.fs_type(opts.workdir)},
        "options": {k: v for k, v in vars(opts).items() if k != "progress"},
        "scenarios": {},
    }
    samples: dict[str, Any] = {}
    session = Session(opts, ui)
    rep["state_root"] = str(session.root)
    rep["host"]["memcg"] = host.memcg_health(session.prefix + "probe")
    with ui, _sigterm_unwinds():
        try:
            session.setup()
            rep["peers"] = session.peer_versions or None
            for name in opts.scenarios:
                try:
                    rep["scenarios"][name], samples[name] = _run_one(session, name)
                except Exception as e:  # noqa: BLE001 - report it, keep the other scenarios
                    rep["scenarios"][name] = {"error": f"{type(e).__name__}: {e}"}
                    ui.note(f"{name} failed: {e}")
        finally:
            with ui.task("cleanup", None):
                rep["cleanup"] = session.teardown()
    rep["notes"] = session.notes + [
        f"{k}: {v}" for k, v in (session.peers.notes.items() if session.peers else ())]
    rep["duration_s"] = round(time.time() - started, 1)
    rep["host"]["cpu_pressure_at_end"] = host.cpu_pressure()
    if opts.plots_dir:
        out = Path(opts.plots_dir)
        try:
            rep["plots"] = plots.make_all(rep, samples, out)
        except ImportError as e:
            rep["notes"].append(f"no plots: {e} (pip install matplotlib)")
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps(rep, indent=1) + "\n")
    if json_out:
        print(json.dumps(rep, indent=1))
    else:
        # Wide enough for the tables when stdout is a pipe or a file (rich assumes 80).
        console = Console()
        if not console.is_terminal:
            console = Console(width=160)
        report.print_report(rep, console)
    return rep


def _command(opts: Options) -> str:
    """The command line that reproduces this run (built from the options, so it is the same
    whether the run came from `corral bench`, `python -m corral.bench` or a test)."""
    d = Options()
    a = [",".join(opts.scenarios) if opts.scenarios != d.scenarios else "all"]
    a += ["--peers"] if opts.peers else []
    a += ["--runs", str(opts.runs)]
    for flag, v, default in (("--count", opts.count, d.count),
                             ("--concurrency", opts.concurrency, d.concurrency),
                             ("--peer-count", opts.peer_count, d.peer_count),
                             ("--batch", opts.batch, d.batch),
                             ("--churn-batch", opts.churn_batch, d.churn_batch),
                             ("--batches-in-flight", opts.batches_in_flight,
                              d.batches_in_flight),
                             ("--snapshot-mb", opts.snapshot_mb, d.snapshot_mb),
                             ("--fork", opts.fork, d.fork),
                             ("--workdir", opts.workdir, d.workdir),
                             ("--nodes", opts.fleet_nodes, d.fleet_nodes),
                             ("--live", opts.fleet_live, d.fleet_live),
                             ("--node-create-ms", opts.fleet_node_ms, d.fleet_node_ms),
                             ("--node-rate", opts.fleet_node_rate, d.fleet_node_rate)):
        if v != default:
            a += [flag, str(v)]
    if opts.networks != d.networks:
        a += ["--network", ",".join(opts.networks)]
    a += ["--profile"] if opts.profile else []
    a += ["--trajlog-baseline", opts.trajlog_baseline] if opts.trajlog_baseline else []
    return "corral bench " + shlex.join(a)


@contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C while the session runs, so its teardown still cleans up."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _run_one(session: Session, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    return scenarios.RUNNERS[name](session)
