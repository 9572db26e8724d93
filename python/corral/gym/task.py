"""The task type, shared with the other RL adapters (corral.rl.task)."""

from corral.rl.task import Task

__all__ = ["Task"]
