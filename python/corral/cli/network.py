"""Network commands: network ls, network show (the daemon's named allowlists)."""

from __future__ import annotations

import os

import typer
from rich.table import Table

from corral.cli.output import handled, out, print_json
from corral.sdk import admin

JSON = typer.Option(False, "--json", help="Machine-readable JSON on stdout.")
network_app = typer.Typer(help="Networks: the daemon's named allowlists (docs/network.md).",
                          no_args_is_help=True)


@network_app.command("ls")
@handled()
def network_ls(json_: bool = JSON) -> None:
    """List the named allowlists (usable as --network NAME, or @NAME in a policy)."""
    os.environ["CORRAL_AUTOSTART"] = "0"
    lists = admin.networks()
    if json_:
        print_json(lists)
        return
    t = Table(box=None, header_style="bold")
    for col in ("NAME", "RULES"):
        t.add_column(col)
    for a in lists:
        t.add_row(a.name, str(len(a.rules)))
    out.print(t)


@network_app.command("show")
@handled()
def network_show(name: str = typer.Argument(..., help="An allowlist's name."),
                 json_: bool = JSON) -> None:
    """One allowlist's rules, one a line."""
    os.environ["CORRAL_AUTOSTART"] = "0"
    a = admin.network(name)
    if json_:
        print_json(a)
        return
    for r in a.rules:
        out.print(r)
