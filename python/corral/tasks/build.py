"""A task's start state: its Dockerfile's steps run once in a sandbox on the base image, kept
as a corral snapshot named after the recipe (TaskDir.snapshot_name). Every trial of the task,
in this process or a later one, starts from that snapshot; a build never runs twice."""

from __future__ import annotations

import asyncio
import os
import posixpath
from typing import Any

from corral import errors as ce
from corral.sdk import AsyncSandbox, AsyncSnapshot
from corral.tasks.dockerfile import Copy, Run
from corral.tasks.taskdir import TaskDir

BUILD_LABEL = "corral-tasks-build"


def sandbox_spec(task: TaskDir, network: str) -> dict[str, Any]:
    """What every sandbox of the task gets (the build's and the trials')."""
    b = task.build
    spec: dict[str, Any] = {"cpu": task.cpus, "memory_mb": task.memory_mb,
                            "network": network, "env": dict(b.env) or None,
                            "cwd": b.workdir, "user": b.user}
    if task.storage_mb is not None:
        spec["disk_mb"] = task.storage_mb
    return spec


class Builder:
    """Builds each recipe once per process (trials of one task wait for one build)."""

    def __init__(self, network: str = "none", endpoint: str | None = None) -> None:
        self.network = network
        self.endpoint = endpoint
        self._locks: dict[str, asyncio.Lock] = {}

    async def ensure(self, task: TaskDir) -> str:
        """The name of the task's start snapshot, built now if no one has."""
        name = task.snapshot_name()
        async with self._locks.setdefault(name, asyncio.Lock()):
            try:
                await AsyncSnapshot.get(name, endpoint=self.endpoint)
                return name
            except ce.SnapshotNotFound:
                pass
            await self._build(task, name)
        return name

    async def _build(self, task: TaskDir, name: str) -> None:
        spec = sandbox_spec(task, self.network)
        spec.update(env=None, user=None, cwd="/", timeout=task.build_timeout + 600,
                    labels={BUILD_LABEL: name})
        sb = await AsyncSandbox.create(task.build.base, endpoint=self.endpoint, **spec)
        try:
            for step in task.build.steps:
                if isinstance(step, Run):
                    r = await sb.exec(["/bin/sh", "-c", step.cmd], cwd=step.cwd,
                                      env=dict(step.env) or None, user=step.user,
                                      timeout=task.build_timeout)
                    if not r.ok:
                        raise ce.InvalidRequest(
                            f"task {task.name}: the build's RUN {step.cmd!r} exited "
                            f"{r.exit_code}: {(r.stdout + r.stderr)[-600:]}",
                            code="invalid_task")
                else:
                    await _copy(sb, step)
            try:
                await sb.snapshot(name)
            except ce.SnapshotExists:
                pass  # another process built the same recipe meanwhile
        finally:
            try:
                await sb.kill()
            except ce.CorralError:
                pass


async def _copy(sb: AsyncSandbox, step: Copy) -> None:
    """Docker's COPY: a directory's contents into dest, a file to dest (or into it)."""
    for src in step.sources:
        if src.is_dir():
            await sb.files.mkdir(step.dest)
            await sb.files.upload(src, step.dest)
            target = step.dest
        else:
            target = (posixpath.join(step.dest, src.name) if step.dest_is_dir else step.dest)
            data = await asyncio.to_thread(src.read_bytes)
            await sb.files.mkdir(posixpath.dirname(target) or "/")
            await sb.files.write(target, data, mode=os.stat(src).st_mode & 0o7777)
        if step.chown:
            (await sb.exec(["chown", "-R", step.chown, target], timeout=120)).check()


__all__ = ["BUILD_LABEL", "Builder", "sandbox_spec"]
