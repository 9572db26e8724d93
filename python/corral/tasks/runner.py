"""``run_tasks``: every (task, attempt) a trial, run ``concurrency`` at a time, one JSONL
record each.

A trial: a sandbox on the task's environment image (its recipe built by corral's image
builder, each step a cached layer, so a task builds once), ``/logs/agent`` and
``/logs/verifier`` made, the agent (agents.py), then the verifier: every process the agent
left killed, ``/logs/verifier`` and ``/tests`` emptied (nothing the agent left there
counts), ``tests/`` copied to ``/tests``, ``bash /tests/test.sh`` run as root (or
``[verifier] user``), its reward read from ``/logs/verifier/reward.json`` (its ``reward``
key) or ``reward.txt``; the sandbox killed.

Status of a trial:
- ``ok``: the verifier wrote a reward;
- ``no_reward``: it wrote none (or not a number): reward 0.0, the agent's or the task's doing;
- ``infra``: the platform failed (a corral ``infra`` error, the sandbox killed from outside,
  a resumed trial whose sandbox is gone or whose calls differ): reward None, mask it;
- ``error``: anything else that stopped the trial before a verdict (a task whose build
  fails: ``invalid_task``): reward None.

Results file: the first line describes the run (``"kind": "run"``: its id, agent, tasks,
attempts), then one ``"kind": "trial"`` line per finished trial, flushed and fsynced as it
ends. Running again with the same file resumes the run: trials with a verdict are kept,
trials that ended ``infra`` run again under a new trajectory id (``.../retry1``), and
trials that were in flight continue from the trajectory log: the trial's calls are made again
under the same trajectory id, so those the daemon logged return their logged results
(nothing runs twice) and the first unlogged one runs for real.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from corral import errors as ce
from corral.rl.episode import is_infra
from corral.sdk import AsyncSandbox
from corral.tasks.agents import AGENT_LOGS, Agent, AgentOutcome
from corral.tasks.environment import Environments
from corral.tasks.taskdir import TaskDir

VERIFIER_LOGS = "/logs/verifier"
RUN_LABEL = "corral-tasks-run"


@dataclass
class TrialResult:
    task: str
    attempt: int
    trajectory_id: str
    status: str = "error"
    reward: float | None = None
    rewards: dict[str, float] = field(default_factory=dict)
    infra_error: bool = False
    error_code: str | None = None
    error: str | None = None
    sandbox_id: str | None = None
    resumed: bool = False
    agent_exit_code: int | None = None
    agent_timed_out: bool = False
    agent_error: str | None = None
    agent_output_tail: str = ""
    verifier_exit_code: int | None = None
    verifier_timed_out: bool = False
    verifier_output_tail: str = ""
    duration_s: float = 0.0

    def record(self) -> dict[str, Any]:
        return {"kind": "trial", **asdict(self)}


@dataclass
class RunSummary:
    run_id: str
    results: list[TrialResult]          # every trial's latest record, this run and before
    ran: int                            # trials run (or resumed) by this call
    wall_s: float

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.results)

    @property
    def reward_mean(self) -> float | None:
        scored = [r.reward for r in self.results if r.reward is not None]
        return sum(scored) / len(scored) if scored else None

    def to_dict(self) -> dict[str, Any]:
        per_task: dict[str, list[float]] = {}
        for r in self.results:
            if r.reward is not None:
                per_task.setdefault(r.task, []).append(r.reward)
        mean = self.reward_mean
        return {"run_id": self.run_id, "trials": len(self.results), "ran": self.ran,
                "ok": self.count("ok"), "no_reward": self.count("no_reward"),
                "infra_failures": self.count("infra"), "errors": self.count("error"),
                "resumed": sum(r.resumed for r in self.results),
                "reward_mean": None if mean is None else round(mean, 4),
                "wall_s": round(self.wall_s, 3),
                "per_task": {k: round(sum(v) / len(v), 4) for k, v in sorted(per_task.items())}}


def _read_results(path: Path) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    header, trials = None, []
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None, []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line torn by a kill
        if rec.get("kind") == "run" and header is None:
            header = rec
        elif rec.get("kind") == "trial":
            trials.append(rec)
    return header, trials


def _from_record(rec: dict[str, Any]) -> TrialResult:
    known = TrialResult.__dataclass_fields__
    return TrialResult(**{k: v for k, v in rec.items() if k in known})


class _Writer:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.f = path.open("a")

    def write(self, rec: dict[str, Any]) -> None:
        self.f.write(json.dumps(rec, allow_nan=False) + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())

    def close(self) -> None:
        self.f.close()


async def run_tasks(tasks: Sequence[TaskDir], agent: Agent, agent_name: str,
                    results_path: str | Path, *, attempts: int = 1, concurrency: int = 4,
                    network: str = "none", endpoint: str | None = None,
                    on_trial: Callable[[TrialResult], None] | None = None) -> RunSummary:
    path = Path(results_path)
    header, old = _read_results(path)
    names = [t.name for t in tasks]
    if header is not None and header.get("agent") != agent_name:
        raise ce.InvalidRequest(
            f"{path} holds a run of agent {header.get('agent')!r}, not {agent_name!r}: "
            "give another results file", code="invalid_task")
    writer = _Writer(path)
    if header is None:
        header = {"kind": "run", "run_id": uuid.uuid4().hex[:12], "agent": agent_name,
                  "tasks": names, "attempts": attempts, "started_at": time.time()}
        writer.write(header)
    run_id = str(header["run_id"])

    latest: dict[tuple[str, int], TrialResult] = {}
    infra_count: dict[tuple[str, int], int] = {}
    for rec in old:
        r = _from_record(rec)
        latest[(r.task, r.attempt)] = r
        if r.status == "infra":
            infra_count[(r.task, r.attempt)] = infra_count.get((r.task, r.attempt), 0) + 1
    todo = []
    for t in tasks:
        for a in range(attempts):
            prev = latest.get((t.name, a))
            if prev is not None and prev.status != "infra":
                continue
            n = infra_count.get((t.name, a), 0)
            tid = f"{run_id}/{t.name}/{a}" + (f"/retry{n}" if n else "")
            todo.append((t, a, tid))

    envs = Environments(network, endpoint)
    sem = asyncio.Semaphore(max(1, concurrency))

    async def one(task: TaskDir, attempt: int, tid: str) -> None:
        async with sem:
            res = await _trial(task, attempt, tid, agent, envs, run_id, network, endpoint)
        latest[(task.name, attempt)] = res
        writer.write(res.record())
        if on_trial is not None:
            on_trial(res)

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(one(*x) for x in todo))
    finally:
        writer.close()
    order = {n: i for i, n in enumerate(names)}
    results = sorted((r for r in latest.values() if r.task in order),
                     key=lambda r: (order[r.task], r.attempt))
    return RunSummary(run_id=run_id, results=results, ran=len(todo),
                      wall_s=time.perf_counter() - t0)


async def _trial(task: TaskDir, attempt: int, tid: str, agent: Agent, envs: Environments,
                 run_id: str, network: str, endpoint: str | None) -> TrialResult:
    res = TrialResult(task=task.name, attempt=attempt, trajectory_id=tid)
    t0 = time.perf_counter()
    sb: AsyncSandbox | None = None
    try:
        env = await envs.ensure(task)
        try:  # a trial that was in flight: its calls replay from the log
            sb = await AsyncSandbox.from_trajectory(tid, step=0, endpoint=endpoint)
            res.resumed = True
        except ce.NotFound:
            # the image's Env, WorkingDir and User apply to the trial's sandbox
            sb = AsyncSandbox(env.image, cpu=task.cpus, memory_mb=task.memory_mb,
                              disk_mb=task.storage_mb, network=network,
                              timeout=task.agent_timeout + task.verifier_timeout + 900,
                              labels={RUN_LABEL: run_id}, trajectory_id=tid,
                              endpoint=endpoint)
        await sb
        res.sandbox_id = sb.id
        await _root(sb, f"mkdir -p {AGENT_LOGS} {VERIFIER_LOGS} && chmod 0777 /logs "
                        f"{AGENT_LOGS} {VERIFIER_LOGS}")
        await _agent_phase(sb, task, agent, res)
        await _verify(sb, task, env.workdir, res)
        await sb.kill()
    except ce.CorralError as e:
        outside = is_infra(e) or isinstance(e, ce.ReplayDivergence)
        res.status = "infra" if outside else "error"
        res.infra_error = outside
        res.reward = None
        res.error_code, res.error = e.code, e.message
        if sb is not None and sb._sid is not None:
            try:
                await sb.kill(key="cleanup")
            except ce.CorralError:
                pass
    res.duration_s = round(time.perf_counter() - t0, 3)
    return res


async def _root(sb: AsyncSandbox, script: str) -> None:
    """The runner's own step before the agent ran: its failure is the image's or the
    platform's."""
    r = await sb.exec(["/bin/sh", "-c", script], user="root", cwd="/", timeout=60)
    if not r.ok:
        raise ce.InternalError(f"{script!r} failed in the trial's sandbox: {r.stderr[-400:]}")


