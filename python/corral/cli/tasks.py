"""``corral tasks run DIR``: Harbor / Terminal-Bench style task directories, each trial in a
fresh sandbox, rewards to a JSONL file (corral.tasks)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from corral.cli.output import err, handled, out, print_json
from corral.tasks import RunSummary, TrialResult, agents, load_tasks, run_tasks

app = typer.Typer(help="Run Harbor / Terminal-Bench style task directories.")


@app.command("run")
@handled()
def run(
    path: Path = typer.Argument(..., help="A task directory, or a directory of them."),
    agent: str | None = typer.Option(None, "--agent", "-a",
                                     help="A built-in agent: oracle (default) or nop."),
    agent_command: str | None = typer.Option(
        None, "--agent-command", help="An agent run in the sandbox under /bin/sh -c "
        "(the instruction in $TASK_INSTRUCTION)."),
    agent_import_path: str | None = typer.Option(
        None, "--agent-import-path", help="A Python policy, module:function."),
    results: Path = typer.Option(Path("results.jsonl"), "--results", "-o",
                                 help="Results JSONL; an existing one is resumed."),
    attempts: int = typer.Option(1, "--attempts", "-k", min=1, help="Trials per task."),
    concurrency: int = typer.Option(4, "--concurrency", "-c", min=1, help="Trials at a time."),
    image: str | None = typer.Option(None, "--image",
                                     help="Build every task on this corral image instead of "
                                          "its Dockerfile's FROM / docker_image."),
    network: str = typer.Option("none", "--network", help="The sandboxes' network mode."),
    json_: bool = typer.Option(False, "--json", help="The summary as JSON on stdout."),
) -> None:
    """Run every task (x attempts) with an agent, then its tests; write one JSONL record per
    trial. Exits 1 if a trial hit an infra failure or an error."""
    tasks = load_tasks(path)
    if image is not None:
        tasks = [t.with_image(image) for t in tasks]
    name, fn = agents.resolve(agent, agent_command, agent_import_path)
    with Progress(TextColumn("[bold]trials"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("reward {task.fields[reward]}"), TimeElapsedColumn(),
                  console=err, transient=json_, disable=json_) as progress:
        bar = progress.add_task("trials", total=len(tasks) * attempts, reward="-")
        rewards: list[float] = []

        def on_trial(r: TrialResult) -> None:
            if r.reward is not None:
                rewards.append(r.reward)
            mean = f"{sum(rewards) / len(rewards):.3f}" if rewards else "-"
            progress.update(bar, advance=1, reward=mean)

        summary = asyncio.run(run_tasks(tasks, fn, name, results, attempts=attempts,
                                        concurrency=concurrency, network=network,
                                        on_trial=on_trial))
    if json_:
        print_json(summary.to_dict())
    else:
        out.print(summary_table(summary, name, results))
        for r in summary.results:
            if r.status in ("infra", "error"):
                err.print(f"{r.task} #{r.attempt}: {r.status} [{r.error_code}] {r.error}")
    if summary.count("infra") or summary.count("error"):
        raise typer.Exit(1)


def summary_table(s: RunSummary, agent: str, results: Path) -> Table:
    d = s.to_dict()
    t = Table(title=f"corral tasks run ({agent})", show_header=False, title_style="bold")
    t.add_column(style="bold")
    t.add_column(justify="right")
    t.add_row("run", f"{s.run_id} -> {results}")
    t.add_row("trials", f"{d['trials']} ({d['ran']} run now, {d['resumed']} resumed)")
    t.add_row("wall time", f"{s.wall_s:.2f} s")
    t.add_row("reward mean", "-" if s.reward_mean is None else f"{s.reward_mean:.3f}")
    t.add_row("verdicts", f"{d['ok']} scored, {d['no_reward']} without a reward (0)")
    t.add_row("infra failures (masked)", str(d["infra_failures"]))
    t.add_row("errors", str(d["errors"]))
    for task, mean in d["per_task"].items():
        t.add_row(f"  {task}", f"{mean:.3f}")
    return t
