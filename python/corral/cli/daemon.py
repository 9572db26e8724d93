"""Daemon and image commands: up, down, status, image ls, image import."""

from __future__ import annotations

import os
import time

import typer
from rich.table import Table

from corral.cli.output import err, handled, kv_table, out, print_json, since
from corral.errors import DaemonUnavailable, InvalidRequest
from corral.models import SubstrateCapabilities, SubstrateInfo
from corral.sdk import Endpoint, admin

app = typer.Typer()
image_app = typer.Typer(help="Images: list and import.", no_args_is_help=True)

JSON = typer.Option(False, "--json", help="Machine-readable JSON on stdout.")


def _local_socket() -> str:
    ep = Endpoint.from_env()
    if ep.unix_path is None:
        raise InvalidRequest(f"CORRAL_URL points at a remote daemon ({ep}); up and down "
                             f"manage the local one: unset CORRAL_URL")
    return ep.unix_path


@app.command()
@handled()
def up(json_: bool = JSON) -> None:
    """Start the local corrald if none is running."""
    from corral.daemon.launcher import ensure_daemon

    sock = _local_socket()
    ensure_daemon(socket_path=sock)
    st = admin.status()
    if json_:
        print_json({"running": True, "socket": sock, **st.model_dump()})
    else:
        out.print(f"corrald {st.version} running (pid {st.pid}) on {sock}")


@app.command()
@handled()
def down(timeout: float = typer.Option(30.0, help="Seconds to wait for it to stop.")) -> None:
    """Stop the local corrald (it kills its sandboxes)."""
    from corral.daemon.launcher import stop_daemon

    sock = _local_socket()
    if stop_daemon(socket_path=sock, timeout=timeout):
        out.print("corrald stopped")
    else:
        err.print(f"corrald was not running (socket {sock})")


@app.command()
@handled()
def status(json_: bool = JSON) -> None:
    """Is the daemon up, and how busy is it."""
    os.environ["CORRAL_AUTOSTART"] = "0"
    try:
        st = admin.status()
    except DaemonUnavailable:
        if json_:
            print_json({"running": False, "endpoint": str(Endpoint.from_env())})
            raise typer.Exit(1) from None
        raise
    subs = admin.substrates()
    if json_:
        print_json({"running": True, "endpoint": str(Endpoint.from_env()), **st.model_dump(),
                    "substrate_capabilities": [s.model_dump() for s in subs]})
        return
    out.print(kv_table([
        ("endpoint", Endpoint.from_env()), ("version", st.version), ("pid", st.pid),
        ("uptime", since(st.started_at)),
        ("sandboxes", f"{st.sandboxes} / {st.capacity} (bound by {st.capacity_bound_by})"),
        ("state dir", st.state_dir),
        ("cgroup", f"v{st.cgroup_version}" if st.cgroup_version else "-"),
        ("substrates", ", ".join(st.substrates)),
    ]))
    out.print(capability_table(subs))


def capability_table(subs: list[SubstrateInfo]) -> Table:
    """One row per substrate the daemon serves, one column per capability."""
    cols = [c for c in SubstrateCapabilities.model_fields if c != "networks"]
    t = Table(box=None, header_style="bold")
    for col in ("SUBSTRATE", *(c.upper() for c in cols), "NETWORKS"):
        t.add_column(col)
    for s in subs:
        caps = s.capabilities
        if not s.available:  # asked for, but this host cannot run it: say why
            t.add_row(s.name, f"not available: {s.reason}")
            continue
        t.add_row(s.name, *("yes" if getattr(caps, c) else "-" for c in cols),
                  ", ".join(caps.networks))
    return t


@image_app.command("ls")
@handled()
def image_ls(json_: bool = JSON) -> None:
    """List images."""
    os.environ["CORRAL_AUTOSTART"] = "0"
    images = admin.images()
    if json_:
        print_json(images)
        return
    t = Table(box=None, header_style="bold")
    for col in ("NAME", "KIND", "SIZE", "CREATED"):
        t.add_column(col)
    for i in images:
        size = "-" if i.size_bytes is None else f"{i.size_bytes / 2**20:.1f} MiB"
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(i.created_at))
        t.add_row(i.name, i.kind, size, created)
    out.print(t)


@image_app.command("import")
@handled()
def image_import(
    name: str = typer.Argument(..., help="Image name (lowercase, digits, . _ -)."),
    source: str = typer.Argument(..., help="Host path of a rootfs directory or tarball."),
    json_: bool = JSON,
) -> None:
    """Register a rootfs directory or tarball as an image."""
    info = admin.import_image(name, os.path.abspath(source))
    if json_:
        print_json(info)
    else:
        out.print(f"imported {info.name}")
