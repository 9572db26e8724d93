"""A trainer that keeps being killed: several episodes in flight in one client process, the
client SIGKILLed at seeded random points (mid-call, and while its calls are retrying against a
daemon that was kill -9ed), each time resumed by ``AsyncSandbox.from_trajectory``. Every exec
step must have run exactly once (a counter file in each sandbox, read back at every odd step),
every replayed read must return what was first read, and no sandbox may be left behind."""

from __future__ import annotations

import base64
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

from corral import Sandbox

EPISODES = 6
STEPS = 40          # per episode: even steps append their number to /root/counter, odd ones read it
SEED = int(os.environ.get("CORRAL_TRAINER_SEED", "2126"))

CLIENT = textwrap.dedent('''
    import asyncio, json, os, sys
    from corral import AsyncSandbox
    from corral.errors import CorralError, NotFound

    work, run, episodes, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    seen_path = os.path.join(work, "seen.jsonl")

    def load_seen():
        seen = {}
        try:
            with open(seen_path) as f:
                for line in f:
                    try:
                        x = json.loads(line)
                    except ValueError:
                        continue  # a line torn by a SIGKILL
                    seen.setdefault((x["e"], x["k"]), x["data"])
        except FileNotFoundError:
            pass
        return seen

    seen = load_seen()
    seen_f = open(seen_path, "a")

    def note(e, k, data):
        if (e, k) in seen:
            if seen[(e, k)] != data:  # a replayed read saw something else than the first one
                with open(os.path.join(work, "mismatch"), "a") as f:
                    f.write(json.dumps([e, k, seen[(e, k)], data]) + "\\n")
            return
        seen[(e, k)] = data
        seen_f.write(json.dumps({"e": e, "k": k, "data": data}) + "\\n")
        seen_f.flush()

    async def retry(fn):
        """The trainer's own retry of an infra failure: the same call again (same key)."""
        for _ in range(600):
            try:
                return await fn()
            except CorralError as e:
                if not e.infra:
                    raise
                print("retry after", e.code, file=sys.stderr, flush=True)
                await asyncio.sleep(0.1)
        raise RuntimeError("gave up")

    async def gate(e):
        """Between two calls: hold while the test pauses the trainer (no call in flight)."""
        pause = os.path.join(work, "pause")
        if os.path.exists(pause):
            open(os.path.join(work, f"paused-{e}"), "w").close()
            while os.path.exists(pause):
                await asyncio.sleep(0.01)

    async def step(sb, e, k):
        if k == steps:
            await sb.kill()
        elif k % 2 == 0:
            r = await sb.exec(f"echo {k} >> /root/counter")
            assert r.exit_code == 0, r
        else:
            note(e, k, await sb.files.read("/root/counter"))

    async def episode(e):
        tid = f"{run}-e{e}"
        try:
            pos = (await retry(lambda: AsyncSandbox.from_trajectory(tid))).step
        except NotFound:
            fresh = AsyncSandbox(trajectory_id=tid, timeout=600, labels={"run": run})
            await retry(lambda: fresh._ready_handle())
            pos = 0
        # Rebuild the episode's state: replay every logged step (they fast-forward; the reads
        # return what was read then), from the start.
        sb = await retry(lambda: AsyncSandbox.from_trajectory(tid, step=0))
        for k in range(pos):
            await retry(lambda: step(sb, e, k))
        if sb.step != pos:
            raise RuntimeError(f"episode {e}: replayed to step {sb.step}, log says {pos}")
        for k in range(pos, steps + 1):
            await asyncio.sleep(0.06)  # the policy thinks (an LLM call)
            await gate(e)
            await retry(lambda: step(sb, e, k))
        open(os.path.join(work, f"done-{e}"), "w").close()

    async def main():
        await asyncio.gather(*(episode(e) for e in range(episodes)))

    asyncio.run(main())
''')


