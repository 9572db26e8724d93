"""``corral dashboard``: print (or open) the URL of corrald's web dashboard.

On TCP (``CORRAL_URL``) the daemon serves the page itself and the URL carries
``CORRAL_TOKEN`` in its fragment. On the unix socket a browser cannot connect: the command runs
a local read-only proxy with a token of its own (corral.cli.dashboard_proxy) until Ctrl-C.
"""

from __future__ import annotations

import os
import sys
import webbrowser

import typer

from corral.cli.output import handled
from corral.sdk.endpoint import Endpoint

app = typer.Typer()


def _show(url: str, open_it: bool) -> None:
    typer.echo(url)
    sys.stdout.flush()
    if open_it:
        webbrowser.open(url)


@app.command("dashboard")
@handled()
def dashboard(
    open_it: bool = typer.Option(False, "--open", help="Open it in a browser too."),
    port: int = typer.Option(0, "--port", help="The local proxy's port on 127.0.0.1 "
                             "(unix socket only; 0: a free one)."),
) -> None:
    """Print the dashboard's URL (keep it private: it carries a token). Over the local socket,
    serve it through a read-only proxy on 127.0.0.1 until interrupted."""
    ep = Endpoint.from_env()
    if ep.unix_path is None:
        token = os.environ.get("CORRAL_TOKEN", "")
        _show(f"{ep.url}/dashboard" + (f"#token={token}" if token else ""), open_it)
        return
    from corral.cli.dashboard_proxy import serve

    typer.echo("serving the dashboard through a local proxy (Ctrl-C stops it):", err=True)
    serve(ep.unix_path, port, lambda url: _show(url, open_it))
