"""corral.rl.trl.CorralEnv through a driver that makes the calls TRL's GRPOTrainer makes on an
``environment_factory`` environment (trl 1.16: the probe of the class's public functions,
``reset(**row)``, tools called with the call's arguments and an exception turned into
``{"error": ...}``, ``get_reward()`` with None as unscorable). TRL itself needs torch, which
is not installed here, so the trainer is this driver; the tool schemas come from the real
``transformers.utils.get_json_schema``, the function TRL's chat templating uses."""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Callable
from typing import Any

import pytest

import corral
from corral import tools
from corral.rl.trl import CorralEnv

get_json_schema = pytest.importorskip("transformers.utils").get_json_schema

TASK = {"instruction": "write ok to /work/out",
        "files": {"/work/README": "write ok to /work/out\n"},
        "score": '[ "$(cat /work/out 2>/dev/null)" = ok ] && echo 1 || echo 0',
        "cwd": "/work"}


class Driver:
    """GRPOTrainer's environment path, reduced to the calls it makes on the environment."""

    def __init__(self, factory: Callable[[], Any]) -> None:
        probe = factory()
        members = dict(inspect.getmembers(type(probe), predicate=inspect.isfunction))
        assert "reset" in members, "TRL requires a callable reset"
        self.has_reward = "get_reward" in members
        self.tool_names = [n for n in members
                           if n not in ("reset", "get_reward") and not n.startswith("_")]
        # TRL renders each bound method's schema through transformers' chat templating
        self.schemas = [get_json_schema(getattr(probe, n)) for n in self.tool_names]
        self.pool = [probe]

    def rollout(self, env: Any, row: dict[str, Any],
                calls: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]], float]:
        prompt = row["prompt"][-1]["content"]
        obs = env.reset(**row)
        if obs is not None:
            prompt += obs
        tool_dict = {n: getattr(env, n) for n in self.tool_names}
        messages = []
        for call in calls:
            name = call["function"]["name"]
            try:
                if name not in tool_dict:
                    raise ValueError(f"Tool {name} not found.")
                result: Any = tool_dict[name](**call["function"]["arguments"])
            except Exception as e:  # noqa: BLE001  (what TRL does)
                result = {"error": str(e)}
            messages.append({"role": "tool", "name": name, "content": str(result)})
        reward = env.get_reward()
        return prompt, messages, math.nan if reward is None else float(reward)


def call(name: str, **args: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": args}}


@pytest.fixture
def driver():  # type: ignore[no-untyped-def]
    d = Driver(lambda: CorralEnv(task=TASK))
    yield d
    for env in d.pool:
        env._close()


def test_schemas_are_corral_tools(driver: Driver) -> None:
    assert driver.has_reward
    assert sorted(driver.tool_names) == sorted(tools.NAMES)
    specs = {s["function"]["name"]: s["function"] for s in tools.SPECS}
    for s in driver.schemas:
        f = s["function"]
        want = specs[f["name"]]["parameters"]
        assert set(f["parameters"]["properties"]) == set(want["properties"]), f["name"]
        assert f["parameters"]["required"] == want["required"], f["name"]
        assert f["description"]


def test_rollouts_score_rewind_and_mask(no_leaks: None, driver: Driver) -> None:
    env = driver.pool[0]
    row = {"prompt": [{"role": "user", "content": "Task: "}], "task": json.dumps(TASK)}
    prompt, msgs, reward = driver.rollout(env, row, [
        call("bash", command="cat README"),
        call("write_file", path="/work/out", content="ok"),
        call("read_file", path="/nope"),          # the model's mistake: readable text
        call("rm_rf"),                            # not a tool: TRL's own error
    ])
    assert prompt == "Task: write ok to /work/out"
    assert msgs[0]["content"] == "write ok to /work/out\n[exit code 0]"
    assert msgs[1]["content"] == "wrote /work/out"
    assert "/nope" in msgs[2]["content"] and "error" not in msgs[2]["content"][:2]
    assert msgs[3]["content"] == str({"error": "Tool rm_rf not found."})
    assert reward == 1.0
    sid = env._sandbox.id

    # the pooled instance is reset for the next rollout: restored in place, its work gone
    _, msgs, reward = driver.rollout(env, row, [call("bash", command="cat /work/out")])
    assert env._sandbox.id == sid
    assert "No such file" in msgs[0]["content"] and reward == 0.0

    # the sandbox killed from outside mid-rollout: the tool errors, the rollout is unscorable
    env.reset(**row)
    env.write_file("/work/out", "ok")
    corral.Sandbox.from_id(sid).kill()
    try:
        env.bash("true")
    except RuntimeError as e:
        assert "sandbox" in str(e).lower()
    else:
        raise AssertionError("a tool call on a killed sandbox must raise")
    assert env.get_reward() is None
    _, msgs, reward = driver.rollout(env, {"prompt": row["prompt"]}, [])   # the factory's task
    assert math.isfinite(reward) and env._sandbox.id != sid        # a fresh sandbox
    _, msgs, reward = driver.rollout(env, row, [call("write_file", path="/work/out",
                                                     content="ok")])
    assert reward == 1.0
