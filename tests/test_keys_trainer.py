"""A trainer that keeps being killed: several episodes in flight in one client process, the
client SIGKILLed at seeded random points (mid-call, while its calls retry after client
timeouts, and while they retry against a daemon that was kill -9ed), the daemon kill -9ed
between calls and under a command in flight, each time resumed by
``AsyncSandbox.from_trajectory``. Every exec step must have run exactly once (a counter file
in each sandbox, read back at every odd step), except that an episode whose command was in
flight at a daemon kill gets ``step_interrupted`` and is masked, its interrupted step having
run at most once; every replayed read must return what was first read, and no sandbox may be
left behind."""

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
from corral.errors import CorralError

from conftest import wait_until

EPISODES = 6
STEPS = 40          # per episode: even steps append their number to /root/counter, odd ones read it
SLOW = 8            # in episodes 0-2, every SLOW-th step (4, 12, ...) is a command that
#                     outlasts the client's timeout: 2 s in episode 0, the one the test kills
#                     the daemon under, 0.8 s in episodes 1 and 2
SEED = int(os.environ.get("CORRAL_TRAINER_SEED", "2126"))

CLIENT = textwrap.dedent('''
    import asyncio, json, os, sys
    from corral import AsyncSandbox
    from corral.errors import CorralError, NotFound, StepInterrupted
    from corral.sdk import api

    work, run, episodes, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    slow = int(sys.argv[5])
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
                if not e.infra or isinstance(e, StepInterrupted):
                    raise  # step_interrupted: the step never runs again, mask the episode
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

    def slow_exec(cmd):
        def make(sid):
            call = api.exec_(sid, cmd, timeout=30)
            call.timeout = 0.3  # the client gives up first: Timeout, retried under the key
            return call
        return make

    async def step(sb, e, k):
        if k == steps:
            await sb.kill()
        elif e < 3 and k % slow == 4:
            mark = os.path.join(work, f"inflight-{os.getpid()}-{e}-{k}")
            open(mark, "w").close()
            secs = 2 if e == 0 else 0.8
            try:  # the mark stays while the call is retried (after a timeout)
                r = await sb._call(slow_exec(f"echo {k} >> /root/counter; sleep {secs}"))
            except StepInterrupted:
                os.unlink(mark)
                raise
            os.unlink(mark)
            assert r.exit_code == 0, r
        elif k % 2 == 0:
            r = await sb.exec(f"echo {k} >> /root/counter")
            assert r.exit_code == 0, r
        else:
            note(e, k, await sb.files.read("/root/counter"))

    async def episode(e):
        tid = f"{run}-e{e}"
        if os.path.exists(os.path.join(work, f"masked-{e}")):
            return
        try:
            await play(e, tid)
        except StepInterrupted as err:
            await mask(e, tid, err)

    async def mask(e, tid, err):
        """A step in flight at a daemon kill: keep what the sandbox says, end the episode."""
        sb = await retry(lambda: AsyncSandbox.from_trajectory(tid))
        counter = await retry(lambda: sb.files.read("/root/counter", key="final"))
        await retry(lambda: sb.kill(key="cleanup"))
        tmp = os.path.join(work, f"masked-{e}.tmp")
        with open(tmp, "w") as f:
            json.dump({"step": int(err.details["key"].rpartition(":")[2]),
                       "counter": counter}, f)
        os.rename(tmp, os.path.join(work, f"masked-{e}"))

    async def play(e, tid):
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
             str(STEPS), str(SLOW)], env=env, stderr=open(self.work / "client.err", "ab"))  # noqa: SIM115
        self.starts += 1

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def ended(self, e: int) -> bool:
        return (self.work / f"done-{e}").exists() or (self.work / f"masked-{e}").exists()

    def done(self) -> bool:
        return all(self.ended(e) for e in range(EPISODES))

    def in_flight(self) -> tuple[int, int] | None:
        """(episode, step) of a 2 s command of the running client (episode 0) whose command
        has run its echo and sleeps, while no 0.8 s one (episodes 1 and 2, the client-timeout
        ones) is in flight: a daemon killed now interrupts it."""
        assert self.proc is not None
        marks = [(m, *map(int, m.name.split("-")[2:]))
                 for m in self.work.glob(f"inflight-{self.proc.pid}-*")]
        if any(e > 0 for _, e, _ in marks):
            return None
        for mark, e, k in marks:
            if k < 12:
                continue  # past the episodes' first steps, which start in step (a burst)
            try:
                sid = Sandbox.from_trajectory(f"{self.run}-e{e}").id
                counter = Sandbox.from_id(sid).files.read("/root/counter")
            except CorralError:
                continue
            others = [m for m in self.work.glob(f"inflight-{self.proc.pid}-*") if m != mark]
            if counter.endswith(f"{k}\n") and mark.exists() and not others:
                return e, k  # (looked again: the others may have started a slow one since)
        return None

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
                                    or self.ended(e) for e in range(EPISODES)):
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
    # or kill -9 of the daemon under episode 0's slow command ("daemon-mid": it, and any other
    # episode with a command in flight, is masked)
    events = ["client"] * 4 + ["daemon", "daemon", "daemon+client", "daemon-mid"]
    rng.shuffle(events)
    kills = {"client": 0, "client_in_retries": 0, "daemon": 0, "daemon_mid": 0}
    cut: list[tuple[int, int]] = []  # (episode, step) in flight at a daemon-mid kill
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
            if ev == "daemon-mid":
                got: list[tuple[int, int]] = []

                def found(got: list[tuple[int, int]] = got) -> bool:
                    x = t.in_flight()
                    if x is not None:
                        got.append(x)
                    return bool(got) or t.exited() or t.ended(0)

                wait_until(found, timeout=60, interval=0.01)
                if not got:
                    continue
                daemon.kill9()
                kills["daemon_mid"] += 1
                cut.append(got[0])
                time.sleep(rng.uniform(0.1, 0.8))  # the client's calls fail and retry meanwhile
                daemon.start()
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
    print("trainer kills:", kills, "client starts:", t.starts, "cut:", cut, "masked:",
          {p.name: p.read_text() for p in tmp_path.glob("masked-*")})
    assert kills["daemon"] >= 2 and kills["client"] + kills["client_in_retries"] >= 3
    assert not (tmp_path / "mismatch").exists(), (tmp_path / "mismatch").read_text()
    assert "retry after timeout" in (tmp_path / "client.err").read_text()  # client timeouts

    seen: dict[tuple[int, int], str] = {}
    for line in (tmp_path / "seen.jsonl").read_text().splitlines():
        try:
            x = json.loads(line)
        except ValueError:
            continue
        seen.setdefault((x["e"], x["k"]), x["data"])
    masked = {e: json.loads((tmp_path / f"masked-{e}").read_text()) for e in range(EPISODES)
              if (tmp_path / f"masked-{e}").exists()}
    # a command in flight at a daemon kill: its episode got step_interrupted at that step
    assert kills["daemon_mid"] == 1 and set(cut) <= {(e, m["step"]) for e, m in masked.items()}
    reads = 0
    for e in range(EPISODES):
        tid = f"{run}-e{e}"
        sb = Sandbox.from_trajectory(tid)
        end = masked[e]["step"] if e in masked else STEPS
        assert sb.step == end + 1 and sb.last_info.state == "dead"
        # the test's own probes (unkeyed reads of the counter) aside, every call was keyed
        keyed = [x for x in sb.log() if x.op != "create" and x.idempotency_key is not None]
        keys = [f"{tid}:{k}" for k in range(end + 1)]
        if e in masked:  # the steps before ran once; the interrupted one at most once
            m = masked[e]
            assert [x.idempotency_key for x in keyed] == keys + ["final", "cleanup"]
            cut_entry = keyed[end]
            assert cut_entry.status == "interrupted" and cut_entry.op == "exec"
            assert cut_entry.error["error"]["code"] == "step_interrupted"
            assert cut_entry.error["error"]["category"] == "infra"
            before = "".join(f"{j}\n" for j in range(0, end, 2))
            assert m["counter"] in (before, before + f"{end}\n"), (e, m)
            keyed = keyed[:end]
        else:
            # every step ran once: one done entry per key, in order
            assert [x.idempotency_key for x in keyed] == keys
        assert all(x.status == "done" and x.error is None for x in keyed)
        for k in range(1, min(end, STEPS), 2):
            # the counter at read k holds each earlier exec step once, in order
            logged = base64.b64decode(keyed[k].result["data_b64"]).decode()
            assert logged == "".join(f"{j}\n" for j in range(0, k, 2)), (e, k, logged)
            if (e, k) in seen:  # what the client saw first is what the log replays
                assert seen[(e, k)] == logged, (e, k)
            reads += 1
    assert len(seen) >= reads - EPISODES  # the odd kill between a read and its note
    assert Sandbox.list(labels={"run": run}) == []
