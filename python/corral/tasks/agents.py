"""What works on a task between its start state and its verifier.

An agent is an async callable ``agent(sandbox, task) -> AgentOutcome`` given the trial's
sandbox (an ``AsyncSandbox`` with a trajectory id: every call it makes is logged and keyed, so
a resumed trial fast-forwards through the calls it already made) and the TaskDir (its
``instruction``). It has ``task.agent_timeout`` seconds. Built in:

- ``oracle``: copies the task's ``solution/`` to ``/solution`` and runs ``solve.sh``, as
  Harbor's oracle agent does: a task whose oracle does not score 1 is a broken task.
- ``nop``: does nothing (the verifier's view of the untouched start state).
- ``command(CMD)``: runs CMD in the sandbox under ``/bin/sh -c`` (an agent installed in the
  image, or a script), with the instruction in ``$TASK_INSTRUCTION`` and in
  ``/logs/agent/instruction.md``.
- ``load("module:function")``: a Python policy of the signature above.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from corral.sdk import AsyncSandbox
from corral.tasks.taskdir import TaskDir, invalid

AGENT_LOGS = "/logs/agent"


@dataclass
class AgentOutcome:
    exit_code: int | None = None
    timed_out: bool = False
    output_tail: str = ""


Agent = Callable[[AsyncSandbox, TaskDir], Awaitable[AgentOutcome | None]]


async def _run(sb: AsyncSandbox, task: TaskDir, cmd: list[str] | str,
               env: dict[str, str] | None = None) -> AgentOutcome:
    r = await sb.exec(cmd, timeout=task.agent_timeout, env=env)
    return AgentOutcome(exit_code=r.exit_code, timed_out=r.timed_out,
                        output_tail=(r.stdout + r.stderr)[-2000:])


async def oracle(sb: AsyncSandbox, task: TaskDir) -> AgentOutcome:
    if not (task.solution_dir / "solve.sh").is_file():
        raise invalid(f"task {task.name} has no solution/solve.sh for the oracle agent")
    await sb.files.mkdir("/solution")
    await sb.files.upload(task.solution_dir, "/solution")
    return await _run(sb, task, ["bash", "/solution/solve.sh"])


async def nop(sb: AsyncSandbox, task: TaskDir) -> AgentOutcome:
    return AgentOutcome()


def command(cmd: str) -> Agent:
    async def agent(sb: AsyncSandbox, task: TaskDir) -> AgentOutcome:
        await sb.files.write(f"{AGENT_LOGS}/instruction.md", task.instruction)
        return await _run(sb, task, ["/bin/sh", "-c", cmd],
                          env={"TASK_INSTRUCTION": task.instruction})
    agent.__name__ = "command"
    return agent


def load(path: str) -> Agent:
    """``module:function`` (an async function, or a class whose instances are called)."""
    mod, _, attr = path.partition(":")
    if not mod or not attr:
        raise invalid(f"agent import path {path!r} is not module:function")
    try:
        obj: Any = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise invalid(f"cannot import agent {path!r}: {e}") from None
    if inspect.isclass(obj):
        obj = obj()
    if not callable(obj):
        raise invalid(f"agent {path!r} is not callable")
    return obj


BUILTIN: dict[str, Agent] = {"oracle": oracle, "nop": nop}


def resolve(name: str | None, cmd: str | None, import_path: str | None) -> tuple[str, Agent]:
    """The agent's label (kept in the results) and the agent."""
    given = [x for x in (cmd, import_path) if x is not None]
    if len(given) + (name is not None) > 1:
        raise invalid("give one agent: a name, --agent-command or --agent-import-path")
    if cmd is not None:
        return f"command:{cmd}", command(cmd)
    if import_path is not None:
        return f"import:{import_path}", load(import_path)
    name = name or "oracle"
    if name not in BUILTIN:
        raise invalid(f"unknown agent {name!r} (built in: {', '.join(sorted(BUILTIN))})")
    return name, BUILTIN[name]
