"""Trajectory commands: ``corral log ID`` (table, --json, --jsonl) and ``corral replay ID``."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import typer
from rich.table import Table
from rich.text import Text

from corral.cli.output import err, handled, inert, out, print_json
from corral.cli.sandboxes import no_autostart
from corral.models import LogEntry
from corral.sdk import Sandbox

app = typer.Typer()


def _clip(text: str, n: int = 60) -> str:
    """One line of at most ``n`` characters, inert (a command's output is the sandbox's)."""
    text = inert(text.replace("\n", "\\n"))
    return text if len(text) <= n else text[: n - 1] + "…"


def summary(e: LogEntry) -> tuple[str, str]:
    """(what, outcome) of one entry, for the table."""
    from corral.sdk.replay import describe

    what = describe(e.model_dump())
    if e.status == "interrupted":
        return what, "INTERRUPTED by a daemon crash (outcome unknown)"
    if e.status == "started":
        return what, "in flight"
    if e.error:
        return what, f"error {e.error.get('error', {}).get('code', '?')}"
    r = e.result or {}
    if e.op in ("exec", "wait") and "exit_code" in r:
        outcome = f"exit {r['exit_code']}" + (" (timed out)" if r.get("timed_out") else "")
        if r.get("stdout"):
            outcome += f"  {_clip(r['stdout'], 40)}"
        return what, outcome
    if e.op == "exec" and "pid" in r:
        return what, f"pid {r['pid']}"
    if e.op == "create":
        snap = f" on {e.snapshot_ids[0]}" if e.snapshot_ids else ""
        if e.request.get("parent"):
            return what, str(r.get("id", "")) + snap
        return e.request.get("image", ""), str(r.get("id", "")) + snap
    if e.op == "snapshot":
        return what, f"{r.get('id', '')} ({r.get('size', 0)} bytes)"
    if e.op == "fork":
        kids = r.get("sandboxes") or []
        return what, f"{(r.get('snapshot') or {}).get('id', '')} -> {' '.join(kids)}"
    if e.op == "restore":
        return what, f"restored {e.snapshot_ids[0] if e.snapshot_ids else ''}"
    if e.op in ("pause", "resume", "info"):
        return what, str(r.get("state", "ok"))
    if "size" in r:
        return what, f"{r['size']} bytes sha256:{str(r.get('sha256', ''))[:12]}"
    if "count" in r:
        return what, f"{r['count']} entries"
    if e.op == "kill":
        return what, "killed" if r.get("killed") else "already ended"
    return what, "ok"


@app.command()
@handled()
def log(
    sandbox_id: str = typer.Argument(..., metavar="ID"),
    json_: bool = typer.Option(False, "--json", help="The entries as one JSON array."),
    jsonl: bool = typer.Option(False, "--jsonl", help="One JSON entry a line (export)."),
) -> None:
    """Show a sandbox's trajectory log (also after it ended, until pruned)."""
    no_autostart()
    entries = Sandbox.from_id(sandbox_id).log()
    if jsonl:
        for e in entries:
            sys.stdout.write(json.dumps(e.model_dump(mode="json"), separators=(",", ":")) + "\n")
        return
    if json_:
        print_json(entries)
        return
    t = Table(box=None, header_style="bold")
    for col in ("#", "TIME", "OP", "WHAT", "RESULT", "DURATION", "KEY"):
        t.add_column(col, no_wrap=col not in ("WHAT", "RESULT"), overflow="fold")
    for e in entries:
        what, outcome = summary(e)
        style = "red" if e.error else None
        t.add_row(str(e.index), time.strftime("%H:%M:%S", time.localtime(e.started_at)), e.op,
                  Text(_clip(what)), Text(inert(outcome), style=style or ""),
                  "-" if e.duration_s is None else f"{e.duration_s * 1000:.1f} ms",
                  e.idempotency_key or "")
    out.print(t)
    if not entries:
        err.print("no entries")


@app.command()
@handled()
def replay(
    sandbox_id: str = typer.Argument(..., metavar="ID"),
    image: str = typer.Option(None, "--image", help="Replay on this image instead."),
    keep: bool = typer.Option(False, "--keep", help="Keep the replay sandbox."),
    json_: bool = typer.Option(False, "--json", help="The report as JSON."),
) -> None:
    """Run a logged session again in a fresh sandbox; report, step by step, where the
    outcomes differ (exit code, output hashes, errors). Exits 1 if any step differs."""
    from corral.sdk.replay import replay as run_replay

    rep = run_replay(sandbox_id, image=image, keep=keep)
    if json_:
        print_json(rep.to_json())
    else:
        t = Table(box=None, header_style="bold")
        for col in ("#", "OP", "WHAT", "", "DIFFERENCES"):
            t.add_column(col, overflow="fold", no_wrap=col in ("#", "OP", ""))
        marks = {"same": Text("same", "green"), "differs": Text("DIFFERS", "bold red"),
                 "skipped": Text("skipped", "dim")}
        for s in rep.steps:
            diffs: Any = "; ".join(f"{k}: {_short(a)} -> {_short(b)}"
                                   for k, (a, b) in s.diffs.items()) or s.note
            t.add_row(str(s.index), s.op, Text(_clip(s.what)), marks[s.status],
                      Text(inert(diffs)))
        out.print(t)
        if rep.base.startswith("sb-"):
            err.print(f"started from {rep.base}: those parent steps were replayed first")
        n = len(rep.differences)
        err.print(f"replayed {sandbox_id} in {rep.replay_id} (image {rep.image}): "
                  + ("identical" if not n else f"{n} step(s) differ"))
    if rep.differences:
        raise typer.Exit(1)


def _short(v: Any) -> str:
    s = str(v)
    return s[:12] if isinstance(v, str) and len(s) == 64 else s
