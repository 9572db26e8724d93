"""``corral demo``: the bundled tasks are right, and a small run gives the rewards the policy's
choices call for, with no infra failures."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys

import pytest

import corral
from corral import Sandbox
from corral.demo import load_tasks, run_demo
from corral.demo.policy import ScriptedPolicy
from corral.demo.runner import DEMO_LABEL, percentile

PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(corral.__file__)))
TASKS = load_tasks()


def test_at_least_eight_complete_tasks():
    assert len(TASKS) >= 8
    for t in TASKS:
        assert t.statement.strip() and t.starter.strip() and t.hidden_test.strip()
        assert t.reference != t.starter and t.wrong


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.name)
def test_task_solutions_on_the_host_python(task, tmp_path):
    """The reference passes and every wrong variant fails under the host's /usr/bin/python3
    (the interpreter the sandbox's host image provides); the starter fails too."""

    def grade(source: str) -> int:
        (tmp_path / "solution.py").write_text(source)
        (tmp_path / "hidden_test.py").write_text(task.hidden_test)
        return subprocess.run(["/usr/bin/python3", "hidden_test.py"], cwd=tmp_path,
                              capture_output=True, timeout=60).returncode

    assert grade(task.reference) == 0
    for name, source in task.wrong.items():
        assert grade(source) != 0, name
    assert grade(task.starter) != 0


def test_task_solutions_inside_a_sandbox():
    """The same, inside one real sandbox, graded exactly as the demo grades."""
    with Sandbox(memory_mb=256) as sb:
        for task in TASKS:
            sb.files.write("/opt/grader/hidden_test.py", task.hidden_test)
            for variant, source in [("reference", task.reference), *task.wrong.items()]:
                sb.files.write("/work/solution.py", source)
                r = sb.exec(["/usr/bin/python3", "/opt/grader/hidden_test.py"], cwd="/work",
                            env={"PYTHONPATH": "/work"}, timeout=30)
                assert (r.exit_code == 0) == (variant == "reference"), (task.name, variant, r)


def test_policy_is_deterministic_per_seed():
    pol = ScriptedPolicy(p_correct=0.5)
    task = TASKS[0]
    a = [pol.choose(task, random.Random(f"7:{i}")).variant for i in range(50)]
    b = [pol.choose(task, random.Random(f"7:{i}")).variant for i in range(50)]
    assert a == b and "reference" in a and any(v != "reference" for v in a)
    assert ScriptedPolicy(p_correct=1.0).choose(task, random.Random(0)).correct
    assert not ScriptedPolicy(p_correct=0.0).choose(task, random.Random(0)).correct


def test_percentile():
    assert percentile([], 50) is None
    assert percentile([5.0], 99) == 5.0
    data = [float(i) for i in range(1, 101)]
    assert percentile(data, 50) == 50.0 and percentile(data, 99) == 99.0


def test_small_demo_run():
    seen: list[int] = []
    summary = asyncio.run(run_demo(episodes=24, concurrency=8, seed=3, p_correct=0.5,
                                   on_episode=lambda r: seen.append(r.index)))
    assert sorted(seen) == list(range(24))
    assert summary.infra_failures == 0 and summary.errors == 0
    assert summary.episodes == summary.completed == 24
    for r in summary.results:
        # The reward is exactly what the policy's choice deserves.
        assert r.reward == r.expected_reward, (r.task, r.variant)
    variants = {r.variant == "reference" for r in summary.results}
    assert variants == {True, False}  # this seed exercises both kinds
    assert summary.consistent == 24
    assert summary.reward_mean == pytest.approx(
        sum(r.variant == "reference" for r in summary.results) / 24)
    d = summary.to_dict()
    for key in ("episodes_per_s", "reset_ms_p50", "reset_ms_p99", "step_ms_p50",
                "step_ms_p99", "reward_mean", "infra_failures"):
        assert d[key] is not None, key
    # Through the vector env: one reset per batch, five batched steps (look, look, write,
    # try, submit), every episode ended by its submit.
    assert all(r.steps == 5 for r in summary.results)
    assert len(summary.step_ms) == 5 * len(summary.reset_ms) == 5 * d["batches"]
    # Every episode's sandbox was thrown away.
    assert Sandbox.list(labels={DEMO_LABEL: None}) == []


def test_demo_cli_json():
    env = dict(os.environ, PYTHONPATH=PKG_PARENT)
    r = subprocess.run([sys.executable, "-m", "corral.cli", "demo", "--episodes", "8",
                        "--concurrency", "4", "--seed", "1", "--json"], capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["episodes"] == d["completed"] == d["reward_matches_policy"] == 8
    assert d["infra_failures"] == 0 and d["errors"] == 0
    assert 0.0 <= d["reward_mean"] <= 1.0 and d["episodes_per_s"] > 0
