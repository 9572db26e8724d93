"""Sandbox commands: create, exec, run, ls, rm, info."""

from __future__ import annotations

import os
import sys
from typing import Any

import typer
from rich.table import Table

from corral.cli.output import (
    EXIT_ERROR,
    EXIT_EXEC_ERROR,
    EXIT_TIMED_OUT,
    err,
    fail,
    handled,
    kv_table,
    labels_text,
    out,
    parse_pairs,
    print_json,
    since,
    until,
)
from corral.errors import CorralError
from corral.models import Network, SandboxInfo
from corral.sdk import ExecResult, Sandbox

app = typer.Typer()

JSON = typer.Option(False, "--json", help="Machine-readable JSON on stdout.")
LABELS = typer.Option(None, "--label", "-l", help="KEY=VALUE (repeatable).")


def no_autostart() -> None:
    """Commands about existing sandboxes must not start a daemon just to find none."""
    os.environ["CORRAL_AUTOSTART"] = "0"


def as_cmd(argv: list[str]) -> str | list[str]:
    """One argument is a shell command line (``'echo $HOME | wc'``); several are an argv."""
    return argv[0] if len(argv) == 1 else list(argv)


def spec_options(image: str, cpu: float, memory: int, pids: int, ttl: float,
                 idle_timeout: float | None, labels: list[str] | None,
                 env: list[str] | None) -> dict[str, Any]:
    return {"image": image, "cpu": cpu, "memory_mb": memory, "pids": pids, "timeout": ttl,
            "idle_timeout": idle_timeout, "labels": parse_pairs(labels, "--label"),
            "env": parse_pairs(env, "--env")}


SUBSTRATE = typer.Option("container", "--substrate",
                         help="What runs the sandbox (corral status lists the substrates).")
NETWORK = typer.Option("none", "--network",
                       help="none: own network namespace, loopback only; disabled: no socket "
                            "but unix ones (cheaper: one shared empty namespace); internet: "
                            "egress through NAT; or a named allowlist (corral network ls).")
ALLOW = typer.Option(None, "--allow", help="Default-deny egress allowing this rule (repeatable): "
                                           "name[:ports], *.suffix, CIDR[:ports], @allowlist.")
DENY = typer.Option(None, "--deny", help="With --allow: a rule to deny (repeatable).")
GROUP = typer.Option(None, "--network-group",
                     help="Networked sandboxes of one group reach each other by id.")


def network_of(network: str, allow: list[str] | None, deny: list[str] | None) -> Any:
    """--allow/--deny make a policy; otherwise the --network name."""
    if allow or deny:
        return Network(allow=list(allow or []), deny=list(deny or []))
    return network


@app.command()
@handled()
def create(
    image: str = typer.Option("host", "--image", help="Image name."),
    cpu: float = typer.Option(1.0, "--cpu", help="CPU cores."),
    memory: int = typer.Option(512, "--memory", help="Memory limit in MiB."),
    pids: int = typer.Option(512, "--pids", help="Max processes."),
    timeout: float = typer.Option(300.0, "--timeout", "--ttl",
                                  help="Seconds until the sandbox is killed."),
    idle_timeout: float = typer.Option(None, "--idle-timeout",
                                       help="Kill after this many idle seconds."),
    label: list[str] = LABELS,
    env: list[str] = typer.Option(None, "--env", "-e", help="KEY=VALUE for every command."),
    network: str = NETWORK,
    allow: list[str] = ALLOW,
    deny: list[str] = DENY,
    network_group: str = GROUP,
    substrate: str = SUBSTRATE,
    json_: bool = JSON,
) -> None:
    """Create a sandbox and print its id."""
    sb = Sandbox(**spec_options(image, cpu, memory, pids, timeout, idle_timeout, label, env),
                 network=network_of(network, allow, deny), network_group=network_group,
                 substrate=substrate)
    if json_:
        print_json(sb.last_info)
    else:
        out.print(sb.id)


