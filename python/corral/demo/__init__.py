"""``corral demo``: an RL-style rollout workload on bundled programming tasks.

tasks.py    the bundled tasks (statement, starter, hidden test, reference, wrong variants)
policy.py   the scripted policy that stands in for an LLM agent
episode.py  one episode in a fresh sandbox, the hidden test as the reward
runner.py   many episodes concurrently on one event loop; the summary
"""

from corral.demo.runner import Summary, run_demo
from corral.demo.tasks import Task, load_tasks

__all__ = ["Summary", "Task", "load_tasks", "run_demo"]
