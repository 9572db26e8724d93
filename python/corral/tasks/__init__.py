"""Harbor / Terminal-Bench style task directories run in corral sandboxes.

taskdir.py     read a task directory (task.toml, instruction.md, environment/, tests/,
               solution/); environment/Dockerfile is read by corral.sdk.dockerfile
agents.py      oracle, nop, an in-sandbox command, a Python policy
environment.py the environment built as a corral image (corral.sdk.build, each step a
               cached layer)
runner.py      trials run concurrently, results JSONL, resume from the trajectory log
"""

from corral.tasks.runner import RunSummary, TrialResult, run_tasks
from corral.tasks.taskdir import TaskDir, load_tasks

__all__ = ["RunSummary", "TaskDir", "TrialResult", "load_tasks", "run_tasks"]
