"""Idempotency keys that mean what they say (docs/trajectory.md, "Idempotency rules"): a step is
bound only when the daemon has the call; a retry of the same call reuses its key (the SDK's own
retries after a lost connection, and the caller's after a timeout); explicit per-call keys;
keyed reads replay what was first seen; ``from_trajectory``; keyed kills of gone sandboxes;
replayed creates of dead sandboxes."""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile
import threading
import time
import uuid

import pytest

from corral import AsyncSandbox, Sandbox
from corral.errors import (
    CorralError,
    DaemonUnavailable,
    InvalidRequest,
    NotFound,
    StepInterrupted,
    Timeout,
)
from corral.sdk import api
from corral.sdk.endpoint import Endpoint


def _tid() -> str:
    return "t-" + uuid.uuid4().hex[:12]


def _keys(sb: Sandbox, op: str | None = None) -> list[str | None]:
    return [e.idempotency_key for e in Sandbox.from_id(sb.id).log()
            if e.op != "create" and (op is None or e.op == op)]


# ---- a step is bound only when the daemon has the call ------------------------------------------
def test_a_call_that_never_reached_the_daemon_takes_no_step(daemon, monkeypatch):
    """daemon_unavailable (nothing answered): the step stays free, the next call (the same or
    another) carries it; a keyed kill of a sandbox the restarted daemon forgot is a success."""
    monkeypatch.setenv("CORRAL_AUTOSTART", "0")
    tid = _tid()
    sb = Sandbox(timeout=600, trajectory_id=tid)
    try:
        sb.exec("echo a >> /root/c")
        daemon.kill9()  # the sandbox stays, re-adopted at the next start
        with pytest.raises(DaemonUnavailable):
            sb.exec("echo b >> /root/c")
        with pytest.raises(DaemonUnavailable):
            sb.files.read("/root/c")
        assert sb.step == 1
        daemon.start()
        sb.files.write("/root/other", "x")  # another call takes the free step
        assert sb.exec("echo b >> /root/c").exit_code == 0
        assert _keys(sb) == [f"{tid}:0", f"{tid}:1", f"{tid}:2"]
        assert sb.files.read("/root/c") == "a\nb\n"
        # replayed from the start: the same calls fast-forward, nothing runs twice
        again = Sandbox.connect(sb.id, trajectory_id=tid)
        again.exec("echo a >> /root/c")
        again.files.write("/root/other", "x")
        again.exec("echo b >> /root/c")
        assert again.files.read("/root/c") == "a\nb\n"
        # a sandbox killed, then forgotten by a restarted daemon: a keyed kill succeeds
        assert sb.kill() is True
        daemon.restart(kill9=True)
        assert Sandbox.from_trajectory(tid).kill() is False
        assert Sandbox.from_id(sb.id).kill(key="cleanup") is False
    finally:
        if daemon.proc is None:
            daemon.start()
        Sandbox.from_id(sb.id).kill(key="final")


class _DropFirst:
    """A unix-socket proxy to the daemon that forwards the first ``drops`` requests and closes
    the client's connection before the answer comes back (a transport error after the daemon
    accepted the call); later connections pass through."""

    def __init__(self, target: str, drops: int = 1) -> None:
        self.dir = tempfile.mkdtemp(prefix="corral-proxy-")
        self.path = os.path.join(self.dir, "p.sock")
        self.target, self.drops = target, drops
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.srv.bind(self.path)
        self.srv.listen(16)
        self.stop = False
        self.dropped = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(c,), daemon=True).start()

    def _one(self, c: socket.socket) -> None:
        up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        up.connect(self.target)
        drop = self.drops > 0
        self.drops -= 1 if drop else 0

        def pump(a: socket.socket, b: socket.socket) -> None:
            try:
                while data := a.recv(65536):
                    b.sendall(data)
            except OSError:
                pass
            finally:
                for s in (a, b):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        if drop:
            data = c.recv(65536)  # the request (small): to the daemon, then hang up on the client
            up.sendall(data)
            time.sleep(0.05)
            c.close()
            self.dropped += 1
            threading.Thread(target=lambda: (up.recv(65536), up.close()), daemon=True).start()
            return
        threading.Thread(target=pump, args=(up, c), daemon=True).start()
        pump(c, up)

    def close(self) -> None:
        self.stop = True
        self.srv.close()
        os.unlink(self.path)
        os.rmdir(self.dir)


