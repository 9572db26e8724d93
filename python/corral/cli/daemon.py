"""Daemon and image commands: up, down, status, image ls / pull / inspect / rm / prune /
import / commit / tag / push / build."""

from __future__ import annotations

import os
import time
from typing import Any

import typer
from rich.table import Table

from corral.cli.output import err, handled, kv_table, out, print_json, since
from corral.errors import DaemonUnavailable, InvalidRequest
from corral.models import SubstrateCapabilities, SubstrateInfo
from corral.sdk import Endpoint, admin

app = typer.Typer()
image_app = typer.Typer(help="Images: list, pull, inspect, remove, prune, import, commit, "
                        "tag, push, build.",
                        no_args_is_help=True)

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
        *([("shared rlimits", ", ".join(st.shared_rlimits) + " (no CAP_SYS_RESOURCE: one "
            "sandbox can take these per-user sums from the others)")]
          if st.shared_rlimits else []),
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


@image_app.command("pull")
@handled()
def image_pull(
    reference: str = typer.Argument(..., help="[registry[:port]/]repo[:tag][@sha256:...]"),
    json_: bool = JSON,
    progress: bool = typer.Option(True, "--progress/--no-progress",
                                  help="Progress bars on stderr."),
) -> None:
    """Pull an image from an OCI registry onto the daemon's node (credentials: the daemon's
    $DOCKER_CONFIG/config.json or ~/.docker/config.json)."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TransferSpeedColumn,
    )

    if not progress or json_:
        info = admin.pull_image(reference)
    else:
        # markup=False: a description names a node and a layer, not styles
        bars = Progress(TextColumn("{task.description}", markup=False), BarColumn(),
                        DownloadColumn(), TransferSpeedColumn(),
                        TextColumn("{task.fields[state]}", markup=False),
                        console=err, transient=False)
        tasks: dict[tuple[str, str], Any] = {}

        def on_event(ev: dict) -> None:
            # Through a cluster gateway every node pulls, and its events name it.
            node = f"{ev['node'][:12]} " if ev.get("node") else ""
            if ev.get("event") == "resolved":
                err.print(f"{node}{ev['reference']}: {ev['layers']} layers, "
                          f"{ev['total_bytes'] / 2**20:.1f} MiB, {ev['digest']}")
            elif ev.get("event") == "layer":
                d = str(ev["digest"])
                if (node, d) not in tasks:
                    tasks[node, d] = bars.add_task(node + d[7:19],
                                                   total=ev.get("total") or None, state="")
                bars.update(tasks[node, d], completed=ev.get("done", 0),
                            state=ev.get("state", ""))
            elif ev.get("event") == "node_error":
                err.print(f"{node}failed: {ev.get('code')}: {ev.get('message')}")

        with bars:
            info = admin.pull_image(reference, progress=on_event)
    if json_:
        print_json(info)
    else:
        out.print(f"pulled {info.name} ({info.digest})")


@image_app.command("inspect")
@handled()
def image_inspect(name: str = typer.Argument(..., help="Image name or reference."),
                  json_: bool = JSON) -> None:
    """An image's details: digest, layers, config (Env, WorkingDir, User, Cmd...)."""
    info = admin.image_info(name)
    if json_:
        print_json(info)
        return
    rows = {"name": info.name, "kind": info.kind, "digest": info.digest or "-",
            "size": "-" if info.size_bytes is None else f"{info.size_bytes / 2**20:.1f} MiB",
            "layers": "\n".join(info.layers or []) or "-"}
    for k, v in (info.config or {}).items():
        rows[k] = " ".join(v) if isinstance(v, list) else str(v)
    out.print(kv_table(list(rows.items())))


@image_app.command("rm")
@handled()
def image_rm(names: list[str] = typer.Argument(..., help="Images to remove."),
             json_: bool = JSON) -> None:
    """Remove images no sandbox or snapshot uses (and the layers no other image lists)."""
    done = [admin.remove_image(n) for n in names]
    if json_:
        print_json(done)
        return
    for d in done:
        out.print(f"removed {d['name']} ({len(d['layers_removed'])} layers freed)")