def run_in(sb: Sandbox, cmd: list[str], *, timeout: float | None, env: list[str] | None,
           cwd: str | None, user: str | None, interactive: bool, stream: bool,
           json_: bool) -> int:
    """Run a command in ``sb``, print its output, return the exit code for the CLI."""
    kw: dict[str, Any] = {"timeout": timeout, "env": parse_pairs(env, "--env"), "cwd": cwd,
                          "user": int(user) if user and user.isdigit() else user}
    stdin = sys.stdin.read() if interactive else None
    if json_ or not stream:
        res: ExecResult = sb.exec(as_cmd(cmd), stdin=stdin, **kw)
        if json_:
            print_json(res)
        else:
            sys.stdout.write(res.stdout)
            sys.stderr.write(res.stderr)
        return _exit_code(res.exit_code, res.timed_out, timeout)
    proc = sb.exec(as_cmd(cmd), stdin=stdin, background=True, **kw)
    proc.close_stdin()  # the command sees EOF, as with `docker exec` without -i
    for name, data in proc.stream():
        f = sys.stdout if name == "stdout" else sys.stderr
        f.write(data)
        f.flush()
    return _exit_code(proc.exit_code, proc.timed_out, timeout)


def _exit_code(code: int | None, timed_out: bool, timeout: float | None) -> int:
    sys.stdout.flush()
    if timed_out:
        err.print(f"corral: the command timed out after {timeout} s and was killed")
        return EXIT_TIMED_OUT
    return 0 if code is None else code


EXEC_TIMEOUT = typer.Option(None, "--timeout", help="Kill the command after this many seconds.")
EXEC_ENV = typer.Option(None, "--env", "-e", help="KEY=VALUE for the command (repeatable).")
CWD = typer.Option(None, "--cwd", "-w", help="Working directory inside the sandbox.")
USER = typer.Option(None, "--user", "-u", help="User name or uid inside the sandbox.")
INTERACTIVE = typer.Option(False, "--interactive", "-i", help="Pass this terminal's stdin.")
NO_STREAM = typer.Option(False, "--no-stream", help="Print the output when the command ends.")
CMD = typer.Argument(..., metavar="-- CMD...", help="A command line, or an argv.")


@app.command("exec")
@handled(EXIT_EXEC_ERROR)
def exec_(
    sandbox_id: str = typer.Argument(..., metavar="ID"),
    cmd: list[str] = CMD,
    timeout: float = EXEC_TIMEOUT,
    env: list[str] = EXEC_ENV,
    cwd: str = CWD,
    user: str = USER,
    interactive: bool = INTERACTIVE,
    no_stream: bool = NO_STREAM,
    json_: bool = JSON,
) -> None:
    """Run a command in a sandbox and exit with its exit code.

    Exit 125 means a corral error, 124 that the command timed out.
    """
    no_autostart()
    sb = Sandbox.connect(sandbox_id)
    raise typer.Exit(run_in(sb, cmd, timeout=timeout, env=env, cwd=cwd, user=user,
                            interactive=interactive, stream=not no_stream, json_=json_))


def image_command(sb: Sandbox) -> list[str]:
    """The command an OCI image runs by default: its Entrypoint then its Cmd (as an argv)."""
    from corral.sdk import admin

    image = sb.info().image
    cfg = admin.image_info(image, endpoint=sb._endpoint).config or {} if image != "host" else {}
    argv = [*cfg.get("Entrypoint", []), *cfg.get("Cmd", [])]
    if not argv:
        raise typer.BadParameter(f"no command given and image {image!r} has no Entrypoint or "
                                 "Cmd")
    return argv


@app.command()
@handled(EXIT_EXEC_ERROR)
def run(
    cmd: list[str] = typer.Argument(None, metavar="-- [CMD...]", help=(
        "A command line, or an argv; none: the image's Entrypoint + Cmd (OCI images).")),
    image: str = typer.Option("host", "--image", help=(
        "Image: host, a local name, or a registry reference (pulled on first use).")),
    cpu: float = typer.Option(1.0, "--cpu", help="CPU cores."),
    memory: int = typer.Option(512, "--memory", help="Memory limit in MiB."),
    pids: int = typer.Option(512, "--pids", help="Max processes."),
    ttl: float = typer.Option(300.0, "--ttl", help="Seconds until the sandbox is killed."),
    label: list[str] = LABELS,
    sandbox_env: list[str] = typer.Option(None, "--sandbox-env",
                                          help="KEY=VALUE for the sandbox (repeatable)."),
    timeout: float = EXEC_TIMEOUT,
    env: list[str] = EXEC_ENV,
    cwd: str = CWD,
    user: str = USER,
    interactive: bool = INTERACTIVE,
    no_stream: bool = NO_STREAM,
    network: str = NETWORK,
    allow: list[str] = ALLOW,
    deny: list[str] = DENY,
    network_group: str = GROUP,
    substrate: str = SUBSTRATE,
    json_: bool = JSON,
) -> None:
    """Create a sandbox, run one command in it, destroy it; exit with the command's code."""
    with Sandbox(**spec_options(image, cpu, memory, pids, ttl, None, label, sandbox_env),
                 network=network_of(network, allow, deny), network_group=network_group,
                 substrate=substrate) as sb:
        if not cmd:
            cmd = image_command(sb)
        code = run_in(sb, cmd, timeout=timeout, env=env, cwd=cwd, user=user,
                      interactive=interactive, stream=not no_stream, json_=json_)
    raise typer.Exit(code)


