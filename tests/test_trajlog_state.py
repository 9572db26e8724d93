"""The trajectory log and sandbox state calls (docs/trajectory.md): snapshot, fork, restore,
pause and resume are logged with their snapshot ids and carry idempotency keys (a replayed
fork returns the same children, a replayed snapshot the same snapshot); started rows of calls
in flight; replay of sessions with state calls. Against the session's real daemon."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from corral import AsyncSandbox, Sandbox, Snapshot
from corral.errors import ReplayDivergence, SandboxNotRunning
from corral.sdk.replay import replay

from apiclient import client, create, expect_error, key, kill, log_of


def live_ids() -> set[str]:
    return {sb.id for sb in Sandbox.list()}


def test_state_calls_are_logged_with_snapshot_ids():
    sb = Sandbox(timeout=300)
    made: list[Sandbox] = []
    try:
        sb.exec("echo one > /root/f")
        snap = sb.snapshot()
        made.append(Sandbox(snapshot=snap))
        sb.exec("echo two > /root/f")
        sb.restore(snap)
        sb.pause()
        sb.resume()
        kids = sb.fork(2)
        made += kids
        entries = sb.log()
        assert [e.op for e in entries] == ["create", "exec", "snapshot", "exec", "restore",
                                          "pause", "resume", "fork"]
        assert all(e.status == "done" for e in entries)
        by = {e.op: e for e in entries}
        assert by["snapshot"].snapshot_ids == [snap.id] and by["snapshot"].result["id"] == snap.id
        assert by["restore"].snapshot_ids == [snap.id]
        assert by["restore"].request == {"snapshot": snap.id}
        assert by["pause"].result["state"] == "paused"
        assert by["resume"].result["state"] == "running"
        fork = by["fork"]
        fork_snap = fork.result["snapshot"]["id"]
        assert fork.snapshot_ids == [fork_snap]
        assert fork.result["sandboxes"] == [k.id for k in kids]
        assert fork.request == {"count": 2, "name": None, "keep_snapshot": False}
        for k in kids:  # each child: a create entry naming its parent and its snapshot
            first = k.log()[0]
            assert first.op == "create" and first.request["parent"] == sb.id
            assert first.snapshot_ids == [fork_snap]
            assert first.result["id"] == k.id and first.request["snapshot"] == fork_snap
        on_snap = made[0].log()[0]
        assert on_snap.op == "create" and on_snap.snapshot_ids == [snap.id]
        assert "parent" not in on_snap.request
        assert made[0].files.read("/root/f") == "one\n"
    finally:
        for b in made + [sb]:
            b.kill()
        Snapshot.get(snap.id).delete()


def test_keyed_fork_and_snapshot_over_http():
    with client() as c:
        sid = create(c)["id"]
        kids: list[str] = []
        snaps: list[str] = []
        try:
            h = {"Idempotency-Key": key()}
            a = c.post(f"/v1/sandboxes/{sid}/snapshot", json={}, headers=h)
            b = c.post(f"/v1/sandboxes/{sid}/snapshot", json={}, headers=h)
            assert a.status_code == b.status_code == 201
            assert a.json() == b.json()  # the same snapshot, not a second one
            snaps.append(a.json()["id"])
            expect_error(c.post(f"/v1/sandboxes/{sid}/snapshot", json={"name": "x" + key()},
                                headers=h), "replay_divergence", 409)
            h = {"Idempotency-Key": key()}
            before = live_ids()
            f1 = c.post(f"/v1/sandboxes/{sid}/fork", json={"count": 2}, headers=h)
            assert f1.status_code == 201, f1.text
            kids = [x["id"] for x in f1.json()["sandboxes"]]
            f2 = c.post(f"/v1/sandboxes/{sid}/fork", json={"count": 2}, headers=h)
            assert f2.status_code == 201
            assert [x["id"] for x in f2.json()["sandboxes"]] == kids
            assert f2.json()["snapshot"] == f1.json()["snapshot"]
            assert live_ids() - before == set(kids)  # forked once
            expect_error(c.post(f"/v1/sandboxes/{sid}/fork", json={"count": 3}, headers=h),
                         "replay_divergence", 409)
            # a child that ended since comes back as dead, with the same id
            kill(c, kids[0])
            f3 = c.post(f"/v1/sandboxes/{sid}/fork", json={"count": 2}, headers=h)
            states = {x["id"]: x["state"] for x in f3.json()["sandboxes"]}
            assert states == {kids[0]: "dead", kids[1]: "running"}
            expect_error(c.post(f"/v1/sandboxes/{kids[0]}/exec", json={"cmd": "true"}),
                         "sandbox_not_running", 409)
            forks = [e for e in log_of(c, sid) if e["op"] == "fork"]
            assert len(forks) == 1
            for op in ("pause", "resume"):
                h = {"Idempotency-Key": key()}
                for _ in range(2):
                    r = c.post(f"/v1/sandboxes/{sid}/{op}", headers=h)
                    assert r.status_code == 200, r.text
            ops = [e["op"] for e in log_of(c, sid)]
            assert ops.count("pause") == ops.count("resume") == 1
            h = {"Idempotency-Key": key()}
            for _ in range(2):
                r = c.post(f"/v1/sandboxes/{sid}/restore", json={"snapshot": snaps[0]},
                           headers=h)
                assert r.status_code == 200 and r.json()["snapshot"] == snaps[0]
            assert [e["op"] for e in log_of(c, sid)].count("restore") == 1
        finally:
            for k in kids[1:]:
                kill(c, k)
            kill(c, sid)
            for s in snaps:
                c.delete(f"/v1/snapshots/{s}")


def test_sdk_replayed_fork_returns_the_same_children():
    tid = key()
    sb = Sandbox(trajectory_id=tid, timeout=300)
    try:
        sb.exec("echo base > /root/b")
        snap = sb.snapshot()
        kids = sb.fork(3)
        assert [k.trajectory_id for k in kids] == [f"{tid}/fork2/{i}" for i in range(3)]
        kids[0].exec("echo k >> /root/k")
        kids[2].kill()
        n_live = len(live_ids())
        # a restarted client runs the same program: nothing is made or run twice
        again = Sandbox(trajectory_id=tid, timeout=300)
        assert again.id == sb.id
        again.exec("echo base > /root/b")
        assert again.snapshot().id == snap.id
        kids2 = again.fork(3)
        assert [k.id for k in kids2] == [k.id for k in kids]
        assert [k.last_info.state for k in kids2] == ["running", "running", "dead"]
        kids2[0].exec("echo k >> /root/k")  # fast-forwards in the child's own trajectory
        assert kids2[2].kill() is True  # logged: the same answer as the first time
        assert kids2[0].files.read("/root/k") == "k\n"
        kids2[0].exec("echo new >> /root/k")  # not logged yet: runs for real
        assert kids2[0].files.read("/root/k") == "k\nnew\n"
        assert len(live_ids()) == n_live
        with pytest.raises(SandboxNotRunning):
            kids2[2].exec("echo not logged")
        with pytest.raises(ReplayDivergence):  # the same step with another request
            Sandbox.connect(sb.id, trajectory_id=tid, step=2).fork(4)
        keyed = [(e.op, e.idempotency_key) for e in sb.log() if e.idempotency_key]
        assert keyed == [("create", f"{tid}:create"), ("exec", f"{tid}:0"),
                         ("snapshot", f"{tid}:1"), ("fork", f"{tid}:2")]
    finally:
        for k in kids[:2]:
            Sandbox.from_id(k.id).kill()
        Sandbox.from_id(sb.id).kill()
        snap.delete()


def test_async_sdk_replays_state_calls():
    async def main() -> None:
        tid = key()
        sb = await AsyncSandbox.create(trajectory_id=tid, timeout=300)
        try:
            await sb.exec("echo a > /root/a")
            snap = await sb.snapshot()
            kids = await sb.fork(2)
            await sb.pause()
            await sb.resume()
            await sb.restore(snap)
            again = await AsyncSandbox.connect(sb.id, trajectory_id=tid)
            await again.exec("echo a > /root/a")
            assert (await again.snapshot()).id == snap.id
            kids2 = await again.fork(2)
            assert [k.id for k in kids2] == [k.id for k in kids]
            assert kids2[1].trajectory_id == f"{tid}/fork2/1"
            await again.pause()
            await again.resume()
            await again.restore(snap)
            ops = [e.op for e in await sb.log()]
            assert ops == ["create", "exec", "snapshot", "fork", "pause", "resume", "restore"]
            for k in kids:
                await k.kill()
        finally:
            await AsyncSandbox.from_id(sb.id).kill()
            await snap.delete()

    asyncio.run(main())


def test_a_call_in_flight_has_a_started_row():
    sb = Sandbox(timeout=120)
    try:
        done = threading.Event()

        def slow() -> None:
            sb.exec("sleep 1.5; echo slow")
            done.set()

        t = threading.Thread(target=slow)
        t.start()
        deadline = time.monotonic() + 10
        started = None
        while time.monotonic() < deadline and started is None:
            started = next((e for e in sb.log() if e.op == "exec"), None)
            time.sleep(0.05)
        assert started is not None and not done.is_set()
        assert started.status == "started" and started.result is None
        assert started.ended_at is None and started.duration_s is None
        assert started.request["cmd"] == "sleep 1.5; echo slow"
        t.join(30)
        ended = next(e for e in sb.log() if e.op == "exec")
        assert ended.seq == started.seq  # finished in place
        assert ended.status == "done" and ended.result["stdout"] == "slow\n"
        assert ended.duration_s >= 1.0
        sb.exec("true")  # a short call is written once, finished
        assert [e.status for e in sb.log()] == ["done"] * 3
    finally:
        sb.kill()


def test_replay_of_a_session_with_state_calls():
    sb = Sandbox(timeout=300)
    kids: list[Sandbox] = []
    try:
        sb.exec("echo one > /root/f")
        snap = sb.snapshot()
        sb.exec("echo two > /root/f")
        sb.restore(snap)
        sb.exec("cat /root/f")
        sb.pause()
        sb.resume()
        kids = sb.fork(1)
        kids[0].exec("cat /root/f; echo child >> /root/f")
        kids[0].exec("cat /root/f")
    finally:
        for k in kids:
            k.kill()
        sb.kill()
    rep = replay(sb.id)
    assert rep.identical, rep.to_json()
    status = {(s.op, s.what): s.status for s in rep.steps}
    assert status[("exec", "cat /root/f")] == "same"
    assert status[("restore", snap.id)] == "same"
    assert status[("snapshot", "")] == "same"
    assert status[("pause", "")] == status[("resume", "")] == "same"
    fork = next(s for s in rep.steps if s.op == "fork")
    assert fork.status == "same" and "child" in fork.note
    # the fork's snapshot was not kept: the child's replay rebuilds its state from the parent
    rep2 = replay(kids[0].id)
    assert rep2.base.startswith(f"{sb.id} up to step ")
    assert [s.status for s in rep2.steps] == ["skipped", "same", "same", "skipped"]
    snap.delete()
    assert not [s for s in Snapshot.list() if s.sandbox_id in (rep.replay_id, rep2.replay_id)]


def test_cli_log_shows_state_calls():
    from test_cli import ok

    sb = Sandbox(timeout=300)
    try:
        snap = sb.snapshot()
        sb.pause()
        sb.resume()
        kid = sb.fork(1)[0]
        kid.kill()
    finally:
        sb.kill()
    table = ok("log", sb.id)
    for word in ("snapshot", snap.id, "pause", "resume", "fork", kid.id):
        assert word in table, (word, table)
    assert f"fork of {sb.id}" in ok("log", kid.id)
    snap.delete()


OLD_SCHEMA = """
CREATE TABLE entries (seq INTEGER PRIMARY KEY, sandbox_id TEXT NOT NULL, op TEXT NOT NULL,
    idem_key TEXT, fingerprint TEXT, request TEXT NOT NULL, result TEXT, error TEXT,
    started_at REAL NOT NULL, ended_at REAL NOT NULL, snapshot_ids TEXT);
