"""The trajectory log (docs/trajectory.md): what is logged, idempotency keys, fast-forward and
resume, deterministic replay, retention. Against the session's real daemon."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from corral import AsyncSandbox, Sandbox
from corral.errors import FileNotFound, ReplayDivergence, SandboxNotRunning
from corral.sdk.replay import replay

from apiclient import async_client, client, create, expect_error, key, kill, log_of, run


def test_same_key_appends_once():
    with client() as c:
        sid = create(c)["id"]
        try:
            k = {"Idempotency-Key": key()}
            body = {"cmd": "echo x >> /root/f; wc -l < /root/f"}
            r1 = c.post(f"/v1/sandboxes/{sid}/exec", json=body, headers=k)
            r2 = c.post(f"/v1/sandboxes/{sid}/exec", json=body, headers=k)
            assert r1.status_code == r2.status_code == 200
            assert r1.json() == r2.json()
            assert r1.json()["stdout"] == "1\n"
            assert run(c, sid, "cat /root/f")["stdout"] == "x\n"  # appended once
            # the same key for another request is a divergence, not a silent replay
            r3 = c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo y >> /root/f"},
                        headers=k)
            err = expect_error(r3, "replay_divergence", 409)
            assert err["details"]["key"] == k["Idempotency-Key"]
            assert run(c, sid, "cat /root/f")["stdout"] == "x\n"
            execs = [e for e in log_of(c, sid) if e["op"] == "exec"]
            keyed = [e for e in execs if e["idempotency_key"] == k["Idempotency-Key"]]
            assert len(keyed) == 1  # the fast-forwarded call is not logged again
        finally:
            kill(c, sid)


def test_keys_on_file_operations_and_create():
    with client() as c:
        k = key()
        a = c.post("/v1/sandboxes", json={}, headers={"Idempotency-Key": k})
        b = c.post("/v1/sandboxes", json={}, headers={"Idempotency-Key": k})
        assert a.status_code == b.status_code == 201
        sid = a.json()["id"]
        assert b.json()["id"] == sid  # one sandbox, not two
        try:
            h = {"Idempotency-Key": key()}
            for _ in range(2):
                r = c.put(f"/v1/sandboxes/{sid}/files", params={"path": "/root/a"},
                          content=b"one", headers=h)
                assert r.status_code == 200
            h2 = {"Idempotency-Key": key()}
            for _ in range(2):  # the second would fail (no /root/a) if it ran again
                r = c.post(f"/v1/sandboxes/{sid}/files/rename",
                           json={"src": "/root/a", "dst": "/root/b"}, headers=h2)
                assert r.status_code == 200, r.text
            h3 = {"Idempotency-Key": key()}
            for _ in range(2):  # a logged error is returned again as the same error
                r = c.post(f"/v1/sandboxes/{sid}/files/remove", json={"path": "/root/nope"},
                           headers=h3)
                expect_error(r, "file_not_found", 404)
            r = c.put(f"/v1/sandboxes/{sid}/files", params={"path": "/root/a"},
                      content=b"two", headers=h)  # same key, other content
            expect_error(r, "replay_divergence", 409)
            assert c.get(f"/v1/sandboxes/{sid}/files", params={"path": "/root/b"}).content \
                == b"one"
        finally:
            kill(c, sid)


def test_concurrent_duplicates_run_once():
    async def main() -> None:
        async with async_client() as c:
            r = await c.post("/v1/sandboxes", json={})
            sid = r.json()["id"]
            try:
                h = {"Idempotency-Key": key()}
                body = {"cmd": "sleep 0.2; echo x >> /root/g; cat /root/g | wc -l"}
                rs = await asyncio.gather(*(c.post(f"/v1/sandboxes/{sid}/exec", json=body,
                                                   headers=h) for _ in range(20)))
                assert {r.status_code for r in rs} == {200}
                assert {r.json()["stdout"] for r in rs} == {"1\n"}
                r = await c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "cat /root/g"})
                assert r.json()["stdout"] == "x\n"
            finally:
                await c.delete(f"/v1/sandboxes/{sid}")

    asyncio.run(main())


def test_log_records_everything_and_outlives_the_sandbox():
    sb = Sandbox()
    sb.exec("printf hello")
    sb.exec("echo err >&2; exit 3")
    sb.files.write("/root/x.txt", "data")
    assert sb.files.read("/root/x.txt") == "data"
    sb.files.mkdir("/root/d")
    sb.files.list("/root")
    sb.files.stat("/root/x.txt")
    with pytest.raises(FileNotFound):
        sb.files.read("/root/missing")
    big = sb.exec("head -c 300000 /dev/zero | tr '\\0' a", max_output_bytes=1000)
    assert big.truncated
    sb.kill()
    entries = sb.log()  # the sandbox is gone; its log is not
    ops = [e.op for e in entries]
    assert ops == ["create", "exec", "exec", "write", "read", "mkdir", "list", "stat", "read",
                   "exec", "kill"]
    assert [e.index for e in entries] == list(range(len(entries)))
    first = entries[1]
    assert first.request["cmd"] == "printf hello"
    assert first.result["stdout"] == "hello" and first.result["exit_code"] == 0
    assert first.result["stdout_sha256"] == hashlib.sha256(b"hello").hexdigest()
    assert first.ended_at >= first.started_at and first.duration_s >= 0
    assert entries[2].result["exit_code"] == 3 and entries[2].result["stderr"] == "err\n"
    assert entries[3].request["sha256"] == hashlib.sha256(b"data").hexdigest()
    assert entries[4].result["size"] == 4
    assert entries[8].error["error"]["code"] == "file_not_found"
    last = entries[9].result  # the hash covers the full output, not the capped part
    assert len(last["stdout"]) == 1000 and last["stdout_bytes"] == 300000
    assert last["stdout_sha256"] == hashlib.sha256(b"a" * 300000).hexdigest()
    with client() as c:
        r = c.get(f"/v1/sandboxes/{sb.id}/log", params={"format": "jsonl"})
        assert r.status_code == 200
        lines = [json.loads(x) for x in r.text.splitlines()]
        assert [x["op"] for x in lines] == ops
        expect_error(c.get("/v1/sandboxes/sb-0000000000000000/log"), "sandbox_not_found", 404)


def test_sdk_keys_and_divergence():
    tid = key()
    sb = Sandbox(trajectory_id=tid)
    try:
        assert sb.exec("echo a >> /root/t").exit_code == 0
        sb.files.write("/root/w", "1")
        assert sb.step == 2
        # a second client on the same trajectory replays: nothing runs twice
        again = Sandbox(trajectory_id=tid)
        assert again.id == sb.id
        assert again.exec("echo a >> /root/t").exit_code == 0
        again.files.write("/root/w", "1")
        assert again.exec("echo b >> /root/t").exit_code == 0  # new: runs for real
        assert Sandbox.from_id(sb.id).files.read("/root/t") == "a\nb\n"
        keys = [e.idempotency_key for e in sb.log() if e.idempotency_key]
        assert keys == [f"{tid}:create", f"{tid}:0", f"{tid}:1", f"{tid}:2"]
        other = Sandbox.connect(sb.id, trajectory_id=tid)
        with pytest.raises(ReplayDivergence):
            other.exec("echo DIFFERENT >> /root/t")
    finally:
        Sandbox.from_id(sb.id).kill()  # sb's next key (its step 2) is taken by "echo b"


def test_async_sdk_keys():
    async def main() -> None:
        tid = key()
        async with AsyncSandbox(trajectory_id=tid) as sb:
            await sb.exec("echo a >> /root/t")
            b = await AsyncSandbox.connect(sb.id, trajectory_id=tid)
            await b.exec("echo a >> /root/t")
            assert (await sb.files.read("/root/t")) == "a\n"
            assert [e.op for e in await sb.log()] == ["create", "exec", "read"]  # one exec

    asyncio.run(main())


RESUME_SCRIPT = textwrap.dedent("""
    import sys, time
    from corral import Sandbox
    tid, marker, slow = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    sb = Sandbox(trajectory_id=tid, timeout=600)
    print(sb.id, flush=True)
    for i in range(6):
        r = sb.exec(f"echo step{i} >> /root/progress; date +%s%N >> /root/runs-{i}")
        assert r.exit_code == 0
        print("done", i, flush=True)
        if slow and i == 2:
            time.sleep(60)  # killed here
    print("finished", flush=True)
