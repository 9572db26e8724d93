"""A task: where an episode starts and how it is scored.

The start state is built once per task and kept as a corral snapshot named after the task's
recipe (image, files, setup), shared by every environment of the task, so a reset restores
files instead of rebuilding them. The scoring script runs as root after the agent's command
(every step, or only at the end with ``score_every_step=False``) from a file written just for
that run and removed after it, so the agent never sees it between steps. A script that exits
non-zero scores 0.0; one that exits 0 scores the finite number on its last line of output, else
1.0. It runs in the agent's sandbox: an agent running as root (``user=None``) can change what
it runs on (the shell, the interpreter); give the agent a ``user`` for training.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Task:
    instruction: str = ""                 # the first observation of every episode
    image: str = "host"
    files: Mapping[str, str] = field(default_factory=dict)   # written before setup
    setup: Sequence[str] = ()             # shell commands (as root) that build the start state
    score: str = "exit 0"                 # shell script; see the module docstring
    success: float = 1.0                  # a score at or above it ends the episode
    max_steps: int = 20                   # then the episode is truncated
    submit: str | None = "submit"         # an action that ends the episode and scores it
    score_every_step: bool = True
    user: str | None = None               # the agent's commands run as (default root)
    cwd: str = "/root"
    command_timeout: float = 30.0
    score_timeout: float = 60.0
    max_output: int = 8192                # characters of output in an observation
    cpu: float = 1.0
    memory_mb: int = 512
    network: str = "none"

    @classmethod
    def of(cls, task: Task | Mapping[str, Any]) -> Task:
        if isinstance(task, Task):
            return task
        if not isinstance(task, Mapping):
            raise TypeError(f"task must be a corral.gym.Task or a mapping, not {type(task)}")
        return cls(**task)

    def __post_init__(self) -> None:
        if self.max_steps < 1 or self.max_output < 1:
            raise ValueError("max_steps and max_output must be at least 1")
        object.__setattr__(self, "files", dict(self.files))
        object.__setattr__(self, "setup", tuple(self.setup))

    def snapshot_name(self) -> str:
        """The start state's snapshot: the same recipe, the same name."""
        recipe = json.dumps({"image": self.image, "files": sorted(self.files.items()),
                             "setup": list(self.setup)}, sort_keys=True)
        return "gym-" + hashlib.sha256(recipe.encode()).hexdigest()[:24]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["setup"] = list(self.setup)
        return d