def test_the_sdk_retries_a_lost_call_with_the_same_key(daemon):
    """The connection drops after the daemon took the call: the SDK sends it again with the same
    key, and the daemon answers with the first run's result (the command ran once)."""
    tid = _tid()
    sb = Sandbox(timeout=600, trajectory_id=tid)
    proxy = _DropFirst(daemon.socket_path, drops=1)
    try:
        via = Sandbox.connect(sb.id, endpoint=proxy.path, trajectory_id=tid, step=0)
        proxy.drops = 1
        r = via.exec("sleep 0.3; echo ran >> /root/c; wc -l < /root/c")
        assert r.stdout.strip() == "1"
        assert via.step == 1 and proxy.dropped == 1
        assert Sandbox.from_id(sb.id).files.read("/root/c") == "ran\n"
        assert _keys(sb, "exec") == [f"{tid}:0"]  # one entry: the retry was fast-forwarded

        async def main() -> None:
            proxy.drops = 1
            a = await AsyncSandbox.connect(sb.id, endpoint=proxy.path, trajectory_id=tid,
                                           step=1)
            r = await a.exec("sleep 0.3; echo again >> /root/c; wc -l < /root/c")
            assert r.stdout.strip() == "2" and a.step == 2 and proxy.dropped == 2

        asyncio.run(main())
        assert sb.files.read("/root/c", key="k-read") == "ran\nagain\n"
    finally:
        proxy.close()
        sb.kill()


def test_a_retry_after_a_client_timeout_reuses_the_key(daemon):
    """A client timeout leaves the outcome unknown: the same call sent again carries the same
    key and gets the result of the run still in flight; a different call moves on."""
    tid = _tid()
    sb = Sandbox(timeout=600, trajectory_id=tid)
    try:
        cmd = "sleep 1; echo ran >> /root/c; cat /root/c"
        call = api.exec_(sb.id, cmd, timeout=30)
        call.timeout = 0.3  # the client gives up long before the command ends
        with pytest.raises(Timeout):
            sb._call(call)
        assert sb.step == 1
        r = sb.exec(cmd, timeout=30)  # the caller's retry: same call, same key
        assert r.stdout == "ran\n" and sb.step == 1
        assert sb.files.read("/root/c") == "ran\n"  # another call: the next step
        assert _keys(sb) == [f"{tid}:0", f"{tid}:1"]
        # an unknown outcome followed by a different call: that one takes a new step
        call = api.exec_(sb.id, "sleep 1", timeout=30)
        call.timeout = 0.2
        with pytest.raises(Timeout):
            sb._call(call)
        sb.exec("true")
        assert _keys(sb, "exec")[-2:] == [f"{tid}:2", f"{tid}:3"]
    finally:
        sb.kill()


