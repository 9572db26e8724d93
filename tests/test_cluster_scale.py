"""corral at full size on a real Ray cluster: three raylets on this machine
(``ray.cluster_utils.Cluster`` on 127.0.0.1), each with its own corrald (state dir, socket,
cgroup name, port). A thousand sandboxes made through the gateway spread within 10% of even;
a node killed while exec calls run on every node loses its sandboxes (``sandbox_lost``,
infra) within 5 s, and the other nodes' sandboxes are untouched and leave nothing behind."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

# Set before Ray is imported (tests/raycluster.py says why).
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import ray  # noqa: E402
from raycluster import corral_on_ray  # noqa: E402

import corral  # noqa: E402
import corral.cluster  # noqa: E402
from corral.errors import SandboxLost  # noqa: E402

from conftest import (  # noqa: E402
    host_mounts_under,
    leaked_sandbox_cgroups,
    pids_in_cgroups,
    wait_until,
)

NODES = 3
COUNT = 1000
BATCH = 250
LOST_WITHIN_S = 5.0


@pytest.fixture(scope="module")
def big():
    """Its own cluster: room for the thousand on every node's corrald, and it loses a node."""
    with corral_on_ray(NODES - 1, max_sandboxes=600) as c:
        ep = corral.cluster.connect()
        yield dict(c, gateway=ep)
        os.environ.pop("CORRAL_URL", None)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _procs_named(cgroup: str, comm: str) -> int:
    n = 0
    for pid in pids_in_cgroups(cgroup):
        with contextlib.suppress(OSError):
            n += Path(f"/proc/{pid}/comm").read_text().strip() == comm
    return n


def _all_lost_after(boxes: list[corral.Sandbox], t_kill: float, within: float
                    ) -> tuple[float | None, Counter[str]]:
    """Seconds after the kill at which every one of ``boxes`` answered sandbox_lost (infra)
    to the same call (one exec batch over them all, asked again until then: a probe per
    sandbox from this one process would measure the probe, not the node), or None; and
    what the last round answered."""
    last: Counter[str] = Counter()
    while time.monotonic() < t_kill + within:
        res = corral.Sandbox.exec_many(boxes, "true", timeout=5, return_exceptions=True)
        last = Counter(type(r).__name__ for r in res)
        if all(isinstance(r, SandboxLost) and r.infra for r in res):
            return time.monotonic() - t_kill, last
        time.sleep(0.02)
    return None, last


def _lost_alone(box: corral.Sandbox) -> bool:
    try:
        box.exec("true", timeout=5)
    except SandboxLost as e:
        return e.infra
    return False


