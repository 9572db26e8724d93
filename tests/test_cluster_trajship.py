"""A lost node's trajectory log survives it: every node's log is shipped to the gateway as it
is written (corral.cluster.trajship), so an episode of a node killed afterwards is read
(``corral log``) and replayed on a surviving node (``corral replay``) through the gateway.
Attacked on a real Ray cluster (two raylets on loopback): the node's supervisor killed, the
gateway itself killed and started again while the nodes keep logging."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

# Set before Ray is imported (tests/raycluster.py says why).
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import ray  # noqa: E402
from raycluster import corral_on_ray, role_labels  # noqa: E402

import corral  # noqa: E402
import corral.cluster  # noqa: E402
from corral.errors import SandboxLost  # noqa: E402
from corral.sdk import api  # noqa: E402
from corral.sdk import endpoint as endpoint_mod  # noqa: E402
from corral.sdk.replay import replay  # noqa: E402

from conftest import wait_until  # noqa: E402

ENTRY = ("seq, sandbox_id, op, idem_key, fingerprint, request, result, error, started_at, "
         "ended_at, snapshot_ids, status")


TOKENS = {"alice": "alice-token-0123456789", "bob": "bob-token-0123456789"}


@pytest.fixture(scope="module")
def cluster():
    tokdir = tempfile.mkdtemp(prefix="corral-trajship-tokens-", dir="/var/tmp")
    path = os.path.join(tokdir, "tokens.json")
    with open(path, "w") as f:
        json.dump(TOKENS, f)
    os.chmod(path, 0o600)

    try:
        with corral_on_ray(1, max_sandboxes=32, tokens_file=path, labels=role_labels) as c:
            corral.cluster.connect()
            yield c
    finally:
        shutil.rmtree(tokdir, ignore_errors=True)


def _http(method: str, url: str, token: str, body: dict | None = None,
          headers: dict[str, str] | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(url, method=method,
                                 data=None if body is None else json.dumps(body).encode())
    req.add_header("Authorization", f"Bearer {token}")
    req.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _rows(path: str, sql: str) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


def _node_db(cluster: dict, node: str) -> str:
    return os.path.join(cluster["nodes"][node]["state_dir"], "trajlog.db")


def _copy_db(cluster: dict, node: str) -> str:
    return os.path.join(cluster["root"], f"{cluster['name']}-gateway", "nodes", node,
                        "trajlog.db")


def _on(role: str, trajectory_id: str) -> corral.Sandbox:
    return corral.Sandbox(image="host", memory_mb=64, timeout=300, trajectory_id=trajectory_id,
                          node_selector={"role": role})


def _episode(sb: corral.Sandbox, tag: str) -> list[Any]:
    """An agent's steps: writes, commands (one failing), reads, a listing."""
    got: list[Any] = []
    sb.files.write("/tmp/task.txt", f"task {tag}\n".encode())
    got.append(sb.exec("mkdir -p /tmp/w && cd /tmp/w && printf 'x = %s\\n' 41 > v.py "
                       "&& cat v.py").stdout)
    got.append(sb.exec("echo $((6 * 7)); echo err >&2").stdout)
    got.append(sb.files.read("/tmp/task.txt"))
    got.append(sb.exec("sh -c 'exit 3'").exit_code)
    got.append(sb.exec("wc -c < /tmp/task.txt; sha256sum /tmp/w/v.py").stdout)
    got.append(sorted(e.name for e in sb.files.list("/tmp")))
    return got


def _shipped(cluster: dict, node: str) -> bool:
    """The gateway's copy of ``node``'s log holds every row the node's own log has."""
    if not Path(_copy_db(cluster, node)).exists():
        return False
    q = f"SELECT {ENTRY} FROM entries ORDER BY seq"
    try:
        ours = _rows(_node_db(cluster, node), q)
        # Empty on both sides is not shipped: the node may not have ingested its calls yet.
        return bool(ours) and ours == _rows(_copy_db(cluster, node), q)
    except sqlite3.OperationalError:  # the copy is being made (no tables yet)
        return False