""")


def test_resume_after_the_client_is_killed(tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(RESUME_SCRIPT)
    tid = key()
    env = dict(os.environ)
    p = subprocess.Popen([sys.executable, str(script), tid, "first", "1"],
                         stdout=subprocess.PIPE, text=True, env=env)
    assert p.stdout is not None
    sid = p.stdout.readline().strip()
    seen = []
    while len(seen) < 3:
        seen.append(p.stdout.readline().strip())
    assert seen == ["done 0", "done 1", "done 2"]
    p.send_signal(signal.SIGKILL)
    p.wait()
    killed_at = time.time()
    # a new client replays the same trajectory: steps 0-2 fast-forward, 3-5 run for real
    out = subprocess.run([sys.executable, str(script), tid, "second", "0"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == sid
    assert "finished" in out.stdout
    sb = Sandbox.connect(sid)
    try:
        assert sb.files.read("/root/progress") == "".join(f"step{i}\n" for i in range(6))
        for i in range(6):  # each step ran exactly once
            assert len(sb.files.read(f"/root/runs-{i}").splitlines()) == 1
        execs = [e for e in sb.log() if e.op == "exec"]
        assert [e.idempotency_key for e in execs] == [f"{tid}:{i}" for i in range(6)]
        assert all(e.started_at < killed_at for e in execs[:3])
        assert all(e.started_at > killed_at for e in execs[3:])  # run by the second client
    finally:
        sb.kill()


def test_replay_reports_where_outputs_differ():
    sb = Sandbox()
    try:
        sb.exec("echo stable")
        sb.files.write("/root/in.txt", "same input\n")
        sb.exec("cat /root/in.txt")
        sb.exec("cat /proc/sys/kernel/random/uuid")  # differs on every run
        sb.exec("exit 4")
        sb.files.read("/root/in.txt")
        p = sb.exec("sleep 0.1; echo bg", background=True)
        p.wait()
    finally:
        sb.kill()
    rep = replay(sb.id)
    assert rep.replay_id and rep.replay_id != sb.id
    by = {s.what: s for s in rep.steps}
    assert by["echo stable"].status == "same"
    assert by["cat /root/in.txt"].status == "same"
    assert by["exit 4"].status == "same"
    uuid_step = by["cat /proc/sys/kernel/random/uuid"]
    assert uuid_step.status == "differs" and set(uuid_step.diffs) == {"stdout_sha256"}
    assert [s.op for s in rep.differences] == ["exec"]
    waits = [s for s in rep.steps if s.op == "wait"]
    assert waits and waits[0].status == "same"
    with pytest.raises(SandboxNotRunning):
        Sandbox.connect(rep.replay_id)  # killed after the replay


def test_retention_prunes_ended_sandboxes(daemon, tmp_path):
    with client() as c:
        sid = create(c)["id"]
        run(c, sid, "true")
        kill(c, sid)
        assert log_of(c, sid)  # a read of the log waits for every queued commit
    # Prune through the daemon's own code path, as the reaper does, on a *copy* of the db: a
    # second writer on the live log would lower its index watermark behind the daemon's back
    # (the daemon keeps it in memory), hiding the entries written next from every reader.
    import sqlite3

    from corral.daemon.trajlog import DB_NAME, TrajLog

    live = sqlite3.connect(os.path.join(daemon.state_dir, DB_NAME))
    copy = sqlite3.connect(tmp_path / DB_NAME)
    try:
        live.backup(copy)
    finally:
        live.close()
        copy.close()
    tl = TrajLog(str(tmp_path), retention_s=0)
    assert tl.read(sid) is not None  # read() uses a connection of its own

    async def prune() -> int:
        tl.open(asyncio.get_running_loop())
        try:
            return await tl.prune(time.time() + 1)
        finally:
            tl.close()

    assert asyncio.run(prune()) >= 1
    assert tl.read(sid) is None  # its sandbox row and entries are gone from the copy
    with client() as c:  # the live log is untouched
        assert log_of(c, sid)


def test_cli_log_and_replay():
    from test_cli import corral_cli, ok

    sb = Sandbox()
    try:
        sb.exec("echo hello-cli")
        sb.files.write("/root/f", "x")
        sb.exec("cat /proc/sys/kernel/random/uuid")
    finally:
        sb.kill()
    table = ok("log", sb.id)
    assert "echo hello-cli" in table and "exit 0" in table and "write" in table
    lines = ok("log", sb.id, "--jsonl").splitlines()
    assert [json.loads(x)["op"] for x in lines] == ["create", "exec", "write", "exec", "kill"]
    assert [e["op"] for e in json.loads(ok("log", sb.id, "--json"))][:2] == ["create", "exec"]
    r = corral_cli("replay", sb.id, "--json")
    assert r.returncode == 1, r.stderr  # the uuid differs
    rep = json.loads(r.stdout)
    assert [s["status"] for s in rep["steps"]] == ["skipped", "same", "same", "differs",
                                                  "skipped"]
    r = corral_cli("replay", sb.id)
    assert "DIFFERS" in r.stdout and "1 step(s) differ" in r.stderr
    r = corral_cli("log", "sb-0000000000000000")
    assert r.returncode == 1 and "sandbox_not_found" in r.stderr


def test_batch_exec_is_logged_per_sandbox():
    with client() as c:
        ids = [create(c)["id"] for _ in range(2)]
        try:
            r = c.post("/v1/sandboxes/batch/exec", json={"ids": ids, "exec": {"cmd": "hostname"}})
            assert r.status_code == 200, r.text
            for sid, item in zip(ids, r.json()["results"], strict=True):
                assert "_sha" not in item and item["stdout"].strip() == sid
                last = log_of(c, sid)[-1]
                assert last["op"] == "exec" and last["result"]["stdout"].strip() == sid
                assert last["result"]["stdout_sha256"] == \
                    hashlib.sha256(item["stdout"].encode()).hexdigest()
        finally:
            for sid in ids:
                kill(c, sid)
