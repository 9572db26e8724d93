"""A scripted stand-in for an LLM agent: it looks around, reads the starter, writes a candidate
(the reference with probability ``p_correct``, else one of the task's wrong variants), and
smoke-runs it, the way an agent's shell tool calls would."""

from __future__ import annotations

import random
from dataclasses import dataclass

from corral.demo.tasks import Task

WORKDIR = "/work"


@dataclass(frozen=True)
class Candidate:
    variant: str  # "reference" or the wrong variant's name
    source: str

    @property
    def correct(self) -> bool:
        return self.variant == "reference"


@dataclass(frozen=True)
class ScriptedPolicy:
    p_correct: float = 0.6

    def choose(self, task: Task, rng: random.Random) -> Candidate:
        if rng.random() < self.p_correct:
            return Candidate("reference", task.reference)
        name = rng.choice(sorted(task.wrong))
        return Candidate(name, task.wrong[name])

    def look_around(self) -> list[str]:
        """Shell commands before editing."""
        return [f"ls -la {WORKDIR}", f"cat {WORKDIR}/TASK.md {WORKDIR}/solution.py"]

    def try_it(self) -> list[str]:
        """Shell commands after editing."""
        return [f"cd {WORKDIR} && python3 solution.py"]