class Trainer:
    def __init__(self, work: Path, run: str) -> None:
        self.work, self.run = work, run
        self.script = work / "client.py"
        self.script.write_text(CLIENT)
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        env = dict(os.environ, CORRAL_AUTOSTART="0")
        self.proc = subprocess.Popen(
            [sys.executable, str(self.script), str(self.work), self.run, str(EPISODES),
             str(STEPS)], env=env, stderr=open(self.work / "client.err", "ab"))  # noqa: SIM115
        self.starts += 1

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def done(self) -> bool:
        return all((self.work / f"done-{e}").exists() for e in range(EPISODES))

    def exited(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is None:
            return False
        assert self.proc.returncode == 0, (self.work / "client.err").read_text()[-3000:]
        return True

    def pause(self, deadline: float) -> None:
        """Hold every episode between two calls: nothing in flight once this returns."""
        (self.work / "pause").touch()
        while time.monotonic() < deadline:
            if self.exited() or all((self.work / f"paused-{e}").exists()
                                    or (self.work / f"done-{e}").exists()
                                    for e in range(EPISODES)):
                return
            time.sleep(0.01)
        raise AssertionError("the trainer did not pause")

    def unpause(self) -> None:
        for e in range(EPISODES):
            (self.work / f"paused-{e}").unlink(missing_ok=True)
        (self.work / "pause").unlink()


def test_a_killed_trainer_resumes_every_step_exactly_once(daemon, tmp_path):
    rng = random.Random(SEED)
    run = "trainer-" + uuid.uuid4().hex[:8]
    t = Trainer(tmp_path, run)
    # what happens while the trainer runs, in a seeded order: SIGKILL of the client mid-call, or
    # kill -9 of the daemon with the client's calls failing and retrying until it is back
    # (then the client lives on, or is SIGKILLed while retrying: "daemon+client")
    events = ["client"] * 4 + ["daemon", "daemon", "daemon+client"]
    rng.shuffle(events)
    kills = {"client": 0, "client_in_retries": 0, "daemon": 0}
    deadline = time.monotonic() + 240
    t.start()
    try:
        for ev in events:
            if t.done():
                break
            time.sleep(rng.uniform(0.15, 0.6))  # some steps of progress first
            if ev == "client":
                if t.exited():
                    break
                t.kill9()
                kills["client"] += 1
                t.start()
                continue
            t.pause(deadline)
            daemon.kill9()
            kills["daemon"] += 1
            t.unpause()  # the client's calls now fail and retry under their keys
            time.sleep(rng.uniform(0.1, 0.8))
            killed = ev == "daemon+client" and not t.exited()
            if killed:
                t.kill9()
                kills["client_in_retries"] += 1
            daemon.start()
            if killed:
                t.start()
        while not t.exited():
            assert time.monotonic() < deadline, "the trainer did not finish"
            time.sleep(0.05)
        assert t.done()
    except BaseException:
        print(daemon.tail(6000))
        raise
    finally:
        if t.proc is not None and t.proc.poll() is None:
            t.kill9()
        if daemon.proc is None:
            daemon.start()
        (tmp_path / "pause").unlink(missing_ok=True)
    print("trainer kills:", kills, "client starts:", t.starts)
    assert kills["daemon"] >= 2 and kills["client"] + kills["client_in_retries"] >= 3
    assert not (tmp_path / "mismatch").exists(), (tmp_path / "mismatch").read_text()

    seen: dict[tuple[int, int], str] = {}
    for line in (tmp_path / "seen.jsonl").read_text().splitlines():
        try:
            x = json.loads(line)
        except ValueError:
            continue
        seen.setdefault((x["e"], x["k"]), x["data"])
    for e in range(EPISODES):
        tid = f"{run}-e{e}"
        sb = Sandbox.from_trajectory(tid)
        assert sb.step == STEPS + 1 and sb.last_info.state == "dead"
        entries = sb.log()
        keyed = [x for x in entries if x.op != "create"]
        # every step ran once: one done entry per key, in order, nothing unkeyed
        assert [x.idempotency_key for x in keyed] == [f"{tid}:{k}" for k in range(STEPS + 1)]
        assert all(x.status == "done" and x.error is None for x in keyed)
        for k in range(1, STEPS, 2):
            # the counter at read k holds each earlier exec step once, in order
            logged = base64.b64decode(keyed[k].result["data_b64"]).decode()
            assert logged == "".join(f"{j}\n" for j in range(0, k, 2)), (e, k, logged)
            if (e, k) in seen:  # what the client saw first is what the log replays
                assert seen[(e, k)] == logged, (e, k)
    assert len(seen) >= EPISODES * (STEPS // 2) - EPISODES  # the odd kill between read & note
    assert Sandbox.list(labels={"run": run}) == []
