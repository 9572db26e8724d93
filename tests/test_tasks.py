"""``corral tasks run``: Harbor-style task directories through the session's real corrald.
Oracle and nop verdicts, an environment built once from a Dockerfile (as a corral image,
each step a cached layer), an agent that tries to
forge its reward (a planted reward file, a background writer, replaced tests), refusals of
what needs Docker, and a runner SIGKILLed mid-trial that resumes from the trajectory log
without running the agent's command twice."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

import corral
from corral.errors import CorralError, ImageNotFound
from corral.sdk import admin
from corral.tasks import agents, load_tasks, run_tasks
from corral.tasks.runner import RUN_LABEL

from conftest import wait_until

BASE = "tasks-base"   # a busybox rootfs (a task's environment is built as an image: on layers)
DOCKERFILE = f"""\
FROM {BASE}
# a comment, and a continued RUN
ARG FLAVOUR=plain
ENV GREETING="hello there" \\
    TARGET=/app/out.txt
WORKDIR /app
COPY data/ /app/data/
COPY seed.txt ./
COPY --chown=1234:1234 *.txt /app/owned/
VOLUME /app/state
HEALTHCHECK CMD true
RUN mkdir -p /app/state && \\
    cat /proc/sys/kernel/random/uuid > /app/state/build_id && echo $FLAVOUR > /app/flavour
