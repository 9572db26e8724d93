"""``corral.gym``: corral sandboxes as gymnasium environments (docs/gym.md).

Importing this module registers ``corral/Shell-v0``; ``gymnasium.make("corral.gym:corral/Shell-v0",
task=...)`` imports it for you.

task.py    what an episode is: a start state (image, files, setup commands) and a scoring script
spaces.py  the text spaces of observations and actions, and fitting output into them
env.py     ShellEnv: one sandbox, reset by restoring the task's snapshot
vector.py  ShellVectorEnv: n sandboxes stepped concurrently (``gymnasium.make_vec``)
"""

from __future__ import annotations

import gymnasium

from corral.gym.env import ShellEnv
from corral.rl.task import Task

ENV_ID = "corral/Shell-v0"

if ENV_ID not in gymnasium.registry:
    gymnasium.register(ENV_ID, entry_point="corral.gym.env:ShellEnv",
                       vector_entry_point="corral.gym.vector:ShellVectorEnv")

__all__ = ["ENV_ID", "ShellEnv", "Task"]
