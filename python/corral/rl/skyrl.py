"""A SkyRL-gym text environment (``skyrl_gym.envs.base_text_env.BaseTextEnv``) over a corral
sandbox, with corral.tools as its tools.

``skyrl_gym.make("corral-tools", env_config=..., extras={"task": {...}, "max_turns": n})``
after ``import corral.rl.skyrl``. ``extras["task"]`` is a corral.rl.task.Task (or its fields);
``env_config`` may name the daemon (``endpoint``). Each ``step`` takes the model's text, runs
the tool calls in it (``<tool_call>{...}</tool_call>``) and returns their results as one user
message; a turn with no tool call, or the last turn, ends the episode and the task's scoring
script gives the reward. A platform failure ends it with reward 0 and
``metadata["infra_error"] = True``, for the trainer to mask.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

import corral
from corral import errors as ce
from corral import tools
from corral.rl import episode
from corral.rl.task import Task

ENV_ID = "corral-tools"


class CorralToolEnv(BaseTextEnv):
    def __init__(self, env_config: Any = None, extras: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        extras = extras or {}
        self.task = Task.of(extras.get("task", {}))
        self.max_turns = int(extras.get("max_turns", self.task.max_steps))
        cfg = env_config if env_config is not None else {}
        self.endpoint = cfg.get("endpoint") if hasattr(cfg, "get") else None
        self.sandbox: corral.Sandbox | None = None
        self.turns = 0

    def init(self, prompt: list[dict[str, str]]) -> tuple[list[dict[str, str]], dict[str, Any]]:
        sb = self.sandbox = episode.rewind(self.sandbox, self.task, self.endpoint)
        self.turns = 0
        return prompt, {"tools": tools.SPECS, "sandbox_id": sb.id}

    def _end(self, meta: dict[str, Any]) -> BaseTextEnvStepOutput:
        assert self.sandbox is not None
        try:
            reward = episode.score(self.sandbox, self.task)
        except ce.CorralError as e:
            meta.update(infra_error=episode.is_infra(e), error_code=e.code)
            reward = 0.0
        return BaseTextEnvStepOutput(observations=[], reward=reward, done=True, metadata=meta)

    def step(self, action: str) -> BaseTextEnvStepOutput:
        if self.sandbox is None:
            raise RuntimeError("call init() before step()")
        self.turns += 1
        meta: dict[str, Any] = {"infra_error": False, "sandbox_id": self.sandbox.id,
                                "turn": self.turns}
        calls = tools.parse_tool_calls(action)
        if not calls:
            return self._end(meta)
        results = [tools.execute(self.sandbox, c) for c in calls]
        if any(r.infra for r in results):
            meta.update(infra_error=True, error=[r.content for r in results if r.infra][0])
            return BaseTextEnvStepOutput(observations=[], reward=0.0, done=True, metadata=meta)
        if self.turns >= self.max_turns:
            return self._end(meta)
        body = "\n".join("<tool_response>" + json.dumps({"name": r.name, "content": r.content})
                         + "</tool_response>" for r in results)
        return BaseTextEnvStepOutput(observations=[{"role": "user", "content": body}],
                                     reward=0.0, done=False, metadata=meta)

    def close(self) -> None:
        episode.discard(self.sandbox)
        self.sandbox = None


def register() -> None:
    import skyrl_gym

    if ENV_ID not in skyrl_gym.envs.registration.registry:
        skyrl_gym.register(ENV_ID, entry_point="corral.rl.skyrl:CorralToolEnv")


register()


def main() -> None:
    """``python -m corral.rl.skyrl``: a scripted episode, as a runnable example."""
    import skyrl_gym

    task = {"files": {"/work/task.txt": "write ok to /work/out"},
            "score": '[ "$(cat /work/out 2>/dev/null)" = ok ] && echo 1 || echo 0'}
    env = skyrl_gym.make(ENV_ID, env_config={}, extras={"task": task, "max_turns": 4})
    try:
        env.init([{"role": "user", "content": "do the task in /work/task.txt"}])
        for action in ('<tool_call>{"name": "read_file", "arguments": '
                       '{"path": "/work/task.txt"}}</tool_call>',
                       '<tool_call>{"name": "write_file", "arguments": '
                       '{"path": "/work/out", "content": "ok"}}</tool_call>',
                       "Done."):
            out = env.step(action)
            print(f"done {out['done']}, reward {out['reward']}, "
                  f"observations {out['observations']}")
    finally:
        env.close()


if __name__ == "__main__":
    main()
