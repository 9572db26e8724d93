"""The bundled programming tasks: one directory each under ``tasks/``.

A task directory holds ``task.md`` (the statement), ``starter.py`` (what the agent is given as
``solution.py``), ``hidden_test.py`` (the reward: exit 0 means solved; written into the sandbox
only after the agent is done), ``solution.py`` (a correct reference) and one or more
``wrong_*.py`` (plausible wrong answers).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

TASKS_DIR = Path(__file__).parent / "tasks"


@dataclass(frozen=True)
class Task:
    name: str
    statement: str
    starter: str
    hidden_test: str
    reference: str
    wrong: dict[str, str]  # variant name ("wrong_...") -> source


@cache
def load_tasks() -> tuple[Task, ...]:
    tasks = []
    for d in sorted(p for p in TASKS_DIR.iterdir() if (p / "task.md").is_file()):
        wrong = {p.stem: p.read_text() for p in sorted(d.glob("wrong_*.py"))}
        if not wrong:
            raise ValueError(f"task {d.name} has no wrong_*.py variant")
        tasks.append(Task(name=d.name, statement=(d / "task.md").read_text(),
                          starter=(d / "starter.py").read_text(),
                          hidden_test=(d / "hidden_test.py").read_text(),
                          reference=(d / "solution.py").read_text(), wrong=wrong))
    return tuple(tasks)
