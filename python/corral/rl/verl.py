"""verl tools over corral sandboxes: ``CorralTool`` follows verl's ``BaseTool`` contract
(verl 0.9; duck-typed: ``import verl`` imports torch, so nothing of verl is needed here).

verl's ``ToolAgentLoop`` wraps every tool call in ``create(create_kwargs=...)`` ->
``execute(instance_id, args, agent_data=...)`` -> ``release(instance_id)``: an instance lives
for one call. The agent's sandbox must outlive the call, so it is keyed on the trajectory
(``agent_data.request_id``) and shared by the tool objects (``bash``, ``read_file``,
``write_file``, ``str_replace``, one per entry of verl's tool config), started on the first
call in the task's start state (``create_kwargs["task"]`` from the row's ``tools_kwargs``,
else the tool config's ``task``; corral.rl.episode). No tool hook marks a trajectory's end:
``finish(request_id)`` (from the reward function, or after the rollout) scores the sandbox and
kills it, returning None when the platform failed during the trajectory (mask it); each
execute's metrics carry ``infra_error`` as well.
"""

from __future__ import annotations

import asyncio
import importlib
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import corral
from corral import errors as ce
from corral import tools
from corral.rl import episode
from corral.rl.task import Task


@dataclass
class _PlainResponse:
    """verl's ToolResponse fields the loop reads, when verl is not installed."""
    text: str | None = None
    image: Any = None
    video: Any = None


def _response(text: str | None = None) -> Any:
    try:
        cls = importlib.import_module("verl.tools.schemas").ToolResponse
    except ImportError:
        return _PlainResponse(text=text)
    return cls(text=text) if text is not None else cls()


@dataclass
class _Session:
    task: Task
    sandbox: corral.Sandbox | None = None
    infra: str | None = None


_sessions: dict[str, _Session] = {}
_locks: dict[str, asyncio.Lock] = {}


class CorralTool:
    def __init__(self, config: Mapping[str, Any] | None = None, tool_schema: Any = None) -> None:
        self.config = dict(config or {})
        if tool_schema is not None:
            fn = getattr(tool_schema, "function", None)
            self.name = fn.name if fn is not None else tool_schema["function"]["name"]
        else:
            self.name = str(self.config.get("name", "bash"))
        if self.name not in tools.NAMES:
            raise ValueError(f"no corral tool {self.name!r} (have {sorted(tools.NAMES)})")
        self.tool_schema = tool_schema if tool_schema is not None else next(
            s for s in tools.SPECS if s["function"]["name"] == self.name)
        self._instances: dict[str, dict[str, Any]] = {}

    def get_openai_tool_schema(self) -> Any:
        return self.tool_schema

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, Any]:
        iid = instance_id or uuid.uuid4().hex
        self._instances[iid] = dict(kwargs.get("create_kwargs") or {})
        return iid, _response()

    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs: Any) -> tuple[Any, float, dict[str, Any]]:
        key = _key(instance_id, kwargs)
        sess = await self._session(key, self._instances.get(instance_id, {}))
        if sess.infra is not None or sess.sandbox is None:
            return (_response(f"error: the sandbox is unavailable: {sess.infra}"), 0.0,
                    {"infra_error": True, "is_error": True})
        res = await asyncio.to_thread(tools.execute, sess.sandbox,
                                      {"name": self.name, "arguments": parameters})
        if res.infra:
            sess.infra = res.content
        return _response(res.content), 0.0, {"infra_error": res.infra, "is_error": res.is_error}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        sess = _sessions.get(_key(instance_id, kwargs))
        if sess is None or sess.sandbox is None or sess.infra is not None:
            return 0.0
        return await asyncio.to_thread(episode.score, sess.sandbox, sess.task)

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._instances.pop(instance_id, None)  # the trajectory's sandbox stays: finish()

    async def _session(self, key: str, create_kwargs: Mapping[str, Any]) -> _Session:
        async with _locks.setdefault(key, asyncio.Lock()):
            sess = _sessions.get(key)
            if sess is None:
                task = Task.of(create_kwargs.get("task") or self.config.get("task") or {})
                sess = _sessions[key] = _Session(task)
                try:
                    sess.sandbox = await asyncio.to_thread(episode.start, task)
                except ce.CorralError as e:
                    if not episode.is_infra(e):
                        raise
                    sess.infra = str(e)
            return sess


def _key(instance_id: str, kwargs: Mapping[str, Any]) -> str:
    return str(getattr(kwargs.get("agent_data"), "request_id", None) or instance_id)


async def finish(request_id: str) -> float | None:
    """Score the trajectory's sandbox and kill it: the task's score, or None (mask it) if the
    platform failed during the trajectory; None too for a trajectory that made no call."""
    sess = _sessions.pop(request_id, None)
    _locks.pop(request_id, None)
    if sess is None or sess.sandbox is None:
        return None
    try:
        if sess.infra is not None:
            return None
        return await asyncio.to_thread(episode.score, sess.sandbox, sess.task)
    except ce.CorralError as e:
        return None if episode.is_infra(e) else 0.0
    finally:
        await asyncio.to_thread(episode.discard, sess.sandbox)


def main() -> None:
    """``python -m corral.rl.verl``: one scripted trajectory through the calls verl's
    ToolAgentLoop makes (create, execute, release per tool call; then finish), as a runnable
    example."""
    from types import SimpleNamespace

    task = {"files": {"/work/task.txt": "write ok to /work/out"},
            "score": '[ "$(cat /work/out 2>/dev/null)" = ok ] && echo 1 || echo 0'}
    agent = SimpleNamespace(request_id=uuid.uuid4().hex)
    calls = [("read_file", {"path": "/work/task.txt"}),
             ("write_file", {"path": "/work/out", "content": "ok"})]

    async def rollout() -> float | None:
        for name, args in calls:
            tool = CorralTool({"name": name, "task": task})
            iid, _ = await tool.create(create_kwargs={"task": task})
            resp, _, metrics = await tool.execute(iid, args, agent_data=agent)
            print(f"{name}: {resp.text!r} {metrics}")
            await tool.release(iid)
        return await finish(agent.request_id)

    print("reward:", asyncio.run(rollout()))


if __name__ == "__main__":
    main()
