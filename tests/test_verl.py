"""corral.rl.verl.CorralTool through a driver that makes the calls verl 0.9.1's
``ToolAgentLoop._call_tool`` makes on a BaseTool (``create(create_kwargs=...)`` ->
``execute(instance_id, args, agent_data=...)`` -> ``release`` around every call, an exception
turned into "Error executing tool ..."). verl imports torch, which is not installed here, so
the loop is this driver; the sandbox work is real."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import corral
from corral import tools
from corral.rl import verl

TASK = {"files": {"/work/README": "write ok to /work/out\n"},
        "score": '[ "$(cat /work/out 2>/dev/null)" = ok ] && echo 1 || echo 0', "cwd": "/work"}


@dataclass
class AgentData:
    request_id: str
    tools_kwargs: dict[str, Any] = field(default_factory=dict)


async def call_tool(active: dict[str, Any], name: str, arguments: str,
                    agent: AgentData) -> tuple[str, float, dict[str, Any]]:
    """verl 0.9.1's _call_tool, for a BaseTool."""
    if name not in active:
        return f"Unknown function '{name}'. Available tools: {list(active)}", 0.0, {}
    try:
        args = json.loads(arguments)
    except (json.JSONDecodeError, TypeError) as e:
        return f"Invalid JSON in arguments for '{name}': {e}", 0.0, {}
    tool, iid = None, None
    try:
        tool = active[name]
        kwargs = agent.tools_kwargs.get(name, {})
        iid, _ = await tool.create(create_kwargs=kwargs.get("create_kwargs", {}))
        resp, reward, metrics = await tool.execute(iid, args, agent_data=agent)
    except Exception as e:  # noqa: BLE001  (what verl does)
        return f"Error executing tool '{name}': {e}", 0.0, {}
    finally:
        if tool and iid:
            await tool.release(iid)
    return resp.text, reward, metrics


def test_a_trajectory_keeps_its_sandbox_across_calls(no_leaks: None) -> None:
    active = {s["function"]["name"]: verl.CorralTool({"task": TASK}, s) for s in tools.SPECS}
    assert all(t.name == n for n, t in active.items())

    async def main() -> None:
        a = AgentData("traj-a", {"bash": {"create_kwargs": {"task": TASK}}})
        b = AgentData("traj-b")
        out = await call_tool(active, "write_file", '{"path": "/work/out", "content": "ok"}', a)
        assert out[0] == "wrote /work/out" and out[2]["infra_error"] is False
        # the next call (a new create/release) sees the same sandbox; another trajectory not
        text, _, _ = await call_tool(active, "bash", '{"command": "cat /work/out"}', a)
        assert text == "ok\n[exit code 0]"
        text, _, _ = await call_tool(active, "bash", '{"command": "cat /work/out"}', b)
        assert "No such file" in text
        # two calls of one turn at once (verl gathers them): one sandbox
        r1, r2 = await asyncio.gather(
            call_tool(active, "bash", '{"command": "hostname"}', b),
            call_tool(active, "read_file", '{"path": "/work/README"}', b))
        assert r2[0] == "write ok to /work/out\n"
        assert (await call_tool(active, "nope", "{}", a))[0].startswith("Unknown function")
        assert (await call_tool(active, "bash", "{not json", a))[0].startswith("Invalid JSON")
        assert await verl.finish("traj-a") == 1.0
        assert await verl.finish("traj-b") == 0.0

        # killed from outside: the call reports infra, the trajectory is masked
        c = AgentData("traj-c")
        await call_tool(active, "write_file", '{"path": "/work/out", "content": "ok"}', c)
        sess = verl._sessions["traj-c"]
        assert sess.sandbox is not None
        corral.Sandbox.from_id(sess.sandbox.id).kill()
        text, _, metrics = await call_tool(active, "bash", '{"command": "true"}', c)
        assert metrics["infra_error"] is True
        text, _, metrics = await call_tool(active, "bash", '{"command": "true"}', c)
        assert metrics["infra_error"] is True and "unavailable" in text
        assert await verl.finish("traj-c") is None
        assert await verl.finish("never-called") is None
        assert verl._sessions == {}

    asyncio.run(main())