def _worker(cluster: dict) -> str:
    return next(n for n in cluster["nodes"] if n != cluster["head"])


def test_shipping_resumes_after_a_gateway_restart_without_duplicates_or_gaps(cluster):
    """The gateway is killed while a node keeps logging; started again, it takes the running
    nodes over and ships from where its copy stands: the copy ends equal to the node's log
    row for row, and the new gateway received exactly the rows past its copy once."""
    node = _worker(cluster)
    sb = _on("worker", trajectory_id="restart-ep")
    assert sb.info().node == node
    try:
        _episode(sb, "a")
        assert wait_until(lambda: _shipped(cluster, node), timeout=20)
        before = _rows(_copy_db(cluster, node), "SELECT max(seq) FROM entries")[0][0]

        gw = ray.get_actor("gateway", namespace="corral")
        ray.kill(gw, no_restart=True)

        def gone() -> bool:
            try:
                ray.get_actor("gateway", namespace="corral")
                return False
            except ValueError:
                return True
        assert wait_until(gone, timeout=30)
        # The node lives on without its gateway: the episode goes on, straight to the node.
        _episode(sb, "b")
        more = [sb.exec(f"echo step-{i}").stdout for i in range(20)]
        assert more == [f"step-{i}\n" for i in range(20)]
        # The node's ingester (a niced thread) moves its journal into the database a little
        # behind the calls: on a loaded machine, up to seconds behind.
        last = sb.log()[-1].seq

        def node_top() -> int:
            return _rows(_node_db(cluster, node), "SELECT max(seq) FROM entries")[0][0]
        assert wait_until(lambda: node_top() >= last, timeout=30)
        top = node_top()
        assert top > before and not _shipped(cluster, node)

        corral.cluster.start(name="someone-else", state_root=cluster["root"],
                             run_dir=cluster["run_dir"])
        corral.cluster.connect()
        st = corral.cluster.status()
        assert {n["node"] for n in st["nodes"]} == set(cluster["nodes"])  # taken over
        assert st["cluster"] == cluster["name"]
        assert sb.exec("echo still").stdout == "still\n"  # its sandboxes untouched
        assert wait_until(lambda: _shipped(cluster, node), timeout=20)
        # No gap: row for row equal (above). No duplicate: every row past the copy's cursor
        # came once; the only rows sent again are started rows the copy held open.
        new = _rows(_node_db(cluster, node), f"SELECT count(*) FROM entries WHERE seq > "
                                             f"{before}")[0][0]
        stats = corral.cluster.status()["trajlog"][node]
        print(f"after the restart: {stats}, {new} rows past the cursor {before}")
        assert stats["rows"] == new and stats["seq"] >= top, (stats, new)
        assert stats["again"] <= stats["calls"] * 2, stats
        # The sandboxes' rows too.
        q = "SELECT sandbox_id, spec, created_at FROM sandboxes ORDER BY sandbox_id"
        assert _rows(_node_db(cluster, node), q) == _rows(_copy_db(cluster, node), q)
    finally:
        sb.kill()
        _gateway_up(cluster)  # whatever failed above, the next test has its gateway


def _gateway_up(cluster: dict) -> None:
    try:
        ray.get_actor("gateway", namespace="corral")
    except ValueError:
        corral.cluster.start(name=cluster["name"], state_root=cluster["root"],
                             run_dir=cluster["run_dir"])
        corral.cluster.connect()


@ray.remote(num_cpus=0)
def _tenant_job(token: str, other: str | None) -> dict[str, Any]:
    """A tenant's Ray job: connects with its own token, makes a sandbox on the worker node
    and runs a command in it, then looks for ``other`` (another tenant's sandbox)."""
    corral.cluster.connect(token=token)
    got: dict[str, Any] = {}
    sb = corral.Sandbox(image="host", memory_mb=64, timeout=300,
                        node_selector={"role": "worker"})
    got["id"], got["node"] = sb.id, sb.info().node
    got["out"] = sb.exec("echo mine").stdout
    got["listed"] = sorted(b.id for b in corral.Sandbox.list())
    if other is not None:
        try:
            corral.Sandbox.connect(other).exec("echo theirs")
            got["reached"] = True
        except corral.errors.NotFound as e:
            got["reached"] = e.code
    return got


