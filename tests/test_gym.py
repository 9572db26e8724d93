"""corral.gym against the session's real corrald: gymnasium's own checker, episodes, reset by
snapshot restore, truncation, vectorisation, and failures told apart (infra vs the agent's)."""

from __future__ import annotations

import gymnasium
import pytest

import corral

gym_mod = pytest.importorskip("corral.gym")
from gymnasium.utils.env_checker import check_env  # noqa: E402

from corral.gym import ENV_ID, ShellEnv, Task  # noqa: E402

TASK = {
    "instruction": "create /work/done containing 'ok'",
    "files": {"/work/README": "make /work/done say ok\n"},
    "setup": ["mkdir -p /work/logs", "echo setup-ran > /work/logs/setup"],
    "score": "[ \"$(cat /work/done 2>/dev/null)\" = ok ] && echo 1 || echo 0",
    "cwd": "/work",
    "max_steps": 5,
}


@pytest.fixture
def env():  # type: ignore[no-untyped-def]
    e = gymnasium.make(ENV_ID, task=TASK)
    try:
        yield e
    finally:
        e.close()


def test_check_env_passes() -> None:
    e = gymnasium.make(ENV_ID, task=dict(TASK, max_steps=50))
    try:
        check_env(e.unwrapped)
    finally:
        e.close()


def test_make_by_module_path() -> None:
    e = gymnasium.make("corral.gym:corral/Shell-v0", task=TASK)
    e.close()


def test_episode_reward_and_termination(env) -> None:  # type: ignore[no-untyped-def]
    obs, info = env.reset(seed=1)
    assert obs == {"output": TASK["instruction"], "exit_code": 0}
    obs, r, term, trunc, info = env.step("cat README logs/setup")
    assert obs["output"] == "make /work/done say ok\nsetup-ran\n" and obs["exit_code"] == 0
    assert (r, term, trunc) == (0.0, False, False) and info["infra_error"] is False
    obs, r, term, trunc, info = env.step("ls /nope")
    assert obs["exit_code"] == 2 and "No such file" in obs["output"]
    obs, r, term, trunc, info = env.step("echo ok > /work/done")
    assert (r, term, trunc) == (1.0, True, False)


def test_reset_restores_the_start_state(env) -> None:  # type: ignore[no-untyped-def]
    env.reset()
    sid = env.unwrapped.sandbox_id
    env.step("echo ok > /work/done; rm /work/README; sleep 300 &")
    env.reset()
    assert env.unwrapped.sandbox_id == sid  # the same sandbox, rewound in place
    obs, *_ = env.step("ls /work; pgrep -c sleep || true")
    assert obs["output"] == "README\nlogs\n0\n"


def test_truncation_and_submit(env) -> None:  # type: ignore[no-untyped-def]
    env.reset()
    for i in range(4):
        _, _, term, trunc, _ = env.step("true")
        assert not term and not trunc, i
    _, r, term, trunc, _ = env.step("true")
    assert (r, term, trunc) == (0.0, False, True)
    env.reset()
    _, r, term, trunc, _ = env.step("submit")
    assert (r, term, trunc) == (0.0, True, False)


def test_scorer_is_hidden_from_the_agent(env) -> None:  # type: ignore[no-untyped-def]
    env.reset()
    env.step("true")  # a scoring has run
    obs, *_ = env.step("ls -a /tmp; grep -rl 'cat /work/done' / --include='*' -s "
                       "--exclude-dir=proc --exclude-dir=sys --exclude-dir=usr | head -3")
    assert ".corral-score" not in obs["output"]


def test_infra_failure_is_masked_then_recovers(env) -> None:  # type: ignore[no-untyped-def]
    env.reset()
    sid = env.unwrapped.sandbox_id
    corral.Sandbox.from_id(sid).kill()  # from outside: not the agent's doing
    obs, r, term, trunc, info = env.step("echo hi")
    assert info["infra_error"] is True and (r, term, trunc) == (0.0, False, True)
    env.reset()
    assert env.unwrapped.sandbox_id != sid
    assert env.step("echo hi")[0]["output"] == "hi\n"


def test_agent_limit_is_its_own(env) -> None:  # type: ignore[no-untyped-def]
    env.reset()
    obs, r, term, trunc, info = env.step(
        "python3 -c 'x = bytearray(2 << 30)'")  # past its memory: the command's own OOM
    assert info["infra_error"] is False
    assert obs["exit_code"] != 0 and not trunc


def test_vector_env_steps_concurrently() -> None:
    venv = gymnasium.make_vec(ENV_ID, num_envs=3, task=TASK)
    try:
        obs, infos = venv.reset(seed=0)
        assert list(obs["output"]) == [TASK["instruction"]] * 3
        ids = set(infos["sandbox_id"])
        assert len(ids) == 3
        obs, r, term, trunc, infos = venv.step(("echo 0", "echo ok > /work/done", "echo 2"))
        assert list(obs["output"]) == ["0\n", "", "2\n"]
        assert list(r) == [0.0, 1.0, 0.0] and list(term) == [False, True, False]
        obs, r, term, trunc, infos = venv.step(("cat /work/done", "cat /work/done", "true"))
        # env 1 was reset by this step (next-step autoreset): its first observation, reward 0
        assert obs["output"][1] == TASK["instruction"] and r[1] == 0.0
        assert "No such file" in obs["output"][0]
    finally:
        venv.close()


def test_task_validation() -> None:
    with pytest.raises(TypeError):
        ShellEnv(task=42)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Task(max_steps=0)
    assert Task(setup=["a"]).snapshot_name() == Task(setup=("a",)).snapshot_name()
    assert Task(setup=["a"]).snapshot_name() != Task(setup=["b"]).snapshot_name()


def test_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    from corral.gym.__main__ import main

    main()
    out = capsys.readouterr().out
    assert "$ echo ok > done -> exit 0, reward 1.0, terminated True, infra False" in out
    assert "vector rewards: [0.0, 1.0, 0.0, 1.0]" in out