class _Unverifiable(Exception):
    """The verifier could not run in what the agent left (its shell gone, its disk full, its
    working directory removed...): the agent's doing, scored 0."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


async def _after_agent(sb: AsyncSandbox, script: str) -> None:
    """A runner step in the sandbox the agent left: its failure is the agent's."""
    r = await sb.exec(["/bin/sh", "-c", script], user="root", cwd="/", timeout=60)
    if not r.ok:
        raise _Unverifiable("verifier_setup_failed", f"{script!r} failed in what the agent "
                            f"left: {r.stderr[-400:]}")


async def _agent_phase(sb: AsyncSandbox, task: TaskDir, agent: Agent,
                       res: TrialResult) -> None:
    try:
        out = await asyncio.wait_for(agent(sb, task), task.agent_timeout + 5)
    except asyncio.TimeoutError:  # the builtin TimeoutError only from 3.11
        res.agent_timed_out = True
        return
    except ce.CorralError as e:
        if e.infra or isinstance(e, ce.InvalidRequest) and e.code == "invalid_task":
            raise
        res.agent_error = str(e)  # the policy's own mistake (a missing file...): still scored
        return
    except Exception as e:  # noqa: BLE001  (a policy's bug is the policy's, not the run's)
        res.agent_error = f"{type(e).__name__}: {e}"
        return
    if isinstance(out, AgentOutcome):
        res.agent_exit_code = out.exit_code
        res.agent_timed_out = out.timed_out
        res.agent_output_tail = out.output_tail


