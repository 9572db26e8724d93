"""A drained node's snapshots move before the node goes: on a real Ray cluster on loopback,
with autoscaling on, an idle node that holds snapshots (a parent and a child taken from a
sandbox started on it) is drained by the autoscaler's path; its snapshots are then on the
other node, ids and names kept, and sandboxes started from them through the gateway see the
files the snapshots hold."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Set before Ray is imported (tests/raycluster.py says why).
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

from raycluster import corral_on_ray, role_labels  # noqa: E402

import corral  # noqa: E402
import corral.cluster  # noqa: E402

from conftest import wait_until  # noqa: E402

SETTINGS = {"node_shape": {"CPU": 1.0}, "min_nodes": 1, "max_nodes": 2, "idle_s": 2.0,
            "demand_window_s": 5.0}


@pytest.fixture(scope="module")
def cluster():
    with corral_on_ray(1, max_sandboxes=8, labels=role_labels) as c:
        corral.cluster.connect()
        yield c


def test_a_drained_nodes_snapshots_move_to_a_live_node(cluster):
    head = corral.cluster.status()["home"]  # the gateway's node: never drained
    worker = next(n for n in cluster["nodes"] if n != head)
    d = cluster["nodes"][worker]
    role = "head" if worker == cluster["head"] else "worker"  # Ray's head may not be home
    sb = corral.Sandbox(image="host", memory_mb=64, timeout=300, node_selector={"role": role})
    assert sb.info().node == worker
    try:
        sb.files.write("/tmp/base.txt", b"base layer\n")
        parent = sb.snapshot(name="drain-parent")
        sb.files.write("/tmp/top.txt", b"top layer\n")
        child = sb.snapshot(name="drain-child")
    finally:
        sb.kill()
    assert corral.Snapshot.get(parent.id).node == worker
    assert corral.Snapshot.get(child.id).node == worker

    corral.cluster.autoscale(SETTINGS)
    try:
        assert wait_until(lambda: worker in corral.cluster.status()["drained"], timeout=60)
    finally:
        corral.cluster.autoscale(None)
    assert not Path(d["socket"]).exists()  # its corrald is gone
    assert worker not in corral.cluster.supervisors()

    for snap, name in ((parent, "drain-parent"), (child, "drain-child")):
        got = corral.Snapshot.get(snap.id)
        assert got.node == head and got.name == name and got.layers == snap.layers, got
    # The child's copy shares the parent's copy's layers (sent once).
    with corral.Sandbox(snapshot=child.id, memory_mb=64) as kid:
        assert kid.info().node == head
        assert kid.files.read("/tmp/base.txt") == "base layer\n"
        assert kid.files.read("/tmp/top.txt") == "top layer\n"
    with corral.Sandbox(snapshot="drain-parent", memory_mb=64) as p:
        assert p.files.read("/tmp/base.txt") == "base layer\n"
        assert not p.files.exists("/tmp/top.txt")
    for snap in (child, parent):
        corral.Snapshot.get(snap.id).delete()
