"""A TRL environment: ``GRPOTrainer(..., environment_factory=CorralEnv)``.

TRL's ``environment_factory`` contract (GRPOTrainer, trl 1.x; duck-typed, nothing of trl is
imported here): the factory makes one instance per concurrent rollout, instances are pooled
and reused; ``reset(**row)`` is called with the dataset row before each rollout and a string
it returns is appended to the last user message; every public method is a tool the model may
call (its schema read from the type hints and the Google-style docstring), called with the
call's arguments, an exception becoming ``{"error": ...}`` in the tool message;
``get_reward()`` scores the finished rollout, and ``None`` marks it unscorable (NaN, left out
of the group's baseline, advantage 0): that is how a platform failure is masked.

A CorralEnv keeps one sandbox. ``reset`` puts it in the row's task start state (the row's
``task`` column: a corral.rl Task or a dict/JSON of its fields; else the factory's task) by
restoring the task's snapshot in place (corral.rl.episode). The tools are corral.tools'
(``bash``, ``read_file``, ``write_file``, ``str_replace``); a model's bad call comes back as
text it can read, a platform failure raises (TRL shows it as an error) and makes
``get_reward`` return None. The sandbox is killed when the instance is collected or the
interpreter exits.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Mapping
from typing import Any

import corral
from corral import errors as ce
from corral import tools as corral_tools
from corral.rl import episode
from corral.rl.task import Task


class CorralEnv:
    def __init__(self, task: Task | Mapping[str, Any] | None = None,
                 endpoint: str | None = None) -> None:
        self._default = Task.of(task) if task is not None else None
        self._task: Task | None = None
        self._endpoint = endpoint
        self._sb: corral.Sandbox | None = None
        self._infra: str | None = None
        self._finalizer: weakref.finalize | None = None

    # ---- TRL's hooks -----------------------------------------------------------------------
    def reset(self, **row: Any) -> str | None:
        task = _row_task(row.get("task")) or self._default
        if task is None:
            raise ValueError("no task: give CorralEnv(task=...) or a 'task' column")
        self._task, self._infra = task, None
        try:
            self._sb = episode.rewind(self._sb, task, self._endpoint)
        except ce.CorralError as e:
            if not episode.is_infra(e):
                raise
            self._sb = None
            self._infra = str(e)  # the rollout goes ahead, unscored
            return task.instruction or None
        if self._finalizer is not None:
            self._finalizer.detach()
        self._finalizer = weakref.finalize(self, episode.discard, self._sb)
        return task.instruction or None

    def get_reward(self) -> float | None:
        """The task's score, or None (masked) if the platform failed during the rollout."""
        if self._infra is not None or self._sb is None or self._task is None:
            return None
        try:
            return episode.score(self._sb, self._task)
        except ce.CorralError as e:
            if episode.is_infra(e):
                self._infra = str(e)
                return None
            return 0.0  # the agent's own doing (its sandbox out of memory...)

    # ---- tools (each public method is one) -------------------------------------------------
    def bash(self, command: str, timeout: float = corral_tools.DEFAULT_TIMEOUT) -> str:
        """Run a shell command in the sandbox.

        Args:
            command: The command, run by /bin/sh -c.
            timeout: Seconds before it is killed (at most 600).

        Returns:
            Its stdout and stderr, then its exit code.
        """
        return self._call("bash", command=command, timeout=timeout)

    def read_file(self, path: str) -> str:
        """Read a text file from the sandbox.

        Args:
            path: Absolute path in the sandbox.

        Returns:
            The file's text.
        """
        return self._call("read_file", path=path)

    def write_file(self, path: str, content: str) -> str:
        """Write a text file in the sandbox (parents are created, an existing file replaced).

        Args:
            path: Absolute path in the sandbox.
            content: The file's new text.

        Returns:
            What was written.
        """
        return self._call("write_file", path=path, content=content)

    def str_replace(self, path: str, old_str: str, new_str: str) -> str:
        """Replace the one occurrence of old_str in a file with new_str.

        Args:
            path: Absolute path in the sandbox.
            old_str: The text to replace; it must occur exactly once.
            new_str: The replacement.

        Returns:
            What was replaced, or why nothing was.
        """
        return self._call("str_replace", path=path, old_str=old_str, new_str=new_str)

    # ---- internals -------------------------------------------------------------------------
    def _call(self, name: str, **args: Any) -> str:
        if self._infra is not None:
            raise RuntimeError(f"the sandbox is unavailable: {self._infra}")
        if self._sb is None:
            raise RuntimeError("reset() was not called")
        res = corral_tools.execute(self._sb, {"name": name, "arguments": args})
        if res.infra:
            self._infra = res.content
            raise RuntimeError(res.content)  # TRL: {"error": ...}; get_reward masks it
        return res.content

    @property
    def _sandbox(self) -> corral.Sandbox | None:
        return self._sb

    def _close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self._sb = None


def _row_task(value: Any) -> Task | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = json.loads(value)
    return Task.of(value)


def main() -> None:
    """``python -m corral.rl.trl``: one scripted rollout through the calls GRPOTrainer makes
    (reset with the row, tool methods, get_reward), as a runnable example."""
    task = {"files": {"/work/task.txt": "write ok to /work/out"},
            "score": '[ "$(cat /work/out 2>/dev/null)" = ok ] && echo 1 || echo 0'}
    env = CorralEnv()
    try:
        print("reset:", env.reset(prompt="do the task in /work/task.txt", task=task))
        print("read_file:", env.read_file("/work/task.txt"))
        print("write_file:", env.write_file("/work/out", "ok"))
        print("reward:", env.get_reward())
    finally:
        env._close()


if __name__ == "__main__":
    main()