# Every process in the sandbox but the init and this shell (kill(-1) as root; a fork racing
# it is refused by the kernel; a process killed runs no code of its own again).
KILL_ALL = "kill -9 -1 2>/dev/null; true"


async def _verify(sb: AsyncSandbox, task: TaskDir, workdir: str, res: TrialResult) -> None:
    """The verifier, in the sandbox the agent left. What the agent broke there (its shell,
    its disk, the verifier's working directory, the verifier's user) leaves the trial
    unverifiable: ``no_reward`` 0.0, never the platform's failure nor an unscored error."""
    try:
        await _run_verifier(sb, task, workdir, res)
    except _Unverifiable as e:
        res.status, res.reward, res.error_code, res.error = "no_reward", 0.0, e.code, e.message
    except ce.CorralError as e:
        if is_infra(e):
            raise
        res.status, res.reward, res.error_code = "no_reward", 0.0, e.code
        res.error = f"the verifier could not run in what the agent left: {e.message}"


async def _run_verifier(sb: AsyncSandbox, task: TaskDir, workdir: str,
                        res: TrialResult) -> None:
    user = task.verifier_user or "root"
    # Every process the agent left is killed first, so nothing of the agent's runs while the
    # verifier does: no writer re-planting a reward, no test swapped mid-run.
    await _after_agent(sb, KILL_ALL)
    await _after_agent(sb, f"rm -rf /tests {VERIFIER_LOGS} && mkdir -p /tests {VERIFIER_LOGS} "
                           f"&& chmod 0777 {VERIFIER_LOGS}")
    await sb.files.upload(task.tests_dir, "/tests")
    r = await sb.exec(["bash", "/tests/test.sh"], timeout=task.verifier_timeout,
                      env=task.verifier_env or None, user=user, cwd=workdir)
    res.verifier_exit_code = r.exit_code
    res.verifier_timed_out = r.timed_out
    res.verifier_output_tail = (r.stdout + r.stderr)[-2000:]
    # What the verifier started (it may run the agent's code) ends before the reward is read.
    await _after_agent(sb, KILL_ALL)
    rewards = await _rewards(sb)
    if rewards is None:
        res.status, res.reward = "no_reward", 0.0
        res.error_code = "reward_missing"
        res.error = f"the verifier wrote no number to {VERIFIER_LOGS}/reward.txt or .json"
        return
    res.status, res.rewards = "ok", rewards
    res.reward = rewards.get("reward", next(iter(rewards.values())) if rewards else 0.0)


async def _rewards(sb: AsyncSandbox) -> dict[str, float] | None:
    """reward.json (numbers only, Harbor's rule) or reward.txt (one number)."""
    out: dict[str, float] = {}
    try:
        parsed = json.loads(await sb.files.read(f"{VERIFIER_LOGS}/reward.json"))
        if isinstance(parsed, dict):
            out = {str(k): float(v) for k, v in parsed.items()
                   if isinstance(v, int | float) and not isinstance(v, bool)
                   and math.isfinite(v)}
    except (ce.FileNotFound, ValueError, OverflowError):
        pass
    if "reward" not in out:
        try:
            got = float((await sb.files.read(f"{VERIFIER_LOGS}/reward.txt")).strip())
            if math.isfinite(got):  # NaN or inf is no reward (nor valid JSON in the results)
                out["reward"] = got
        except (ce.FileNotFound, ValueError):
            pass
    return out or None
