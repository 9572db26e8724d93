"""Snapshot commands: snapshot ls | rm | create | restore, fork, pause, resume."""

from __future__ import annotations

import typer
from rich.table import Table

from corral.cli.output import EXIT_ERROR, err, fail, handled, out, print_json, since
from corral.cli.sandboxes import JSON, no_autostart
from corral.errors import CorralError
from corral.sdk import Sandbox, Snapshot

app = typer.Typer()  # top-level: fork, pause, resume
snapshot_app = typer.Typer(no_args_is_help=True,
                           help="Snapshots of sandboxes' files (ls, create, rm, restore).")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


@snapshot_app.command("ls")
@handled()
def ls(json_: bool = JSON,
       quiet: bool = typer.Option(False, "--quiet", "-q", help="Ids only.")) -> None:
    """List snapshots."""
    no_autostart()
    snaps = Snapshot.list()
    if json_:
        print_json([s.info for s in snaps])
        return
    if quiet:
        for s in snaps:
            out.print(s.id)
        return
    t = Table(box=None, header_style="bold")
    for col in ("ID", "NAME", "IMAGE", "PARENT", "LAYERS", "SIZE", "AGE", "FROM"):
        t.add_column(col, no_wrap=True)
    for s in snaps:
        t.add_row(s.id, s.name or "-", s.image, s.parent or "-", str(len(s.layers)),
                  _size(s.size), since(s.created_at), s.sandbox_id or "-")
    out.print(t)
    if not snaps:
        err.print("no snapshots")


@snapshot_app.command("create")
@handled()
def create(sandbox_id: str = typer.Argument(..., metavar="SANDBOX"),
           name: str = typer.Option(None, "--name", "-n", help="A unique name."),
           json_: bool = JSON) -> None:
    """Snapshot a sandbox's files; prints the snapshot id."""
    no_autostart()
    snap = Sandbox.from_id(sandbox_id).snapshot(name=name)
    if json_:
        print_json(snap.info)
    else:
        out.print(snap.id)


@snapshot_app.command("rm")
def rm(keys: list[str] = typer.Argument(..., metavar="SNAPSHOT...")) -> None:
    """Delete snapshots (by id or name). Layers still used by a sandbox or a child snapshot
    are kept until those end."""
    no_autostart()
    failed = False
    for key in keys:
        try:
            Snapshot.get(key).delete()
            out.print(f"{key} deleted")
        except CorralError as e:
            failed = True
            fail(e)
    if failed:
        raise typer.Exit(EXIT_ERROR)


@snapshot_app.command("restore")
@handled()
def restore(sandbox_id: str = typer.Argument(..., metavar="SANDBOX"),
            key: str = typer.Argument(..., metavar="SNAPSHOT")) -> None:
    """Roll a sandbox back to a snapshot in place (its processes are restarted)."""
    no_autostart()
    Sandbox.from_id(sandbox_id).restore(key)
    out.print(f"{sandbox_id} restored to {key}")


@app.command()
@handled()
def fork(sandbox_id: str = typer.Argument(..., metavar="SANDBOX"),
         count: int = typer.Option(1, "--count", "-n", help="How many children."),
         keep: bool = typer.Option(False, "--keep-snapshot", help="Keep the snapshot listed."),
         json_: bool = JSON) -> None:
    """Snapshot a sandbox and start COUNT sandboxes on it; prints their ids."""
    no_autostart()
    kids = Sandbox.from_id(sandbox_id).fork(count, keep_snapshot=keep)
    if json_:
        print_json([k.last_info for k in kids])
        return
    for k in kids:
        out.print(k.id)


@app.command()
@handled()
def pause(sandbox_id: str = typer.Argument(..., metavar="ID")) -> None:
    """Freeze every process of a sandbox (any exec or file call resumes it)."""
    no_autostart()
    Sandbox.from_id(sandbox_id).pause()
    out.print(f"{sandbox_id} paused")


@app.command()
@handled()
def resume(sandbox_id: str = typer.Argument(..., metavar="ID")) -> None:
    """Thaw a paused sandbox."""
    no_autostart()
    Sandbox.from_id(sandbox_id).resume()
    out.print(f"{sandbox_id} resumed")
