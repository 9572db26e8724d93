"""corral.tools (OpenAI-style tools) and the SkyRL-gym adapter, against the session's real
corrald: every tool, bad calls answered (never raised), infra failures flagged for masking."""

from __future__ import annotations

import asyncio
import json

import pytest

import corral
from corral import tools


@pytest.fixture
def sb():  # type: ignore[no-untyped-def]
    with corral.Sandbox(timeout=120) as s:
        yield s


def call(name: str, **args: object) -> dict:
    return {"id": "c1", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)}}


def test_specs_are_openai_function_tools() -> None:
    names = [s["function"]["name"] for s in tools.SPECS]
    assert names == ["bash", "read_file", "write_file", "str_replace"]
    for s in tools.SPECS:
        assert s["type"] == "function"
        p = s["function"]["parameters"]
        assert p["type"] == "object" and set(p["required"]) <= set(p["properties"])


def test_every_tool(sb: corral.Sandbox) -> None:
    r = tools.execute(sb, call("write_file", path="/w/a.py", content="x = 1\nprint(x)\n"))
    assert (r.is_error, r.content) == (False, "wrote /w/a.py")
    r = tools.execute(sb, call("str_replace", path="/w/a.py", old_str="x = 1", new_str="x = 2"))
    assert not r.is_error
    assert tools.execute(sb, call("read_file", path="/w/a.py")).content == "x = 2\nprint(x)\n"
    r = tools.execute(sb, call("bash", command="python3 /w/a.py; echo err >&2; exit 3"))
    assert r.content == "2\nerr\n[exit code 3]" and not r.is_error
    assert r.message() == {"role": "tool", "content": r.content, "name": "bash",
                           "tool_call_id": "c1"}
    r = tools.execute(sb, call("bash", command="sleep 5", timeout=0.5))
    assert "timed out" in r.content
    # the plain shape works too
    assert tools.execute(sb, {"name": "read_file", "arguments": {"path": "/w/a.py"}}).content


def test_bad_calls_are_answered(sb: corral.Sandbox) -> None:
    bad = [
        {"function": {"name": "rm_rf", "arguments": "{}"}},
        {"function": {"name": "bash", "arguments": "{not json"}},
        call("bash"),
        call("bash", command="true", timeout=-1),
        call("read_file", path="/nope"),
        call("read_file", path="relative"),
        call("str_replace", path="/etc/hostname", old_str="", new_str="x"),
        "not a call",
    ]
    for c in bad:
        r = tools.execute(sb, c)  # type: ignore[arg-type]
        assert r.is_error and not r.infra and r.content.startswith("error:"), c
    sb.files.write("/w/dup", "a a")
    r = tools.execute(sb, call("str_replace", path="/w/dup", old_str="a", new_str="b"))
    assert r.is_error and "2 times" in r.content
    assert sb.files.read("/w/dup") == "a a"


def test_a_huge_file_the_agent_made_is_not_read_into_the_trainer(sb: corral.Sandbox) -> None:
    """A sparse GiB costs the agent nothing to make; read_file read it whole into the
    trainer's memory (+3 GiB of RSS) to show 16 KiB of it. Past MAX_FILE_BYTES, read_file and
    str_replace answer an error the model can act on, having read that much at most."""
    import resource

    sb.exec("mkdir -p /w && truncate -s 1G /w/huge && printf a > /w/small").check()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for c in (call("read_file", path="/w/huge"),
              call("str_replace", path="/w/huge", old_str="x", new_str="y")):
        r = tools.execute(sb, c)
        assert r.is_error and not r.infra and "bigger than" in r.content, r.content
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 64 << 10, grown_kib  # a few reads of MAX_FILE_BYTES, not a GiB
    assert tools.execute(sb, call("read_file", path="/w/small")).content == "a"
    assert sb.files.stat("/w/huge").size == 1 << 30  # untouched


def test_infra_failure_is_flagged(sb: corral.Sandbox) -> None:
    corral.Sandbox.from_id(sb.id).kill()  # from outside the agent loop
    r = tools.execute(sb, call("bash", command="echo hi"))
    assert r.is_error and r.infra


def test_async_tools() -> None:
    async def main() -> None:
        async with corral.AsyncSandbox(timeout=60) as s:
            r = await tools.aexecute(s, call("write_file", path="/w/f", content="abc"))
            assert not r.is_error
            r = await tools.aexecute(s, call("str_replace", path="/w/f", old_str="b",
                                             new_str="B"))
            assert not r.is_error
            assert (await tools.aexecute(s, call("bash", command="cat /w/f"))).content == \
                "aBc\n[exit code 0]"

    asyncio.run(main())


def test_a_score_is_a_finite_number_of_a_script_that_succeeded(sb: corral.Sandbox) -> None:
    """The scoring script may run the agent's code, which may print: a number printed by a
    script that then failed was its score (an agent's wrong answer that printed 1 scored 1),
    and inf or NaN were scores too (NaN reads as masked in TRL)."""
    from corral.rl.episode import score
    from corral.rl.task import Task

    for script, want in (("echo 0.5", 0.5), ("echo 1; exit 1", 0.0), ("echo inf", 0.0),
                         ("echo nan", 0.0), ("echo -1e999", 0.0), ("true", 1.0),
                         ("echo not a number", 1.0), ("exit 3", 0.0)):
        assert score(sb, Task(score=script, cwd="/")) == want, script


def test_parse_tool_calls() -> None:
    text = ('thinking <tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>'
            "<tool_call>oops</tool_call>")
    calls = tools.parse_tool_calls(text)
    assert calls[0] == {"name": "bash", "arguments": {"command": "ls"}}
    assert calls[1]["name"] == "?"
    assert tools.parse_tool_calls("no calls here") == []


def test_skyrl_gym_episode() -> None:
    skyrl_gym = pytest.importorskip("skyrl_gym", reason="skyrl-gym is not installed")
    import corral.rl.skyrl  # noqa: F401 - registers corral-tools

    task = {"files": {"/work/task.txt": "write ok to /work/out"},
            "score": '[ "$(cat /work/out 2>/dev/null)" = ok ] && echo 1 || echo 0'}
    env = skyrl_gym.make("corral-tools", env_config={}, extras={"task": task, "max_turns": 4})
    try:
        prompt = [{"role": "user", "content": "do the task"}]
        got, meta = env.init(prompt)
        assert got == prompt and [t["function"]["name"] for t in meta["tools"]][0] == "bash"
        step = env.step('<tool_call>{"name": "read_file", "arguments": '
                        '{"path": "/work/task.txt"}}</tool_call>')
        assert not step["done"] and "write ok to /work/out" in step["observations"][0]["content"]
        step = env.step('<tool_call>{"name": "write_file", "arguments": '
                        '{"path": "/work/out", "content": "ok"}}</tool_call>')
        assert not step["done"] and step["reward"] == 0.0
        step = env.step("done: I wrote it.")  # no tool call: the episode ends and is scored
        assert step["done"] and step["reward"] == 1.0 and not step["metadata"]["infra_error"]
        # the next episode starts from the task's start state again
        env.init(prompt)
        step = env.step("nothing")
        assert step["done"] and step["reward"] == 0.0
    finally:
        env.close()


def test_skyrl_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("skyrl_gym", reason="skyrl-gym is not installed")
    from corral.rl.skyrl import main

    main()
    assert "done True, reward 1.0" in capsys.readouterr().out