def test_a_tenants_ray_job_connects_with_its_token_and_reaches_only_its_own(cluster):
    """``connect(token=...)`` in a Ray job: the job acts as its tenant at the gateway and
    at the node its handle talks to; another tenant's job neither lists nor reaches its
    sandbox; a bare ``connect()`` is the admin's and sees both."""
    worker = _worker(cluster)
    alice = ray.get(_tenant_job.remote(TOKENS["alice"], None), timeout=180)
    try:
        assert alice["node"] == worker and alice["out"] == "mine\n", alice
        assert alice["id"] in alice["listed"]
        bob = ray.get(_tenant_job.remote(TOKENS["bob"], alice["id"]), timeout=180)
        try:
            assert bob["reached"] == "sandbox_not_found", bob
            assert alice["id"] not in bob["listed"] and bob["id"] not in alice["listed"]
            admin = {b.id for b in corral.Sandbox.list()}  # this process: a bare connect()
            assert {alice["id"], bob["id"]} <= admin
        finally:
            corral.Sandbox.connect(bob["id"]).kill()
    finally:
        corral.Sandbox.connect(alice["id"]).kill()
    with pytest.raises(corral.errors.InvalidRequest):
        corral.cluster.connect(token="")


def test_a_lost_nodes_episode_is_read_and_replayed_on_a_survivor(cluster):
    """An episode runs on a node, the node's supervisor is killed (its corrald and sandboxes
    go with it): through the gateway its log is still there (ended ``lost``), and `corral
    replay` (CLI and SDK) runs it again on the surviving node with every step the same.
    Runs last: the cluster loses a node."""
    node = _worker(cluster)
    survivor = cluster["head"]
    sb = _on("worker", trajectory_id="lost-ep")
    assert sb.info().node == node
    sid = sb.id
    first = _episode(sb, "lost")
    logged = sb.log()
    # A tenant's sandbox on the same node, a command run in it.
    gw_url = os.environ["CORRAL_URL"]
    code, alice_sb = _http("POST", gw_url + "/v1/sandboxes", TOKENS["alice"],
                           {"image": "host", "memory_mb": 64},
                           {"X-Corral-Node-Selector": "role=worker",
                            "Idempotency-Key": "alice-ep:create"})
    assert code == 201 and alice_sb["node"] == node, alice_sb
    code, res = _http("POST", f"{alice_sb['endpoint']}/v1/sandboxes/{alice_sb['id']}/exec",
                      TOKENS["alice"], {"cmd": "echo alice"})
    assert code == 200 and res["stdout"] == "alice\n", res

    def ingested() -> bool:
        """The node's database has every call above: its ingester (a niced thread) moves
        the journal there behind the calls, and only the database is shipped."""
        ops = _rows(_node_db(cluster, node), "SELECT sandbox_id, op FROM entries")
        return (alice_sb["id"], "exec") in ops and \
            sum(1 for sbid, _ in ops if sbid == sid) >= len(logged)
    assert wait_until(ingested, timeout=30)
    assert wait_until(lambda: _shipped(cluster, node), timeout=20)
    steps = sb._step

    ray.kill(corral.cluster.supervisors()[node], no_restart=True)
    assert wait_until(lambda: node in corral.cluster.status()["lost"], timeout=15)

    def lost() -> bool:
        try:
            sb.exec("true", timeout=2)  # answered until its corrald has stopped
            return False
        except SandboxLost as e:
            assert e.infra
            return True
    assert wait_until(lost, timeout=15, interval=0.05)

    # Resumed by its trajectory (a restarted trainer): the handle is positioned after the
    # last logged step, its sandbox dead on the lost node, and a call on it is lost.
    resumed = corral.Sandbox.from_trajectory("lost-ep")
    assert resumed.id == sid and resumed._step == steps
    assert resumed.last_info.state == "dead" and resumed.last_info.node == node
    with pytest.raises(SandboxLost) as lost_err:
        resumed.exec("true")
    assert lost_err.value.infra and lost_err.value.details["node"] == node
    with pytest.raises(corral.errors.NotFound):
        corral.Sandbox.from_trajectory("no-such-ep")

    # Its log, from the gateway's copy: every entry as the node logged it, ended "lost".
    url = os.environ["CORRAL_URL"]
    token = endpoint_mod._tokens[url]
    env = dict(os.environ, CORRAL_URL=url, CORRAL_TOKEN=token)
    r = subprocess.run([sys.executable, "-m", "corral.cli", "log", sid, "--json"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    copy = json.loads(r.stdout)
    entries = copy["entries"] if isinstance(copy, dict) else copy
    key = [(e.seq, e.op, e.idempotency_key, e.result, e.error) for e in logged]
    assert [(e["seq"], e["op"], e["idempotency_key"], e["result"], e["error"])
            for e in entries] == key
    via_sdk = corral.Sandbox.from_id(sid, endpoint=url)
    assert via_sdk._call(api.log_raw(sid))["sandbox"]["reason"] == "lost"
    # A tenant reads its own lost sandbox's log from the copy, and no other's.
    alice_log = f"{url}/v1/sandboxes/{alice_sb['id']}/log"
    code, got = _http("GET", alice_log, TOKENS["alice"])
    assert code == 200 and got["copy"] and got["node"] == node, got
    assert [e["op"] for e in got["entries"]] == ["create", "exec"]
    assert got["entries"][1]["result"]["stdout"] == "alice\n"
    code, got = _http("GET", alice_log, TOKENS["bob"])
    assert code == 404 and got["error"]["code"] == "sandbox_not_found", got
    code, got = _http("GET", f"{url}/v1/sandboxes/{sid}/log", TOKENS["bob"])  # the admin's
    assert code == 404 and got["error"]["code"] == "sandbox_not_found", got
    code, got = _http("GET", alice_log, "wrong-token-0123456789")
    assert code == 401, got
    # And its trajectory: hers to resume, no one else's to find.
    code, got = _http("GET", f"{url}/v1/trajectories/alice-ep", TOKENS["alice"])
    assert code == 200 and got["sandbox_id"] == alice_sb["id"] and got["copy"], got
    assert got["sandbox"]["state"] == "dead" and got["step"] == 0, got
    code, got = _http("GET", f"{url}/v1/trajectories/alice-ep", TOKENS["bob"])
    assert code == 404 and got["error"]["code"] == "not_found", got
    code, got = _http("POST", f"{url}/v1/sandboxes/{alice_sb['id']}/exec", TOKENS["alice"],
                      {"cmd": "true"})
    assert code == 410 and got["error"]["code"] == "sandbox_lost", got
    code, got = _http("POST", f"{url}/v1/sandboxes/{alice_sb['id']}/exec", TOKENS["bob"],
                      {"cmd": "true"})
    assert code == 404, got

    # The CLI's replay through the gateway: on the survivor, identical.
    r = subprocess.run([sys.executable, "-m", "corral.cli", "replay", sid, "--json"], env=env,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-2000:])
    rep = json.loads(r.stdout)
    assert rep["identical"] and rep["source_id"] == sid, rep
    # The SDK's, kept: the replay sandbox's own results equal the original's.
    report = replay(sid, keep=True)
    try:
        assert report.identical, report.to_json()
        same = [s for s in report.steps if s.status == "same"]
        assert len(same) == len([e for e in logged if e.op not in ("create", "kill", "info")])
        found = [b for b in corral.Sandbox.list() if b.id == report.replay_id]
        assert found and found[0].info().node == survivor
        mine = found[0].log()
        assert [e.result.get("stdout") for e in mine if e.op == "exec"] == \
            [e.result.get("stdout") for e in logged if e.op == "exec"]
        assert [(e.result or {}).get("exit_code") for e in mine if e.op == "exec"] == \
            [(e.result or {}).get("exit_code") for e in logged if e.op == "exec"]
        assert first[3] == 3  # the failing step failed then, and (same) again
    finally:
        for b in corral.Sandbox.list():
            if b.id == report.replay_id:
                b.kill()
