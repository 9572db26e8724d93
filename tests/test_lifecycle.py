"""Lifecycle: TTL and idle reaping, timeouts, labels, concurrency, and crash recovery
(``kill -9 corrald`` then a restart: survivors re-adopted, the dead cleaned, nothing leaked)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
import uuid

import pytest

from apiclient import async_client, client, create, expect_error, kill, run
from conftest import (
    CGROUP_NAME,
    STATE_DIR,
    host_mounts_under,
    leaked_sandbox_cgroups,
    pids_in_cgroups,
    spare_cgroups,
    wait_until,
)

SANDBOXES = os.path.join(STATE_DIR, "sandboxes")


@pytest.fixture
def c():
    with client() as cl:
        yield cl


def cgroups_of(sid: str) -> list[str]:
    return [p for p in leaked_sandbox_cgroups() if p.endswith("/" + sid)]



def reason(c, sid: str) -> str | None:
    r = c.get(f"/v1/sandboxes/{sid}")
    if r.status_code == 200:
        return None
    return r.json()["error"]["details"].get("reason", r.json()["error"]["code"])


# ---- TTL and idle ----------------------------------------------------------------------
def test_ttl_expiry(c):
    info = create(c, timeout=1)
    sid = info["id"]
    assert reason(c, sid) is None
    assert wait_until(lambda: reason(c, sid) == "expired", 10)
    expect_error(c.get(f"/v1/sandboxes/{sid}"), "sandbox_expired", 409)
    assert wait_until(lambda: not cgroups_of(sid))
    assert wait_until(lambda: not os.path.exists(os.path.join(SANDBOXES, sid)))
    assert wait_until(lambda: not os.path.exists(f"/proc/{info['init_pid']}"))


def test_ttl_expiry_during_exec(c):
    sid = create(c, timeout=1.5)["id"]
    r = c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "sleep 30"})
    err = expect_error(r, "sandbox_expired", 409)
    assert err["details"]["reason"] == "expired"


def test_set_timeout_extends_and_shortens(c):
    sid = create(c, timeout=1)["id"]
    control = create(c, timeout=1)["id"]  # made after it, with its first TTL
    r = c.post(f"/v1/sandboxes/{sid}/timeout", json={"timeout": 60})
    assert r.status_code == 200
    # Once the control expires, the reaper has passed the first deadline: it was moved.
    assert wait_until(lambda: reason(c, control) == "expired", 10)
    assert reason(c, sid) is None
    assert run(c, sid, "echo alive")["stdout"] == "alive\n"
    meta = json.load(open(os.path.join(SANDBOXES, sid, "meta.json")))
    assert meta["expires_at"] == pytest.approx(r.json()["expires_at"])
    c.post(f"/v1/sandboxes/{sid}/timeout", json={"timeout": 0.5})
    assert wait_until(lambda: reason(c, sid) == "expired", 10)


def test_idle_timeout(c):
    sid = create(c, idle_timeout=1.0, timeout=600)["id"]
    # Any API call on the sandbox is activity.
    for _ in range(8):
        time.sleep(0.3)
        assert c.get(f"/v1/sandboxes/{sid}").status_code == 200
    # A command running longer than the idle timeout is activity too.
    assert run(c, sid, "sleep 2.5")["exit_code"] == 0
    # Then silence: reaped.
    assert wait_until(lambda: sid not in [s["id"] for s in
                                          c.get("/v1/sandboxes").json()["sandboxes"]], 10)
    assert reason(c, sid) == "idle_timeout"
    assert wait_until(lambda: not cgroups_of(sid))


# ---- list ------------------------------------------------------------------------------
def test_list_filters_by_labels(c):
    tag = uuid.uuid4().hex[:8]
    a = create(c, labels={"job": tag, "role": "a"}, metadata={"note": "x"})["id"]
    b = create(c, labels={"job": tag, "role": "b"})["id"]
    other = create(c, labels={"job": "other"})["id"]
    try:
        def ids(*labels):
            r = c.get("/v1/sandboxes", params=[("label", x) for x in labels])
            return sorted(s["id"] for s in r.json()["sandboxes"])

        assert ids(f"job={tag}") == sorted([a, b])
        assert ids(f"job={tag}", "role=a") == [a]
        assert ids(f"job={tag}", "role=c") == []
        assert ids("role") == sorted([a, b])   # key present
        assert other in ids()
        listed = {s["id"]: s for s in c.get("/v1/sandboxes").json()["sandboxes"]}
        assert listed[a]["metadata"] == {"note": "x"}
    finally:
        for sid in (a, b, other):
            kill(c, sid)
    assert ids(f"job={tag}") == []


# ---- concurrency -----------------------------------------------------------------------
def test_concurrent_clients_threads():
    errors: list[str] = []

    def worker(n: int) -> None:
        try:
            with client() as c:
                for i in range(4):
                    sid = create(c, labels={"worker": str(n)})["id"]
                    r = run(c, sid, f"echo {n}-{i}")
                    assert r["stdout"] == f"{n}-{i}\n"
                    kill(c, sid)
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []


def test_concurrent_calls_one_event_loop(c):
    ids = [create(c)["id"] for _ in range(4)]

    async def main() -> list[dict]:
        async with async_client() as ac:
            async def one(i: int) -> dict:
                r = await ac.post(f"/v1/sandboxes/{ids[i % 4]}/exec",
                                  json={"cmd": ["echo", str(i)]})
                return r.json()

            return await asyncio.gather(*(one(i) for i in range(300)))

    try:
        results = asyncio.run(main())
        assert [r["stdout"] for r in results] == [f"{i}\n" for i in range(300)]
    finally:
        for sid in ids:
            kill(c, sid)


# ---- crash recovery --------------------------------------------------------------------
def test_kill9_restart_readopts_and_cleans(daemon):
    with client() as c:
        survivor = create(c, labels={"crash": "survivor"}, timeout=600)
        victim = create(c, labels={"crash": "victim"}, timeout=600)
        expiring = create(c, timeout=2)
        sid = survivor["id"]
        c.put(f"/v1/sandboxes/{sid}/files", params={"path": "/work/keep.txt"}, content=b"kept")
        run(c, sid, "echo upper > /root/marker; sleep 1000 >/dev/null 2>&1 &")
        before = run(c, sid, "ps -e -o pid,ppid,stat,args")
    daemon_pid = int(open(os.path.join(STATE_DIR, "corrald.pid")).read())

    daemon.kill9()
    assert not os.path.exists(f"/proc/{daemon_pid}") or \
        open(f"/proc/{daemon_pid}/stat").read().split()[2] == "Z"
    # While the daemon is down: one sandbox's init dies, a bogus half-made record appears
    # (a crash mid-create), and another sandbox's TTL passes.
    os.kill(victim["init_pid"], signal.SIGKILL)
    half = os.path.join(SANDBOXES, "sb-00000000deadbeef")
    os.makedirs(os.path.join(half, "upper"), exist_ok=True)
    with open(os.path.join(half, "meta.json"), "w") as fh:
        json.dump({"id": "sb-00000000deadbeef", "spec": {}, "created_at": 0, "expires_at": 0,
                   "runtime": None}, fh)
    assert wait_until(lambda: time.time() > expiring["expires_at"], 10)  # its TTL passes
    daemon.start()

    with client() as c:
        # The survivor is usable by id, with its files and processes.
        info = c.get(f"/v1/sandboxes/{sid}")
        assert info.status_code == 200, info.text
        assert info.json()["init_pid"] == survivor["init_pid"]
        assert c.get(f"/v1/sandboxes/{sid}/files", params={"path": "/work/keep.txt"}).content \
            == b"kept"
        r = run(c, sid, "cat /root/marker; pgrep -x sleep >/dev/null && echo running")
        ps = "ps -e -o pid,ppid,stat,args"
        assert r["stdout"] == "upper\nrunning\n", (before, run(c, sid, ps))
        # The victim is reported lost and fully cleaned.
        expect_error(c.get(f"/v1/sandboxes/{victim['id']}"), "sandbox_lost", 410)
        assert not cgroups_of(victim["id"])
        assert not os.path.exists(os.path.join(SANDBOXES, victim["id"]))
        assert not os.path.exists(half)
        # The expired one is reaped by the new daemon.
        assert wait_until(lambda: c.get(f"/v1/sandboxes/{expiring['id']}").status_code != 200)
        assert wait_until(lambda: not cgroups_of(expiring["id"]))
        listed = [s["id"] for s in c.get("/v1/sandboxes").json()["sandboxes"]]
        assert sid in listed and victim["id"] not in listed
        # Exec, background processes and kill work on the adopted sandbox.
        pid = c.post(f"/v1/sandboxes/{sid}/exec",
                     json={"cmd": "echo bg", "background": True}).json()["pid"]
        assert c.post(f"/v1/sandboxes/{sid}/procs/{pid}/wait", json={}).json()["stdout"] == "bg\n"
        kill(c, sid)
        assert wait_until(lambda: not cgroups_of(sid))
        # Adopted inits are no longer the daemon's children: the host's init reaps them.
        assert wait_until(lambda: not os.path.exists(f"/proc/{survivor['init_pid']}"))


def test_failed_start_keeps_sandboxes_for_the_next(daemon):
    import socket
    import subprocess
    import sys

    with client() as c:
        sid = create(c, timeout=600)["id"]
    daemon.kill9()
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        r = subprocess.run([sys.executable, "-m", "corral.daemon", "--tcp",
                            f"127.0.0.1:{busy.getsockname()[1]}", "--token", "t"],
                           capture_output=True, timeout=120)
    finally:
        busy.close()
    assert r.returncode != 0
    assert cgroups_of(sid)  # the failed start re-adopted it, then left it alone
    daemon.start()
    with client() as c:
        assert run(c, sid, "echo still")["stdout"] == "still\n"
        kill(c, sid)


def test_graceful_stop_destroys_everything(daemon):
    with client() as c:
        infos = [create(c, timeout=600) for _ in range(3)]
    in_flight = {}

    def long_exec():
        with client() as c2:
            in_flight["r"] = c2.post(f"/v1/sandboxes/{infos[0]['id']}/exec",
                                     json={"cmd": "sleep 60"})

    t = threading.Thread(target=long_exec)
    t.start()
    with client() as c:  # the command runs
        assert wait_until(lambda: run(c, infos[0]["id"], "pgrep -x sleep >/dev/null && echo y")
                          ["stdout"] == "y\n")
    daemon.stop()
    t.join(30)
    # The command in flight is told the daemon went away (infra), not given a fake exit code.
    expect_error(in_flight["r"], "daemon_restarted", 503)
    assert not os.path.exists(daemon.socket_path)
    assert not os.path.exists(os.path.join(STATE_DIR, "corrald.pid"))
    assert leaked_sandbox_cgroups() == [] and pids_in_cgroups() == set()
    assert spare_cgroups() == []  # recycled memory cgroups go with a graceful stop
    assert os.listdir(SANDBOXES) == []
    assert host_mounts_under(STATE_DIR) == []
    for info in infos:
        assert wait_until(lambda i=info: not os.path.exists(f"/proc/{i['init_pid']}"))
    daemon.start()
    with client() as c:
        # Destroyed by the daemon's stop, not by its client: an infra error after the restart
        # too (the ids are kept in the state dir), so a trainer masks that rollout.
        r = c.get(f"/v1/sandboxes/{infos[0]['id']}")
        expect_error(r, "daemon_restarted", 503)
        assert r.json()["error"]["details"]["reason"] == "shutdown"
        expect_error(c.post(f"/v1/sandboxes/{infos[1]['id']}/exec", json={"cmd": "true"}),
                     "daemon_restarted", 503)
        expect_error(c.get("/v1/sandboxes/sb-00000000000000ff"), "sandbox_not_found", 404)
    daemon.restart()  # and after one more restart
    with client() as c:
        expect_error(c.get(f"/v1/sandboxes/{infos[2]['id']}"), "daemon_restarted", 503)


def test_many_sandboxes_survive_kill9(daemon):
    with client() as c:
        r = c.post("/v1/sandboxes/batch", json={"count": 40, "spec": {"timeout": 600}})
        assert r.status_code == 201, r.text
        ids = [s["id"] for s in r.json()["sandboxes"]]
    daemon.restart(kill9=True)
    with client() as c:
        listed = {s["id"] for s in c.get("/v1/sandboxes").json()["sandboxes"]}
        assert set(ids) <= listed
        for sid in ids[:5]:
            assert run(c, sid, "echo ok")["stdout"] == "ok\n"
        for sid in ids:
            kill(c, sid)
    assert wait_until(lambda: not any(cgroups_of(s) for s in ids))


def _memcgs_dying() -> int:
    """Memory cgroups the kernel still holds though removed (v1: count minus live dirs)."""
    with open("/proc/cgroups") as f:
        total = next(int(line.split()[2]) for line in f if line.split()[:1] == ["memory"])
    live = sum(1 for _ in os.walk("/sys/fs/cgroup/memory"))
    return total - live


def test_sandboxes_that_read_new_files_leave_no_dying_memory_cgroup(daemon):
    """A sandbox that reads a file no one had read is charged for its page cache; once the
    sandbox is gone, its memory cgroup must not stay dying in the kernel (kept until those
    pages are evicted, ~7 MB of shrinker_info each on a host that once ran 50,000
    sandboxes), whether it is recycled or removed, and at the daemon's stop too."""
    if not os.path.isdir(f"/sys/fs/cgroup/memory/{CGROUP_NAME}"):
        pytest.skip("cgroup v2: the daemon does not drain memory cgroups there (v1 only)")
    d = f"/usr/local/share/corral-test-{os.getpid()}"  # seen by the host image's /usr
    os.makedirs(d)
    try:
        for i in range(12):
            with open(f"{d}/f{i}", "wb") as f:
                f.write(os.urandom(1 << 20))
                f.flush()
                os.fsync(f.fileno())
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        before = _memcgs_dying()
        with client() as c:
            for i in range(12):
                sid = create(c, timeout=120)["id"]
                assert run(c, sid, f"wc -c < {d}/f{i}")["stdout"].strip() == str(1 << 20)
                kill(c, sid)
        assert wait_until(lambda: _memcgs_dying() <= before + 2, timeout=5), \
            (before, _memcgs_dying())
        daemon.stop()  # its spares, charged with those pages, go too: drained, not dying
        assert spare_cgroups() == []
        assert wait_until(lambda: _memcgs_dying() <= before + 2, timeout=5), \
            (before, _memcgs_dying())
    finally:
        if daemon.proc is None:
            daemon.start()
        for i in range(12):
            if os.path.exists(f"{d}/f{i}"):
                os.unlink(f"{d}/f{i}")
        os.rmdir(d)
