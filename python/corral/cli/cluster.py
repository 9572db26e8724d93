"""``corral cluster start | status | autoscale | stop``: corral on a Ray cluster
(docs/cluster.md)."""

from __future__ import annotations

from typing import Any

import typer
from rich.table import Table

from corral.cli.output import handled, out, print_json
from corral.cluster import DEFAULT_RUN_DIR, DEFAULT_STATE_ROOT

app = typer.Typer(help="corral on a Ray cluster: start, status, autoscale, stop.",
                  no_args_is_help=True)

ADDRESS = typer.Option("auto", "--address", help="The Ray cluster: auto (the one this machine "
                       "belongs to) or HOST:PORT of its head.")
JSON = typer.Option(False, "--json", help="Machine-readable JSON on stdout.")


def _show(st: dict[str, Any], json_: bool) -> None:
    if json_:
        print_json(st)
        return
    out.print(f"gateway {st['gateway']} (cluster {st['cluster']}, power-of-{st['k']} "
              f"placement, {st['placed']} placed)")
    out.print(f"{st['live']} live of {st['capacity']}; {st['creates_per_s']:.1f} creates/s, "
              f"{st['ends_per_s']:.1f} ends/s (the last {st['rate_window_s']:.0f} s)")
    t = Table("node", "endpoint", "live", "capacity", "creates/s", "ends/s", "free memory",
              "CPU", "images", "labels", "report age")
    for n in st["nodes"]:
        t.add_row(n["node"][:16], n["endpoint"], str(n["live"]), str(n["capacity"]),
                  f"{n['creates_per_s']:.1f}", f"{n['ends_per_s']:.1f}",
                  f"{n['mem_free_mb']} MiB", f"{n['cpu_busy']:.0%}", str(len(n["images"])),
                  ",".join(f"{k}={v}" for k, v in n["labels"].items()),
                  f"{n['report_age_s']:.1f} s")
    out.print(t)
    for node, why in st["lost"].items():
        out.print(f"lost: {node[:16]} ({why})")
    for node in st["drained"]:
        out.print(f"drained: {node[:16]}")
    if a := st.get("autoscale"):
        out.print(f"autoscale: {a['min_nodes']}..{a['max_nodes']} nodes of {a['node_shape']}, "
                  f"asked Ray for {a['asked_nodes']}, {a['unmet_creates']} creates refused "
                  f"in the last {a['demand_window_s']:.0f} s")


@app.command()
@handled()
def start(address: str = ADDRESS,
          name: str = typer.Option("corral", help="Keeps this cluster's node state, sockets "
                                   "and cgroups apart from another's on the same machines."),
          k: int = typer.Option(2, help="Nodes sampled per placement (power-of-k choices)."),
          max_sandboxes: int = typer.Option(0, help="Admission limit per node; 0: derived "
                                            "from each machine."),
          state_root: str = typer.Option(DEFAULT_STATE_ROOT, help="Where each "
                                         "machine keeps its nodes' state (a local path)."),
          run_dir: str = typer.Option(DEFAULT_RUN_DIR, help="Where each machine keeps "
                                      "its nodes' sockets (a local path)."),
          tokens_file: str = typer.Option("", help="The tenants' tokens file, at this path "
                                          "on every machine (docs/daemon.md, Tenants)."),
          gateway_port: int = typer.Option(0, help="The gateway's TCP port; 0: a free one."),
          json_: bool = JSON) -> None:
    """Deploy a supervisor (and its corrald) on every Ray node, and the gateway."""
    import corral.cluster

    _show(corral.cluster.start(address, name=name, k=k, max_sandboxes=max_sandboxes,
                               state_root=state_root, run_dir=run_dir,
                               tokens_file=tokens_file, gateway_port=gateway_port), json_)


@app.command()
@handled()
def status(address: str = ADDRESS, json_: bool = JSON) -> None:
    """Nodes, live sandboxes, capacity, creates and ends per second, free memory, CPU."""
    import corral.cluster

    _show(corral.cluster.status(address), json_)


@app.command()
@handled()
def autoscale(address: str = ADDRESS,
              node_shape: str = typer.Option("", help="What one node that holds sandboxes "
                                             "offers Ray, RESOURCE=N[,RESOURCE=N] (e.g. "
                                             "CPU=16): the bundle asked for per node wanted."),
              min_nodes: int = typer.Option(1, help="Never drain below this many nodes."),
              max_nodes: int = typer.Option(100, help="Never ask for more nodes than this."),
              idle_s: float = typer.Option(300.0, help="Drain a node with no sandbox this "
                                           "long."),
              demand_window_s: float = typer.Option(30.0, help="How long refused creates "
                                                    "count as demand."),
              off: bool = typer.Option(False, "--off", help="Stop autoscaling (withdraws "
                                       "the request)."),
              json_: bool = JSON) -> None:
    """Autoscale through Ray's autoscaler: creates refused for want of room become resource
    requests; idle nodes are drained."""
    import corral.cluster
    from corral.errors import InvalidRequest

    if off:
        corral.cluster.autoscale(None, address)
    else:
        try:
            shape = {k.strip(): float(v) for k, _, v in
                     (p.partition("=") for p in node_shape.split(",") if p.strip())}
        except ValueError:
            raise InvalidRequest(f"bad --node-shape {node_shape!r}: RESOURCE=N[,...]") \
                from None
        corral.cluster.autoscale({"node_shape": shape, "min_nodes": min_nodes,
                                  "max_nodes": max_nodes, "idle_s": idle_s,
                                  "demand_window_s": demand_window_s}, address)
    _show(corral.cluster.status(address), json_)


@app.command()
@handled()
def stop(address: str = ADDRESS) -> None:
    """Stop every node's corrald (destroying its sandboxes) and the gateway."""
    import corral.cluster

    corral.cluster.stop(address)
    out.print("corral cluster stopped")
