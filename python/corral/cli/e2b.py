"""``corral e2b serve``: the E2B-compatible front (docs/e2b.md)."""

from __future__ import annotations

import os

import typer

from corral.e2b.auth import new_api_key
from corral.e2b.config import DEFAULT_HOST, DEFAULT_PORT, KEY_ENV

app = typer.Typer(no_args_is_help=True, help="The E2B-compatible front (docs/e2b.md).")


@app.callback()
def _group() -> None:
    """The E2B-compatible front (docs/e2b.md)."""


@app.command("serve")
def serve(
    host: str = typer.Option(DEFAULT_HOST, "--host", help="Address to listen on."),
    port: int = typer.Option(DEFAULT_PORT, "--port", help="Port (0: any free one)."),
    api_key: str = typer.Option(None, "--api-key",
                                help=f"The key clients send as E2B_API_KEY (or ${KEY_ENV})."),
    generate_key: bool = typer.Option(False, "--generate-key",
                                      help="Make a random API key and print it."),
    endpoint: str = typer.Option(None, "--endpoint",
                                 help="corrald's socket or URL (default: the environment)."),
) -> None:
    """Serve E2B's control plane and envd APIs over corral: point the stock e2b SDK here
    with E2B_API_URL=E2B_SANDBOX_URL=http://HOST:PORT and E2B_API_KEY."""
    key = api_key or os.environ.get(KEY_ENV)
    if key is None and generate_key:
        key = new_api_key()
        typer.echo(f"E2B_API_KEY={key}")
    if not key:
        typer.echo(f"corral e2b serve: an API key is required (--api-key, ${KEY_ENV} or "
                   "--generate-key)", err=True)
        raise typer.Exit(2)
    from corral.e2b.serve import run  # aiohttp: only when serving

    run(key, host, port, endpoint)
