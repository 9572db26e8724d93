"""Demo episodes through the gymnasium environment (corral.gym): a bundled task as a gym
task, the scripted policy's choices as shell actions, the hidden test as the scoring script.

The hidden test is never in the sandbox while the agent acts: it is the task's scoring script,
which the environment writes for one run after the agent submits and removes after it
(corral.rl.episode.score)."""

from __future__ import annotations

import random
import shlex
import time
from dataclasses import dataclass
from typing import Any

from corral.demo.policy import WORKDIR, Candidate, ScriptedPolicy
from corral.demo.tasks import Task
from corral.rl.task import Task as GymTask

EOF_MARK = "CORRAL_DEMO_EOF"


@dataclass
class EpisodeResult:
    index: int
    task: str
    variant: str                  # what the policy wrote: "reference" or a wrong variant
    reward: float | None = None   # None when the episode was lost to an infra failure
    infra_error: str | None = None
    error: str | None = None      # a non-infra error: a bug somewhere, never expected
    steps: int = 0                # actions taken (the last one, submit, scores)

    @property
    def expected_reward(self) -> float:
        return 1.0 if self.variant == "reference" else 0.0


def gym_task(task: Task) -> GymTask:
    """The bundled task as a corral.gym task: statement and starter as files, the hidden test
    as the score (exit 0: 1, else 0)."""
    if EOF_MARK in task.hidden_test:
        raise ValueError(f"task {task.name}: the hidden test contains {EOF_MARK}")
    score = (f"cd {WORKDIR} && PYTHONPATH={WORKDIR} /usr/bin/python3 - >/dev/null 2>&1 "
             f"<<'{EOF_MARK}' && echo 1 || echo 0\n{task.hidden_test}\n{EOF_MARK}\n")
    return GymTask(instruction=task.statement,
                   files={f"{WORKDIR}/TASK.md": task.statement,
                          f"{WORKDIR}/solution.py": task.starter},
                   score=score, score_every_step=False, cwd=WORKDIR, max_steps=16,
                   command_timeout=10, score_timeout=30, memory_mb=256)


def actions(policy: ScriptedPolicy, cand: Candidate) -> list[str]:
    """The episode's actions: look, write the candidate, try it, submit."""
    if EOF_MARK in cand.source:
        raise ValueError(f"a candidate contains {EOF_MARK}")
    write = f"cat > {shlex.quote(WORKDIR + '/solution.py')} <<'{EOF_MARK}'\n{cand.source}{EOF_MARK}"
    return [*policy.look_around(), write, *policy.try_it(), "submit"]


def choose(task: Task, policy: ScriptedPolicy, seed: int, index: int) -> Candidate:
    # Per-episode rng: the same seed gives the same choices at any concurrency.
    return policy.choose(task, random.Random(f"{seed}:{index}:choice"))


def now_ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def finish(res: EpisodeResult, reward: float, info: dict[str, Any]) -> None:
    """The last step's verdict: a reward, or a masked / failed episode."""
    if info.get("infra_error"):
        res.infra_error = f"[{info.get('error_code')}] {info.get('error')}"
    elif info.get("error_code"):
        res.error = f"[{info['error_code']}] {info.get('error')}"
    else:
        res.reward = float(reward)
