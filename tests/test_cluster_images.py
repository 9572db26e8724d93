"""Images through a cluster's gateway: a pull is made on every node (or the nodes a node
selector names), once per node, with each node's progress streamed; a node that cannot pull
fails the pull with its own error and what every node answered. A real Ray cluster (two
raylets on loopback) and a registry on this machine."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest

# Set before Ray is imported (tests/raycluster.py says why).
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import imagefix as fx  # noqa: E402
from raycluster import corral_on_ray, role_labels  # noqa: E402

import corral  # noqa: E402
import corral.cluster  # noqa: E402
from corral.errors import CorralError  # noqa: E402
from corral.sdk import admin  # noqa: E402

from conftest import wait_until  # noqa: E402

pytestmark = pytest.mark.skipif(
    not all(os.path.exists(p) for p in ("/usr/bin/docker-registry", "/usr/bin/skopeo",
                                        fx.BUSYBOX)),
    reason="needs docker-registry, skopeo and busybox-static (scripts/setup.sh)")


@pytest.fixture(scope="module")
def env() -> Iterator[dict[str, Any]]:
    base = fx.oci_layout("clusterimg", [
        ("gzip", fx.busybox_base()),
        ("gzip", [fx.d("opt"), fx.f("opt/where.txt", b"from the registry\n"),
                  fx.rand("opt/blob.bin", 256 << 10, seed=7)])],
        {"Env": ["PATH=/bin"], "Cmd": ["sh"]})
    with contextlib.ExitStack() as stack:
        reg = stack.enter_context(fx.registry())
        reg.push(base, "team/clusterimg")
        reg.push(base, "team/clusterimg", "sel")
        # The nodes' corrald inherit the raylets' environment: they may pull from it.
        stack.enter_context(mock.patch.dict(os.environ, {"CORRAL_REGISTRIES": reg.addr}))
        c = stack.enter_context(corral_on_ray(1, max_sandboxes=16, labels=role_labels))
        gw = corral.cluster.connect()
        yield {"reg": reg, "cluster": c, "gateway": gw.url}


def _images(node_socket: str) -> set[str]:
    return {i.name for i in admin.images(endpoint=node_socket)}


def test_a_pull_through_the_gateway_pulls_on_every_node_once(env):
    c, reg = env["cluster"], env["reg"]
    ref = f"{reg.addr}/team/clusterimg:latest"
    events: list[dict[str, Any]] = []
    info = admin.pull_image(ref, progress=events.append, endpoint=env["gateway"])
    assert info.name == ref and info.digest
    nodes = set(c["nodes"])
    # Each node's progress, named; each node's end.
    assert {e["node"] for e in events if e.get("event") == "layer"} == nodes
    assert sorted(e["node"] for e in events if e.get("event") == "node_done") == sorted(nodes)
    for d in c["nodes"].values():
        assert ref in _images(d["socket"])
    # Once per node: each layer's blob fetched once by each node.
    for layer in info.layers or []:
        assert reg.requests(f"/blobs/{layer}") == len(nodes), layer
    # Again: every node has it, nothing fetched (the answer names the nodes).
    again = admin.pull_image(ref, endpoint=env["gateway"])
    assert again.digest == info.digest
    for layer in info.layers or []:
        assert reg.requests(f"/blobs/{layer}") == len(nodes), layer
    # The load reports carry it, and sandboxes of it run on both nodes.
    assert wait_until(lambda: all(ref in n["images"] for n in corral.cluster.status()["nodes"]),
                      timeout=15, interval=0.2)
    boxes = corral.Sandbox.create_many(4, ref, memory_mb=64, timeout=120, spread=True)
    try:
        assert {b.info().node for b in boxes} == nodes
        outs = corral.Sandbox.exec_many(boxes, "cat /opt/where.txt")
        assert [r.stdout for r in outs] == ["from the registry\n"] * 4
    finally:
        corral.Sandbox.kill_many(boxes, return_exceptions=True)


def test_a_pull_with_a_node_selector_pulls_on_those_nodes_only(env):
    c, reg = env["cluster"], env["reg"]
    ref = f"{reg.addr}/team/clusterimg:sel"
    worker = next(n for n in c["nodes"] if n != c["head"])
    info = admin.pull_image(ref, endpoint=env["gateway"], node_selector={"role": "worker"})
    assert info.name == ref
    assert ref in _images(c["nodes"][worker]["socket"])
    assert ref not in _images(c["nodes"][c["head"]]["socket"])
    with pytest.raises(corral.errors.CapacityExceeded):
        admin.pull_image(ref, endpoint=env["gateway"], node_selector={"role": "nowhere"})


def test_a_pull_that_fails_says_what_every_node_answered(env):
    c, reg = env["cluster"], env["reg"]
    missing = f"{reg.addr}/team/nothing-here:v1"
    for progress in (None, [].append):
        with pytest.raises(CorralError) as got:
            admin.pull_image(missing, progress=progress, endpoint=env["gateway"])
        err = got.value
        assert err.code == "image_not_found", err.to_payload()
        assert err.details["node"] in c["nodes"]
        assert err.details["nodes"] == {n: "image_not_found" for n in c["nodes"]}
    # A reference the registry list does not allow is the nodes' refusal, unchanged.
    with pytest.raises(CorralError) as got:
        admin.pull_image("registry.invalid/team/x:1", endpoint=env["gateway"])
    assert set(got.value.details["nodes"]) == set(c["nodes"]), got.value.to_payload()