@image_app.command("prune")
@handled()
def image_prune(json_: bool = JSON) -> None:
    """Remove every stored layer no image lists."""
    res = admin.prune_images()
    if json_:
        print_json(res)
    else:
        out.print(f"removed {len(res.layers_removed)} layers")


@image_app.command("commit")
@handled()
def image_commit(sandbox: str = typer.Argument(..., help="Sandbox id."),
                 name: str = typer.Argument(..., help="New image: a local name or a "
                                                      "registry reference."),
                 replace: bool = typer.Option(False, "--replace", help="Replace an image of "
                                                                      "that name."),
                 json_: bool = JSON) -> None:
    """A sandbox's files as a new image (its image's layers + one layer of its changes)."""
    from corral.sdk import api
    from corral.sdk.sync_transport import transport

    t0 = time.monotonic()
    info = transport(Endpoint.from_env()).call(api.commit(sandbox, name, None, replace))
    if json_:
        print_json(info)
    else:
        out.print(f"committed {info.name} ({len(info.layers or [])} layers, "
                  f"{(time.monotonic() - t0) * 1000:.0f} ms)")


@image_app.command("tag")
@handled()
def image_tag(source: str = typer.Argument(..., help="An existing image."),
              name: str = typer.Argument(..., help="The new name."),
              json_: bool = JSON) -> None:
    """A new name for an image (its layers are shared, nothing is copied)."""
    info = admin.tag_image(source, name)
    if json_:
        print_json(info)
    else:
        out.print(f"tagged {info.name}")


@image_app.command("push")
@handled()
def image_push(name: str = typer.Argument(..., help="The image to push."),
               reference: str = typer.Argument(None, help="Where to (default: its name)."),
               json_: bool = JSON) -> None:
    """Push an image to an OCI registry (credentials: the daemon's docker config)."""
    res = admin.push_image(name, reference)
    if json_:
        print_json(res)
    else:
        out.print(f"pushed {res.reference} ({res.digest}; {res.uploaded} of "
                  f"{len(res.layers)} layers sent, {res.bytes / 2**20:.1f} MiB)")


@image_app.command("build")
@handled()
def image_build(
    context: str = typer.Argument(".", help="The build context (COPY sources)."),
    file: str = typer.Option(None, "-f", "--file", help="Dockerfile (default: "
                                                        "CONTEXT/Dockerfile)."),
    tag: str = typer.Option(..., "-t", "--tag", help="The image's name."),
    build_arg: list[str] = typer.Option([], "--build-arg", help="ARG=VALUE (repeat)."),
    network: str = typer.Option("none", "--network", help="Network mode of RUN steps."),
    target: str = typer.Option(None, "--target", help="The stage to build (default: the "
                                                      "last); only the stages it needs run."),
    json_: bool = JSON,
) -> None:
    """Build an image from a Dockerfile: each RUN / COPY step runs in a sandbox and becomes
    a cached layer (FROM, with stages and COPY --from, RUN, COPY, ADD of local files, ENV,
    ARG, WORKDIR, USER, LABEL, MAINTAINER, CMD, ENTRYPOINT, EXPOSE, STOPSIGNAL)."""
    from corral.sdk import dockerfile

    path = file or os.path.join(context, "Dockerfile")
    with open(path) as f:
        text = f.read()
    args = dict(a.partition("=")[::2] for a in build_arg)
    recipe = dockerfile.parse(text, os.path.abspath(context), args, target=target)
    res = recipe.build(tag, network=network,
                       output=None if json_ else (lambda s: err.print(s, markup=False,
                                                                      highlight=False)))
    if json_:
        print_json({"image": res.image.model_dump(), "seconds": res.seconds,
                    "steps": [vars(s) for s in res.steps]})
    else:
        hits = sum(1 for s in res.steps if s.cached)
        out.print(f"built {res.image.name} in {res.seconds:.2f} s ({hits} of "
                  f"{len(res.steps)} steps cached)")
