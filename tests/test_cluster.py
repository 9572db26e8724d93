"""corral on a real Ray cluster: two raylets on this machine (ray.cluster_utils.Cluster, bound to
127.0.0.1), each node with its own corrald (state dir, socket, cgroup name, port) owned by a
supervisor actor, and the gateway actor placing creates. Node loss is attacked by killing a
supervisor: its sandboxes answer ``sandbox_lost`` within 5 s and nothing of them stays."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

# Set before Ray is imported (tests/raycluster.py says why).
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import ray  # noqa: E402
from raycluster import NODE_ARGS, corral_on_ray  # noqa: E402

import corral  # noqa: E402
import corral.cluster  # noqa: E402
from corral import placing  # noqa: E402
from corral.errors import (  # noqa: E402
    CapacityExceeded,
    Conflict,
    InvalidRequest,
    SandboxLost,
    SandboxNotFound,
    SnapshotCopyFailed,
    SnapshotNotFound,
    error_from_payload,
)
from corral.sdk import admin  # noqa: E402
from corral.sdk import endpoint as endpoint_mod  # noqa: E402

from conftest import (  # noqa: E402
    cgroup_dirs,
    host_mounts_under,
    leaked_sandbox_cgroups,
    pids_in_cgroups,
    wait_until,
)


@pytest.fixture(scope="module")
def cluster():
    with corral_on_ray(1, max_sandboxes=64,
                       labels=lambda head: {head: {"role": "head", "pool": "a"}}) as c:
        yield c


@pytest.fixture
def gateway(cluster):
    ep = corral.cluster.connect()
    yield ep
    os.environ.pop("CORRAL_URL", None)


def _get(url: str, token: str | None) -> tuple[int, dict]:
    req = urllib.request.Request(url)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_each_node_runs_its_own_corrald(cluster):
    nodes = cluster["nodes"]
    assert len(nodes) == 2
    assert set(nodes) == {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    for key in ("state_dir", "socket", "cgroup", "endpoint", "keeper_pid"):
        assert len({d[key] for d in nodes.values()}) == 2, key
    st = corral.cluster.status()
    assert {n["node"] for n in st["nodes"]} == set(nodes)
    for n in st["nodes"]:
        assert n["capacity"] == 64 and n["live"] == 0 and n["report_age_s"] < 3
        assert n["endpoint"].startswith("http://127.0.0.1:")
    for d in nodes.values():
        # Ray starts its workers niced (15); a node's corrald runs at the default priority.
        kids = Path(f"/proc/{d['keeper_pid']}/task/{d['keeper_pid']}/children").read_text()
        assert [os.getpriority(os.PRIO_PROCESS, int(k)) for k in kids.split()] == [0], kids
        assert cgroup_dirs(d["cgroup"]), d["cgroup"]          # each its own cgroup tree
        code, body = _get(d["endpoint"] + "/v1/status", None)  # TCP needs the token
        assert code == 401, body


def test_a_nodes_corrald_that_dies_comes_back_with_its_sandboxes(cluster, gateway):
    """A node's corrald killed (a crash, an OOM kill) left its sandboxes running unseen for
    good: the node was never marked lost, its capacity gone, and a cluster stop left them
    too. Its keeper starts it again on its state dir: the sandbox is adopted and runs on."""
    token = endpoint_mod._tokens[gateway.url]
    d = next(iter(cluster["nodes"].values()))

    def corrald() -> int:
        kids = Path(f"/proc/{d['keeper_pid']}/task/{d['keeper_pid']}/children").read_text()
        return int(kids.split()[0]) if kids.split() else 0

    def back(first: int) -> bool:
        try:
            return corrald() not in (0, first) and \
                _get(d["endpoint"] + "/v1/sandboxes/" + sid, token)[0] == 200
        except OSError:  # refused while it starts
            return False

    def post(path: str, body: dict, method: str = "POST") -> dict:
        req = urllib.request.Request(d["endpoint"] + path, method=method,
                                     data=json.dumps(body).encode())
        req.add_header("Authorization", f"Bearer {token}")
        req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())

    sid = post("/v1/sandboxes", {})["id"]
    try:
        post(f"/v1/sandboxes/{sid}/exec", {"cmd": "sleep 600 >/dev/null 2>&1 &"})
        first = corrald()
        os.kill(first, signal.SIGKILL)
        assert wait_until(lambda: back(first), timeout=90)
        assert _get(d["endpoint"] + "/v1/sandboxes/" + sid, token)[1]["state"] == "running"
        ps = post(f"/v1/sandboxes/{sid}/exec", {"cmd": "ps -e -o args"})["stdout"]
        assert "sleep 600" in ps, ps  # the same sandbox, adopted
    finally:
        post(f"/v1/sandboxes/{sid}", {}, method="DELETE")


def test_no_sandbox_reaches_a_node_of_the_cluster(cluster, gateway):
    """Every node's corrald blocks every Ray node's address for its sandboxes, whatever
    their policy (Ray's ports take commands from anyone); a list changed behind the
    supervisor's back gets the nodes back at its next look, and keeps what the admin added
    (the supervisor wrote its nodes alone, and an admin's block was undone within seconds)."""
    token = endpoint_mod._tokens[gateway.url]
    addrs = {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    want = sorted(f"{a}/32" for a in addrs)
    for d in cluster["nodes"].values():
        code, body = _get(d["endpoint"] + "/v1/network/blocked", token)
        assert code == 200 and set(want) <= set(body["configured"]), body
    d = next(iter(cluster["nodes"].values()))
    req = urllib.request.Request(d["endpoint"] + "/v1/network/blocked", method="PUT",
                                 data=json.dumps({"blocked": ["192.0.2.1"]}).encode())
    req.add_header("Authorization", f"Bearer {token}")
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=10) as r:
        assert json.loads(r.read())["live"] == ["192.0.2.1/32"]
    assert wait_until(lambda: sorted(_get(d["endpoint"] + "/v1/network/blocked",
                                          token)[1]["live"]) == sorted([*want, "192.0.2.1/32"]),
                      timeout=60)


def test_cli_status_shows_the_nodes(cluster):
    r = subprocess.run([sys.executable, "-m", "corral.cli", "cluster", "status", "--json",
                        "--address", cluster["ray"].address],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    st = json.loads(r.stdout)
    assert {n["node"] for n in st["nodes"]} == set(cluster["nodes"])
    assert st["gateway"].startswith("http://127.0.0.1:")
    # start again is idempotent: the running cluster, its nodes kept (same corrald each).
    r = subprocess.run([sys.executable, "-m", "corral.cli", "cluster", "start", "--json",
                        "--address", cluster["ray"].address, "--name", cluster["name"],
                        "--state-root", cluster["root"], "--run-dir", cluster["run_dir"],
                        "--max-sandboxes", "64"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    again = json.loads(r.stdout)
    assert again["gateway"] == st["gateway"] and again["cluster"] == cluster["name"]
    assert {n["node"] for n in again["nodes"]} == set(cluster["nodes"])
    assert {n: d["keeper_pid"] for n, d in cluster["describe"]().items()} == \
        {n: d["keeper_pid"] for n, d in cluster["nodes"].items()}


def test_status_shows_live_sandboxes_capacity_and_rates(cluster, gateway):
    """Status sums the nodes' live counts and capacity, and shows creates and ends per
    second, per node and for the cluster (from the nodes' reports); so does the CLI."""
    boxes = corral.Sandbox.create_many(8, "host", memory_mb=64, timeout=120)
    try:
        seen: dict[str, Any] = {}

        def made() -> bool:
            seen.update(corral.cluster.status())
            return seen["live"] == 8 and seen["creates_per_s"] > 0
        assert wait_until(made, timeout=15, interval=0.2), seen
        st = seen
        assert st["capacity"] == sum(n["capacity"] for n in st["nodes"]) == 128
        assert all(n["creates_per_s"] > 0 for n in st["nodes"]), st["nodes"]  # spread
        assert st["creates_per_s"] <= 8 / 0.5  # 8 over at least one report's interval
        r = subprocess.run([sys.executable, "-m", "corral.cli", "cluster", "status",
                            "--address", cluster["ray"].address],
                           capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, COLUMNS="200"))
        assert r.returncode == 0, r.stderr[-2000:]
        assert "8 live of 128" in r.stdout and "creates/s" in r.stdout, r.stdout
    finally:
        corral.Sandbox.kill_many(boxes, return_exceptions=True)

    def ended() -> bool:
        st = corral.cluster.status()
        return st["live"] == 0 and st["ends_per_s"] > 0
    assert wait_until(ended, timeout=15, interval=0.2), corral.cluster.status()


def test_gateway_authenticates_and_is_no_data_path(cluster, gateway):
    code, body = _get(gateway.url + "/v1/cluster", None)
    assert code == 401 and body["error"]["code"] == "unauthorized"
    code, _ = _get(gateway.url + "/v1/cluster", "wrong")
    assert code == 401
    token = endpoint_mod._tokens[gateway.url]
    code, body = _get(gateway.url + "/v1/cluster", token)
    assert code == 200 and len(body["nodes"]) == 2
    # A sandbox's calls are the node's business, not the gateway's (a lookup by id is the
    # gateway's: connect() finds the node).
    code, body = _get(gateway.url + "/v1/sandboxes/sb-x/files?path=/etc/hostname", token)
    assert code == 404 and "endpoint" in body["error"]["message"]
    code, body = _get(gateway.url + "/v1/sandboxes/sb-x", token)
    assert code == 404 and body["error"]["code"] == "sandbox_not_found"


def test_an_id_in_a_gateway_path_reaches_no_other_node_route(cluster, gateway):
    """The gateway asks nodes with its own credentials: an id that is a dot segment, or holds
    a slash or a query, must not resolve into another route of a node (here /v1/status)."""
    token = endpoint_mod._tokens[gateway.url]
    for raw in ("..%2F..%2Fv1%2Fstatus%3F", "%2E%2E", "..", "%2E", "..%2Fstatus"):
        for tail in ("/log", ""):
            code, body = _get(gateway.url + "/v1/sandboxes/" + raw + tail, token)
            assert code == 404, (raw, tail, body)
            assert body["error"]["code"] == "sandbox_not_found", (raw, tail, body)
        for kind in ("snapshots", "trajectories"):
            code, body = _get(gateway.url + f"/v1/{kind}/{raw}", token)
            assert code == 404 and "nodes" not in body, (raw, kind, body)


def _create(url: str, token: str, selector: str) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/v1/sandboxes", method="POST",
                                 data=json.dumps({"image": "host", "memory_mb": 64}).encode())
    req.add_header("Authorization", f"Bearer {token}")
    req.add_header("Content-Type", "application/json")
    req.add_header("X-Corral-Node-Selector", selector)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_node_selector_places_on_labelled_nodes_only(cluster, gateway):
    token = endpoint_mod._tokens[gateway.url]
    made = []
    try:
        for _ in range(3):
            code, info = _create(gateway.url, token, "role=head")
            assert code == 201, info
            made.append(corral.Sandbox.from_id(info["id"], endpoint=gateway.on_node(
                info["endpoint"], info["node"])))
            assert info["node"] == cluster["head"]
        code, body = _create(gateway.url, token, "role=nowhere")
        assert code == 429 and body["error"]["code"] == "capacity_exceeded"
        assert "labels" in body["error"]["message"]
        code, body = _create(gateway.url, token, "=bad")
        assert code == 400 and body["error"]["code"] == "invalid_request"
    finally:
        for b in made:
            b.kill()


def test_the_gateway_takes_bodies_as_sent(cluster, gateway):
    """An encoded body is refused before anything is placed or made: the gateway's body pool
    counts bodies by their size as sent, and 15 KB of gzip inflated to 15 MiB."""
    import gzip

    token = endpoint_mod._tokens[gateway.url]
    mark = f"encoded-{os.getpid()}"
    body = gzip.compress(json.dumps({"image": "host", "labels": {"mark": mark},
                                     "env": {"PAD": "x" * (8 << 20)}}).encode())
    req = urllib.request.Request(gateway.url + "/v1/sandboxes", method="POST", data=body)
    for name, value in (("Authorization", f"Bearer {token}"),
                        ("Content-Type", "application/json"), ("Content-Encoding", "gzip")):
        req.add_header(name, value)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 400
    err = json.loads(e.value.read())["error"]
    assert err["code"] == "invalid_request" and "Content-Encoding" in err["message"], err
    assert not corral.Sandbox.list(endpoint=gateway.url, labels={"mark": mark})


def _ask_placement(url: str, token: str, placement: str, selector: str = "",
                   labels: dict[str, str] | None = None) -> tuple[int, dict, str | None]:
    body = {"image": "host", "memory_mb": 64, "labels": labels or {}}
    req = urllib.request.Request(url + "/v1/sandboxes", method="POST",
                                 data=json.dumps(body).encode())
    req.add_header("Authorization", f"Bearer {token}")
    req.add_header("Content-Type", "application/json")
    req.add_header(placing.HEADER, placement)
    if selector:
        req.add_header("X-Corral-Node-Selector", selector)
    try:  # urllib does not follow a 307 of a POST: it raises it
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read()), r.headers.get("Location")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers.get("Location")


def test_a_create_that_asks_for_its_node_gets_the_node_and_nothing_is_made(cluster, gateway):
    """The SDK's create through a gateway: the gateway answers the placement (307, the node,
    and the placements asked for ahead) and makes nothing; left-out nodes are never placed
    on; a bad ask is invalid_request; a node itself ignores the ask and makes the
    sandbox."""
    token = endpoint_mod._tokens[gateway.url]
    head = cluster["head"]
    other = next(n for n in cluster["nodes"] if n != head)
    mark = {"ask": f"placement-{os.getpid()}"}
    gw = ray.get_actor("gateway", namespace=corral.cluster.NAMESPACE)
    placed_before = ray.get(gw.status.remote())["placed"]
    code, body, location = _ask_placement(gateway.url, token, "node", "role=head", mark)
    endpoint = cluster["nodes"][head]["endpoint"]
    assert code == 307 and body == {"placed": {"node": head, "endpoint": endpoint}}, body
    assert location == endpoint + "/v1/sandboxes"
    assert ray.get(gw.status.remote())["placed"] == placed_before + 1
    for _ in range(6):
        code, body, _ = _ask_placement(gateway.url, token, f"node; exclude={head}",
                                       labels=mark)
        assert code == 307 and body["placed"]["node"] == other, body
    code, body, _ = _ask_placement(gateway.url, token, f"node; exclude={head}", "role=head")
    assert code == 429 and body["error"]["code"] == "capacity_exceeded"
    # Placements ahead: each placed like a create, counted, on the selected nodes only.
    before = ray.get(gw.status.remote())["placed"]
    code, body, _ = _ask_placement(gateway.url, token, "node; ahead=3", "role=head")
    assert code == 307 and [a["node"] for a in body["ahead"]] == [head] * 3, body
    assert ray.get(gw.status.remote())["placed"] == before + 4
    assert wait_until(lambda: all(n["placed_since_report"] == 0
                                  for n in corral.cluster.status()["nodes"]))
    code, body, _ = _ask_placement(gateway.url, token, "node; ahead=4", labels=mark)
    assert {a["node"] for a in body["ahead"]} | {body["placed"]["node"]} == set(cluster["nodes"])
    code, body, _ = _ask_placement(gateway.url, token, "everything")
    assert code == 400 and body["error"]["code"] == "invalid_request"
    assert corral.Sandbox.list(labels=mark) == []  # the gateway made nothing
    code, body, _ = _ask_placement(endpoint, token, "node", labels=mark)
    try:
        assert code == 201 and body["id"].startswith("sb-"), body
        assert [b.id for b in corral.Sandbox.list(labels=mark)] == [body["id"]]
    finally:
        corral.Sandbox.from_id(body["id"], endpoint=gateway.on_node(endpoint, head)).kill()


def test_placements_past_a_tenants_limit_are_made_by_the_gateway(cluster, gateway):
    """A placement counts on its node until that node's next report though nothing is made
    yet: a client asking for placements it never uses could make every node look full. Past
    its limit in a second, a tenant's asks are answered with sandboxes the gateway made (real
    ones, under the nodes' limits), which the SDK takes as well."""
    gw = ray.get_actor("gateway", namespace=corral.cluster.NAMESPACE)
    token = endpoint_mod._tokens[gateway.url]
    mark = {"limit": f"placements-{os.getpid()}"}
    assert ray.get(gw.set_placement_limit.remote(4)) == 4
    made: list[corral.Sandbox] = []
    try:
        code, body, _ = _ask_placement(gateway.url, token, "node; ahead=8", labels=mark)
        assert code == 307 and len(body["ahead"]) == 3, body  # 4 placements in all
        code, body, _ = _ask_placement(gateway.url, token, "node; ahead=2", labels=mark)
        assert code == 201 and body["node"] in cluster["nodes"], body
        made.append(corral.Sandbox.from_id(body["id"], endpoint=gateway.on_node(
            body["endpoint"], body["node"])))
        sb = corral.Sandbox(image="host", memory_mb=64, labels=mark)
        made.append(sb)
        assert sb.exec("echo made").stdout == "made\n"
        assert {b.id for b in corral.Sandbox.list(labels=mark)} == {b.id for b in made}
    finally:
        ray.get(gw.set_placement_limit.remote(None))
        corral.Sandbox.kill_many(made, return_exceptions=True)


def test_the_sdks_node_selector_places_on_labelled_nodes_only(cluster, gateway):
    """``node_selector=`` on Sandbox, create_many and their async twins: every sandbox on the
    labelled node; labels no node has: capacity_exceeded; a selector the header cannot carry:
    refused before anything is sent (the gateway's count of placements does not move)."""
    head = cluster["head"]
    made: list[Any] = []

    async def run() -> list[str]:
        one = await corral.AsyncSandbox(image="host", memory_mb=64,
                                        node_selector={"role": "head"})
        many = await corral.AsyncSandbox.create_many(3, image="host", memory_mb=64,
                                                     node_selector={"pool": "a"})
        boxes = [one, *many]
        made.extend(corral.Sandbox.from_id(b.id, endpoint=b._endpoint) for b in boxes)
        return [(await b.info()).node for b in boxes]
    try:
        made.append(corral.Sandbox(image="host", memory_mb=64, node_selector={"role": "head"}))
        made += corral.Sandbox.create_many(4, image="host", memory_mb=64, spread=True,
                                           node_selector={"role": "head", "pool": "a"})
        assert {b.info().node for b in made} == {head}
        assert asyncio.run(run()) == [head] * 4
        assert made[0].exec("echo on-head").stdout == "on-head\n"
        with pytest.raises(CapacityExceeded) as e:
            corral.Sandbox(image="host", memory_mb=64, node_selector={"role": "nowhere"})
        assert "labels" in str(e.value)
        with pytest.raises(CapacityExceeded):
            corral.Sandbox.create_many(2, image="host", node_selector={"role": "nowhere"})
        # Sent as it is, the first would be read as two labels the head has, and placed.
        for bad in ({"role": "head,pool=a"}, {"a=b": "c"}):
            with pytest.raises(InvalidRequest):
                corral.Sandbox(image="host", node_selector=bad)
            with pytest.raises(InvalidRequest):
                corral.AsyncSandbox(image="host", node_selector=bad)
    finally:
        corral.Sandbox.kill_many(made, return_exceptions=True)


def test_creates_spread_over_nodes_and_calls_go_direct(cluster, gateway):
    # The earlier tests' sandboxes are gone from the reports (the gateway counts a sandbox it
    # placed until a report includes it: kills it does not see).
    assert wait_until(lambda: all(n["live"] == 0 and n["placed_since_report"] == 0
                                  for n in corral.cluster.status()["nodes"]))
    boxes = [corral.Sandbox(image="host", memory_mb=64, timeout=120) for _ in range(8)]
    try:
        per_node = Counter(b.info().node for b in boxes)
        assert set(per_node) == set(cluster["nodes"]), per_node
        assert max(per_node.values()) - min(per_node.values()) <= 2, \
            (per_node, corral.cluster.status()["nodes"])
        for i, b in enumerate(boxes):
            node = cluster["nodes"][b.info().node]
            # After placement the handle talks to its node, never to the gateway.
            assert b._endpoint.url == node["endpoint"] != gateway.url
            r = b.exec(f"echo hi-{i}; hostname")
            assert r.exit_code == 0 and r.stdout.startswith(f"hi-{i}\n")
            b.files.write("/tmp/x", f"data-{i}")
            assert b.files.read("/tmp/x") == f"data-{i}"
        # A handle pickled to another process keeps its node (and its node's token here).
        twin = pickle.loads(pickle.dumps(boxes[0]))
        assert twin._endpoint == boxes[0]._endpoint and twin._endpoint.node
        assert twin.exec("echo twin").stdout == "twin\n"
        # the load reports follow
        assert wait_until(lambda: sum(n["live"] for n in corral.cluster.status()["nodes"]) == 8)
    finally:
        for b in boxes:
            b.kill()


def test_async_sandbox_through_the_gateway(cluster, gateway):
    async def run() -> tuple[str | None, str]:
        async with corral.AsyncSandbox(image="host", memory_mb=64) as sb:
            r = await sb.exec("echo async")
            return (await sb.info()).node, r.stdout
    node, out = asyncio.run(run())
    assert node in cluster["nodes"] and out == "async\n"


def _live(node: str) -> int:
    return next(n["live"] + n["placed_since_report"]
                for n in corral.cluster.status()["nodes"] if n["node"] == node)


def test_a_batch_whose_answer_is_megabytes_crosses_the_gateway(cluster, gateway):
    """A node's batch answer is one line listing every sandbox's info, metadata included (up
    to 256 KiB a sandbox): far past aiohttp's line limit, it still reaches the client."""
    meta = {f"k{i}": "x" * 4096 for i in range(64)}
    boxes = corral.Sandbox.create_many(6, "host", memory_mb=64, timeout=120, metadata=meta)
    try:
        assert len(boxes) == 6 and len({b.info().node for b in boxes}) == 2
        assert all(b.info().metadata == meta for b in boxes)
    finally:
        corral.Sandbox.kill_many(boxes, return_exceptions=True)


def _gateway_pid() -> int:
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and (d / "cmdline").read_bytes().startswith(b"ray::Gateway"):
                return int(d.name)
        except OSError:
            continue
    raise AssertionError("no gateway process")


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(field)


def test_a_big_log_crosses_the_gateway_a_page_at_a_time(cluster, gateway):
    """A sandbox's log is as big as its commands' outputs made it (1 MiB each is kept): read
    through the gateway it is streamed from the node, never held whole (six reads at once of
    a 214 MB log took the gateway to 4 GB, every tenant's placements with it)."""
    url = os.environ["CORRAL_URL"]
    token = endpoint_mod._tokens[url]
    with corral.Sandbox("host", memory_mb=128, timeout=300) as sb:
        for _ in range(40):
            r = sb.exec("head -c 786432 /dev/urandom | base64 -w0", max_output_bytes=2 << 20)
            assert len(r.stdout) == 1 << 20
        pid = _gateway_pid()
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak from here on
        before = _status_kib(pid, "VmRSS")

        def read() -> int:
            req = urllib.request.Request(f"{url}/v1/sandboxes/{sb.id}/log")
            req.add_header("Authorization", f"Bearer {token}")
            n = 0
            with urllib.request.urlopen(req, timeout=120) as resp:
                assert resp.status == 200
                while chunk := resp.read(1 << 20):
                    n += len(chunk)
            return n

        with ThreadPoolExecutor(4) as ex:
            sizes = list(ex.map(lambda _: read(), range(4)))
        assert all(n > 40 << 20 for n in sizes), sizes
        grew = _status_kib(pid, "VmHWM") - before
        assert grew < 64 << 10, f"the gateway's peak grew {grew} KiB for 4 x {sizes[0]} bytes"


def test_create_many_splits_over_nodes_and_batches_go_to_each_node(cluster, gateway):
    assert wait_until(lambda: all(_live(n) == 0 for n in cluster["nodes"]), timeout=15)
    boxes = corral.Sandbox.create_many(10, "host", memory_mb=64, timeout=120)
    try:
        assert len(boxes) == 10
        per_node = Counter(b.info().node for b in boxes)
        assert set(per_node) == set(cluster["nodes"]), per_node
        for b in boxes:  # each handle talks to its own node, not to the gateway
            assert b._endpoint.url == cluster["nodes"][b._endpoint.node]["endpoint"]
        # One exec batch over handles of both nodes: a request per node, the results in the
        # order given (a sandbox's hostname is its id).
        order = boxes[::-1]
        res = corral.Sandbox.exec_many(order, "hostname")
        assert [r.stdout.strip() for r in res] == [b.id for b in order]
        assert wait_until(lambda: sum(_live(n) for n in cluster["nodes"]) == 10, timeout=15)
        # Plain ids go to the gateway, which asks every node: the same answers, in order.
        ids = [b.id for b in order] + ["sb-0000000000000000"]
        res = corral.Sandbox.exec_many(ids, "hostname", return_exceptions=True)
        assert [r.stdout.strip() for r in res[:-1]] == ids[:-1]
        assert isinstance(res[-1], SandboxNotFound)
        got = corral.Sandbox.kill_many(ids[:4] + ids[-1:], return_exceptions=True)
        assert got[:4] == [True] * 4 and isinstance(got[-1], SandboxNotFound)
        assert corral.Sandbox.kill_many(boxes, return_exceptions=True)[::-1][:4] == [False] * 4
        assert wait_until(lambda: sum(_live(n) for n in cluster["nodes"]) == 0, timeout=15)
    finally:
        corral.Sandbox.kill_many(boxes, return_exceptions=True)


def test_creates_from_a_snapshot_are_made_where_the_snapshot_is(cluster, gateway):
    """Through the gateway, a create (single or batch) from a snapshot lands on the node that
    holds it, whatever the load says; a snapshot no node has is snapshot_not_found; a name
    two nodes both use is refused rather than guessed."""
    assert wait_until(lambda: all(_live(n) == 0 for n in cluster["nodes"]), timeout=15)
    nodes = list(cluster["nodes"])
    parents = [corral.Sandbox(image="host", memory_mb=64, timeout=120) for _ in range(4)]
    kids: list = []
    snaps: list = []
    try:
        by_node = {p.info().node: p for p in parents}
        assert set(by_node) == set(nodes), "four creates spread over both nodes"
        for node, p in by_node.items():
            p.files.write("/work/state", f"from {node}\n")
            snaps.append(p.snapshot(name="same-name"))
        for snap, (node, _) in zip(snaps, by_node.items(), strict=True):
            made = [corral.Sandbox(snapshot=snap.id, memory_mb=64, timeout=120)
                    for _ in range(3)]
            made += corral.Sandbox.create_many(3, snapshot=snap.id, memory_mb=64, timeout=120)
            kids += made
            assert {k.info().node for k in made} == {node}
            assert {k.files.read("/work/state") for k in made} == {f"from {node}\n"}
        with pytest.raises(SnapshotNotFound):
            corral.Sandbox(snapshot="snap-0000000000000000", memory_mb=64)
        with pytest.raises(SnapshotNotFound):
            corral.Sandbox.create_many(2, snapshot="snap-0000000000000000", memory_mb=64)
        with pytest.raises(Conflict):  # one name on both nodes: two different snapshots
            corral.Sandbox(snapshot="same-name", memory_mb=64)
        # Through the gateway, a snapshot comes from its node, and its handle talks there.
        for snap, node in zip(snaps, by_node, strict=True):
            got = corral.Snapshot.get(snap.id)
            assert got.id == snap.id and got.info.node == node
            assert got._endpoint.url == cluster["nodes"][node]["endpoint"]
        with pytest.raises(SnapshotNotFound):
            corral.Snapshot.get("snap-0000000000000000")
    finally:
        corral.Sandbox.kill_many([*kids, *parents], return_exceptions=True)
        for snap in snaps:
            snap.delete()


def test_list_through_the_gateway_merges_every_node_and_pages(cluster, gateway):
    """The gateway asks every node: one list, in the nodes' order, paged with one cursor
    across nodes, each handle bound to its node."""
    from corral.sdk import api
    from corral.sdk.sync_transport import transport

    run = {"run": f"list-{os.getpid()}"}
    boxes = corral.Sandbox.create_many(7, "host", memory_mb=64, timeout=120, labels=run)
    try:
        assert len({b.info().node for b in boxes}) == 2
        listed = corral.Sandbox.list(labels=run)
        assert sorted(b.id for b in listed) == sorted(b.id for b in boxes)
        for b in listed:  # each handle talks to its node, not the gateway
            assert b._endpoint.url == cluster["nodes"][b.last_info.node]["endpoint"]
            assert b.exec("hostname").stdout.strip() == b.id
        ids: list[str] = []
        after = None
        while True:  # pages of 3 over two nodes: every sandbox once, in order
            items, after = transport(gateway).call(api.list_(run, after, limit=3))
            assert len(items) <= 3
            ids += [i.id for i in items]
            if not after:
                break
        order = {b.id: (b.last_info.created_at, b.id) for b in listed}
        assert ids == sorted(order, key=order.__getitem__), ids
    finally:
        corral.Sandbox.kill_many(boxes, return_exceptions=True)


def test_connect_by_id_through_the_gateway_finds_the_node(cluster, gateway):
    """Sandbox.connect(id) with the SDK pointed at the gateway: the gateway asks every node,
    the handle talks to the sandbox's node; an id no node has is sandbox_not_found."""
    boxes = corral.Sandbox.create_many(4, "host", memory_mb=64, timeout=120)
    try:
        assert len({b.info().node for b in boxes}) == 2
        for b in boxes:
            got = corral.Sandbox.connect(b.id)
            assert got.last_info.node == b.last_info.node
            assert got._endpoint.url == cluster["nodes"][b.last_info.node]["endpoint"]
            assert got.exec("hostname").stdout.strip() == b.id

        async def connect_async() -> str:
            sb = await corral.AsyncSandbox.connect(boxes[0].id)
            return (await sb.exec("hostname")).stdout.strip()

        assert asyncio.run(connect_async()) == boxes[0].id
        with pytest.raises(corral.SandboxNotFound):
            corral.Sandbox.connect("sb-" + "0" * 16)
    finally:
        corral.Sandbox.kill_many(boxes, return_exceptions=True)


def test_a_trainer_resumes_a_trajectory_through_the_gateway(cluster, gateway):
    """A trainer preempted mid-episode resumes with from_trajectory(tid) through the gateway:
    the gateway finds the node whose log has the trajectory, the handle talks to that node,
    positioned after the logged steps (a replayed call is answered from the log, not run
    again)."""
    tid = f"resume-{os.getpid()}"
    sb = corral.Sandbox(image="host", memory_mb=64, timeout=120, trajectory_id=tid)
    try:
        sb.exec("echo one >> /root/n")
        sb.exec("echo two >> /root/n")
        again = corral.Sandbox.from_trajectory(tid)
        assert again.id == sb.id and again.step == sb.step
        assert again._endpoint.url == cluster["nodes"][sb.last_info.node]["endpoint"]
        replay = corral.Sandbox.from_trajectory(tid, step=0)
        replay.exec("echo one >> /root/n")  # step 0 again: answered from the log
        assert again.exec("cat /root/n").stdout == "one\ntwo\n"
        with pytest.raises(corral.NotFound):
            corral.Sandbox.from_trajectory(f"no-such-{os.getpid()}")
    finally:
        sb.kill()


def test_a_retried_keyed_create_through_the_gateway_is_the_same_sandbox(cluster, gateway):
    """A create sent again with its key (its answer lost) goes to the node that took the
    first, which answers with the same sandbox: placement alone would put each retry on any
    node, a second sandbox for one trajectory."""
    made: list[corral.Sandbox] = []
    try:
        for i in range(6):
            tid = f"retry-{os.getpid()}-{i}"
            a = corral.Sandbox(image="host", memory_mb=64, timeout=120, trajectory_id=tid)
            b = corral.Sandbox(image="host", memory_mb=64, timeout=120, trajectory_id=tid)
            made += [a, b]
            assert a.id == b.id and a.last_info.node == b.last_info.node, (i, a.id, b.id)
        assert len({b.last_info.node for b in made}) == 2  # placement still spreads them
    finally:
        corral.Sandbox.kill_many(made, return_exceptions=True)


def test_demo_runs_through_the_cluster(cluster):
    """`corral demo --cluster ADDRESS`: the README's rollout workload through the gateway,
    from another process that joins the Ray cluster."""
    env = dict(os.environ)
    env.pop("CORRAL_URL", None)
    r = subprocess.run([sys.executable, "-m", "corral.cli", "demo", "--cluster",
                        cluster["ray"].address, "-n", "24", "-c", "8", "--json"],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout)
    assert summary["completed"] == 24 and summary["errors"] == 0, summary
    assert summary["infra_failures"] == 0 and summary["reward_matches_policy"] == 24, summary
    assert "through the cluster gateway" in r.stderr
    # It ran on the cluster's nodes and left nothing there.
    assert wait_until(lambda: sum(_live(n) for n in cluster["nodes"]) == 0, timeout=30)


def _node_call(gateway, cluster, node: str, method: str, path: str) -> tuple[int, dict]:
    req = urllib.request.Request(cluster["nodes"][node]["endpoint"] + path, method=method)
    req.add_header("Authorization", f"Bearer {endpoint_mod._tokens[gateway.url]}")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _fill(cluster, gateway, node: str) -> list:
    """Sandboxes made on ``node`` itself until it is full, and the gateway sees it so."""
    st = next(n for n in corral.cluster.status()["nodes"] if n["node"] == node)
    ep = gateway.on_node(cluster["nodes"][node]["endpoint"], node)
    fill = corral.Sandbox.create_many(st["capacity"] - _live(node), "host", endpoint=ep,
                                      memory_mb=64, timeout=120)
    assert wait_until(lambda: _live(node) >= st["capacity"], timeout=15)
    return fill


def _imports(gateway, cluster, node: str) -> int:
    """The snapshots ``node`` stored from another node's export (its /metrics)."""
    req = urllib.request.Request(cluster["nodes"][node]["endpoint"] + "/metrics")
    req.add_header("Authorization", f"Bearer {endpoint_mod._tokens[gateway.url]}")
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    return int(float(next(line.split()[1] for line in text.splitlines()
                          if line.startswith("corral_snapshots_imported_total "))))


def _layer_dirs(cluster, node: str) -> set[str]:
    return set(os.listdir(os.path.join(cluster["nodes"][node]["state_dir"], "layers")))


def test_a_full_holder_moves_the_snapshot_to_a_node_with_room(cluster, gateway):
    """The node that holds a snapshot is full: a create from it (single, several at once,
    and a batch) is made on the other node, to which the snapshot's layers were copied, and
    sees the snapshot's files; the copy keeps the snapshot's id."""
    assert wait_until(lambda: all(_live(n) == 0 for n in cluster["nodes"]), timeout=15)
    parent = corral.Sandbox(image="host", memory_mb=64, timeout=120)
    kids: list = []
    fill: list = []
    holder = parent.info().node
    other = next(n for n in cluster["nodes"] if n != holder)
    snap = None
    try:
        blob = os.urandom(1 << 20)
        parent.files.write("/work/blob", blob)
        parent.exec("echo moved > /work/state && rm -f /etc/hostname").check()
        snap = parent.snapshot(name=f"moving-{os.getpid()}")
        parent.kill()
        assert wait_until(lambda: _live(holder) == 0, timeout=15)
        fill = _fill(cluster, gateway, holder)
        imported = _imports(gateway, cluster, other)
        # Four creates at once wait for one copy.
        with ThreadPoolExecutor(4) as pool:
            kids += pool.map(lambda _: corral.Sandbox(snapshot=snap.name, memory_mb=64,
                                                      timeout=120), range(4))
        assert _imports(gateway, cluster, other) == imported + 1
        kids += corral.Sandbox.create_many(3, snapshot=snap.id, memory_mb=64, timeout=120)
        assert {k.info().node for k in kids} == {other}
        for k in kids:
            assert k.files.read("/work/state") == "moved\n"
            assert k.exec("test -e /etc/hostname").exit_code == 1
        assert kids[0].files.read_bytes("/work/blob") == blob
        code, got = _node_call(gateway, cluster, other, "GET", f"/v1/snapshots/{snap.id}")
        assert code == 200 and got["layers"] == snap.layers and got["name"] == snap.name
        assert set(snap.layers) <= _layer_dirs(cluster, other)
    finally:
        corral.Sandbox.kill_many([*kids, *fill, parent], return_exceptions=True)
        # The next tests place by load: they must see the nodes empty again.
        wait_until(lambda: all(_live(n) == 0 for n in cluster["nodes"]), timeout=15)
        if snap is not None:
            snap.delete()
            _node_call(gateway, cluster, other, "DELETE", f"/v1/snapshots/{snap.id}")


def test_a_failed_snapshot_copy_is_an_infra_error_and_leaves_nothing(cluster, gateway):
    """The snapshot stands on an image only its holder has: with the holder full, the copy
    to the other node fails (the target refuses the import): snapshot_copy_failed, an infra
    error naming the cause, and the target keeps no layer and no record of it."""
    assert wait_until(lambda: all(_live(n) == 0 for n in cluster["nodes"]), timeout=15)
    holder = cluster["head"]
    other = next(n for n in cluster["nodes"] if n != holder)
    name = f"only-here-{os.getpid()}"
    src = _image_dir()
    try:
        admin.import_image(name, src, endpoint=cluster["nodes"][holder]["socket"])
    finally:
        shutil.rmtree(src, ignore_errors=True)
    ep = gateway.on_node(cluster["nodes"][holder]["endpoint"], holder)
    parent = corral.Sandbox(image=name, endpoint=ep, memory_mb=64, timeout=120)
    fill: list = []
    snap = None
    try:
        parent.files.write("/tmp/x", "x")
        snap = parent.snapshot()
        parent.kill()
        assert wait_until(lambda: _live(holder) == 0, timeout=15)
        before = _layer_dirs(cluster, other)
        fill = _fill(cluster, gateway, holder)
        for create in (lambda: corral.Sandbox(snapshot=snap.id, memory_mb=64, timeout=120),
                       lambda: corral.Sandbox.create_many(2, snapshot=snap.id, memory_mb=64)):
            with pytest.raises(SnapshotCopyFailed) as err:
                create()
            assert err.value.infra and err.value.details["target"] == other
            assert err.value.details["cause"]["code"] == "image_not_found", err.value.details
        code, _ = _node_call(gateway, cluster, other, "GET", f"/v1/snapshots/{snap.id}")
        assert code == 404
        assert _layer_dirs(cluster, other) == before
        spares = os.path.join(cluster["nodes"][other]["state_dir"], "spares")
        assert not [p for p in os.listdir(spares) if p.startswith("imp-")]
    finally:
        corral.Sandbox.kill_many([*fill, parent], return_exceptions=True)
        wait_until(lambda: all(_live(n) == 0 for n in cluster["nodes"]), timeout=15)
        if snap is not None:
            snap.delete()


def test_a_spread_fork_group_lands_on_every_node_with_the_parents_files(cluster, gateway):
    """A fork group from a snapshot asked to spread (``create_many(..., spread=True)``):
    its children land on both nodes, the snapshot's layers copied once to the node that
    lacked it, and every child sees the parent's files. Without spread the same group stays
    on the holder, which has room (copying would cost more than it buys)."""
    assert wait_until(lambda: all(_live(n) == 0 for n in cluster["nodes"]), timeout=15)
    parent = corral.Sandbox(image="host", memory_mb=64, timeout=120)
    holder = parent.info().node
    other = next(n for n in cluster["nodes"] if n != holder)
    kids: list = []
    snap = None
    try:
        blob = os.urandom(256 << 10)
        parent.files.write("/work/blob", blob)
        parent.exec("echo forked > /work/state").check()
        snap = parent.snapshot()
        kids = corral.Sandbox.create_many(4, snapshot=snap.id, memory_mb=64, timeout=120)
        assert {k.info().node for k in kids} == {holder}
        imported = _imports(gateway, cluster, other)
        group = corral.Sandbox.create_many(6, snapshot=snap.id, memory_mb=64, timeout=120,
                                           spread=True)
        kids += group
        per_node = Counter(k.info().node for k in group)
        assert per_node == {holder: 3, other: 3}, per_node
        assert _imports(gateway, cluster, other) == imported + 1
        for k in group:
            assert k._endpoint.url == cluster["nodes"][k._endpoint.node]["endpoint"]
            assert k.files.read("/work/state") == "forked\n"
            assert k.files.read_bytes("/work/blob") == blob
        # A bad flag is refused before anything is made.
        code, lines = _batch(gateway.url, endpoint_mod._tokens[gateway.url],
                             {"count": 2, "spec": {"snapshot": snap.id}},
                             "spread=maybe")
        assert code == 400 and lines[-1]["error"]["code"] == "invalid_request", lines
    finally:
        corral.Sandbox.kill_many([*kids, parent], return_exceptions=True)
        wait_until(lambda: all(_live(n) == 0 for n in cluster["nodes"]), timeout=15)
        if snap is not None:
            snap.delete()
            _node_call(gateway, cluster, other, "DELETE", f"/v1/snapshots/{snap.id}")


def _snapshots_on(gateway, cluster, node: str) -> list[str]:
    code, body = _node_call(gateway, cluster, node, "GET", "/v1/snapshots")
    assert code == 200, body
    return [s["id"] for s in body["snapshots"]]


def test_sb_fork_spread_places_the_children_over_the_nodes_in_one_call(cluster, gateway):
    """``sb.fork(n, spread=True)`` on a sandbox the gateway placed: one call; the children
    land on both nodes with the parent's files and spec (env, cwd, labels), each handle on its
    node; the snapshot is on no node afterwards (not kept). Keyed by a trajectory, the fork
    sent again (a restarted client) returns the same children, each child its trajectory.
    A fork the cluster has no room for leaves nothing."""
    assert wait_until(lambda: all(_live(n) == 0 for n in cluster["nodes"]), timeout=15)
    head = cluster["head"]
    other = next(n for n in cluster["nodes"] if n != head)
    before = {n: set(_snapshots_on(gateway, cluster, n)) for n in cluster["nodes"]}
    made: list = []
    try:
        parent = corral.Sandbox(image="host", memory_mb=64, timeout=120, cwd="/tmp",
                                env={"ROLL": "out-7"}, labels={"group": "g1"},
                                node_selector={"role": "head"})
        made.append(parent)
        parent.files.write("/tmp/state.txt", b"step 3\n")
        kids = parent.fork(4, spread=True)
        made += kids
        assert Counter(k.info().node for k in kids) == {head: 2, other: 2}
        for k in kids:
            assert k._endpoint.url == cluster["nodes"][k.info().node]["endpoint"]
            assert k.exec("cat state.txt; echo $ROLL; pwd").stdout == "step 3\nout-7\n/tmp\n"
            assert k.info().labels == {"group": "g1"}
        for n in cluster["nodes"]:  # dropped where it was taken and where it was copied
            assert set(_snapshots_on(gateway, cluster, n)) == before[n]

        ep = corral.Sandbox(image="host", memory_mb=64, timeout=120, trajectory_id="fk-ep",
                            node_selector={"role": "head"})
        made.append(ep)
        ep.files.write("/tmp/ep.txt", b"episode\n")  # step 0
        group = ep.fork(3, spread=True, keep_snapshot=True, name="fk-ep-snap")  # step 1
        made += group
        assert len({k.info().node for k in group}) == 2
        assert [k._traj for k in group] == [f"fk-ep/fork1/{i}" for i in range(3)]
        again = corral.Sandbox.from_trajectory("fk-ep", step=1).fork(
            3, spread=True, keep_snapshot=True, name="fk-ep-snap")
        assert [k.id for k in again] == [k.id for k in group]
        for i, k in enumerate(group):
            assert corral.Sandbox.from_trajectory(f"fk-ep/fork1/{i}").id == k.id
            assert k.files.read("/tmp/ep.txt") == "episode\n"
        kept = corral.Snapshot.get("fk-ep-snap")  # on the parent's node, and copied
        assert kept.sandbox_id == ep.id and kept.id in _snapshots_on(gateway, cluster, head)

        with pytest.raises(CapacityExceeded):
            parent.fork(500, spread=True, name="fk-too-many")
        with pytest.raises(SnapshotNotFound):
            corral.Snapshot.get("fk-too-many")
    finally:
        corral.Sandbox.kill_many(made, return_exceptions=True)
        with contextlib.suppress(SnapshotNotFound):
            corral.Snapshot.get("fk-ep-snap").delete()
        for n in cluster["nodes"]:
            for sid in set(_snapshots_on(gateway, cluster, n)) - before[n]:
                _node_call(gateway, cluster, n, "DELETE", f"/v1/snapshots/{sid}")
        wait_until(lambda: all(_live(n) == 0 for n in cluster["nodes"]), timeout=15)


def test_a_create_from_a_snapshot_asks_only_the_nodes_that_report_it(cluster, gateway):
    """The nodes' load reports list their snapshots: a create from a snapshot id asks its
    reported holder only, so a node that does not answer (its corrald frozen) costs it
    nothing, where asking every node waited for that node's time-out."""
    assert wait_until(lambda: all(_live(n) == 0 for n in cluster["nodes"]), timeout=15)
    gw = ray.get_actor("gateway", namespace=corral.cluster.NAMESPACE)
    parent = corral.Sandbox(image="host", memory_mb=64, timeout=120)
    holder = parent.info().node
    other = next(n for n in cluster["nodes"] if n != holder)
    pid = _corrald_pid(cluster, other)
    kid = snap = None
    try:
        parent.files.write("/work/state", "reported\n")
        snap = parent.snapshot()
        assert wait_until(lambda: ray.get(gw.reported_holders.remote(snap.id)) == [holder],
                          timeout=10)
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        kid = corral.Sandbox(snapshot=snap.id, memory_mb=64, timeout=120)
        took = time.monotonic() - t0
        print(f"create from a reported snapshot, another node frozen: {took:.2f} s")
        assert took < 3.0, took  # asking every node waits 5 s for the frozen one
        assert kid.info().node == holder
        assert kid.files.read("/work/state") == "reported\n"
    finally:
        os.kill(pid, signal.SIGCONT)
        corral.Sandbox.kill_many([x for x in (kid, parent) if x is not None],
                                 return_exceptions=True)
        if snap is not None:
            snap.delete()
        # The next tests place by load: the thawed node reports again.
        wait_until(lambda: all(n["report_age_s"] < 1 for n in corral.cluster.status()["nodes"]),
                   timeout=20)
    # A deleted snapshot leaves the reports.
    assert wait_until(lambda: ray.get(gw.reported_holders.remote(snap.id)) == [], timeout=10)


def _batch(url: str, token: str | None, body: dict, query: str = "stream=ndjson",
           selector: str = "") -> tuple[int, list[dict]]:
    req = urllib.request.Request(f"{url}/v1/sandboxes/batch?{query}", method="POST",
                                 data=json.dumps(body).encode())
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    req.add_header("Content-Type", "application/json")
    if selector:
        req.add_header("X-Corral-Node-Selector", selector)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, [json.loads(x) for x in r.read().splitlines() if x.strip()]
    except urllib.error.HTTPError as e:
        return e.code, [json.loads(e.read())]


def test_batch_create_streams_progress_from_every_node(cluster, gateway):
    token = endpoint_mod._tokens[gateway.url]
    code, lines = _batch(gateway.url, token, {"count": 6, "spec": {"image": "host",
                                                                   "memory_mb": 64}})
    assert code == 201, lines
    *progress, last = lines
    infos = last["sandboxes"]
    try:
        assert progress and all(set(p) == {"progress"} for p in progress)
        dones = [p["progress"]["done"] for p in progress]
        assert dones == sorted(dones) and dones[-1] == 6
        assert all(p["progress"]["count"] == 6 for p in progress)
        assert len(infos) == 6 and {i["node"] for i in infos} == set(cluster["nodes"])
        for i in infos:
            assert i["endpoint"] == cluster["nodes"][i["node"]]["endpoint"]
    finally:
        for i in infos:
            corral.Sandbox.from_id(i["id"], endpoint=gateway.on_node(i["endpoint"],
                                                                     i["node"])).kill()
    # Bad batches are refused before anything is made, with the daemon's codes.
    for body, query, want in (({"count": 0}, "", "invalid_request"),
                              ({"count": 2, "spec": {"image": 5}}, "", "invalid_request"),
                              ({"count": 2}, "partial=maybe", "invalid_request"),
                              ({"count": 2}, "stream=json", "invalid_request"),
                              ({"count": 500}, "", "capacity_exceeded")):
        code, lines = _batch(gateway.url, token, body, query)
        assert lines[-1]["error"]["code"] == want, (body, query, lines)
    code, lines = _batch(gateway.url, None, {"count": 1})
    assert code == 401 and lines[0]["error"]["code"] == "unauthorized"
    code, lines = _batch(gateway.url, token, {"count": 1}, selector="role=nowhere")
    assert code == 429 and lines[0]["error"]["code"] == "capacity_exceeded"
    assert wait_until(lambda: sum(_live(n) for n in cluster["nodes"]) == 0, timeout=15)


def test_client_leaving_a_batch_create_leaves_no_sandbox(cluster, gateway):
    """A client that drops its streamed batch create half-way (one node's share made, the
    other's held up by a frozen corrald): the gateway destroys the share made and cancels the
    other, whose node destroys what it made once it sees its client gone."""
    import http.client
    from urllib.parse import urlsplit

    assert wait_until(lambda: sum(_live(n) for n in cluster["nodes"]) == 0, timeout=15)
    worker = next(n for n in cluster["nodes"] if n != cluster["head"])
    pid = _corrald_pid(cluster, worker)
    token = endpoint_mod._tokens[gateway.url]
    u = urlsplit(gateway.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    os.kill(pid, signal.SIGSTOP)
    try:
        conn.request("POST", "/v1/sandboxes/batch?stream=ndjson",
                     body=json.dumps({"count": 10, "spec": {"image": "host",
                                                            "memory_mb": 64}}),
                     headers={"Authorization": f"Bearer {token}",
                              "Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 201
        while True:  # the head's share is made
            line = json.loads(resp.readline())
            assert line["progress"]["count"] == 10 and "sandboxes" not in line, line
            if line["progress"]["done"] >= 1:
                break
        conn.sock.close()  # the client leaves
        conn.close()
    finally:
        os.kill(pid, signal.SIGCONT)

    def listed() -> int:
        return sum(len(corral.Sandbox.list(endpoint=gateway.on_node(d["endpoint"], n)))
                   for n, d in cluster["nodes"].items())
    # inflight counts until every share has ended: then nothing more is made anywhere.
    assert wait_until(lambda: sum(_live(n) for n in cluster["nodes"]) == 0, timeout=60), \
        (corral.cluster.status()["nodes"], listed())
    assert wait_until(lambda: listed() == 0, timeout=30)


def _image_dir() -> str:
    """A rootfs with busybox as its shell and a file that says where it came from."""
    d = tempfile.mkdtemp(prefix="corral-img-", dir="/var/tmp")
    for sub in ("bin", "etc", "tmp"):
        os.makedirs(os.path.join(d, sub))
    shutil.copy(shutil.which("busybox") or "/bin/busybox", os.path.join(d, "bin", "busybox"))
    os.symlink("busybox", os.path.join(d, "bin", "sh"))
    os.symlink("busybox", os.path.join(d, "bin", "cat"))
    Path(d, "etc", "where").write_text("the image\n")
    return d


def test_placement_prefers_the_node_that_has_the_image(cluster, gateway):
    """Two nodes, one of which has the image: every create of it goes there while that node
    is not much fuller; a create of another image goes by load alone."""
    node = next(n for n in cluster["nodes"] if n != cluster["head"])
    name = f"local-{os.getpid()}"
    src = _image_dir()
    try:
        admin.import_image(name, src, endpoint=cluster["nodes"][node]["socket"])
    finally:
        shutil.rmtree(src, ignore_errors=True)

    def seen() -> bool:
        by = {n["node"]: n["images"] for n in corral.cluster.status()["nodes"]}
        return name in by[node] and name not in by[cluster["head"]] and "host" in by[node]
    assert wait_until(seen, timeout=15)
    st = corral.cluster.status()
    assert all(0.0 <= n["cpu_busy"] <= 1.0 for n in st["nodes"])
    boxes = []
    try:
        for _ in range(4):
            boxes.append(corral.Sandbox(image=name, memory_mb=64, timeout=120))
        boxes += corral.Sandbox.create_many(4, name, memory_mb=64, timeout=120)
        assert {b.info().node for b in boxes} == {node}
        assert boxes[0].exec("cat /etc/where").stdout == "the image\n"
    finally:
        corral.Sandbox.kill_many(boxes, return_exceptions=True)


def _add_node(cluster, labels: dict[str, str]) -> tuple[Any, str]:
    """A raylet more, with corral started on it: (the raylet, its node id)."""
    raylet = cluster["ray"].add_node(**NODE_ARGS)
    cluster["ray"].wait_for_nodes()
    corral.cluster.start(name=cluster["name"], state_root=cluster["root"],
                         run_dir=cluster["run_dir"], max_sandboxes=64,
                         labels={raylet.node_id: labels})
    return raylet, raylet.node_id


def _corrald_pid(cluster, node: str) -> int:
    return int(ray.get(corral.cluster.supervisors()[node].report.remote())["pid"])


def test_node_lost_mid_batch_answers_per_item_not_a_hang(cluster, gateway):
    """A batch create split over two nodes, one of which stops answering (its corrald frozen)
    and then is lost (its supervisor killed). All or nothing: the batch fails with an infra
    error after the silence limit and the other node's share is destroyed. Partial: the lost
    node's items answer sandbox_lost as soon as the gateway sees the loss, the others live."""
    c = cluster["ray"]
    raylet, nid = _add_node(cluster, {"role": "frozen", "pool": "a"})
    d = ray.get(corral.cluster.supervisors()[nid].describe.remote())
    pid = _corrald_pid(cluster, nid)
    head = cluster["head"]
    token = endpoint_mod._tokens[gateway.url]
    before = _live(head)
    made: list = []
    try:
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        code, lines = _batch(gateway.url, token, {"count": 8, "spec": {"image": "host",
                                                                       "memory_mb": 64}},
                             selector="pool=a")
        took = time.monotonic() - t0
        assert code == 201 and "error" in lines[-1], lines[-1]
        err = lines[-1]["error"]
        assert err["code"] == "sandbox_lost" and err["infra"] and err["details"]["node"] == nid
        assert took < 15, took
        print(f"frozen node: all-or-nothing batch failed after {took:.2f} s")
        # The head's share was destroyed (all or nothing).
        assert wait_until(lambda: _live(head) == before, timeout=15)

        # The frozen node is out of placement now (its reports stopped); bring it back.
        os.kill(pid, signal.SIGCONT)
        assert wait_until(lambda: any(n["node"] == nid and n["report_age_s"] < 1
                                      for n in corral.cluster.status()["nodes"]), timeout=20)
        os.kill(pid, signal.SIGSTOP)
        out: dict = {}

        def call() -> None:
            out["answer"] = _batch(gateway.url, token, {"count": 8, "spec": {
                "image": "host", "memory_mb": 64}}, "stream=ndjson&partial=true", "pool=a")
        th = threading.Thread(target=call)
        th.start()
        assert wait_until(lambda: _live(head) > before, timeout=20)  # the batch is under way
        t_kill = time.monotonic()
        ray.kill(corral.cluster.supervisors()[nid], no_restart=True)
        th.join(30)
        assert not th.is_alive(), "the batch hangs"
        answered = time.monotonic() - t_kill
        print(f"node lost mid-batch: answered {answered:.2f} s after the kill")
        assert answered < 5
        code, lines = out["answer"]
        items = lines[-1]["sandboxes"]
        made = [corral.Sandbox.from_id(i["id"], endpoint=gateway.on_node(i["endpoint"],
                                                                         i["node"]))
                for i in items if "error" not in i]
        lost = [error_from_payload(i) for i in items if "error" in i]
        assert made and lost and len(made) + len(lost) == 8
        for e in lost:
            assert isinstance(e, SandboxLost) and e.infra and e.details["node"] == nid
        for b in made:
            assert b.info().node == head and b.exec("echo ok").stdout == "ok\n"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)  # so that it can stop and clean up
        corral.Sandbox.kill_many(made, return_exceptions=True)
    assert wait_until(lambda: not _alive(d["keeper_pid"]), timeout=60)
    assert not leaked_sandbox_cgroups(d["cgroup"]) and not pids_in_cgroups(d["cgroup"])
    assert not host_mounts_under(d["state_dir"]), \
        Path(d["state_dir"], "corrald.log").read_text()[-4000:]
    c.remove_node(raylet)  # else a later start() adopts it again (its raylet still lives)


def _lost_within(boxes: list, seconds: float) -> bool:
    def all_lost() -> bool:
        for b in boxes:
            try:
                b.exec("true", timeout=2)
                return False
            except SandboxLost as e:
                assert e.infra
        return True
    return wait_until(all_lost, timeout=seconds, interval=0.05)


def test_raylet_death_takes_the_nodes_corrald_and_sandboxes(cluster, gateway):
    """A node whose raylet dies abruptly (as when its machine goes): the supervisor's worker
    dies with it, the keeper's pipe closes, corrald destroys the node's sandboxes."""
    c = cluster["ray"]
    raylet, nid = _add_node(cluster, {"role": "doomed"})
    sup = corral.cluster.supervisors()[nid]
    d = ray.get(sup.describe.remote())
    token = endpoint_mod._tokens[gateway.url]
    boxes, pids = [], []
    for _ in range(3):
        code, info = _create(gateway.url, token, "role=doomed")
        assert code == 201 and info["node"] == nid, info
        boxes.append(corral.Sandbox.from_id(
            info["id"], endpoint=gateway.on_node(info["endpoint"], info["node"])))
        pids.append(info["init_pid"])
    assert boxes[0].exec("echo up").stdout == "up\n"
    t0 = time.monotonic()
    c.remove_node(raylet, allow_graceful=False)
    assert _lost_within(boxes, 5.0), "not lost within 5 s"
    print(f"raylet killed: sandboxes lost after {time.monotonic() - t0:.2f} s")
    assert wait_until(lambda: not _alive(d["keeper_pid"]), timeout=60)
    assert not any(_alive(p) for p in pids)
    assert not leaked_sandbox_cgroups(d["cgroup"]) and not pids_in_cgroups(d["cgroup"])
    assert not host_mounts_under(d["state_dir"])
    assert wait_until(lambda: nid in corral.cluster.status()["lost"], timeout=10)


@ray.remote(num_cpus=1)
def _rollout(i: int) -> tuple[str | None, str]:
    """A Ray task, as a trainer's rollout worker: connect() finds the gateway through Ray."""
    import corral
    import corral.cluster

    corral.cluster.connect()
    with corral.Sandbox(image="host", memory_mb=64) as sb:
        return sb.info().node, sb.exec(f"echo task-{i}").stdout


def test_ray_tasks_use_the_cluster_with_connect(cluster):
    got = ray.get([_rollout.remote(i) for i in range(4)], timeout=120)
    assert [out for _, out in got] == [f"task-{i}\n" for i in range(4)]
    assert {node for node, _ in got} <= set(cluster["nodes"])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def test_node_loss_sandboxes_lost_and_cleaned(cluster, gateway):
    """Kill one node's supervisor (as when its raylet or machine dies): its sandboxes answer
    sandbox_lost within 5 s, its corrald removes every one of them (no process, cgroup or mount
    left), and the other node's sandboxes are untouched. Runs last: the cluster loses a node."""
    boxes = [corral.Sandbox(image="host", memory_mb=64, timeout=120) for _ in range(6)]
    try:
        by_node: dict[str, list[corral.Sandbox]] = {}
        for b in boxes:
            by_node.setdefault(b.info().node or "", []).append(b)
        assert len(by_node) == 2, by_node
        victim, survivor = sorted(by_node, key=lambda n: n == ray.get_runtime_context()
                                  .get_node_id())  # kill the worker node, not the head
        vd = cluster["nodes"][victim]
        lost = by_node[victim]
        pids = [b.info().init_pid for b in lost]
        assert all(p and _alive(p) for p in pids)
        for b in lost:  # a long command in flight when the node goes
            b.exec("sleep 300", background=True)
        t0 = time.monotonic()
        ray.kill(cluster["supervisors"][victim], no_restart=True)

        assert _lost_within(lost, 5.0), "not lost within 5 s"
        print(f"supervisor killed: sandboxes lost after {time.monotonic() - t0:.2f} s")
        # A batch over handles of both nodes: per-item sandbox_lost for the lost node's, the
        # survivor's run.
        res = corral.Sandbox.exec_many(boxes, "echo batch", return_exceptions=True)
        for b, r in zip(boxes, res, strict=True):
            if b in lost:
                assert isinstance(r, SandboxLost) and r.infra, r
            else:
                assert r.stdout == "batch\n", r
        # Cleaned up on the host: init processes, cgroups, mounts, the daemon itself.
        assert wait_until(lambda: not any(_alive(p) for p in pids if p), timeout=30)
        assert wait_until(lambda: not _alive(vd["keeper_pid"]), timeout=60)
        assert not leaked_sandbox_cgroups(vd["cgroup"])
        assert not pids_in_cgroups(vd["cgroup"])
        assert not host_mounts_under(vd["state_dir"])
        assert not Path(vd["socket"]).exists()
        # The survivor is untouched, and new sandboxes go there only.
        for b in by_node[survivor]:
            assert b.exec("echo still").stdout == "still\n"
        assert wait_until(lambda: victim in corral.cluster.status()["lost"], timeout=10)
        with corral.Sandbox(image="host", memory_mb=64) as sb:
            assert sb.info().node == survivor
    finally:
        for b in boxes:
            try:
                b.kill()
            except SandboxLost:
                pass


def test_a_ship_call_is_bounded_whatever_its_node_holds_open(tmp_path):
    """Every shipping call (each node, every 0.5 s) names the rows the gateway's copy holds
    open (calls in flight) and a slice of the open sandboxes: a tenant's long calls with
    megabyte requests, in sandboxes with megabyte environments, must not make each call carry
    them all again, in the supervisor's memory and the gateway's. A row still started is not
    sent again, every part of an answer stops at the call's bytes, and the copy still ends
    equal to the node's log (no Ray needed: the supervisor's reader and the gateway's copy)."""
    import sqlite3

    from corral.cluster.trajship import LogCopies
    from corral.cluster.trajsource import ENTRY_COLS, LogSource
    from corral.daemon.trajlog import _SCHEMA, DB_NAME

    big, budget, n = "x" * (1 << 20), 4 << 20, 32
    node = tmp_path / "node"
    node.mkdir()
    db = sqlite3.connect(node / DB_NAME, isolation_level=None)
    db.executescript(_SCHEMA)
    db.executemany("INSERT INTO sandboxes (sandbox_id, spec, created_at) VALUES (?, ?, 1)",
                   [(f"sb-{i}", json.dumps({"env": {"E": big}})) for i in range(n)])
    db.executemany(f"INSERT INTO entries ({ENTRY_COLS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                   [(i + 1, f"sb-{i}", "exec", None, None, json.dumps({"stdin": big}), None,
                     None, 1.0, 1.0, None, "started") for i in range(n)])
    src, copies = LogSource(str(node)), LogCopies(str(tmp_path / "gateway"))

    def ship() -> dict[str, Any]:
        """One call, as the gateway makes it; its answer's bytes within three budgets (new
        rows, rows that ended, open sandboxes), each overshot by one row at most."""
        cur = copies.cursor("n1")
        got = src.since(cur["after"], cur["recheck"], cur["sandboxes"], budget)
        size = sum(len(v) for r in got["entries"] + got["sandboxes"] for v in r
                   if isinstance(v, str))
        assert size <= 3 * (budget + (2 << 20)) + 4096, size
        copies.apply("n1", cur["after"], got)
        return got

    def rows(conn: sqlite3.Connection) -> list[tuple[Any, ...]]:
        return conn.execute(f"SELECT {ENTRY_COLS} FROM entries ORDER BY seq").fetchall()

    try:
        for _ in range(n):  # the backlog: a few rows a call
            if not ship()["more"]:
                break
        copy = sqlite3.connect(os.path.join(copies.dir_of("n1"), DB_NAME))
        assert rows(copy) == rows(db)
        assert ship()["entries"] == []  # the open rows have not changed: not sent again
        db.execute("UPDATE entries SET status=NULL, result=?", (json.dumps({"out": big}),))
        for _ in range(n):  # every call ended: a few rows a call again
            if not ship()["more"]:
                break
        assert rows(copy) == rows(db)
        copy.close()
    finally:
        copies.close()
        src.close()
        db.close()
