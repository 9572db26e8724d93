"""Autoscaling through Ray's autoscaler, on a real Ray cluster on loopback: creates refused for
want of room become a resource request in Ray's GCS (the one Ray's autoscaler acts on) of one
``node_shape`` bundle per node wanted; a node that joins is adopted without a call to start();
the request is withdrawn once the demand is met; a node idle for ``idle_s`` is drained (its
corrald stops, Ray sees it idle); demand brings a drained node back.

What Ray's autoscaler then does with the request (start a node through its node provider,
release an idle one) needs a node provider: this test plays that part with
``Cluster.add_node`` and checks what Ray was asked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

# Set before Ray is imported (tests/raycluster.py says why).
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import ray  # noqa: E402
from raycluster import NODE_ARGS, corral_on_ray  # noqa: E402

import corral  # noqa: E402
import corral.cluster  # noqa: E402
from corral.errors import CapacityExceeded, InvalidRequest  # noqa: E402

from conftest import wait_until  # noqa: E402

SHAPE = {"CPU": 1.0}
SETTINGS = {"node_shape": SHAPE, "min_nodes": 1, "max_nodes": 3, "idle_s": 3.0,
            "demand_window_s": 60.0}


@pytest.fixture(scope="module")
def cluster():
    with corral_on_ray(0, max_sandboxes=3, autoscale=SETTINGS) as c:
        corral.cluster.connect()
        yield c


def ray_request() -> list[dict[str, float]]:
    """The resource request standing in Ray's GCS, as Ray's autoscaler reads it."""
    from ray.autoscaler.v2.utils import is_autoscaler_v2

    if is_autoscaler_v2():
        from ray._private.state import state
        from ray.autoscaler.v2.sdk import get_cluster_resource_state

        rs = get_cluster_resource_state(state.get_gcs_client())
        return [dict(r.request.resources_bundle) for c in rs.cluster_resource_constraints
                for r in c.resource_requests for _ in range(r.count)]
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(b"autoscaler_resource_request")
    return json.loads(raw) if raw else []


def _create() -> corral.Sandbox | CapacityExceeded:
    try:
        return corral.Sandbox(image="host", memory_mb=64, timeout=120)
    except CapacityExceeded as e:
        return e


def _batch(count: int) -> int:
    url = os.environ["CORRAL_URL"]
    from corral.sdk.endpoint import _tokens

    req = urllib.request.Request(f"{url}/v1/sandboxes/batch", method="POST",
                                 data=json.dumps({"count": count}).encode())
    req.add_header("Authorization", f"Bearer {_tokens[url]}")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_bad_settings_are_refused(cluster):
    for bad in ({}, {"node_shape": {}}, {"node_shape": {"CPU": -1}},
                {"node_shape": SHAPE, "min_nodes": 4, "max_nodes": 2},
                {"node_shape": SHAPE, "idle_s": 0}, {"node_shape": "CPU"}):
        with pytest.raises(InvalidRequest):
            corral.cluster.autoscale(bad)
    assert corral.cluster.status()["autoscale"]["node_shape"] == SHAPE


def _fill() -> list[corral.Sandbox]:
    """Create until the gateway refuses (every node full, as its load reports say: a report
    asked for just before a create may count it twice, for one report interval)."""
    boxes: list[corral.Sandbox] = []
    while not isinstance(b := _create(), CapacityExceeded):
        boxes.append(b)
        assert len(boxes) <= 6, "never full"
    return boxes


def _until_on(node: str) -> list[corral.Sandbox]:
    """Create until one lands on ``node`` (none refused: a refusal is demand, and demand
    holds off draining)."""
    boxes: list[corral.Sandbox] = []
    while not boxes or boxes[-1].info().node != node:
        b = _create()
        assert isinstance(b, corral.Sandbox) and len(boxes) < 4, (b, boxes)
        boxes.append(b)
    return boxes


def _empty() -> bool:
    """No sandbox live or being placed, as the gateway sees it."""
    return all(n["live"] + n["placed_since_report"] == 0
               for n in corral.cluster.status()["nodes"])


def test_demand_beyond_capacity_asks_ray_then_withdraws_and_drains(cluster):
    head = cluster["head"]
    assert wait_until(_empty, timeout=15)
    assert ray_request() == []  # room enough: nothing asked
    boxes: list = []
    try:
        # Saturated: a create is refused, and Ray is asked for a second node.
        boxes += _fill()
        assert 2 <= len(boxes) <= 3 and {b.info().node for b in boxes} == {head}
        assert wait_until(lambda: ray_request() == [SHAPE] * 2, timeout=10), ray_request()
        # A batch of 5 more: (2 or 3 live + 6 refused) / 3 per node = 3 nodes, the max.
        assert _batch(5) == 429
        assert wait_until(lambda: ray_request() == [SHAPE] * 3, timeout=10), ray_request()
        assert corral.cluster.status()["autoscale"]["asked_nodes"] == 3

        # The autoscaler's part: a node joins. The gateway adopts it by itself, the
        # request is withdrawn (the demand it stood for has room now), creates go there.
        c = cluster["ray"]
        new = c.add_node(**NODE_ARGS).node_id
        assert wait_until(lambda: any(n["node"] == new
                                      for n in corral.cluster.status()["nodes"]), timeout=60)
        assert wait_until(lambda: ray_request() == [], timeout=10), ray_request()
        boxes += _until_on(new)
        d = ray.get(corral.cluster.supervisors()[new].describe.remote())
    finally:
        corral.Sandbox.kill_many(boxes, return_exceptions=True)

    # Idle for idle_s: the new node is drained (its corrald stopped, out of placement); the
    # gateway's own node never is.
    assert wait_until(lambda: new in corral.cluster.status()["drained"], timeout=30)
    st = corral.cluster.status()
    assert [n["node"] for n in st["nodes"]] == [head] and head not in st["drained"]
    assert not Path(d["socket"]).exists()
    assert new not in corral.cluster.supervisors()

    # Demand again, with the drained node still in Ray: it is adopted back.
    assert wait_until(_empty, timeout=15)
    boxes = []
    try:
        boxes += _fill()
        assert wait_until(lambda: new in corral.cluster.supervisors(), timeout=30)
        boxes += _until_on(new)
    finally:
        corral.Sandbox.kill_many(boxes, return_exceptions=True)


def test_autoscale_off_withdraws_the_request(cluster):
    assert wait_until(_empty, timeout=15)
    boxes: list = []
    try:
        boxes += _fill()
        assert wait_until(lambda: ray_request() != [], timeout=10)
        assert corral.cluster.autoscale(None) is None
        assert ray_request() == []
        assert corral.cluster.status()["autoscale"] is None
    finally:
        corral.Sandbox.kill_many(boxes, return_exceptions=True)
        corral.cluster.autoscale(SETTINGS)


def test_cli_sets_autoscaling(cluster):
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "corral.cli", "cluster", "autoscale",
                               "--address", cluster["ray"].address, *args],
                              capture_output=True, text=True, timeout=120)
    try:
        r = cli("--node-shape", "CPU=2,corral=1", "--max-nodes", "5", "--idle-s", "60",
                "--json")
        assert r.returncode == 0, r.stderr[-2000:]
        a = json.loads(r.stdout)["autoscale"]
        assert a["node_shape"] == {"CPU": 2.0, "corral": 1.0} and a["max_nodes"] == 5
        r = cli("--node-shape", "CPU=lots")
        assert r.returncode != 0 and "node-shape" in r.stderr + r.stdout
        assert corral.cluster.status()["autoscale"]["max_nodes"] == 5  # unchanged
        r = cli("--off", "--json")
        assert r.returncode == 0 and json.loads(r.stdout)["autoscale"] is None
    finally:
        corral.cluster.autoscale(SETTINGS)