# ---- a call in flight at a daemon kill never runs twice ----------------------------------------
def test_a_command_in_flight_at_a_daemon_kill_never_runs_twice(daemon, monkeypatch):
    """kill -9 of the daemon while two keyed commands run (a stepped one and one with an
    explicit key), each bumping a counter in the sandbox and then sleeping: after the restart,
    the SDK's own retry and the caller's retries of the same keys answer step_interrupted
    (infra), the commands never run again, and the log says what is known."""
    from conftest import wait_until

    monkeypatch.setenv("CORRAL_AUTOSTART", "0")
    tid = _tid()
    sb = Sandbox(timeout=600, trajectory_id=tid)
    other = Sandbox.from_id(sb.id)
    step_cmd = "echo x >> /root/c; sleep 60"
    key_cmd = "echo y >> /root/d; sleep 60"
    out: dict[str, BaseException] = {}

    def run(name: str, fn) -> threading.Thread:  # type: ignore[no-untyped-def]
        def body() -> None:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - asserted below
                out[name] = e
        t = threading.Thread(target=body, daemon=True)
        t.start()
        return t

    try:
        threads = [run("step", lambda: sb.exec(step_cmd, timeout=90)),
                   run("key", lambda: other.exec(key_cmd, timeout=90, key="bump"))]
        probe = Sandbox.from_id(sb.id)
        assert wait_until(lambda: probe.files.exists("/root/c") and probe.files.exists(
            "/root/d"), timeout=30)
        daemon.kill9()
        daemon.start()
        for t in threads:
            t.join(60)
            assert not t.is_alive()
        for name in ("step", "key"):  # the SDK's retry met the new daemon, or gave up
            assert isinstance(out[name], CorralError) and out[name].infra, out
        # the caller's retries: the same calls, the same keys
        for _ in range(2):
            with pytest.raises(StepInterrupted) as err:
                sb.exec(step_cmd, timeout=90)
            assert err.value.category == "infra" and err.value.details["key"] == f"{tid}:0"
            assert err.value.details["op"] == "exec" and err.value.details["interrupted"]
            with pytest.raises(StepInterrupted):
                other.exec(key_cmd, timeout=90, key="bump")
        assert sb.step == 1
        assert probe.files.read("/root/c") == "x\n" and probe.files.read("/root/d") == "y\n"
        entries = [e for e in probe.log() if e.op == "exec"]
        assert [(e.idempotency_key, e.status, e.error["error"]["code"]) for e in entries] == [
            (k, "interrupted", "step_interrupted") for k in (f"{tid}:0", "bump")] or [
            (e.idempotency_key, e.status) for e in entries] == [
            ("bump", "interrupted"), (f"{tid}:0", "interrupted")]
        # resumed: positioned after the interrupted step; a different call runs at step 1
        again = Sandbox.from_trajectory(tid)
        assert again.step == 1
        assert again.exec("cat /root/c").stdout == "x\n"
        # replaying from the start meets the interrupted step again, never reruns it
        with pytest.raises(StepInterrupted):
            Sandbox.from_trajectory(tid, step=0).exec(step_cmd, timeout=90)
        assert probe.files.read("/root/c") == "x\n"
    finally:
        if daemon.proc is None:
            daemon.start()
        sb.kill()


# ---- explicit keys ------------------------------------------------------------------------------
def test_explicit_keys(daemon):
    sb = Sandbox(timeout=600, trajectory_id=_tid())
    try:
        r1 = sb.exec("echo x >> /root/k; wc -l < /root/k", key="turn-7/tests")
        r2 = sb.exec("echo x >> /root/k; wc -l < /root/k", key="turn-7/tests")
        assert r1.stdout == r2.stdout == "1\n"
        assert sb.step == 0  # an explicit key takes no step
        sb.files.write("/root/f", "one", key="w1")
        sb.files.write("/root/f", "one", key="w1")
        assert sb.files.read("/root/f", key="r1") == "one"
        sb.files.write("/root/f", "two")
        assert sb.files.read("/root/f", key="r1") == "one"  # what r1 saw
        assert sb.files.read("/root/f") == "two"
        for bad in ("", "a:b", "x" * 257):
            with pytest.raises(InvalidRequest):
                sb.exec("true", key=bad)
        plain = Sandbox(timeout=600)  # no trajectory: explicit keys still work
        try:
            plain.exec("echo y >> /root/k", key="once")
            plain.exec("echo y >> /root/k", key="once")
            assert plain.files.read("/root/k") == "y\n"
        finally:
            plain.kill(key="bye")
            assert plain.kill(key="bye") is True  # the logged answer

        async def main() -> None:
            a = await AsyncSandbox.connect(sb.id)
            assert (await a.exec("echo x >> /root/k; wc -l < /root/k",
                                 key="turn-7/tests")).stdout == "1\n"
            assert await a.files.read("/root/f", key="r1") == "one"
            with pytest.raises(InvalidRequest):
                await a.files.stat("/root/f", key="a:b")

        asyncio.run(main())
    finally:
        sb.kill()


