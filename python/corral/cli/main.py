"""``corral``: the command line (typer + rich). Entry point ``corral.cli.main:main``.

daemon.py     up, down, status, image ls | import
sandboxes.py  create, exec, run, ls, rm, info
snapshots.py  snapshot ls | create | rm | restore, fork, pause, resume
demo.py       demo
trajectory.py log, replay
run_code.py   run-code
e2b.py        e2b serve
tasks.py      tasks run (Harbor-style task directories)
dashboard.py  dashboard (the web dashboard's URL; a local proxy on the socket)
cluster.py    cluster start | status | stop (Ray)
output.py     tables, JSON, the ``error [code]: message`` format and exit codes
"""

from __future__ import annotations

import typer

from corral import __version__
from corral.cli import (
    cluster,
    daemon,
    dashboard,
    demo,
    e2b,
    network,
    run_code,
    sandboxes,
    snapshots,
    tasks,
    trajectory,
)

app = typer.Typer(
    name="corral", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
    help="corral: isolated Linux sandboxes for agentic RL.\n\nThe daemon is found on "
         "$CORRAL_SOCKET (default /run/corral/corrald.sock) or $CORRAL_URL (+ $CORRAL_TOKEN).",
)
for sub in (daemon.app, sandboxes.app, snapshots.app, demo.app, trajectory.app, run_code.app,
            dashboard.app):
    app.registered_commands += sub.registered_commands
app.add_typer(daemon.image_app, name="image")
app.add_typer(network.network_app, name="network")
app.add_typer(snapshots.snapshot_app, name="snapshot")
app.add_typer(e2b.app, name="e2b")
app.add_typer(cluster.app, name="cluster")
app.add_typer(tasks.app, name="tasks")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"corral {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version.")) -> None:
    pass


def main() -> None:
    app()


if __name__ == "__main__":
    main()

app.registered_commands += __import__("corral.cli.bench", fromlist=["app"]).app.registered_commands
