"""corral under Ray's own autoscaler: its monitor runs on the head with the fake multi-node
provider, which starts worker raylets on this machine the way a cloud provider boots machines.
Creates refused for want of room make Ray start a node; the gateway adopts it; Ray keeps that
node while it holds sandboxes (its idle timeout here is 6 s, far shorter than the sandboxes'
lives) and releases it once corral has drained it."""

from __future__ import annotations

import os
import time

import pytest

# Set before Ray is imported (tests/raycluster.py says why).
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import ray  # noqa: E402
from raycluster import corral_on_ray  # noqa: E402
from test_cluster_autoscale import ray_request  # noqa: E402

import corral  # noqa: E402
import corral.cluster  # noqa: E402
from corral.errors import CapacityExceeded  # noqa: E402

from conftest import wait_until  # noqa: E402

# Worker nodes offer a resource of corral's own: holding one is how corral tells Ray's
# autoscaler that a node is in use (sandboxes take no Ray resources).
SHAPE = {"corral": 1.0}
WORKERS = {"corral-node": {"resources": {"CPU": 1, "corral": 1,
                                         "object_store_memory": 80 << 20},
                           "node_config": {}, "min_workers": 0, "max_workers": 1}}
SETTINGS = {"node_shape": SHAPE, "min_nodes": 1, "max_nodes": 2, "idle_s": 3.0,
            "demand_window_s": 3.0}


@pytest.fixture(scope="module")
def cluster():
    with corral_on_ray(0, ray_autoscaler=WORKERS, max_sandboxes=2, autoscale=SETTINGS) as c:
        corral.cluster.connect()
        yield c


def _alive() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


def _create() -> corral.Sandbox | None:
    try:
        return corral.Sandbox(image="host", memory_mb=64, timeout=300)
    except CapacityExceeded:
        return None


def test_ray_starts_a_node_keeps_it_while_it_holds_sandboxes_then_releases_it(cluster):
    head = cluster["head"]
    boxes: list[corral.Sandbox] = []
    try:
        while (b := _create()) is not None:  # the head fills; the next create is refused
            boxes.append(b)
            assert len(boxes) <= 3, "never full"
        assert {b.info().node for b in boxes} == {head}

        # Ray's autoscaler starts a node, the gateway adopts it, a create lands there.
        def placed_elsewhere() -> bool:
            b = _create()
            if b is not None:
                boxes.append(b)
            return b is not None and b.info().node != head
        assert wait_until(placed_elsewhere, timeout=120)
        on_new = boxes[-1]
        new = on_new.info().node
        assert new in _alive() and new != head

        # The demand is met and the request withdrawn: Ray must still keep the node that
        # holds a sandbox, past several of its idle timeouts.
        assert wait_until(lambda: ray_request() == [], timeout=30)
        until = time.monotonic() + 20
        while time.monotonic() < until:
            r = on_new.exec("sleep 1; echo alive", timeout=30)
            assert r.stdout == "alive\n" and new in _alive(), (r, _alive())

        # Its sandboxes gone, corral drains it and Ray releases it.
        corral.Sandbox.kill_many(boxes, return_exceptions=True)
        assert wait_until(lambda: new in corral.cluster.status()["drained"], timeout=60)
        assert wait_until(lambda: new not in _alive(), timeout=60)
        assert head in _alive()
    finally:
        corral.Sandbox.kill_many(boxes, return_exceptions=True)