# ---- keyed reads replay the past ----------------------------------------------------------------
def test_keyed_reads_return_what_the_first_run_saw(daemon):
    tid = _tid()
    sb = Sandbox(timeout=600, trajectory_id=tid)
    try:
        sb.files.write("/root/f", "v1")                     # 0
        first = [sb.files.read("/root/f"),                   # 1
                 sb.files.stat("/root/f").size,              # 2
                 sorted(e.name for e in sb.files.list("/root")),  # 3
                 sb.files.exists("/root/g"),                 # 4
                 sb.info().state]                            # 5
        sb.files.write("/root/f", "version 2")              # 6
        sb.files.write("/root/g", "new")                    # 7
        assert sb.step == 8
        assert {e.op for e in sb.log()} >= {"read", "stat", "list", "info"}
        again = Sandbox.connect(sb.id, trajectory_id=tid)
        again.files.write("/root/f", "v1")
        replayed = [again.files.read("/root/f"), again.files.stat("/root/f").size,
                    sorted(e.name for e in again.files.list("/root")),
                    again.files.exists("/root/g"), again.info().state]
        assert replayed == first == ["v1", 2, ["f"], False, "running"]
        assert again.step == 6
        # the present is still there for calls past the log
        assert Sandbox.from_id(sb.id).files.read("/root/f") == "version 2"
    finally:
        sb.kill()


# ---- from_trajectory ----------------------------------------------------------------------------
def test_from_trajectory_positions_after_the_last_completed_step(daemon):
    tid = _tid()
    sb = Sandbox(timeout=600, trajectory_id=tid)
    try:
        for i in range(3):
            sb.exec(f"echo {i} >> /root/c")
        kids = sb.fork(2)  # step 3
        sb.files.read("/root/c")  # step 4
        back = Sandbox.from_trajectory(tid)
        assert (back.id, back.step, back.trajectory_id) == (sb.id, 5, tid)
        assert back.last_info is not None and back.last_info.state == "running"
        back.exec("echo 3 >> /root/c")  # step 5, runs for real
        assert sb.files.read("/root/c", key="x") == "0\n1\n2\n3\n"
        kid = Sandbox.from_trajectory(f"{tid}/fork3/1")
        assert (kid.id, kid.step) == (kids[1].id, 0)
        kids[1].exec("true")
        assert Sandbox.from_trajectory(f"{tid}/fork3/1").step == 1

        async def main() -> None:
            a = await AsyncSandbox.from_trajectory(tid)
            assert (a.id, a.step) == (sb.id, 6)

        asyncio.run(main())
        with pytest.raises(NotFound):
            Sandbox.from_trajectory(_tid())
        with pytest.raises(InvalidRequest):
            Sandbox.from_trajectory("a:b")
        for k in kids:
            k.kill()
        back.kill()  # step 6
        gone = Sandbox.from_trajectory(tid)
        assert gone.step == 7 and gone.last_info.state == "dead"
    finally:
        sb.kill(key="final")


# ---- kills and creates of gone sandboxes --------------------------------------------------------
def test_a_forks_explicit_key_names_children_no_other_fork_has(daemon):
    """The children of a trajectory's fork keyed ``S`` are ``T/fork{S}/{i}``, as are those of
    the fork at step ``S``. An explicit key of digits only named the same children as that
    step's fork: a resume of one child found the other's sandbox and ran its calls there
    (and bound that child's keys, so its own next call diverged). A '/' in the key put the
    name beyond a resume. Both are refused; other explicit keys name children of their own."""
    tid = _tid()
    sb = Sandbox(timeout=600, trajectory_id=tid)
    try:
        for bad in ("1", "007", "a/b", "x/fork1"):
            with pytest.raises(InvalidRequest) as e:
                sb.fork(1, key=bad)
            assert e.value.details.get("key") == bad, e.value
        named = sb.fork(1, key="expand-1")
        stepped = sb.fork(1)  # step 0 (explicit keys take no step)
        assert Sandbox.from_trajectory(f"{tid}/forkexpand-1/0").id == named[0].id
        assert Sandbox.from_trajectory(f"{tid}/fork0/0").id == stepped[0].id
        for kid in (*named, *stepped):
            kid.kill()
    finally:
        sb.kill()