CMD ["bash"]
"""

BASH = b'#!/bin/sh\nexec /bin/sh "$@"\n'   # test.sh and solve.sh are run with bash


def _base_rootfs() -> str:
    """A rootfs of busybox with every applet, cached by the hash of its recipe."""
    bb = open("/bin/busybox", "rb").read()
    applets = subprocess.run(["/bin/busybox", "--list"], capture_output=True, text=True,
                             check=True).stdout.split()
    h = hashlib.sha256(bb + BASH + " ".join(applets).encode()).hexdigest()[:16]
    root = f"/var/cache/corral-test/tasks-base-{h}"
    if os.path.isdir(root):
        return root
    tmp = f"{root}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    for d in ("bin", "etc", "tmp", "root", "home/app"):
        os.makedirs(f"{tmp}/{d}")
    os.chmod(f"{tmp}/tmp", 0o1777)
    with open(f"{tmp}/bin/busybox", "wb") as fh:
        fh.write(bb)
    with open(f"{tmp}/bin/bash", "wb") as fh:
        fh.write(BASH)
    for f in ("busybox", "bash"):
        os.chmod(f"{tmp}/bin/{f}", 0o755)
    for a in applets:
        if not os.path.lexists(f"{tmp}/bin/{a}"):
            os.symlink("busybox", f"{tmp}/bin/{a}")
    with open(f"{tmp}/etc/passwd", "w") as fh:
        fh.write("root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:app:/home/app:/bin/sh\n")
    with open(f"{tmp}/etc/group", "w") as fh:
        fh.write("root:x:0:\napp:x:1000:\n")
    os.rename(tmp, root)
    return root


@pytest.fixture(scope="module", autouse=True)
def base_image():  # type: ignore[no-untyped-def]
    if not os.path.exists("/bin/busybox"):
        pytest.skip("needs busybox-static (scripts/setup.sh)")
    with contextlib.suppress(ImageNotFound):
        admin.remove_image(BASE)
    admin.import_image(BASE, _base_rootfs())
    yield
    admin.remove_image(BASE)


TEST_SH = """\
#!/bin/bash
# reward 1 iff the target holds the greeting followed by the seed's contents
want="$GREETING $(cat /app/seed.txt)"
if [ "$(cat "$TARGET" 2>/dev/null)" = "$want" ]; then echo 1 > /logs/verifier/reward.txt
else echo 0 > /logs/verifier/reward.txt; fi
"""

SOLVE_SH = 'echo "$GREETING $(cat /app/seed.txt)" > "$TARGET"\n'


def make_task(root: Path, name: str, *, test_sh: str = TEST_SH, toml: str = "",
              dockerfile: str = DOCKERFILE, solve: str = SOLVE_SH) -> Path:
    d = root / name
    (d / "environment" / "data").mkdir(parents=True)
    (d / "tests").mkdir()
    (d / "solution").mkdir()
    (d / "task.toml").write_text(textwrap.dedent("""\
        version = "1.0"
        [metadata]
        difficulty = "easy"
        [agent]
        timeout_sec = 60.0
        [verifier]
        timeout_sec = 60.0
        [environment]
        cpus = 1
        memory = "256M"
        """) + toml)
    (d / "instruction.md").write_text(f"Write the greeting and the seed to $TARGET ({name}).\n")
    (d / "environment" / "Dockerfile").write_text(dockerfile)
    (d / "environment" / "seed.txt").write_text(f"seed-{name}\n")
    (d / "environment" / "data" / "x.csv").write_text("a,b\n1,2\n")
    (d / "tests" / "test.sh").write_text(test_sh)
    (d / "solution" / "solve.sh").write_text(solve)
    return d


def cli(*args: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "corral.cli", "tasks", "run", *args],
                          capture_output=True, text=True, timeout=300, **kw)  # type: ignore[call-overload]


def records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.fixture
def cleanup_images():  # type: ignore[no-untyped-def]
    before = {i.name for i in admin.images()}
    yield
    for i in admin.images():
        if i.name not in before and i.name.startswith(("task-", "build-")):
            admin.remove_image(i.name)


def live(run_id: str) -> list[corral.Sandbox]:
    return corral.Sandbox.list(labels={RUN_LABEL: run_id})


def test_oracle_scores_one_nop_zero_and_the_build_runs_once(
        tmp_path: Path, no_leaks: None, cleanup_images: None) -> None:
    make_task(tmp_path, "greet")
    json_test = TEST_SH.replace("echo 1 > /logs/verifier/reward.txt",
                                'echo \'{"reward": 1, "style": 0.5, "note": "x"}\' '
                                "> /logs/verifier/reward.json")
    make_task(tmp_path, "greet-json", test_sh=json_test)
    tasks = load_tasks(tmp_path)
    assert [t.name for t in tasks] == ["greet", "greet-json"]
    name, fn = agents.resolve("oracle", None, None)
    out = tmp_path / "oracle.jsonl"
    s = asyncio.run(run_tasks(tasks, fn, name, out, attempts=3, concurrency=6))
    assert [(r.task, r.status, r.reward) for r in s.results] == (
        [("greet", "ok", 1.0)] * 3 + [("greet-json", "ok", 1.0)] * 3), [
        (r.task, r.error_code, r.error, r.agent_error) for r in s.results if r.status != "ok"]
    assert s.results[3].rewards == {"reward": 1.0, "style": 0.5}   # numbers only, as Harbor
    recs = records(out)
    assert recs[0]["kind"] == "run" and recs[0]["agent"] == "oracle"
    assert sorted((r["task"], r["attempt"]) for r in recs[1:]) == sorted(
        (t, a) for t in ("greet", "greet-json") for a in range(3))
    assert not live(s.run_id)

    # The environment was built once per task: every trial sees the same build id, and the
    # Dockerfile's ENV, ARG, WORKDIR, COPY (a glob, --chown) took effect; VOLUME and
    # HEALTHCHECK, which only describe a container, were skipped.
    def steps() -> dict[str, float]:
        return {i.name: i.created_at for i in admin.images() if i.name.startswith("build-")}

    built = steps()
    assert built
    probe = agents.command("cat /app/state/build_id; pwd; cat /app/flavour /app/data/x.csv; "
                           "echo $GREETING; stat -c %u /app/owned/seed.txt")
    s2 = asyncio.run(run_tasks(tasks[:1], probe, "command:probe", tmp_path / "probe.jsonl",
                               attempts=4, concurrency=4))
    outs = {r.agent_output_tail for r in s2.results}
    assert len(outs) == 1, outs
    assert outs.pop().split("\n")[1:] == ["/app", "plain", "a,b", "1,2", "hello there",
                                          "1234", ""]
    assert all(r.status == "ok" and r.reward == 0.0 for r in s2.results)
    assert steps() == built   # a new run: every step came from the cache, none made again

    name, fn = agents.resolve("nop", None, None)
    s3 = asyncio.run(run_tasks(tasks, fn, name, tmp_path / "nop.jsonl"))
    assert [(r.status, r.reward) for r in s3.results] == [("ok", 0.0), ("ok", 0.0)]


def test_an_agent_cannot_forge_its_reward(tmp_path: Path, no_leaks: None,
                                          cleanup_images: None) -> None:
    # A verifier that writes a reward only on success: whatever reward file exists is forged.
    quiet = TEST_SH.replace("else echo 0 > /logs/verifier/reward.txt; fi", "fi")
    make_task(tmp_path, "forge", test_sh=quiet)
    tasks = load_tasks(tmp_path)
    forger = agents.command(
        "echo 1 > /logs/verifier/reward.txt; echo '{\"reward\": 1}' > /logs/verifier/reward.json;"
        # a writer left behind, re-planting the reward while the verifier runs
        " (setsid sh -c 'while :; do mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt;"
        " done' </dev/null >/dev/null 2>&1 &);"
        # tests planted where the verifier's will go
        " mkdir -p /tests && printf 'echo 1 > /logs/verifier/reward.txt\\n' > /tests/test.sh;"
        " echo planted")
    s = asyncio.run(run_tasks(tasks, forger, "command:forger", tmp_path / "r.jsonl"))
    [r] = s.results
    assert r.agent_output_tail.strip() == "planted"
    assert (r.status, r.reward, r.error_code) == ("no_reward", 0.0, "reward_missing"), r
    assert not r.infra_error


def test_what_an_agent_breaks_for_its_verifier_scores_zero(tmp_path: Path, no_leaks: None,
                                                         cleanup_images: None) -> None:
    """The verifier runs in the sandbox the agent left. An agent that removed the shell the
    runner's steps need had its trial recorded infra (masked, and rerun at every resume); one
    that removed the verifier's working directory, error with no reward (left out of the
    mean); a verifier's reward of NaN was recorded as it was (and the results file was no
    longer JSON). Each scores 0."""
    make_task(tmp_path, "nosh")
    make_task(tmp_path, "noworkdir")
    make_task(tmp_path, "nanreward", test_sh="#!/bin/bash\necho nan > /logs/verifier/reward.txt\n")
    by_task = {"nosh": "rm -f /bin/sh", "noworkdir": "rm -rf /app", "nanreward": "true"}

    async def breaker(sb: corral.AsyncSandbox, task: Any) -> None:
        await sb.exec(["/bin/busybox", "sh", "-c", by_task[task.name]], user="root")

    s = asyncio.run(run_tasks(load_tasks(tmp_path), breaker, "breaker", tmp_path / "r.jsonl"))
    got = {r.task: (r.status, r.reward, r.error_code, r.infra_error) for r in s.results}
    assert got == {"nosh": ("no_reward", 0.0, "verifier_setup_failed", False),
                   "noworkdir": ("no_reward", 0.0, "cwd_not_found", False),
                   "nanreward": ("no_reward", 0.0, "reward_missing", False)}, got
    for line in (tmp_path / "r.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))


def test_dockerfile_and_task_refusals(tmp_path: Path) -> None:
    bad = {
        "stage-cycle": "FROM host AS a\nCOPY --from=a /x /y\n",
        "later-stage": "FROM host\nCOPY --from=1 /x /y\nFROM host\n",
        "outside": "FROM host\nCOPY ../../task.toml /x\n",
        "url": "FROM host\nADD http://example.com/x /x\n",
        "no-from": "RUN true\n",
        "onbuild": "FROM host\nONBUILD RUN true\n",
        "shell": "FROM host\nSHELL [\"/bin/bash\", \"-c\"]\n",
        "run-mount": "FROM host\nRUN --mount=type=cache,target=/c true\n",
        "chmod": "FROM host\nCOPY --chmod=755 seed.txt /x\n",
        "missing": "FROM host\nCOPY nothing-here.txt /x\n",
        "glob-none": "FROM host\nCOPY *.nope /x/\n",
        # refused before anything runs: the RUN before the refusal never does
        "late": "FROM host\nRUN touch /ran\nADD https://example.com/x /x\n",
    }
    for name, df in bad.items():
        d = make_task(tmp_path / name, "t", dockerfile=df)
        r = cli(str(d), "-o", str(tmp_path / f"{name}.jsonl"))
        assert r.returncode == 1 and "error [invalid_task]" in r.stderr, (name, r.stderr)
    r = cli(str(tmp_path / "nowhere"))
    assert r.returncode == 1 and "error [invalid_task]" in r.stderr
    d = make_task(tmp_path / "ok", "t")
    r = cli(str(d), "--agent", "nop", "--agent-command", "true")
    assert r.returncode == 1 and "error [invalid_task]" in r.stderr
    r = cli(str(d), "--agent", "gpt-7")
    assert r.returncode == 1 and "unknown agent" in r.stderr


def test_a_failing_build_is_an_error_not_a_reward(tmp_path: Path, no_leaks: None,
                                                   cleanup_images: None) -> None:
    before = {i.name for i in admin.images()}
    make_task(tmp_path, "broken", dockerfile=f"FROM {BASE}\nRUN echo nope >&2; exit 3\n")
    name, fn = agents.resolve("oracle", None, None)
    s = asyncio.run(run_tasks(load_tasks(tmp_path), fn, name, tmp_path / "r.jsonl",
                              attempts=2))
    assert [(r.status, r.reward, r.error_code, r.infra_error) for r in s.results] == [
        ("error", None, "invalid_task", False)] * 2
    assert all("exited 3" in (r.error or "") and "nope" in (r.error or "")
               for r in s.results)
    # the failed step left no layer and no image
    assert {i.name for i in admin.images()} == before


def test_killed_runner_resumes_from_the_trajectory_log(tmp_path: Path, no_leaks: None,
                                                       cleanup_images: None) -> None:
    """SIGKILL the runner while the agent's command runs; the rerun continues the trial: the
    command is not run again (its keyed retry returns the in-flight call's result). Then a
    trial whose sandbox is killed from outside while the runner is down is an infra failure,
    masked, and the next rerun runs it afresh."""
    make_task(tmp_path / "tasks", "slow")
    agent_cmd = ("echo run >> /app/agent_runs; "
                 f"while [ ! -e /app/go ]; do sleep 0.05; done; {SOLVE_SH.strip()}")
    # the verifier also insists the agent's command ran exactly once
    once_test = TEST_SH.replace('if [ "$(cat', 'if [ "$(cat /app/agent_runs)" = run ] && [ "$(cat')
    (tmp_path / "tasks" / "slow" / "tests" / "test.sh").write_text(once_test)
    out = tmp_path / "r.jsonl"
    args = [str(tmp_path / "tasks"), "--agent-command", agent_cmd, "-o", str(out), "--json"]

    def start() -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-m", "corral.cli", "tasks", "run", *args],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def agent_running(run_id: str) -> corral.Sandbox | None:
        for sb in live(run_id):
            try:
                if sb.exec("cat /app/agent_runs 2>/dev/null").stdout == "run\n":
                    return sb
            except CorralError:
                pass
        return None

    # 1. killed mid-agent, resumed: one run of the agent's command, reward 1.
    p = start()
    try:
        assert wait_until(lambda: out.exists() and out.read_text().strip(), 60)
        run_id = records(out)[0]["run_id"]
        assert wait_until(lambda: agent_running(run_id) is not None, 60)
        p.send_signal(signal.SIGKILL)
        p.wait(30)
        sb = agent_running(run_id)
        assert sb is not None
        sb.exec("touch /app/go")   # the command finishes while no runner is there
        p = start()
        stdout, stderr = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, stderr
    summary = json.loads(stdout)
    assert (summary["ok"], summary["resumed"], summary["reward_mean"]) == (1, 1, 1.0)
    [rec] = [r for r in records(out) if r["kind"] == "trial"]
    assert rec["resumed"] and rec["reward"] == 1.0
    assert rec["trajectory_id"] == f"{run_id}/slow/0"
    assert not live(run_id)

    # 2. a new run: killed mid-agent, its sandbox killed from outside: masked, then rerun.
    out.unlink()
    p = start()
    try:
        assert wait_until(lambda: out.exists() and out.read_text().strip(), 60)
        run_id = records(out)[0]["run_id"]
        assert wait_until(lambda: agent_running(run_id) is not None, 60)
        p.send_signal(signal.SIGKILL)
        p.wait(30)
        for sb in live(run_id):
            sb.kill()
        p = start()
        stdout, stderr = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 1
    summary = json.loads(stdout)
    assert (summary["infra_failures"], summary["reward_mean"]) == (1, None)
    [rec] = [r for r in records(out) if r["kind"] == "trial"]
    assert rec["status"] == "infra" and rec["infra_error"] and rec["reward"] is None

    # the next rerun: the masked trial runs afresh under a new trajectory id
    other = cli(str(tmp_path / "tasks"), "--agent", "nop", "-o", str(out))
    assert other.returncode == 1 and "holds a run of agent" in other.stderr
    p = start()
    try:
        assert wait_until(lambda: agent_running(run_id) is not None, 60)
        for s in live(run_id):
            s.exec("touch /app/go")
        stdout, stderr = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, stderr
    summary = json.loads(stdout)
    assert (summary["ok"], summary["infra_failures"], summary["reward_mean"]) == (1, 0, 1.0)
    trials = [r for r in records(out) if r["kind"] == "trial"]
    assert [(r["status"], r["trajectory_id"]) for r in trials] == [
        ("infra", f"{run_id}/slow/0"), ("ok", f"{run_id}/slow/0/retry1")]
    assert not live(run_id)


POLICY = '''
from corral.tasks.taskdir import TaskDir

async def solve(sandbox, task: TaskDir):
    env = (await sandbox.exec("echo $GREETING; cat /app/seed.txt")).stdout.split("\\n")
    await sandbox.files.write("/app/out.txt", f"{env[0]} {env[1]}\\n")

async def broken(sandbox, task):
    await sandbox.files.write("/app/out.txt", "half")
    raise KeyError("the policy's own bug")
'''


def test_python_policy_its_bugs_and_the_agent_timeout(tmp_path: Path, no_leaks: None,
                                                      cleanup_images: None,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    d = make_task(tmp_path / "tasks", "greet")
    (tmp_path / "corral_test_policy.py").write_text(POLICY)
    monkeypatch.syspath_prepend(str(tmp_path))
    tasks = load_tasks(d)
    name, fn = agents.resolve(None, None, "corral_test_policy:solve")
    assert name == "import:corral_test_policy:solve"
    [r] = asyncio.run(run_tasks(tasks, fn, name, tmp_path / "a.jsonl")).results
    assert (r.status, r.reward, r.agent_error) == ("ok", 1.0, None), r
    _, fn = agents.resolve(None, None, "corral_test_policy:broken")
    [r] = asyncio.run(run_tasks(tasks, fn, "b", tmp_path / "b.jsonl")).results
    assert (r.status, r.reward) == ("ok", 0.0) and "the policy's own bug" in (r.agent_error or "")
    for bad in ("corral_test_policy", "corral_test_policy:nope", "no_such_module:x"):
        try:
            agents.resolve(None, None, bad)
        except CorralError as e:
            assert e.code == "invalid_task"
        else:
            raise AssertionError(bad)

    # an agent past [agent] timeout_sec is stopped, and the verifier still runs
    toml = (d / "task.toml").read_text().replace("[agent]\ntimeout_sec = 60.0",
                                                  "[agent]\ntimeout_sec = 1.0")
    (d / "task.toml").write_text(toml)
    slow = agents.command(f"{SOLVE_SH.strip()}; sleep 30")
    t0 = time.monotonic()
    [r] = asyncio.run(run_tasks(load_tasks(d), slow, "slow", tmp_path / "c.jsonl")).results
    assert time.monotonic() - t0 < 20
    assert r.agent_timed_out and (r.status, r.reward) == ("ok", 1.0), r
