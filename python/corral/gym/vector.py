"""``ShellVectorEnv``: ``num_envs`` ShellEnvs (one sandbox each) stepped concurrently.

``gymnasium.make_vec("corral/Shell-v0", num_envs=n, task=...)`` builds it (the registration's
``vector_entry_point``). Each step runs every environment's command at the same time on a
thread pool (the sandboxes are independent; corral's blocking SDK is thread-safe), so a step
takes about as long as the slowest command, not the sum. Autoreset is gymnasium's default,
next-step: an environment that ended is reset by the following ``step`` call, which returns
its first observation with reward 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array, iterate

from corral.gym.env import ShellEnv
from corral.rl.task import Task


class ShellVectorEnv(VectorEnv[Any, Any, Any]):
    metadata = {"render_modes": ["ansi"], "autoreset_mode": AutoresetMode.NEXT_STEP}

    def __init__(self, num_envs: int = 1, task: Task | Mapping[str, Any] | None = None,
                 render_mode: str | None = None, endpoint: str | None = None,
                 labels: Mapping[str, str] | None = None) -> None:
        if num_envs < 1:
            raise ValueError("num_envs must be at least 1")
        self.num_envs = num_envs
        self.envs = [ShellEnv(task, render_mode=render_mode, endpoint=endpoint, labels=labels)
                     for _ in range(num_envs)]
        self.render_mode = render_mode
        self.single_observation_space = self.envs[0].observation_space
        self.single_action_space = self.envs[0].action_space
        self.observation_space = batch_space(self.single_observation_space, num_envs)
        self.action_space = batch_space(self.single_action_space, num_envs)
        self._pool = ThreadPoolExecutor(max_workers=num_envs, thread_name_prefix="corral-gym")
        self._autoreset = np.zeros(num_envs, dtype=np.bool_)

    def _batch(self, obs: list[Any]) -> Any:
        out = create_empty_array(self.single_observation_space, self.num_envs)
        assert out is not None  # a Dict of Text and Discrete always has one
        return concatenate(self.single_observation_space, obs, out)

    def reset(self, *, seed: int | Sequence[int | None] | None = None,
              options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        if seed is None or isinstance(seed, int):
            seeds: list[int | None] = [None if seed is None else seed + i
                                       for i in range(self.num_envs)]
        else:
            seeds = list(seed)
            if len(seeds) != self.num_envs:
                raise ValueError(f"{len(seeds)} seeds for {self.num_envs} environments")
        results = list(self._pool.map(lambda e, s: e.reset(seed=s, options=options),
                                      self.envs, seeds))
        infos: dict[str, Any] = {}
        for i, (_, info) in enumerate(results):
            infos = self._add_info(infos, info, i)
        self._autoreset[:] = False
        return self._batch([o for o, _ in results]), infos

    def step(self, actions: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray,
                                          dict[str, Any]]:
        acts = list(iterate(self.action_space, actions))
        if len(acts) != self.num_envs:
            raise ValueError(f"{len(acts)} actions for {self.num_envs} environments")

        def one(i: int) -> tuple[Any, float, bool, bool, dict[str, Any]]:
            if self._autoreset[i]:
                obs, info = self.envs[i].reset()
                return obs, 0.0, False, False, info
            return self.envs[i].step(acts[i])

        results = list(self._pool.map(one, range(self.num_envs)))
        infos: dict[str, Any] = {}
        for i, r in enumerate(results):
            infos = self._add_info(infos, r[4], i)
        rewards = np.array([r[1] for r in results], dtype=np.float64)
        terminated = np.array([r[2] for r in results], dtype=np.bool_)
        truncated = np.array([r[3] for r in results], dtype=np.bool_)
        self._autoreset = terminated | truncated
        return self._batch([r[0] for r in results]), rewards, terminated, truncated, infos

    def render(self) -> tuple[Any, ...] | None:
        if self.render_mode is None:
            return None
        return tuple(e.render() for e in self.envs)

    def close_extras(self, **kwargs: Any) -> None:
        list(self._pool.map(lambda e: e.close(), self.envs))
        self._pool.shutdown(wait=True)
