"""Run the demo's episodes through corral.gym's vector environment and summarize them.

Episodes are grouped by task; each group runs in batches on a ``ShellVectorEnv`` of up to
``concurrency`` sandboxes (corral/Shell-v0 via ``gymnasium.make_vec``): one ``reset`` (every
sandbox restored to the task's snapshot), then one batched ``step`` per action, every
environment's command running at the same time."""

from __future__ import annotations

import asyncio
import math
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gymnasium

from corral.demo.episode import EpisodeResult, actions, choose, finish, gym_task, now_ms
from corral.demo.policy import ScriptedPolicy
from corral.demo.tasks import Task, load_tasks
from corral.errors import CorralError, SnapshotNotFound
from corral.rl import episode
from corral.rl.task import Task as GymTask
from corral.sdk import Sandbox, Snapshot

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
    reset_ms: list[float] = field(repr=False)   # one per batch
    step_ms: list[float] = field(repr=False)    # one per batched step
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
            "batches": len(self.reset_ms),
            "reset_ms_p50": r(percentile(self.reset_ms, 50)),
            "reset_ms_p99": r(percentile(self.reset_ms, 99)),
            "step_ms_p50": r(percentile(self.step_ms, 50)),
            "step_ms_p99": r(percentile(self.step_ms, 99)),
            "steps": len(self.step_ms),
            "infra_failures": self.infra_failures,
            "errors": self.errors,
            "reward_matches_policy": self.consistent,
            "per_task": self.per_task,
        }


async def run_demo(episodes: int = 256, concurrency: int = 32, seed: int = 0,
                   p_correct: float = 0.6,
                   on_episode: Callable[[EpisodeResult], None] | None = None) -> Summary:
    """``episodes`` episodes, batches of at most ``concurrency``; deterministic per seed."""
    tasks = load_tasks()
    policy = ScriptedPolicy(p_correct=p_correct)
    labels = {DEMO_LABEL: uuid.uuid4().hex[:12]}
    groups: dict[str, list[int]] = {}
    for i in range(episodes):
        task = tasks[random.Random(f"{seed}:{i}").randrange(len(tasks))]
        groups.setdefault(task.name, []).append(i)
    by_name = {t.name: t for t in tasks}
    results: list[EpisodeResult] = []
    reset_ms: list[float] = []
    step_ms: list[float] = []

    def run_all() -> None:
        for name, idx in groups.items():
            _ensure_snapshot(gym_task(by_name[name]), labels)
            for b in range(0, len(idx), concurrency):
                batch = _batch(by_name[name], idx[b:b + concurrency], policy, seed, labels,
                               reset_ms, step_ms)
                for res in batch:
                    results.append(res)
                    if on_episode is not None:
                        on_episode(res)

    t0 = time.perf_counter()
    try:
        await asyncio.to_thread(run_all)
    finally:
        wall = time.perf_counter() - t0
        await asyncio.to_thread(_sweep, labels)
    return summarize(sorted(results, key=lambda r: r.index), wall, reset_ms, step_ms)


def _ensure_snapshot(task: GymTask, labels: dict[str, str]) -> None:
    """Build the task's start snapshot once, before n environments would race to."""
    try:
        Snapshot.get(task.snapshot_name())
    except SnapshotNotFound:
        episode.discard(episode.start(task, labels=labels))
    except CorralError:
        pass  # the batch's reset reports it


def _batch(task: Task, idx: list[int], policy: ScriptedPolicy, seed: int,
           labels: dict[str, str], reset_log: list[float],
           step_log: list[float]) -> list[EpisodeResult]:
    """One batch of episodes of one task on one vector env, in lockstep."""
    cands = [choose(task, policy, seed, i) for i in idx]
    res = [EpisodeResult(index=i, task=task.name, variant=c.variant)
           for i, c in zip(idx, cands, strict=True)]
    plans = [actions(policy, c) for c in cands]
    try:
        envs = gymnasium.make_vec("corral.gym:corral/Shell-v0", num_envs=len(idx),
                                  task=gym_task(task), labels=labels)
    except CorralError as e:
        return _lost(res, e)
    try:
        t0 = time.perf_counter()
        envs.reset(seed=seed)
        reset_log.append(now_ms(t0))
        done = [False] * len(idx)
        for k in range(len(plans[0])):
            t0 = time.perf_counter()
            _, rewards, term, trunc, infos = envs.step(tuple(p[k] for p in plans))
            step_log.append(now_ms(t0))
            for j, r in enumerate(res):
                if done[j]:
                    continue
                r.steps += 1
                if term[j] or trunc[j]:
                    done[j] = True
                    finish(r, float(rewards[j]), _info(infos, j))
        for j, r in enumerate(res):
            if not done[j]:
                r.error = "the episode did not end at submit"
    except CorralError as e:
        return _lost(res, e)
    finally:
        envs.close()
    return res


def _info(infos: dict[str, Any], j: int) -> dict[str, Any]:
    """Environment j's entries of a vector env's batched info dict."""
    return {k: v[j] for k, v in infos.items()
            if not k.startswith("_") and infos.get(f"_{k}", [True] * (j + 1))[j]}


def _lost(res: list[EpisodeResult], e: CorralError) -> list[EpisodeResult]:
    for r in res:
        if r.reward is None and r.infra_error is None and r.error is None:
            if e.infra:
                r.infra_error = str(e)
            else:
                r.error = str(e)
    return res


def _sweep(labels: dict[str, str]) -> None:
    """Kill anything of this run still alive (an interrupted run, a failed close)."""
    try:
        for sb in Sandbox.list(labels=labels):
            try:
                sb.kill()
            except CorralError:
                pass
    except CorralError:
        pass


def summarize(results: list[EpisodeResult], wall_s: float, reset_ms: list[float],
              step_ms: list[float]) -> Summary:
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
        reset_ms=reset_ms,
        step_ms=step_ms,
        consistent=sum(r.reward == r.expected_reward for r in done),
        per_task=dict(sorted(per_task.items())),
        results=results,
    )
