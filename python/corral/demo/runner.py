"""Run many episodes concurrently on one event loop and summarize them."""

from __future__ import annotations

import asyncio
import math
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from corral.demo.episode import EpisodeResult, run_episode
from corral.demo.policy import ScriptedPolicy
from corral.demo.tasks import load_tasks
from corral.errors import CorralError
from corral.sdk import AsyncSandbox

DEMO_LABEL = "corral-demo"


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no data."""
    if not values:
        return None
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))]


@dataclass
class Summary:
    episodes: int
    completed: int
    infra_failures: int
    errors: int
    wall_s: float
    reward_mean: float | None
    create_ms: list[float] = field(repr=False)
    exec_ms: list[float] = field(repr=False)
    consistent: int                   # episodes whose reward matched the policy's choice
    per_task: dict[str, dict[str, Any]]
    results: list[EpisodeResult] = field(repr=False)

    @property
    def episodes_per_s(self) -> float:
        return self.episodes / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        def r(x: float | None, nd: int = 2) -> float | None:
            return None if x is None else round(x, nd)

        return {
            "episodes": self.episodes,
            "completed": self.completed,
            "wall_s": r(self.wall_s, 3),
            "episodes_per_s": r(self.episodes_per_s),
            "reward_mean": r(self.reward_mean, 4),
            "create_ms_p50": r(percentile(self.create_ms, 50)),
            "create_ms_p99": r(percentile(self.create_ms, 99)),
            "exec_ms_p50": r(percentile(self.exec_ms, 50)),
            "exec_ms_p99": r(percentile(self.exec_ms, 99)),
            "execs": len(self.exec_ms),
            "infra_failures": self.infra_failures,
            "errors": self.errors,
            "reward_matches_policy": self.consistent,
            "per_task": self.per_task,
        }


async def run_demo(episodes: int = 256, concurrency: int = 32, seed: int = 0,
                   p_correct: float = 0.6,
                   on_episode: Callable[[EpisodeResult], None] | None = None) -> Summary:
    """``episodes`` episodes, at most ``concurrency`` at a time; deterministic per seed."""
    tasks = load_tasks()
    policy = ScriptedPolicy(p_correct=p_correct)
    labels = {DEMO_LABEL: uuid.uuid4().hex[:12]}
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(episodes):
        queue.put_nowait(i)
    results: list[EpisodeResult] = []

    async def worker() -> None:
        while not queue.empty():
            i = queue.get_nowait()
            # Per-episode rng: the same seed gives the same choices at any concurrency.
            rng = random.Random(f"{seed}:{i}")
            task = tasks[rng.randrange(len(tasks))]
            res = await run_episode(i, task, rng, policy, labels)
            results.append(res)
            if on_episode is not None:
                on_episode(res)

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, episodes)))))
    finally:
        wall = time.perf_counter() - t0
        await _sweep(labels)
    return summarize(sorted(results, key=lambda r: r.index), wall)


async def _sweep(labels: dict[str, str]) -> None:
    """Kill anything of this run still alive (an interrupted run, a failed kill)."""
    try:
        for sb in await AsyncSandbox.list(labels=labels):
            try:
                await sb.kill()
            except CorralError:
                pass
    except CorralError:
        pass


def summarize(results: list[EpisodeResult], wall_s: float) -> Summary:
    done = [r for r in results if r.reward is not None]
    per_task: dict[str, dict[str, Any]] = {}
    for r in done:
        t = per_task.setdefault(r.task, {"episodes": 0, "reward_sum": 0.0})
        t["episodes"] += 1
        t["reward_sum"] += r.reward or 0.0
    for t in per_task.values():
        t["reward_mean"] = round(t.pop("reward_sum") / t["episodes"], 4)
    return Summary(
        episodes=len(results),
        completed=len(done),
        infra_failures=sum(r.infra_error is not None for r in results),
        errors=sum(r.error is not None for r in results),
        wall_s=wall_s,
        reward_mean=(sum(r.reward or 0.0 for r in done) / len(done)) if done else None,
        create_ms=[r.create_ms for r in results if r.create_ms is not None],
        exec_ms=[x for r in results for x in r.exec_ms],
        consistent=sum(r.reward == r.expected_reward for r in done),
        per_task=dict(sorted(per_task.items())),
        results=results,
    )
