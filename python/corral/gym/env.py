"""``ShellEnv``: a gymnasium environment over one corral sandbox.

Observation: ``{"output": str, "exit_code": int}`` (the command's stdout then stderr, fitted by
spaces.fit; the first observation is the task's instruction). Action: a shell command (run
under ``/bin/sh -c``). Reward: the task's score (task.py). ``terminated`` when the score reaches
``task.success`` or the agent submits; ``truncated`` at ``task.max_steps``.

Reset restores the sandbox to the task's snapshot in place (its processes are killed, its
files rewound); the first reset builds the snapshot if no environment of the task has yet
(corral.rl.episode).

Failures are told apart, so a trainer can mask what is not the policy's doing: a platform
failure (``CorralError.infra``, or the sandbox killed from outside) ends the episode as
``truncated`` with ``info["infra_error"] = True`` and reward 0; a limit the agent hit (its
sandbox's memory or TTL) ends it as ``terminated`` with ``info["error_code"]`` and reward 0.
A later reset starts a fresh sandbox if the old one is gone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import gymnasium
from gymnasium import spaces

import corral
from corral import errors as ce
from corral.gym import spaces as text_spaces
from corral.rl import episode
from corral.rl.task import Task

MAX_ACTION = 16384


class ShellEnv(gymnasium.Env[dict[str, Any], str]):
    metadata = {"render_modes": ["ansi"], "render_fps": 1}

    def __init__(self, task: Task | Mapping[str, Any] | None = None,
                 render_mode: str | None = None, endpoint: str | None = None,
                 labels: Mapping[str, str] | None = None) -> None:
        self.task = Task.of(task if task is not None else {})
        self.labels = dict(labels or {})
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode must be one of {self.metadata['render_modes']}")
        self.render_mode = render_mode
        self.endpoint = endpoint
        self.observation_space = spaces.Dict({
            "output": text_spaces.text(self.task.max_output),
            "exit_code": spaces.Discrete(256),
        })
        self.action_space = text_spaces.text(MAX_ACTION)
        self.sandbox: corral.Sandbox | None = None
        self._steps = 0
        self._last = ""

    # ---- the sandbox (corral.rl.episode) ---------------------------------------------------
    def _drop(self) -> None:
        episode.discard(self.sandbox)
        self.sandbox = None

    @property
    def sandbox_id(self) -> str | None:
        return self.sandbox.id if self.sandbox is not None else None

    # ---- gymnasium ------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None,
              ) -> tuple[dict[str, Any], dict[str, Any]]:
        super().reset(seed=seed)
        self.sandbox = episode.rewind(self.sandbox, self.task, self.endpoint, self.labels)
        self._steps = 0
        self._last = ""
        obs = {"output": text_spaces.fit(self.task.instruction, self.task.max_output),
               "exit_code": 0}
        return obs, {"sandbox_id": self.sandbox_id}

    def step(self, action: str) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        if not isinstance(action, str):
            raise TypeError(f"an action is a shell command (str), not {type(action).__name__}")
        if len(action) > MAX_ACTION:
            raise ValueError(f"an action is at most {MAX_ACTION} characters")
        if self.sandbox is None:
            raise RuntimeError("call reset() before step()")
        t = self.task
        self._steps += 1
        submitted = t.submit is not None and action.strip() == t.submit
        info: dict[str, Any] = {"infra_error": False, "sandbox_id": self.sandbox.id}
        try:
            if submitted:
                output, code = "", 0
            else:
                r = self.sandbox.exec(action, timeout=t.command_timeout, user=t.user)
                output, code = r.stdout + r.stderr, r.exit_code & 0xFF
                info.update(exit_code=r.exit_code, timed_out=r.timed_out, truncated=r.truncated)
            last = submitted or self._steps >= t.max_steps
            score = episode.score(self.sandbox, self.task) if (t.score_every_step or last) else 0.0
        except ce.CorralError as e:
            return self._failed(e, info)
        info["score"] = score
        terminated = submitted or score >= t.success
        truncated = not terminated and self._steps >= t.max_steps
        self._last = f"$ {action}\n{output}"
        obs = {"output": text_spaces.fit(output, t.max_output), "exit_code": code}
        return obs, float(score), terminated, truncated, info

    def _failed(self, e: ce.CorralError, info: dict[str, Any],
                ) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        """An error ends the episode: infra -> truncated (mask it), the agent's -> terminated."""
        outside = episode.is_infra(e)
        info.update(infra_error=outside, error_code=e.code, error=e.message)
        if episode.sandbox_gone(e):
            self._drop()
        obs = {"output": text_spaces.fit(f"error: {e.message}", self.task.max_output),
               "exit_code": 0}
        return obs, 0.0, not outside, outside, info

    def render(self) -> str | None:
        if self.render_mode == "ansi":
            return self._last
        return None

    def close(self) -> None:
        self._drop()
        super().close()