CREATE TABLE sandboxes (sandbox_id TEXT PRIMARY KEY, spec TEXT, created_at REAL,
    ended_at REAL, reason TEXT);
INSERT INTO entries (sandbox_id, op, request, result, started_at, ended_at)
    VALUES ('sb-old', 'exec', '{"cmd":"true"}', '{"exit_code":0}', 1.0, 2.0);
"""


def test_a_log_from_before_started_rows_is_migrated(tmp_path):
    """A trajlog.db written before the status column existed opens, reads and takes started
    rows (through the daemon's own TrajLog code, on a private state dir)."""
    import sqlite3

    from corral.daemon.trajlog import TrajLog

    conn = sqlite3.connect(tmp_path / "trajlog.db")
    conn.executescript(OLD_SCHEMA)
    conn.close()

    async def main() -> None:
        tl = TrajLog(str(tmp_path), start_ms=0)
        tl.open(asyncio.get_running_loop())
        try:
            _, entries = tl.read("sb-old")
            assert [(e["op"], e["status"], e["duration_s"]) for e in entries] == \
                [("exec", "done", 1.0)]

            gate = asyncio.Event()

            async def slow() -> dict:
                await gate.wait()
                return {"ok": True}

            async def started(n: int) -> None:  # keyed: journaled as started before it runs
                while tl.stats["started_rows"] < n:
                    await asyncio.sleep(0)

            task = asyncio.ensure_future(tl.run("sb-old", "mkdir", {"path": "/x"}, "k1", slow))
            await asyncio.wait_for(started(1), 10)
            await tl.flushed()  # journaled: in the database once ingested
            assert [e["status"] for e in tl.read("sb-old")[1]] == ["done", "started"]
            gate.set()
            await task
            await tl.flushed()
            assert [e["status"] for e in tl.read("sb-old")[1]] == ["done", "done"]
            # a started row left open (a crash) is interrupted at the next open
            gate.clear()
            task = asyncio.ensure_future(tl.run("sb-old", "mkdir", {"path": "/y"}, "k2", slow))
            await asyncio.wait_for(started(2), 10)
        finally:
            tl.close()
        task.cancel()
        tl2 = TrajLog(str(tmp_path))
        tl2.open(asyncio.get_running_loop())
        try:
            assert tl2.interrupted == 1
            last = tl2.read("sb-old")[1][-1]
            assert last["status"] == "interrupted" and last["idempotency_key"] == "k2"
            # binds its key to step_interrupted: a retry never runs it again
            fp, _, result, error = tl2._lookup("sb-old", "k2")
            assert result is None and error["error"]["code"] == "step_interrupted"
            assert error["error"]["category"] == "infra"
            assert error["error"]["details"]["key"] == "k2"
            assert tl2._lookup("sb-old", "k1") is not None
        finally:
            tl2.close()

    asyncio.run(main())


def test_a_keyed_call_is_started_before_it_runs_and_never_runs_twice(tmp_path):
    """Through the daemon's own TrajLog on a private state dir: a keyed mutating call's
    started row is journaled before the call runs (with start_ms far off, so no timer); a
    daemon that dies under it (the log closed with the call in flight) leaves its key bound
    to step_interrupted at the next open, and a retry never runs it. A call cancelled in
    flight (a stop) is bound the same way at once. A keyed kill is the exception: its retry
    kills again. Unkeyed calls still wait for their timer."""
    from corral.daemon.trajlog import TrajLog
    from corral.errors import StepInterrupted

    ran: list[str] = []
    gate: dict[str, asyncio.Event] = {}

    def slow(name: str):  # type: ignore[no-untyped-def]
        async def call() -> dict:
            ran.append(name)
            await gate[name].wait()
            return {"ok": True}
        return call

    async def main() -> None:
        loop = asyncio.get_running_loop()
        tl = TrajLog(str(tmp_path), start_ms=60_000)
        tl.open(loop)
        tl.sandbox_created("sb", {"image": "host"}, time.time())
        for name in ("exec", "kill", "plain", "cancelled"):
            gate[name] = asyncio.Event()
        calls = [asyncio.ensure_future(tl.run("sb", "exec", {"cmd": "x"}, "k-exec",
                                              slow("exec"))),
                 asyncio.ensure_future(tl.run("sb", "mkdir", {"path": "/p"}, None,
                                              slow("plain")))]
        cancelled = asyncio.ensure_future(tl.run("sb", "write", {"path": "/w"}, "k-w",
                                                 slow("cancelled")))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert sorted(ran) == ["cancelled", "exec", "plain"]
        assert tl.stats["started_rows"] == 2  # the keyed ones, before they ran; not "plain"
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        with pytest.raises(StepInterrupted) as err:  # bound at once, in this daemon's life
            await tl.run("sb", "write", {"path": "/w"}, "k-w", slow("never"))
        assert err.value.details["key"] == "k-w" and err.value.category == "infra"
        tl.close()  # the daemon "dies" with k-exec in flight
        for c in calls:
            c.cancel()
        tl2 = TrajLog(str(tmp_path), start_ms=60_000)
        tl2.open(loop)
        try:
            assert tl2.interrupted == 1
            ran.clear()
            for _ in range(2):
                with pytest.raises(StepInterrupted) as err:
                    await tl2.run("sb", "exec", {"cmd": "x"}, "k-exec", slow("again"))
                assert err.value.details["op"] == "exec" and err.value.details["seq"] > 0
            assert ran == []  # never ran again
            entries = tl2.read("sb")[1]
            assert [(e["op"], e["status"]) for e in entries] == [
                ("exec", "interrupted"), ("write", "interrupted")]
            # a keyed kill in flight at a crash: not bound, the retry kills
            gate["k2"] = asyncio.Event()
            k = asyncio.ensure_future(tl2.run("sb", "kill", {}, "k-kill", slow("k2")))
            await asyncio.sleep(0)
            await asyncio.sleep(0)  # its request encoded, its start held for the timer
            assert ran == ["k2"] and tl2.stats["started_rows"] == 0  # no early row
            tl2.start_hold_s = 0.0
            tl2._queue_due()  # its timer's row, as if start_ms had passed
            assert tl2.stats["started_rows"] == 1
        finally:
            tl2.close()
        k.cancel()
        tl3 = TrajLog(str(tmp_path), start_ms=60_000)
        tl3.open(loop)
        try:
            assert tl3.interrupted == 1 and tl3._lookup("sb", "k-kill") is None
            gate["k3"] = asyncio.Event()
            gate["k3"].set()
            assert await tl3.run("sb", "kill", {}, "k-kill", slow("k3")) == {"ok": True}
        finally:
            tl3.close()

    asyncio.run(main())
