"""kill -9 of a pooled corrald at random moments of a mixed workload, three times over.

Creates (single, batch, from a snapshot, fork), execs, file writes, snapshots, kills and pool
refills are all in flight when the daemon dies. After each restart every sandbox the daemon
lists must work (its files intact), every call a worker saw fail must have failed with an
infra error (never a wrong result), and at the end, once everything is killed and every
snapshot deleted, nothing may be left: no sandbox cgroup, process, directory, mount or layer.
The seed is printed, so a failure can be replayed (CORRAL_CHAOS_SEED).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from typing import Any

import pytest
from test_pools import ep, pooled_daemon

from corral import Sandbox, Snapshot
from corral.errors import CorralError

from conftest import journal_started, wait_until, with_holds

ROUNDS = 3


class Workload:
    """Worker threads looping over the SDK until ``stop``; a call may fail only with an infra
    error (the daemon is gone or restarted). Everything else is a finding."""

    def __init__(self, endpoint: str, seed: int) -> None:
        self.ep = endpoint
        self.stop = threading.Event()
        self.findings: list[str] = []
        self.infra = 0
        self.done = 0
        self.seed = seed
        self.home_seen: list[int] = []
        self.churn_seen: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    def _ok(self) -> None:
        with self._lock:
            self.done += 1

    def _failed(self, who: str, e: BaseException) -> None:
        with self._lock:
            if isinstance(e, CorralError) and e.infra:
                self.infra += 1
            else:
                import traceback

                at = [f"line {f.lineno}" for f in traceback.extract_tb(e.__traceback__)
                      if f.filename == __file__]
                self.findings.append(f"{who} ({', '.join(at)}): {type(e).__name__}: {e}")

    def _loop(self, who: str, step: Any) -> None:
        rng = random.Random(f"{self.seed}-{who}")
        n = 0
        while not self.stop.is_set():
            try:
                step(rng, n)
                self._ok()
            except BaseException as e:  # noqa: BLE001 - judged by _failed
                self._failed(who, e)
                time.sleep(0.02)  # the daemon is down: don't spin
            n += 1

    def churn(self, rng: random.Random, n: int) -> None:
        sb = Sandbox(endpoint=self.ep, timeout=600)
        r = sb.exec(f"echo c{n} > /root/f && cat /root/f")
        assert (r.exit_code, r.stdout) == (0, f"c{n}\n"), r
        with self._lock:
            self.churn_seen.append((sb.id, n))  # a client saw it: the log must have it
        if rng.random() < 0.8:
            sb.kill()  # else left for the restart to re-adopt (and the end to kill)

    def batch(self, rng: random.Random, n: int) -> None:
        boxes = Sandbox.create_many(rng.randint(2, 5), endpoint=self.ep, timeout=600)
        res = Sandbox.exec_many(boxes, "echo b", endpoint=self.ep)
        assert all(r.stdout == "b\n" for r in res), res
        Sandbox.kill_many(boxes, endpoint=self.ep)

    def snapshots(self, rng: random.Random, n: int) -> None:
        sb = Sandbox(endpoint=self.ep, timeout=600)
        try:
            sb.files.write("/root/s", f"s{n}")
            snap = sb.snapshot()
            kids = sb.fork(rng.randint(1, 3))
            for k in kids:
                assert k.files.read("/root/s") == f"s{n}"
            Sandbox.kill_many(kids, endpoint=self.ep)
            if rng.random() < 0.5:
                child = Sandbox(endpoint=self.ep, snapshot=snap, timeout=600)
                assert child.exec("cat /root/s").stdout == f"s{n}"
                child.kill()
        finally:
            _swallow(sb.kill)

    def long_lived(self, rng: random.Random, n: int) -> None:
        if not hasattr(self, "_home"):
            self._home = Sandbox(endpoint=self.ep, timeout=600)
            self._home.files.write("/root/count", "")
        sb = self._home
        r = sb.exec(f"echo {n} >> /root/count")
        assert r.exit_code == 0, r
        self.home_seen.append(n)  # a client saw this line written
        if rng.random() < 0.2:
            sb.exec("sleep 30 >/dev/null 2>&1 &")  # a background process across restarts

    def pauses(self, rng: random.Random, n: int) -> None:
        # Labeled: the check after each restart leaves these alone (an exec there would
        # resume one this worker just paused).
        sb = Sandbox(endpoint=self.ep, timeout=600, labels={"chaos": "pauses"})
        try:
            sb.exec("sleep 30 >/dev/null 2>&1 &")
            assert sb.pause().state == "paused"
            if rng.random() < 0.5:
                assert sb.resume().state == "running"
            assert sb.exec("echo p").stdout == "p\n"  # resumes a paused one transparently
        finally:
            _swallow(sb.kill)

    def restores(self, rng: random.Random, n: int) -> None:
        sb = Sandbox(endpoint=self.ep, timeout=600)
        try:
            sb.files.write("/root/r", "before")
            snap = sb.snapshot()
            sb.files.write("/root/r", "after")
            sb.files.write("/root/big", os.urandom(rng.randint(1, 4) << 20))  # a thread op
            sb.restore(snap)
            assert sb.files.read("/root/r") == "before"
            assert sb.exec("test -e /root/big || echo gone").stdout == "gone\n"
            snap.delete()
        finally:
            _swallow(sb.kill)

    def start(self) -> list[threading.Thread]:
        steps = {"churn": self.churn, "batch": self.batch, "snapshots": self.snapshots,
                 "long_lived": self.long_lived, "pauses": self.pauses,
                 "restores": self.restores}
        threads = [threading.Thread(target=self._loop, args=(k, v), daemon=True)
                   for k, v in steps.items()]
        for t in threads:
            t.start()
        return threads


def _debug(e: BaseException, sb: Sandbox, d: Any) -> str:
    """What the daemon is doing: each thread's state and kernel stack, its children's."""
    out = [repr(e), f"{sb.id} {sb.last_info}"]
    pid = d.proc.pid if d.proc else None
    pids = [pid] if pid else []
    try:
        pids += [int(x) for x in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    except OSError:
        pass
    for p in pids:
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            base = f"/proc/{p}/task/{t}"
            try:
                stat = open(f"{base}/stat").read().rsplit(")", 1)[1].split()[0]
                comm = open(f"{base}/comm").read().strip()
                stack = open(f"{base}/stack").read()
            except OSError:
                continue
            out.append(f"--- {p}/{t} {comm} state {stat}\n{stack}")
    out.append("--- log\n" + d.tail(30000))
    return "\n".join(out)


def _mounts_under(path: str) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if line.split()[4].startswith(path)]


def test_kill9_at_random_moments_loses_and_leaks_nothing(monkeypatch):
    seed = int(os.environ.get("CORRAL_CHAOS_SEED") or random.randrange(1 << 30))
    print(f"chaos seed {seed} (CORRAL_CHAOS_SEED={seed} to replay)")
    rng = random.Random(seed)
    monkeypatch.setenv("CORRAL_AUTOSTART", "0")  # a dead daemon must stay dead until we say
    with pooled_daemon(CORRAL_POOL="auto", CORRAL_POOL_TARGET="4") as d:
        url = ep(d)
        work = Workload(url, seed)
        threads = work.start()
        try:
            for _ in range(ROUNDS):
                time.sleep(rng.uniform(0.5, 2.0))  # everything in flight, at some point
                if rng.random() < 0.35 and d.proc is not None:
                    # A graceful stop cut short: sandboxes half destroyed.
                    d.proc.send_signal(signal.SIGTERM)
                    time.sleep(rng.uniform(0.0, 0.2))
                d.kill9()
                time.sleep(rng.uniform(0.0, 0.3))
                d.start()
                time.sleep(0.3)
                # Every sandbox the new daemon lists works, with its files.
                for sb in Sandbox.list(endpoint=url):
                    if sb.last_info is not None and sb.last_info.labels.get("chaos"):
                        continue
                    try:
                        assert sb.exec("test -d /root && echo up").stdout == "up\n"
                    except CorralError as e:  # ended meanwhile (a worker's kill): fine
                        assert e.code in ("sandbox_not_found", "sandbox_not_running",
                                          "sandbox_lost"), _debug(e, sb, d)
        finally:
            work.stop.set()
            for t in threads:
                t.join(120)
        assert not any(t.is_alive() for t in threads)
        assert not work.findings, f"seed {seed}: {work.findings[:10]}"
        print(f"calls ok {work.done}, infra failures {work.infra}")
        assert work.done > 20 and work.infra > 0, (work.done, work.infra)
        # The long-lived sandbox, re-adopted three times, kept every line a client saw written.
        home = getattr(work, "_home", None)
        if home is not None:
            try:
                lines = [int(x) for x in home.files.read("/root/count").split()]
                assert lines == sorted(lines) and set(work.home_seen) <= set(lines), \
                    (work.home_seen, lines)
            except CorralError as e:  # lost, or destroyed by a graceful stop: infra
                assert e.infra, e
        # Every exec a client saw is in its sandbox's trajectory log, with its output (the
        # sandboxes ended, killed or lost, but their logs outlive them).
        for sid, n in random.Random(seed).sample(work.churn_seen, min(40, len(work.churn_seen))):
            entries = Sandbox.from_id(sid, endpoint=url).log()
            got = [e.result["stdout"] for e in entries if e.op == "exec" and e.result]
            assert f"c{n}\n" in got, (sid, n, entries)
        # Kill everything, delete every snapshot: nothing may be left.
        live = Sandbox.list(endpoint=url)
        Sandbox.kill_many(live, return_exceptions=True, endpoint=url)
        for snap in Snapshot.list(endpoint=url):
            snap.delete()
        assert Sandbox.list(endpoint=url) == []
        assert Snapshot.list(endpoint=url) == []
        d.stop()  # graceful: spares and pools go; pooled_daemon checks cgroups, pids, dirs
        assert _mounts_under(d.state_dir) == [], d.tail(6000)
        layers = os.path.join(d.state_dir, "layers")
        left = [x for x in os.listdir(layers) if not x.startswith(".")] \
            if os.path.isdir(layers) else []
        assert left == [], left
        d.start()  # pooled_daemon stops it again and runs its leak checks


def _freezer_file(cgroup: str, sid: str) -> str:
    v1 = f"/sys/fs/cgroup/freezer/{cgroup}/{sid}/freezer.state"
    return v1 if os.path.exists(v1) else f"/sys/fs/cgroup/{cgroup}/{sid}/cgroup.freeze"


def _freeze(cgroup: str, sid: str, on: bool) -> None:
    f = _freezer_file(cgroup, sid)
    with open(f, "w") as fh:
        fh.write(("FROZEN" if on else "THAWED") if f.endswith("freezer.state")
                 else ("1" if on else "0"))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _frozen(cgroup: str, sid: str) -> bool:
    return open(_freezer_file(cgroup, sid)).read().strip() in ("FROZEN", "FREEZING", "1")


def test_a_sandbox_frozen_at_a_crash_is_thawed_on_readoption(monkeypatch):
    """kill -9 while a snapshot's capture holds a sandbox frozen (simulated: its freezer set
    by hand, no pause recorded): the next daemon thaws it, and its next exec runs. Left
    frozen, that exec's child froze as it joined the cgroup, and the daemon's event loop
    with it (found by the chaos test above). A paused sandbox stays paused."""
    monkeypatch.setenv("CORRAL_AUTOSTART", "0")
    with pooled_daemon(CORRAL_POOL="off") as d:
        url = ep(d)
        cut, paused = Sandbox(endpoint=url), Sandbox(endpoint=url)
        paused.pause()
        d.kill9()
        _freeze(d.cgroup, cut.id, True)
        d.start()
        assert not _frozen(d.cgroup, cut.id)
        assert Sandbox.connect(cut.id, endpoint=url).exec("echo thawed", timeout=10).stdout \
            == "thawed\n"
        again = Sandbox.connect(paused.id, endpoint=url)
        assert again.info().state == "paused" and _frozen(d.cgroup, paused.id)
        assert again.exec("echo resumed", timeout=10).stdout == "resumed\n"  # transparently
        Sandbox.kill_many([cut.id, paused.id], endpoint=url)


def test_an_exec_during_a_snapshot_waits_without_blocking_the_daemon(monkeypatch, tmp_path):
    """An exec on a sandbox whose snapshot is being captured (the sandbox frozen) waits for
    the capture, and the daemon keeps serving everyone else meanwhile. Before, the exec's
    child froze as it joined the cgroup and the daemon's spawn (a vfork) waited for it with
    the event loop blocked until the capture ended."""
    hold = tmp_path / "hold"
    monkeypatch.setenv("CORRAL_AUTOSTART", "0")
    with pooled_daemon(CORRAL_POOL="off", **with_holds(snapshot=hold)) as d:
        url = ep(d)
        a, b = Sandbox(endpoint=url), Sandbox(endpoint=url)
        a.files.write("/root/x", "1")
        hold.write_text("")
        out: dict[str, Any] = {}

        def snap() -> None:
            out["snap"] = a.snapshot()

        def run_a() -> None:
            out["a"] = a.exec("cat /root/x", timeout=30)

        ts = threading.Thread(target=snap)
        ts.start()
        deadline = time.monotonic() + 30
        while not _frozen(d.cgroup, a.id):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        ta = threading.Thread(target=run_a)
        ta.start()
        # The exec on a is in the daemon, waiting for the capture.
        assert wait_until(lambda: journal_started(d.state_dir, a.id, "exec"), 30)
        # Meanwhile the daemon serves other sandboxes (its loop is not stuck in a spawn).
        other = Sandbox.connect(b.id, endpoint=url)
        assert other.exec("echo b", timeout=10).stdout == "b\n"
        assert "a" not in out and ta.is_alive()  # a's exec waits for the capture
        assert a.info().state == "running"
        hold.unlink()
        ts.join(30)
        ta.join(30)
        assert out["a"].stdout == "1" and out["snap"].id
        assert not _frozen(d.cgroup, a.id)
        Sandbox.kill_many([a, b], endpoint=url)
        out["snap"].delete()


def test_an_init_dying_while_the_daemon_is_down_is_lost_not_running(monkeypatch):
    """The daemon dies with a command running in a sandbox (the command is the daemon's
    child), then the sandbox's init is killed. Its exit waits until that command is reaped,
    which only the host's init now does, and some never do promptly: the init sits in exit,
    its pid and start time unchanged, its root gone. Such a sandbox is lost (an infra error),
    never `running` with every call failing `sandbox_not_running` (found by the chaos test)."""
    monkeypatch.setenv("CORRAL_AUTOSTART", "0")
    with pooled_daemon(CORRAL_POOL="off") as d:
        url = ep(d)
        sb = Sandbox(endpoint=url)
        init = sb.info().init_pid
        t = threading.Thread(target=lambda: _swallow(lambda: sb.exec("sleep 30", timeout=60)))
        t.start()
        probe = Sandbox.connect(sb.id, endpoint=url)
        # The command runs, a child of the daemon.
        assert wait_until(lambda: probe.exec("pgrep -x sleep || true").stdout.strip() != "")
        d.kill9()
        t.join(30)
        os.kill(init, signal.SIGKILL)
        assert wait_until(lambda: not _alive(init))
        d.start()
        with pytest.raises(CorralError) as e:
            Sandbox.connect(sb.id, endpoint=url).exec("true", timeout=10)
        assert e.value.code == "sandbox_lost" and e.value.infra, e.value


def _swallow(fn: Any) -> None:
    try:
        fn()
    except CorralError:
        pass


if __name__ == "__main__":
    pytest.main([__file__, "-q", "-s"])