def test_keyed_kill_of_a_gone_sandbox_and_replayed_create_of_a_dead_one(daemon):
    tid = _tid()
    sb = Sandbox(timeout=600, trajectory_id=tid)
    assert sb.last_info.state == "running"
    sb.exec("true", key="k1")
    Sandbox.from_id(sb.id).kill()  # an operator's kill
    assert sb.kill() is False  # keyed (step 0): already gone, a success
    # a key bound to another call still kills (a cleanup is never refused)
    other = Sandbox(timeout=600)
    other.exec("true", key="k1")
    assert other.kill(key="k1") is True
    assert not other.is_running()
    # the replayed create reports the sandbox as it is now
    again = Sandbox(timeout=600, trajectory_id=tid)
    assert again.id == sb.id and again.last_info.state == "dead"


def test_endpoint_is_unchanged_by_keys():
    assert Endpoint.parse("/x/y.sock").unix_path == "/x/y.sock"


def test_keyed_reads_past_the_logs_cap(daemon):
    """A keyed read over 1 MiB (the bytes are not logged) or a page of a listing over 4096
    entries: the replay returns the file (directory page) as it is now if it is still what
    was read then, and says replay_divergence, never something else, once it has changed.
    A listing in pages of 1000 (the SDK's) logs each page whole: its replay returns what was
    listed then, whatever changed since."""
    from corral.errors import ReplayDivergence

    from apiclient import client

    sb = Sandbox(timeout=600)
    try:
        big = bytes(range(256)) * (6 * 1024)  # 1.5 MiB
        sb.files.write("/root/big", big)
        assert sb.files.read_bytes("/root/big", key="big") == big
        assert sb.files.read_bytes("/root/big", key="big") == big  # re-read: unchanged
        entry = [e for e in sb.log() if e.idempotency_key == "big"][0]
        assert "data_b64" not in entry.result and entry.result["size"] == len(big)
        sb.exec("mkdir /root/many && cd /root/many && seq 5000 | xargs touch")
        first = sb.files.list("/root/many", key="ls")
        assert len(first) == 5000
        assert sb.files.list("/root/many", key="ls") == first

        def one_page() -> dict:
            with client() as c:
                r = c.get(f"/v1/sandboxes/{sb.id}/files/list",
                          params={"path": "/root/many", "limit": "6000"},
                          headers={"Idempotency-Key": "ls-one-page"})
            return r.json()
        whole = one_page()
        assert len(whole["entries"]) == 5000 and whole["next"] is None
        assert one_page() == whole
        sb.files.write("/root/big", big[:-1] + b"!")
        sb.exec("touch /root/many/extra")
        with pytest.raises(ReplayDivergence):
            sb.files.read_bytes("/root/big", key="big")
        assert sb.files.list("/root/many", key="ls") == first
        assert one_page()["error"]["code"] == "replay_divergence"
    finally:
        sb.kill()


def test_keyed_reads_over_the_wire(daemon):
    """The wire contract: bad keys on reads are invalid_request (never a 500); a keyed info is
    logged and replayed; GET /v1/trajectories/{tid} of an unknown trajectory is not_found."""
    from apiclient import client, create, kill

    with client() as c:
        sid = create(c)["id"]
        try:
            for bad in ("x" * 300, ""):
                r = c.get(f"/v1/sandboxes/{sid}/files/stat", params={"path": "/root"},
                          headers={"Idempotency-Key": bad})
                assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
            r1 = c.get(f"/v1/sandboxes/{sid}", headers={"Idempotency-Key": "i1"})
            c.post(f"/v1/sandboxes/{sid}/timeout", json={"timeout": 500})
            r2 = c.get(f"/v1/sandboxes/{sid}", headers={"Idempotency-Key": "i1"})
            assert r1.status_code == r2.status_code == 200 and r1.json() == r2.json()
            assert c.get(f"/v1/sandboxes/{sid}").json()["expires_at"] != r1.json()["expires_at"]
            ops = [e["op"] for e in c.get(f"/v1/sandboxes/{sid}/log").json()["entries"]]
            assert ops.count("info") == 1  # keyed once; the unkeyed poll is not logged
            r = c.get("/v1/trajectories/" + uuid.uuid4().hex)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        finally:
            kill(c, sid)
