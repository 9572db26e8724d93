"""Harbor / Terminal-Bench style task directories run in corral sandboxes.

taskdir.py     read a task directory (task.toml, instruction.md, environment/, tests/,
               solution/)
dockerfile.py  the Dockerfile subset a task's environment is built from
build.py       the start state: built once per recipe, kept as a snapshot
agents.py      oracle, nop, an in-sandbox command, a Python policy
runner.py      trials run concurrently, results JSONL, resume from the trajectory log
"""

from corral.tasks.runner import RunSummary, TrialResult, run_tasks
from corral.tasks.taskdir import TaskDir, load_tasks

__all__ = ["RunSummary", "TaskDir", "TrialResult", "load_tasks", "run_tasks"]
