"""kill -9 of corrald under load (docs/daemon.md, "Stopping, crashing and restarting"): every
sandbox is re-adopted with its files, the calls in flight fail with an infra error (never as
the command's own failure), and the trajectory log holds every call a client saw completed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral import AsyncSandbox, Sandbox
from corral.errors import CorralError, DaemonRestarted, DaemonUnavailable, StepInterrupted

from conftest import journal_started, wait_until, with_holds


def _running(sb: Sandbox, name: str) -> bool:
    return sb.exec(f"pgrep -x {name} >/dev/null && echo y").stdout == "y\n"


def _record_has_runtime(sdir: str) -> bool:
    try:
        return bool(json.loads(Path(sdir, "meta.json").read_text()).get("runtime"))
    except (OSError, ValueError):
        return False


def test_kill9_under_load(daemon):
    boxes = [Sandbox(timeout=600) for _ in range(3)]
    for b in boxes:
        b.files.write("/root/keep", b.id)
    lock = threading.Lock()
    seen: dict[str, list[tuple[str, str, int]]] = {b.id: [] for b in boxes}
    failures: list[tuple[str, BaseException]] = []
    started = threading.Event()

    def note(sid: str, cmd: str, stdout: str, code: int) -> None:
        with lock:
            seen[sid].append((cmd, stdout, code))

    def worker(b: Sandbox, w: str) -> None:
        n = 0
        while True:
            cmd = f"echo {w}-{n}; echo {w}-{n} >> /root/trail; sleep 0.0{n % 3}"
            try:
                r = b.exec(cmd)
            except CorralError as e:
                failures.append((w, e))
                return
            note(b.id, cmd, r.stdout, r.exit_code)
            n += 1
            if n == 5:
                started.set()

    def long_one(b: Sandbox) -> None:
        try:
            r = b.exec("sleep 30; echo late")
        except CorralError as e:
            failures.append(("long", e))
        else:
            failures.append(("long", AssertionError(f"completed: {r}")))

    def async_worker(b: Sandbox) -> None:
        async def main() -> None:
            ab = await AsyncSandbox.connect(b.id)

            async def one(t: int) -> None:
                n = 0
                while True:
                    cmd = f"echo a{t}-{n}"
                    try:
                        r = await ab.exec(cmd)
                    except CorralError as e:
                        failures.append((f"async{t}", e))
                        return
                    note(b.id, cmd, r.stdout, r.exit_code)
                    n += 1

            await asyncio.gather(*(one(t) for t in range(4)))

        asyncio.run(main())

    threads = [threading.Thread(target=worker, args=(b, f"w{i}{j}"))
               for i, b in enumerate(boxes) for j in range(2)]
    threads.append(threading.Thread(target=long_one, args=(boxes[0],)))
    threads.append(threading.Thread(target=async_worker, args=(boxes[1],)))
    try:
        for t in threads:
            t.start()
        assert started.wait(30)
        # Load running: the long command in flight, each async caller past its first call.
        assert wait_until(lambda: _running(boxes[0], "sleep"), 30)
        assert wait_until(lambda: {c.split("-")[0] for c, _, _ in list(seen[boxes[1].id])
                                   if c.startswith("echo a")} == {f"echo a{t}" for t in range(4)},
                          30)
        daemon.kill9()
        for t in threads:
            t.join(60)
            assert not t.is_alive()
        daemon.start()
        # every caller failed with an infra error; the one in flight with daemon_restarted
        assert len(failures) == len(boxes) * 2 + 1 + 4
        for who, e in failures:
            assert isinstance(e, (DaemonRestarted, DaemonUnavailable)), (who, e)
            assert e.infra
        assert isinstance(dict(failures)["long"], DaemonRestarted)
        total = sum(len(v) for v in seen.values())
        assert total > 20
        for b in boxes:
            again = Sandbox.connect(b.id)  # re-adopted: same id, files intact, usable
            assert again.files.read("/root/keep") == b.id
            assert again.exec("echo alive").stdout == "alive\n"
            logged = {}
            for e in again.log():
                if e.op == "exec" and e.result is not None:
                    logged.setdefault(e.request["cmd"], []).append(e.result)
            for cmd, stdout, code in seen[b.id]:
                assert cmd in logged, f"{cmd!r} was seen by a client but is not in the log"
                res = logged[cmd][0]
                assert (res["stdout"], res["exit_code"]) == (stdout, code)
            # no call was logged as a command failure caused by the crash
            assert all(r["exit_code"] == 0 for rs in logged.values() for r in rs)
            # the calls in flight are in the log, as interrupted (outcome unknown)
            cut = [e for e in again.log() if e.status == "interrupted"]
            for e in cut:
                assert e.result is None and e.error["error"]["code"] == "step_interrupted"
                assert e.ended_at is None
                assert all(cmd != e.request["cmd"] for cmd, _, _ in seen[b.id])
            if b is boxes[0]:
                assert "sleep 30; echo late" in [e.request["cmd"] for e in cut]
    finally:
        if daemon.proc is None:
            daemon.start()
        for b in boxes:
            try:
                b.kill()
            except CorralError:
                pass


def test_interrupted_calls_are_logged_and_a_retry_never_runs_them(daemon):
    """A keyed exec in flight at kill -9: after the restart its row is interrupted and its key
    bound to step_interrupted, so the SDK's own retry (same key, sent once the daemon is back)
    does not run it again; the command itself, in the re-adopted sandbox, ran once."""
    tid = uuid.uuid4().hex
    sb = Sandbox(timeout=600, trajectory_id=tid)
    cmd = "echo started >> /root/ran; until test -f /root/fast; do sleep 0.02; done; " \
          "echo ran >> /root/ran"
    outcome: list[object] = []

    def slow() -> None:
        try:
            outcome.append(sb.exec(cmd))
        except CorralError as e:
            outcome.append(e)

    try:
        sb.exec("echo before")
        t = threading.Thread(target=slow)
        t.start()
        handle = Sandbox.from_id(sb.id)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # until the command runs
            if handle.files.exists("/root/ran"):
                break
            time.sleep(0.02)
        else:
            raise AssertionError("the command did not start")
        daemon.kill9()
        daemon.start()  # within the SDK's retry window (docs/trajectory.md)
        t.join(60)
        assert len(outcome) == 1 and isinstance(outcome[0], StepInterrupted), outcome
        assert outcome[0].infra and outcome[0].details["key"] == f"{tid}:1"
        assert sb.step == 2
        handle.files.write("/root/fast", "")
        entries = [e for e in handle.log() if e.op == "exec"]
        assert [(e.idempotency_key, e.status) for e in entries] == [
            (f"{tid}:0", "done"), (f"{tid}:1", "interrupted")]
        cut = entries[1]
        assert cut.request["cmd"] == cmd and cut.ended_at is None
        from test_cli import ok

        assert "INTERRUPTED" in ok("log", sb.id)
        assert cut.error["error"]["code"] == "step_interrupted"
        assert cut.error["error"]["details"]["interrupted"] is True
        # a restarted client replaying the same steps: the first fast-forwards, the second
        # answers step_interrupted again; the command never ran a second time
        again = Sandbox.connect(sb.id, trajectory_id=tid)
        assert again.exec("echo before").stdout == "before\n"
        with pytest.raises(StepInterrupted):
            again.exec(cmd)
        assert handle.files.read("/root/ran").splitlines()[0] == "started"
        assert handle.files.read("/root/ran").count("started") == 1
        assert len([e for e in handle.log() if e.idempotency_key == f"{tid}:1"]) == 1
    finally:
        if daemon.proc is None:
            daemon.start()
        Sandbox.from_id(sb.id).kill()


@contextlib.contextmanager
def _with_hold(daemon, point: str, hold: Path) -> Iterator[None]:
    """The daemon restarted holding at ``point`` while ``hold`` exists (conftest.with_holds);
    afterwards restarted without it, and (if the test passed) every sandbox it left
    killed."""
    daemon.stop()
    env = with_holds(**{point: hold})
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        daemon.start()
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        hold.unlink(missing_ok=True)
        if daemon.proc is not None:
            daemon.stop()
        daemon.start()
    for sid in os.listdir(os.path.join(daemon.state_dir, "sandboxes")):
        Sandbox.from_id(sid).kill()


def test_a_create_is_logged_before_its_client_sees_it(daemon, tmp_path):
    """kill -9 with a create's entry not yet journaled (held there, conftest.with_holds):
    the create has not answered, its client gets an infra error, never a sandbox missing
    from the log."""
    hold = tmp_path / "hold"
    made: list[object] = []
    with _with_hold(daemon, "entry", hold):
        sb = Sandbox(timeout=600)
        hold.touch()

        def long_one() -> None:
            try:
                sb.exec("sleep 30")
            except CorralError as e:
                made.append(e)

        def create() -> None:
            try:
                made.append(Sandbox(timeout=600))
            except CorralError as e:
                made.append(e)

        t1 = threading.Thread(target=long_one)
        t1.start()
        assert wait_until(lambda: journal_started(daemon.state_dir, sb.id, "exec"), 30)
        t2 = threading.Thread(target=create)
        t2.start()
        sdir = os.path.join(daemon.state_dir, "sandboxes")
        deadline = time.monotonic() + 30
        while len(os.listdir(sdir)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        (new,) = set(os.listdir(sdir)) - {sb.id}
        # The new sandbox runs (its record written with its runtime); its entry waits (hook).
        assert wait_until(lambda: _record_has_runtime(os.path.join(sdir, new)), 30)
        assert t2.is_alive() and not any(isinstance(m, Sandbox) for m in made)
        daemon.kill9()
        t1.join(60)
        t2.join(60)
        assert len(made) == 2
        assert all(isinstance(m, (DaemonRestarted, DaemonUnavailable)) for m in made), made
        hold.unlink()
        daemon.start()
        # Re-adopted (its record was written): its log gets the create it lacked, from the
        # record, marked recovered.
        entries = Sandbox.from_id(new).log()
        assert [(e.op, e.status) for e in entries] == [("create", "done")]
        assert entries[0].result["id"] == new and entries[0].result["recovered"] is True
        # The exec's started row was journaled: in the log, its outcome unknown.
        assert [(e.op, e.status) for e in Sandbox.from_id(sb.id).log()] == \
            [("create", "done"), ("exec", "interrupted")]


def test_journaled_calls_survive_kill9_before_they_reach_the_database(daemon, tmp_path):
    """The journal is the log's commit point: with the ingester held (conftest.with_holds),
    calls answer once journaled, none of them in the
    database yet; kill -9; the next daemon ingests them before serving, every one the client
    saw, in order, and an idempotency key bound by one of them still fast-forwards."""
    import sqlite3

    from corral.daemon.trajlog import DB_NAME

    hold = tmp_path / "hold-ingest"
    with _with_hold(daemon, "ingest", hold):
        sb = Sandbox(timeout=600, trajectory_id=f"t-{uuid.uuid4().hex[:8]}")
        sb.log()  # the create is in the database; everything after stays in the journal
        hold.touch()
        seen = [sb.exec(f"echo {i} >> /root/trail; echo {i}").stdout for i in range(20)]
        assert seen == [f"{i}\n" for i in range(20)]
        time.sleep(0.3)  # several ingest intervals: held, not ingested
        db = sqlite3.connect(os.path.join(daemon.state_dir, DB_NAME))
        try:
            in_db = db.execute("SELECT count(*) FROM entries WHERE sandbox_id=?",
                               (sb.id,)).fetchone()[0]
        finally:
            db.close()
        assert in_db == 1  # only the create
        daemon.kill9()
        hold.unlink()
        daemon.start()
        entries = Sandbox.from_id(sb.id).log()
        execs = [e for e in entries if e.op == "exec"]
        assert [e.result["stdout"] for e in execs] == seen
        assert all(e.status == "done" for e in entries)
        assert [e.seq for e in entries] == sorted(e.seq for e in entries)
        # Fast-forward after the crash: the same trajectory's first 20 steps are logged.
        again = Sandbox.connect(sb.id, trajectory_id=sb.trajectory_id)
        r = again.exec("echo 0 >> /root/trail; echo 0")
        assert r.stdout == "0\n"
        trail = Sandbox.from_id(sb.id).files.read("/root/trail")
        assert trail.split() == [str(i) for i in range(20)]


def test_kill9_readopts_network_disabled(daemon):
    """A re-adopted sandbox with network "disabled" keeps its walls: commands started by the
    new daemon get the unix-only filter and the Landlock scope too, and its namespace (the old
    daemon's shared one) is never handed to a sandbox with network "none"."""
    probe = ("import socket\n"
             "try: socket.socket(socket.AF_INET); print('inet OK')\n"
             "except OSError as e: print('inet', e.errno)\n"
             "s=socket.socket(socket.AF_UNIX); s.bind('\\0readopt-probe'); print('unix OK')\n")
    b = Sandbox(network="disabled", timeout=600)
    try:
        b.files.write("/opt/p.py", probe)
        before = b.exec("python3 /opt/p.py; readlink /proc/self/ns/net")
        assert "inet 97" in before.stdout and "unix OK" in before.stdout, before.stdout
        old_ns = before.stdout.split()[-1]
        daemon.kill9()
        daemon.start()
        again = Sandbox.connect(b.id)
        assert again.info().network == "disabled"
        after = again.exec("python3 /opt/p.py; readlink /proc/self/ns/net")
        assert after.stdout == before.stdout, (before.stdout, after.stdout)
        with Sandbox(network="disabled") as fresh:
            assert "inet 97" in fresh.exec("python3 -c \"import socket\n"
                                           "try: socket.socket(); print('inet OK')\n"
                                           "except OSError as e: print('inet', e.errno)\"").stdout
        again.kill()
        for _ in range(3):
            with Sandbox() as other:
                ns = other.exec("readlink /proc/self/ns/net").stdout.strip()
                assert ns != old_ns
    finally:
        _running_again(daemon, b)


def test_kill9_keeps_exec_through_the_init(daemon):
    """The init holds both ends of its exec channel, so a re-adopted sandbox's commands still
    start through it (their parent is the init, pid 1), and a command the old daemon started
    through it runs on (the init, not the dead daemon, is its parent)."""
    ppid = "awk '/^PPid/{print $2}' /proc/$$/status"
    b = Sandbox(timeout=600)
    try:
        assert b.exec(ppid).stdout == "1\n"
        b.exec("sleep 0.2; echo done >/tmp/bg", background=True)
        daemon.kill9()
        daemon.start()
        again = Sandbox.connect(b.id)
        r = again.exec(f"{ppid}; sleep 0.3; cat /tmp/bg; exit 3")
        assert (r.exit_code, r.stdout) == (3, "1\ndone\n"), (r.exit_code, r.stdout, r.stderr)
    finally:
        _running_again(daemon, b)


def test_an_adopted_sandbox_s_own_oom_is_still_its_own(daemon):
    """A sandbox made with memory+swap equal to its memory limit (by a daemon before the
    one-page slack) keeps no fail count at its own limit; adopted as it is, its own OOM would
    read as the host's (infra: the agent's failure masked). The adopting daemon gives it the
    page."""
    from conftest import CGROUP_NAME

    b = Sandbox(memory_mb=48, timeout=600)
    try:
        assert b.exec("true").exit_code == 0  # its memory cgroup exists
        memcg = Path(f"/sys/fs/cgroup/memory/{CGROUP_NAME}/{b.id}")
        if not (memcg / "memory.memsw.limit_in_bytes").exists():
            pytest.skip("no v1 memory+swap accounting here")
        limit = (memcg / "memory.limit_in_bytes").read_text().strip()
        (memcg / "memory.memsw.limit_in_bytes").write_text(limit)  # as an older daemon made it
        daemon.kill9()
        daemon.start()
        assert int((memcg / "memory.memsw.limit_in_bytes").read_text()) == int(limit) + 4096
        again = Sandbox.connect(b.id)
        r = again.exec(["python3", "-c", "b = []\nwhile True: b.append(bytearray(1 << 20))"])
        assert (r.oom_killed, r.exit_code) == (True, 137), r
    finally:
        _running_again(daemon, b)


def _running_again(daemon, *boxes) -> None:
    """Teardown of a restart test: the daemon up again, its sandboxes gone."""
    if daemon.proc is None:
        daemon.start()
    for box in boxes:
        try:
            box.kill()
        except CorralError:
            pass
