"""One RL episode: a fresh sandbox, the policy's edits and commands, the hidden test as the
reward, the sandbox thrown away."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

from corral.demo.policy import WORKDIR, ScriptedPolicy
from corral.demo.tasks import Task
from corral.errors import CorralError
from corral.sdk import AsyncSandbox, ExecResult

GRADER = "/opt/grader/hidden_test.py"  # outside the agent's workdir, written after it is done


@dataclass
class EpisodeResult:
    index: int
    task: str
    variant: str                  # what the policy wrote: "reference" or a wrong variant
    reward: float | None = None   # None when the episode was lost to an infra failure
    infra_error: str | None = None
    error: str | None = None      # a non-infra corral error: a bug somewhere, never expected
    create_ms: float | None = None
    exec_ms: list[float] = field(default_factory=list)
    grader_output: str = ""

    @property
    def expected_reward(self) -> float:
        return 1.0 if self.variant == "reference" else 0.0


async def run_episode(index: int, task: Task, rng: random.Random, policy: ScriptedPolicy,
                      labels: dict[str, str]) -> EpisodeResult:
    cand = policy.choose(task, rng)
    res = EpisodeResult(index=index, task=task.name, variant=cand.variant)

    async def sh(sb: AsyncSandbox, cmd: str | list[str], timeout: float,
                 **kw: Any) -> ExecResult:
        t0 = time.perf_counter()
        out = await sb.exec(cmd, timeout=timeout, **kw)
        res.exec_ms.append((time.perf_counter() - t0) * 1000)
        return out

    try:
        sb = AsyncSandbox(image="host", cpu=1, memory_mb=256, pids=128, timeout=120,
                          labels=labels)
        t0 = time.perf_counter()
        async with sb:
            res.create_ms = (time.perf_counter() - t0) * 1000
            # The environment: a statement and a starter file.
            await sb.files.write(f"{WORKDIR}/TASK.md", task.statement)
            await sb.files.write(f"{WORKDIR}/solution.py", task.starter)
            # The agent: look, edit, try.
            for cmd in policy.look_around():
                await sh(sb, cmd, timeout=10)
            await sb.files.write(f"{WORKDIR}/solution.py", cand.source)
            for cmd in policy.try_it():
                await sh(sb, cmd, timeout=10)
            # The reward: the hidden test, only now put into the sandbox.
            await sb.files.write(GRADER, task.hidden_test)
            graded = await sh(sb, ["/usr/bin/python3", GRADER], cwd=WORKDIR, timeout=30,
                              env={"PYTHONPATH": WORKDIR})
            res.grader_output = (graded.stdout + graded.stderr)[-400:]
            res.reward = 1.0 if graded.exit_code == 0 else 0.0
    except CorralError as e:
        if e.infra:
            res.reward = None  # masked: the platform failed, not the policy
            res.infra_error = str(e)
        else:
            res.error = str(e)
    return res
