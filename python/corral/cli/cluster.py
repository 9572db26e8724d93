"""``corral cluster start | status | stop``: corral on a Ray cluster (docs/cluster.md)."""

from __future__ import annotations

from typing import Any

import typer
from rich.table import Table

from corral.cli.output import handled, out, print_json

app = typer.Typer(help="corral on a Ray cluster: start, status, stop.", no_args_is_help=True)

ADDRESS = typer.Option("auto", "--address", help="The Ray cluster: auto (the one this machine "
                       "belongs to) or HOST:PORT of its head.")
JSON = typer.Option(False, "--json", help="Machine-readable JSON on stdout.")


def _show(st: dict[str, Any], json_: bool) -> None:
    if json_:
        print_json(st)
        return
    out.print(f"gateway {st['gateway']} (cluster {st['cluster']}, power-of-{st['k']} "
              f"placement, {st['placed']} placed)")
    t = Table("node", "endpoint", "live", "capacity", "free memory", "labels", "report age")
    for n in st["nodes"]:
        t.add_row(n["node"][:16], n["endpoint"], str(n["live"]), str(n["capacity"]),
                  f"{n['mem_free_mb']} MiB", ",".join(f"{k}={v}" for k, v in n["labels"].items()),
                  f"{n['report_age_s']:.1f} s")
    out.print(t)
    for node, why in st["lost"].items():
        out.print(f"lost: {node[:16]} ({why})")


@app.command()
@handled()
def start(address: str = ADDRESS,
          name: str = typer.Option("corral", help="Keeps this cluster's node state, sockets "
                                   "and cgroups apart from another's on the same machines."),
          k: int = typer.Option(2, help="Nodes sampled per placement (power-of-k choices)."),
          max_sandboxes: int = typer.Option(0, help="Admission limit per node; 0: derived "
                                            "from each machine."),
          json_: bool = JSON) -> None:
    """Deploy a supervisor (and its corrald) on every Ray node, and the gateway."""
    import corral.cluster

    _show(corral.cluster.start(address, name=name, k=k, max_sandboxes=max_sandboxes), json_)


@app.command()
@handled()
def status(address: str = ADDRESS, json_: bool = JSON) -> None:
    """Nodes, live sandboxes, capacity, free memory."""
    import corral.cluster

    _show(corral.cluster.status(address), json_)


@app.command()
@handled()
def stop(address: str = ADDRESS) -> None:
    """Stop every node's corrald (destroying its sandboxes) and the gateway."""
    import corral.cluster

    corral.cluster.stop(address)
    out.print("corral cluster stopped")
