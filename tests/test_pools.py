"""Warm pools (corral.daemon.pools): a create that matches takes a ready sandbox.

Each test runs a private corrald with its own pool settings (the session daemon runs without
pools so that other tests see exactly the sandboxes they made). What must hold: a pooled
sandbox is indistinguishable from a fresh one, a dead pooled sandbox is never handed out, and
pooled sandboxes never leak (graceful stop, kill -9 + restart).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from pathlib import Path

import pytest

from corral import Sandbox

from conftest import (
    CGROUP_NAME,
    DaemonProcess,
    cgroup_dirs,
    leaked_sandbox_cgroups,
    private_daemon,
    wait_until,
)


def pooled_daemon(**env: str) -> contextlib.AbstractContextManager[DaemonProcess]:
    return private_daemon("corral-pool-", f"{CGROUP_NAME}-pool", CORRAL_POOL_IDLE_S="600",
                          **env)


def ep(d: DaemonProcess) -> str:
    return f"unix://{d.socket_path}"


def metrics(d: DaemonProcess) -> dict[str, float]:
    import httpx

    t = httpx.HTTPTransport(uds=d.socket_path)
    with httpx.Client(transport=t, base_url="http://corral", timeout=10) as c:
        text = c.get("/metrics").text
    return {m[1]: float(m[2]) for m in re.finditer(r"^(corral_\w+) ([0-9.e+-]+)$", text, re.M)}


def wait_ready(d: DaemonProcess, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics(d).get("corral_pool_ready", 0) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"pool never reached {n} ready: {metrics(d)}")


def _dead(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def sandbox_dirs(d: DaemonProcess) -> set[str]:
    return set(os.listdir(os.path.join(d.state_dir, "sandboxes")))


def observe(sb: Sandbox) -> dict[str, str]:
    """What a program inside can see that a pool could give away."""
    r = sb.exec("echo $X $HOSTNAME; hostname; cat /etc/hostname 2>/dev/null; ls -A /tmp /root; "
                "ls /proc > /root/p; grep -c '^[0-9]' /root/p; rm /root/p; id -u; "
                "grep Cap /proc/self/status; ls -A /dev | tr '\\n' ' '; pwd")
    assert r.exit_code == 0, r.stderr
    return {"out": r.stdout.replace(sb.id, "<id>"), "err": r.stderr}


def test_pooled_sandbox_is_indistinguishable_from_a_fresh_one():
    with pooled_daemon(CORRAL_POOL="static", CORRAL_POOL_SIZES="host:2") as d:
        wait_ready(d, 2)
        pooled_dirs = sandbox_dirs(d)
        assert len(pooled_dirs) == 2  # made ahead: a dir each, no record yet
        assert all(not os.path.exists(os.path.join(d.state_dir, "sandboxes", s, "meta.json"))
                   for s in pooled_dirs)
        time.sleep(1.0)  # the pooled ones are older than the take: their clocks must not show
        t0 = time.time()
        warm = Sandbox(endpoint=ep(d), timeout=100, labels={"k": "v"}, metadata={"m": "1"},
                       env={"X": "y"})
        m = metrics(d)
        assert m["corral_pool_hits_total"] == 1
        assert warm.id in pooled_dirs  # it was one of the pool's
        info = warm.last_info
        assert info is not None
        assert t0 - 0.5 <= info.created_at <= time.time()
        assert info.expires_at - info.created_at == pytest.approx(100)
        assert info.last_active_at >= info.created_at
        assert (info.labels, info.metadata, info.hostname) == ({"k": "v"}, {"m": "1"}, warm.id)
        assert os.path.exists(os.path.join(d.state_dir, "sandboxes", warm.id, "meta.json"))
        assert [s.id for s in Sandbox.list(labels={"k": "v"}, endpoint=ep(d))] == [warm.id]
        # A fresh one of the same spec, bypassing the pool: the pool has one more ready, so
        # make it cold by asking for other limits (a different pool key that is not pooled).
        cold = Sandbox(endpoint=ep(d), timeout=100, labels={"k": "v"}, env={"X": "y"},
                       memory_mb=511)
        assert metrics(d)["corral_pool_misses_total"] == 0  # static mode: not a pool key
        assert observe(warm) == observe(cold)
        assert warm.exec("hostname").stdout.strip() == warm.id
        warm.files.write("/tmp/a", "x")
        assert warm.files.read("/tmp/a") == "x"
        assert warm.kill() and cold.kill()
        wait_ready(d, 2)  # refilled


def test_batch_create_takes_from_the_pool_then_makes_the_rest():
    with pooled_daemon(CORRAL_POOL="static", CORRAL_POOL_SIZES="host:3") as d:
        wait_ready(d, 3)
        boxes = Sandbox.create_many(5, endpoint=ep(d), timeout=100)
        try:
            m = metrics(d)
            assert (m["corral_pool_hits_total"], m["corral_pool_misses_total"]) == (3, 2)
            res = Sandbox.exec_many(boxes, "hostname")
            assert [r.stdout.strip() for r in res] == [b.id for b in boxes]
        finally:
            Sandbox.kill_many(boxes)


def test_explicit_hostname_is_never_pooled():
    with pooled_daemon(CORRAL_POOL="static", CORRAL_POOL_SIZES="host:1") as d:
        wait_ready(d, 1)
        with Sandbox(endpoint=ep(d), hostname="box1") as sb:
            assert sb.exec("hostname").stdout == "box1\n"
            m = metrics(d)
            assert m["corral_pool_hits_total"] == 0 and m["corral_pool_ready"] == 1


def test_a_create_with_layers_is_never_pooled(tmp_path):
    """A pool's sandboxes are made of the bare image: a create asking for layers (a toolkit,
    a workspace) of the same limits took one and silently lacked its layers (its record
    still listed them; the task then failed as the agent's)."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "task.txt").write_text("the workspace\n")
    with pooled_daemon(CORRAL_POOL="static", CORRAL_POOL_SIZES="host:1") as d:
        wait_ready(d, 1)
        with Sandbox(endpoint=ep(d), layers=[{"dir": str(ws), "at": "/opt/ws"}]) as sb:
            assert sb.exec("cat /opt/ws/task.txt").stdout == "the workspace\n"
            m = metrics(d)
            assert m["corral_pool_hits_total"] == 0 and m["corral_pool_ready"] == 1


def test_pool_off():
    with pooled_daemon(CORRAL_POOL="off", CORRAL_POOL_SIZES="host:4") as d:
        for _ in range(3):
            with Sandbox(endpoint=ep(d)) as sb:
                assert sb.exec("true").exit_code == 0
        time.sleep(0.6)
        m = metrics(d)
        assert m["corral_pool_ready"] == 0 and m["corral_pool_hits_total"] == 0
        assert sandbox_dirs(d) == set()


def test_auto_pool_follows_demand():
    with pooled_daemon(CORRAL_POOL="auto", CORRAL_POOL_LEAD_S="1") as d:
        assert metrics(d)["corral_pool_ready"] == 0  # nothing asked for yet
        hits = 0
        deadline = time.monotonic() + 60
        while hits == 0 and time.monotonic() < deadline:
            for _ in range(10):
                with Sandbox(endpoint=ep(d), memory_mb=256) as sb:
                    assert sb.exec("true").exit_code == 0
            hits = metrics(d)["corral_pool_hits_total"]
        assert hits > 0, metrics(d)


INET_PROBE = ("python3 -c \"import socket\n"
              "try: socket.socket(); print('inet OK')\n"
              "except OSError as e: print('inet', e.errno)\"; readlink /proc/self/ns/net")


def test_pools_are_keyed_by_network():
    """A pooled sandbox has the walls of the network mode asked for: "disabled" ones join the
    shared namespace with the unix-only filter, "none" ones get their own namespace."""
    with pooled_daemon(CORRAL_POOL="auto", CORRAL_POOL_LEAD_S="1") as d:
        hits = 0
        deadline = time.monotonic() + 60
        seen: set[str] = set()
        while hits == 0 and time.monotonic() < deadline:
            for _ in range(10):
                with Sandbox(endpoint=ep(d), memory_mb=256, network="disabled") as sb:
                    out = sb.exec(INET_PROBE).stdout.split()
                    assert out[:2] == ["inet", "97"], out  # EAFNOSUPPORT
                    seen.add(out[-1])
            hits = metrics(d)["corral_pool_hits_total"]
        assert hits > 0, metrics(d)
        assert len(seen) == 1  # pooled or not: the one shared namespace
        for _ in range(10):
            with Sandbox(endpoint=ep(d), memory_mb=256) as sb:
                out = sb.exec(INET_PROBE).stdout.split()
                assert out[:2] == ["inet", "OK"] and out[-1] not in seen, out


def test_dead_pooled_sandbox_is_never_handed_out():
    with pooled_daemon(CORRAL_POOL="static", CORRAL_POOL_SIZES="host:1") as d:
        wait_ready(d, 1)
        (pooled,) = sandbox_dirs(d)
        pids = set()
        for top in cgroup_dirs(d.cgroup):  # type: ignore[attr-defined]
            procs = top / pooled / "cgroup.procs"
            if procs.exists():
                pids.update(int(x) for x in procs.read_text().split())
        assert len(pids) == 1  # just its init
        init = pids.pop()
        os.kill(init, signal.SIGKILL)
        assert wait_until(lambda: _dead(init))  # before the take
        with Sandbox(endpoint=ep(d)) as sb:
            assert sb.id != pooled
            assert sb.exec("echo ok").stdout == "ok\n"
        wait_ready(d, 1)
        assert pooled not in sandbox_dirs(d)  # destroyed, not kept


def test_pooled_sandboxes_never_leak_across_kill9():
    with pooled_daemon(CORRAL_POOL="static", CORRAL_POOL_SIZES="host:3") as d:
        wait_ready(d, 3)
        keep = Sandbox(endpoint=ep(d), timeout=300)
        wait_ready(d, 3)
        pooled = sandbox_dirs(d) - {keep.id}
        assert len(pooled) == 3
        d.kill9()
        d.start()
        m = metrics(d)
        assert m["corral_adopted_total"] == 1  # the one handed out survives ...
        assert m["corral_orphans_removed_total"] >= 3  # ... the pooled ones are cleaned
        assert keep.exec("echo still").stdout == "still\n"
        wait_ready(d, 3)
        assert not (pooled & sandbox_dirs(d))
        cg_ids = {Path(p).name for p in leaked_sandbox_cgroups(d.cgroup)}  # type: ignore[attr-defined]
        assert not (pooled & cg_ids)
        keep.kill()


def test_pooled_sandboxes_have_what_a_first_exec_needs():
    """Pooled sandboxes get the cgroups a cold one makes at its first exec (v1 memory, cpu),
    so the first command in a warm sandbox does not pay for them."""
    with pooled_daemon(CORRAL_POOL="static", CORRAL_POOL_SIZES="host:1") as d:
        wait_ready(d, 1)
        (pooled,) = sandbox_dirs(d)
        tops = cgroup_dirs(d.cgroup)  # type: ignore[attr-defined]
        assert tops and all((top / pooled).is_dir() for top in tops)
        with Sandbox(endpoint=ep(d)) as sb:
            assert sb.id == pooled and sb.exec("true").exit_code == 0


def test_refill_waits_for_the_first_exec():
    """A take holds new refills back until the taken sandbox's first exec has ended (the call
    its user waits on; a refill would run over it), or the sandbox is gone; not while the
    pool is low (at most a quarter of its target ready)."""
    with pooled_daemon(CORRAL_POOL="static", CORRAL_POOL_SIZES="host:4",
                       CORRAL_POOL_DEFER_MS="60000") as d:
        wait_ready(d, 4)
        a = Sandbox(endpoint=ep(d), timeout=100)
        time.sleep(1.0)
        assert metrics(d)["corral_pool_ready"] == 3  # held back: 3 > 4 // 4
        assert a.exec("true").exit_code == 0
        wait_ready(d, 4, timeout=30)  # its first exec is over: refilled
        b = Sandbox(endpoint=ep(d), timeout=100)
        time.sleep(0.5)
        assert metrics(d)["corral_pool_ready"] == 3
        b.kill()  # gone before any exec: the hold ends too
        wait_ready(d, 4, timeout=30)
        boxes = [Sandbox(endpoint=ep(d), timeout=100) for _ in range(3)]
        try:
            # 1 ready = 4 // 4: low, so refilled at once (above a quarter) although three
            # first execs are pending; the rest once they have run.
            wait_ready(d, 2, timeout=30)
            assert [r.exit_code for r in Sandbox.exec_many(boxes, "true")] == [0, 0, 0]
            wait_ready(d, 4, timeout=30)
        finally:
            Sandbox.kill_many(boxes)
        a.kill()


def test_refill_hold_ends_after_the_defer_time():
    with pooled_daemon(CORRAL_POOL="static", CORRAL_POOL_SIZES="host:2",
                       CORRAL_POOL_DEFER_MS="1500") as d:
        wait_ready(d, 2)
        with Sandbox(endpoint=ep(d), timeout=100):  # never runs anything
            t0 = time.monotonic()
            time.sleep(0.5)
            assert metrics(d)["corral_pool_ready"] == 1
            wait_ready(d, 2, timeout=30)
            assert time.monotonic() - t0 >= 1.4


def test_takes_are_newest_first():
    """The sandbox made last is handed out first (its kernel state is the warmest)."""
    # One refill at a time: the pool's order (made last = ready last) is the dirs' order.
    with pooled_daemon(CORRAL_POOL="static", CORRAL_POOL_SIZES="host:3",
                       CORRAL_POOL_WORKERS="1") as d:
        wait_ready(d, 3)
        base = os.path.join(d.state_dir, "sandboxes")
        # A pooled sandbox's dir is not touched after it is made: its ctime is its making.
        made = sorted(sandbox_dirs(d), key=lambda s: os.stat(os.path.join(base, s)).st_ctime_ns)
        with Sandbox(endpoint=ep(d), timeout=100) as sb:
            assert sb.id == made[-1]
