"""An episode's sandbox, for any adapter: started on the task's snapshot, rewound in place,
scored by the task's script; and errors sorted into the policy's own and the platform's.

The start state (image + files + setup) is built once per task and kept as a corral snapshot
named after its recipe (Task.snapshot_name), shared by every environment of the task, in this
process or another. A rewind restores the sandbox to it in place (every process killed, files
rewound, same id), which costs less than a new sandbox plus the old one's kill.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping
from typing import Any

import corral
from corral import errors as ce
from corral.rl.task import Task


def _spec(task: Task, endpoint: str | None,
          labels: Mapping[str, str] | None = None) -> dict[str, Any]:
    return {"cpu": task.cpu, "memory_mb": task.memory_mb, "network": task.network,
            "cwd": task.cwd, "timeout": 24 * 3600, "labels": {"corral.rl": "1", **(labels or {})},
            "endpoint": endpoint}


def start(task: Task, endpoint: str | None = None,
          labels: Mapping[str, str] | None = None) -> corral.Sandbox:
    """A sandbox in the task's start state, making the shared snapshot if it is missing."""
    name = task.snapshot_name()
    try:
        return corral.Sandbox(snapshot=name, **_spec(task, endpoint, labels))
    except ce.SnapshotNotFound:
        pass
    sb = corral.Sandbox(task.image, **_spec(task, endpoint, labels))
    try:
        for path, content in task.files.items():
            sb.files.write(path, content)
        for cmd in task.setup:
            sb.exec(cmd, timeout=600, cwd="/").check()  # in /: task.cwd may not exist yet
        try:
            sb.snapshot(name)
        except ce.SnapshotExists:
            pass  # another environment of the task made it meanwhile: the same recipe
    except BaseException:
        sb.kill()
        raise
    return sb


def rewind(sb: corral.Sandbox | None, task: Task, endpoint: str | None = None,
           labels: Mapping[str, str] | None = None) -> corral.Sandbox:
    """``sb`` restored to the task's start state, or a new sandbox if it (or the snapshot) is
    gone."""
    if sb is not None:
        try:
            sb.restore(task.snapshot_name())
            return sb
        except ce.CorralError:
            discard(sb)
    return start(task, endpoint, labels)


def discard(sb: corral.Sandbox | None) -> None:
    if sb is not None:
        try:
            sb.kill()
        except ce.CorralError:
            pass


def score(sb: corral.Sandbox, task: Task) -> float:
    """Run the scoring script as root from a file written for this run and removed after it,
    so the agent never finds it between steps. A script that fails (exits non-zero) scores
    0.0, whatever it printed (the agent's code it runs may print a number); one that exits 0
    scores the finite number on its last line of output, else 1.0."""
    path = f"/tmp/.corral-score-{secrets.token_hex(8)}"
    sb.files.write(path, task.score, mode=0o700)
    try:
        r = sb.exec(["/bin/sh", path], timeout=task.score_timeout, cwd=task.cwd)
    finally:
        sb.files.remove(path)
    if not r.ok:
        return 0.0
    lines = [x for x in r.stdout.strip().splitlines() if x.strip()]
    if lines:
        try:
            got = float(lines[-1])
        except ValueError:
            return 1.0
        return got if math.isfinite(got) else 0.0  # NaN would be read as masked, inf as won
    return 1.0


def is_infra(e: ce.CorralError) -> bool:
    """Not the policy's doing, so a trainer masks it: a platform failure, or the sandbox
    ended from outside the episode (``sandbox_not_running`` itself: killed by its client,
    not started, being restored). How it ended of its own (``sandbox_crashed``: OOM, its
    pids limit, its init's exit; ``sandbox_expired``) is the policy's."""
    return e.infra or type(e) is ce.SandboxNotRunning


def sandbox_gone(e: ce.CorralError) -> bool:
    return isinstance(e, ce.SandboxNotRunning | ce.SandboxLost | ce.SandboxNotFound)
