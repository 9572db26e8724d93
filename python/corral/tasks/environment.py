"""A task's environment: its recipe (environment/Dockerfile, or [environment] docker_image)
built as a corral image by the image builder (corral.sdk.build: each RUN / COPY / WORKDIR
step run in a sandbox and committed as a layer, cached as ``build-<hash>``), tagged
``task-<name>``. Every trial is a fresh sandbox on that image."""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass

from corral import errors as ce
from corral.tasks.taskdir import TaskDir, invalid


@dataclass(frozen=True)
class Environment:
    image: str      # the built image (its last step's cached image: immutable by content)
    workdir: str    # its WorkingDir, where the verifier runs


class Environments:
    """Each task's environment image, built through the image builder once per process
    (trials of one task wait for one build); the builder's per-step cache makes a rebuild in
    a later process a few image look-ups."""

    def __init__(self, network: str, endpoint: str | None) -> None:
        self.network, self.endpoint = network, endpoint
        self._done: dict[tuple[str, str], Environment | ce.CorralError] = {}
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}

    async def ensure(self, task: TaskDir) -> Environment:
        key = (str(task.path), task.recipe.base)
        async with self._locks.setdefault(key, asyncio.Lock()):
            if key not in self._done:
                try:
                    self._done[key] = await asyncio.to_thread(self._build, task)
                except ce.CorralError as e:
                    if e.infra:
                        raise  # the platform's: the next trial tries again
                    self._done[key] = e  # the task's: every trial of it ends the same
        done = self._done[key]
        if isinstance(done, ce.CorralError):
            raise done
        return done

    def _build(self, task: TaskDir) -> Environment:
        if task.recipe.base == "host" and not task.recipe.steps:
            return Environment("host", "/")  # nothing to build (and host is not layers)
        name = "task-" + re.sub(r"[^a-z0-9_.-]+", "-", task.name.lower())[:50]
        try:
            res = task.recipe.build(name, endpoint=self.endpoint, network=self.network,
                                    step_timeout=task.build_timeout,
                                    memory_mb=task.memory_mb)
        except ce.InvalidRequest as e:  # a failing step, a COPY source gone: the task's
            d = e.details or {}
            what = (f"{d['step']} exited {d['exit_code']}" if "exit_code" in d
                    else "build failed")
            raise invalid(f"task {task.name}: the environment's {what}: "
                          f"{(d.get('stdout', '') + d.get('stderr', ''))[-600:] or e.message}"
                          ) from None
        wd = (res.image.config or {}).get("WorkingDir")
        return Environment(res.steps[-1].image if res.steps else res.image.name,
                           wd if isinstance(wd, str) and wd.startswith("/") else "/")


__all__ = ["Environment", "Environments"]
