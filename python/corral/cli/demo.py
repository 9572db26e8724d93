"""``corral demo``: run the rollout workload with a progress bar, then the summary table."""

from __future__ import annotations

import asyncio

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from corral.cli.output import err, handled, out, print_json
from corral.demo import Summary, run_demo

app = typer.Typer()


@app.command()
@handled()
def demo(
    episodes: int = typer.Option(256, "--episodes", "-n", min=1, help="Episodes to run."),
    concurrency: int = typer.Option(32, "--concurrency", "-c", min=1,
                                    help="Episodes at a time."),
    seed: int = typer.Option(0, "--seed", help="Seed of the policy's choices."),
    p_correct: float = typer.Option(0.6, "--p-correct", min=0.0, max=1.0,
                                    help="How often the policy writes a correct solution."),
    json_: bool = typer.Option(False, "--json", help="The summary as JSON on stdout."),
    cluster: str | None = typer.Option(
        None, "--cluster", help="Run through the corral cluster of the Ray cluster at this "
                                "address ('auto': the one this machine is in), deployed for "
                                "the run and stopped after if none runs there."),
) -> None:
    """RL-style rollouts on bundled programming tasks, through the gymnasium environment.

    Each episode: a corral/Shell-v0 environment reset to the task's start state, a scripted
    agent's shell actions, a hidden test as the reward; episodes of a task run in batches on a
    vector environment. Exits 1 if any episode hit an infra failure or an error.
    """
    if cluster is not None:
        from corral.cluster import deployed_for

        with deployed_for(cluster) as ep:
            err.print(f"through the cluster gateway {ep.url}")
            _run(episodes, concurrency, seed, p_correct, json_)
        return
    _run(episodes, concurrency, seed, p_correct, json_)


def _run(episodes: int, concurrency: int, seed: int, p_correct: float, json_: bool) -> None:
    with Progress(TextColumn("[bold]episodes"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("reward {task.fields[reward]}"), TimeElapsedColumn(),
                  console=err, transient=json_, disable=json_) as progress:
        bar = progress.add_task("episodes", total=episodes, reward="-")
        rewards: list[float] = []

        def on_episode(res: object) -> None:
            reward = getattr(res, "reward", None)
            if reward is not None:
                rewards.append(reward)
            mean = f"{sum(rewards) / len(rewards):.3f}" if rewards else "-"
            progress.update(bar, advance=1, reward=mean)

        summary = asyncio.run(run_demo(episodes=episodes, concurrency=concurrency, seed=seed,
                                       p_correct=p_correct, on_episode=on_episode))
    if json_:
        print_json(summary.to_dict())
    else:
        out.print(summary_table(summary, concurrency))
        for r in summary.results:
            if r.error or r.infra_error:
                err.print(f"episode {r.index} ({r.task}): {r.error or r.infra_error}")
                break
    if summary.errors or summary.infra_failures:
        raise typer.Exit(1)


def summary_table(s: Summary, concurrency: int) -> Table:
    d = s.to_dict()

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f} ms"

    t = Table(title="corral demo", show_header=False, title_style="bold", min_width=44)
    t.add_column(style="bold")
    t.add_column(justify="right")
    t.add_row("episodes", f"{s.episodes} ({d['batches']} batches of <= {concurrency})")
    t.add_row("wall time", f"{s.wall_s:.2f} s")
    t.add_row("episodes/s", f"{s.episodes_per_s:.1f}")
    t.add_row("reward mean", "-" if s.reward_mean is None else f"{s.reward_mean:.3f}")
    t.add_row("reward = policy's choice", f"{s.consistent} / {s.completed}")
    t.add_row("vector reset p50 / p99", f"{ms(d['reset_ms_p50'])} / {ms(d['reset_ms_p99'])}")
    t.add_row("vector step p50 / p99", f"{ms(d['step_ms_p50'])} / {ms(d['step_ms_p99'])}")
    t.add_row("infra failures (masked)", str(s.infra_failures))
    t.add_row("errors", str(s.errors))
    return t