@app.command("ls")
@handled()
def ls(
    label: list[str] = LABELS,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only the ids."),
    json_: bool = JSON,
) -> None:
    """List running sandboxes (filter with --label KEY=VALUE or --label KEY)."""
    no_autostart()
    # list() fills each handle's last_info from the listing itself
    infos = [sb.last_info for sb in Sandbox.list(labels=label or None) if sb.last_info]
    if json_:
        print_json(infos)
        return
    if quiet:
        for i in infos:
            out.print(i.id)
        return
    t = Table(box=None, header_style="bold")
    for col in ("ID", "STATE", "IMAGE", "CPU", "MEMORY", "AGE", "EXPIRES IN", "LABELS"):
        t.add_column(col, no_wrap=col != "LABELS", overflow="fold")
    for i in sorted(infos, key=lambda i: i.created_at):
        t.add_row(i.id, i.state, i.image, f"{i.cpu:g}", f"{i.memory_mb} MiB",
                  since(i.created_at), until(i.expires_at), labels_text(i.labels))
    out.print(t)
    if not infos:
        err.print("no sandboxes")


@app.command()
def rm(
    ids: list[str] = typer.Argument(None, metavar="[ID]..."),
    all_: bool = typer.Option(False, "--all", "-a", help="Every running sandbox (or every "
                                                        "one matching --label)."),
    label: list[str] = LABELS,
) -> None:
    """Kill sandboxes."""
    no_autostart()
    try:
        if all_:
            targets = [sb.id for sb in Sandbox.list(labels=label or None)]
        elif ids:
            targets = list(ids)
        else:
            raise typer.BadParameter("give sandbox ids, or --all")
    except CorralError as e:
        raise fail(e) from None
    failed = False
    for sid in targets:
        try:
            killed = Sandbox.from_id(sid).kill()
            out.print(f"{sid} {'killed' if killed else 'already ended'}")
        except CorralError as e:
            failed = True
            fail(e)
    if failed:
        raise typer.Exit(EXIT_ERROR)


@app.command()
@handled()
def info(sandbox_id: str = typer.Argument(..., metavar="ID"), json_: bool = JSON) -> None:
    """Show one sandbox."""
    no_autostart()
    i = Sandbox.connect(sandbox_id).last_info
    assert i is not None
    if json_:
        print_json(i)
        return
    out.print(kv_table(info_rows(i)))


def info_rows(i: SandboxInfo) -> list[tuple[str, Any]]:
    return [
        ("id", i.id), ("state", i.state), ("image", i.image), ("substrate", i.substrate),
        ("cpu", f"{i.cpu:g}"), ("memory", f"{i.memory_mb} MiB"), ("pids", i.pids),
        ("network", i.network if isinstance(i.network, str) else
         "policy: " + i.network.model_dump_json()),
        ("hostname", i.hostname), ("age", since(i.created_at)),
        ("expires in", until(i.expires_at)),
        ("idle timeout", f"{i.idle_timeout:g} s" if i.idle_timeout else "none"),
        ("labels", labels_text(i.labels) or "-"), ("metadata", labels_text(i.metadata) or "-"),
        ("init pid", i.init_pid),
        *net_rows(i),
    ]


def net_rows(i: SandboxInfo) -> list[tuple[str, Any]]:
    """A networked sandbox's address and counters."""
    n = i.net
    if n is None:
        return []
    return [("address", n.address + (f", {n.address6}" if n.address6 else "")),
            ("network group", i.network_group or "-"),
            ("sent", f"{n.tx_bytes} B in {n.tx_packets} packets"),
            ("received", f"{n.rx_bytes} B in {n.rx_packets} packets"),
            ("denied", f"{n.denied_packets} packets"),
            ("denied to", ", ".join(f"{k} ({v})" for k, v in
                                    list(n.denied_destinations.items())[:10]) or "-"),
            ("refused names", ", ".join(f"{k} ({v})" for k, v in n.refused_names.items()) or "-")]