def test_a_thousand_sandboxes_spread_evenly_and_a_node_lost_mid_run(big):
    t_start = time.monotonic()
    nodes = big["nodes"]
    assert len(nodes) == NODES
    # What a node's corrald holds with no sandbox: the survivors must come back to it.
    base = {n: {"mounts": set(host_mounts_under(d["state_dir"])),
                "cgroups": set(leaked_sandbox_cgroups(d["cgroup"])),
                "pids": pids_in_cgroups(d["cgroup"])} for n, d in nodes.items()}
    boxes: list[corral.Sandbox] = []
    stop = threading.Event()
    threads: list[threading.Thread] = []
    try:
        for _ in range(COUNT // BATCH):
            boxes += corral.Sandbox.create_many(BATCH, "host", memory_mb=64, timeout=900)
        made_s = time.monotonic() - t_start
        per_node = Counter(b._endpoint.node for b in boxes)
        even = COUNT / NODES
        spread = {n[:8]: per_node[n] for n in nodes}
        worst_off = max(abs(c - even) for c in per_node.values()) / even
        print(f"\n{COUNT} sandboxes in {made_s:.1f} s ({COUNT / made_s:.0f}/s), per node "
              f"{spread}, even {even:.1f}, worst {worst_off:.1%} off")
        assert set(per_node) == set(nodes), per_node
        assert all(abs(per_node[n] - even) <= 0.1 * even for n in nodes), spread
        for b in boxes:  # each handle talks to its node, never the gateway
            assert b._endpoint.url == nodes[b._endpoint.node]["endpoint"]
        assert wait_until(lambda: sum(n["live"] for n in corral.cluster.status()["nodes"])
                          == COUNT, timeout=30)

        head = big["head"]
        victim = next(n for n in nodes if n != head)  # the gateway's node stays
        vd = nodes[victim]
        lost = [b for b in boxes if b._endpoint.node == victim]
        kept = [b for b in boxes if b._endpoint.node != victim]
        lost_pids = [p for p in (b.info().init_pid for b in lost) if p]
        kept_pids = {b.id: b.info().init_pid for b in kept}
        assert len(lost_pids) == len(lost) and all(_alive(p) for p in lost_pids[:50])

        # Work in flight on every node when the node goes: long commands on the victim
        # (they must end with sandbox_lost, not hang), a stream of short ones on the others
        # (every one must succeed).
        in_flight: list[tuple[float, BaseException | None]] = []
        errors: list[BaseException] = []
        rounds = Counter[int]()

        def long_call(b: corral.Sandbox) -> None:
            try:
                b.exec("sleep 120", timeout=150)
                in_flight.append((time.monotonic(), None))
            except BaseException as e:  # noqa: BLE001 - judged below
                in_flight.append((time.monotonic(), e))

        def short_calls(i: int, mine: list[corral.Sandbox]) -> None:
            j = 0
            while not stop.is_set():
                b = mine[j % len(mine)]
                try:
                    r = b.exec(f"echo {i}-{j}", timeout=30)
                    assert r.exit_code == 0 and r.stdout == f"{i}-{j}\n", r
                except BaseException as e:  # noqa: BLE001 - judged below
                    errors.append(e)
                    return
                rounds[i] += 1
                j += 1

        LONG, SHORT = 8, 6
        threads = [threading.Thread(target=long_call, args=(b,)) for b in lost[:LONG]]
        threads += [threading.Thread(target=short_calls, args=(i, kept[i::SHORT]))
                    for i in range(SHORT)]
        for t in threads:
            t.start()
        assert wait_until(lambda: _procs_named(vd["cgroup"], "sleep") == LONG, timeout=30)
        assert wait_until(lambda: len(rounds) == SHORT, timeout=30), (rounds, errors)

        t_kill = time.monotonic()
        ray.kill(big["supervisors"][victim], no_restart=True)
        lost_at, last = _all_lost_after(lost, t_kill, LOST_WITHIN_S + 5)
        assert wait_until(lambda: len(in_flight) == LONG, timeout=LOST_WITHIN_S + 5)
        ended = [t - t_kill for t, _ in in_flight]
        # Each handle on its own answers so too.
        t_each = time.monotonic()
        with ThreadPoolExecutor(16) as pool:
            each = list(pool.map(_lost_alone, lost))
        print(f"node {victim[:8]} killed with {len(lost)} sandboxes: every one answered "
              f"sandbox_lost {lost_at or float('nan'):.2f} s after the kill; in-flight execs "
              f"ended {min(ended):.2f}-{max(ended):.2f} s after it; {len(lost)} single "
              f"calls answered sandbox_lost in {time.monotonic() - t_each:.2f} s")
        assert lost_at is not None and lost_at < LOST_WITHIN_S, (lost_at, last)
        assert all(each), Counter(each)
        for _, e in in_flight:
            assert isinstance(e, SandboxLost) and e.infra, e
        assert max(ended) < LOST_WITHIN_S, ended

        # The survivors never noticed: the stream of calls ran through, every sandbox still
        # answers (a batch over all the handles: the lost node's items are sandbox_lost),
        # and its init is the same process.
        stop.set()
        for t in threads:
            t.join(60)
        assert not errors, errors[:3]
        print(f"survivors: {sum(rounds.values())} exec calls in flight across the loss, "
              "none failed")
        res = corral.Sandbox.exec_many(boxes, "hostname", return_exceptions=True)
        for b, r in zip(boxes, res, strict=True):
            if b._endpoint.node == victim:
                assert isinstance(r, SandboxLost) and r.infra, r
            else:
                assert not isinstance(r, BaseException) and r.stdout == f"{b.id}\n", r
        assert all(_alive(p) for p in kept_pids.values() if p)
        assert wait_until(lambda: victim in corral.cluster.status()["lost"], timeout=10)

        # The lost node left nothing: processes, cgroups, mounts, its socket, corrald.
        assert wait_until(lambda: not any(_alive(p) for p in lost_pids), timeout=60)
        assert wait_until(lambda: not _alive(vd["keeper_pid"]), timeout=60)
        assert not leaked_sandbox_cgroups(vd["cgroup"])
        assert not pids_in_cgroups(vd["cgroup"])
        assert not host_mounts_under(vd["state_dir"])
        assert not Path(vd["socket"]).exists()

        # The survivors' sandboxes killed: each node is back where it started.
        assert all(r is True for r in corral.Sandbox.kill_many(kept))
        for n, d in nodes.items():
            if n == victim:
                continue
            b0 = base[n]
            assert wait_until(lambda d=d, b0=b0: set(leaked_sandbox_cgroups(d["cgroup"]))
                              == b0["cgroups"], timeout=60), n
            assert wait_until(lambda d=d, b0=b0: pids_in_cgroups(d["cgroup"]) <= b0["pids"],
                              timeout=30), n
            assert set(host_mounts_under(d["state_dir"])) <= b0["mounts"], n
        assert not any(_alive(p) for p in kept_pids.values() if p)
        assert wait_until(lambda: all(n["live"] == 0 for n in corral.cluster.status()["nodes"]),
                          timeout=15)
        print(f"test took {time.monotonic() - t_start:.1f} s")
    finally:
        stop.set()
        corral.Sandbox.kill_many(boxes, return_exceptions=True)  # ends the long calls too
        for t in threads:
            t.join(60)
