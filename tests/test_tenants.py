"""Tenants of one daemon attack each other over TCP (docs/security.md, tenants).

A private daemon listens on TCP with the admin token and a tokens file of three tenants.
Tenant bob tries every sandbox route of the API (the ROUTES table, so a new route is covered
when it is added) on alice's sandbox, her snapshot, her trajectory and her idempotency key:
each must answer exactly what an unknown id answers, and alice's sandbox must be untouched.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from corral import placing
from corral.daemon.app import ROUTES
from corral.daemon.tenants import TENANT_LABEL

from apiclient import expect_error
from conftest import CGROUP_NAME, free_port, private_daemon, wait_until

ADMIN = "admin-token-0123456789"
TOKENS = {"alice": "alice-token-0123456789", "bob": "bob-token-0123456789",
          "carol": "carol-token-0123456789"}


def _write_tokens(path: str, tokens: dict[str, str]) -> None:
    tmp = path + ".new"
    with open(tmp, "w") as f:
        json.dump(tokens, f)
    os.replace(tmp, path)  # a new inode: the daemon sees the change at once


class Tenant:
    def __init__(self, base: str, token: str | None) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.c = httpx.Client(base_url=base, headers=headers, timeout=120)

    def create(self, **spec: Any) -> dict[str, Any]:
        r = self.c.post("/v1/sandboxes", json=spec)
        assert r.status_code == 201, r.text
        return r.json()

    def exec(self, sid: str, cmd: str) -> dict[str, Any]:
        r = self.c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd})
        assert r.status_code == 200, r.text
        return r.json()


@pytest.fixture(scope="module")
def daemon_tcp() -> Iterator[dict[str, Any]]:
    tokdir = tempfile.mkdtemp(prefix="corral-test-tenants-tok-", dir="/var/tmp")
    path = os.path.join(tokdir, "tokens.json")
    _write_tokens(path, TOKENS)
    port = free_port()
    try:
        with private_daemon("corral-test-tenants-", f"{CGROUP_NAME}-tenants",
                            CORRAL_TCP=f"127.0.0.1:{port}", CORRAL_TOKEN=ADMIN,
                            CORRAL_TOKENS=path) as d:
            base = f"http://127.0.0.1:{port}"
            admin = Tenant(base, ADMIN)
            try:
                yield {"base": base, "tokens": path, "admin": admin, "daemon": d}
            finally:  # everything any tenant made
                for sb in admin.c.get("/v1/sandboxes").json()["sandboxes"]:
                    admin.c.delete(f"/v1/sandboxes/{sb['id']}")
                for s in admin.c.get("/v1/snapshots").json()["snapshots"]:
                    admin.c.delete(f"/v1/snapshots/{s['id']}")
                admin.c.close()
    finally:
        for name in os.listdir(tokdir):
            os.unlink(os.path.join(tokdir, name))
        os.rmdir(tokdir)


@pytest.fixture(scope="module")
def world(daemon_tcp: dict[str, Any]) -> dict[str, Any]:
    """Alice's sandbox (a file, a background process, a snapshot, a keyed trajectory) and
    bob's own sandbox."""
    base = daemon_tcp["base"]
    alice, bob = Tenant(base, TOKENS["alice"]), Tenant(base, TOKENS["bob"])
    sa = alice.create(labels={"who": "alice"})["id"]
    alice.exec(sa, "echo secret > /root/secret")
    r = alice.c.post(f"/v1/sandboxes/{sa}/exec", json={"cmd": "sleep 600", "background": True})
    assert r.status_code == 200, r.text
    pid = r.json()["pid"]
    r = alice.c.post(f"/v1/sandboxes/{sa}/snapshot", json={"name": "alice-snap"})
    assert r.status_code == 201, r.text
    snap = r.json()["id"]
    r = alice.c.post("/v1/sandboxes", json={}, headers={"Idempotency-Key": "traj-a:create"})
    assert r.status_code == 201, r.text
    st = r.json()["id"]
    r = alice.c.post(f"/v1/sandboxes/{st}/exec", json={"cmd": "true"},
                     headers={"Idempotency-Key": "traj-a:0"})
    assert r.status_code == 200, r.text
    sb = bob.create()["id"]
    return {"alice": alice, "bob": bob, "sa": sa, "pid": pid, "snap": snap, "st": st,
            "sb": sb, **daemon_tcp}


def _fill(path: str, sid: str, pid: int) -> str:
    return (path.replace("{id}", sid).replace("{pid}", str(pid)).replace("{port}", "8080"))


def _same_as_unknown(foreign: httpx.Response, unknown: httpx.Response, fid: str,
                     uid: str) -> None:
    """A foreign id's answer is an unknown id's, but for the id itself."""
    assert foreign.status_code == unknown.status_code == 404, (foreign.text, unknown.text)
    assert foreign.text.replace(fid, "ID") == unknown.text.replace(uid, "ID")
    assert foreign.json()["error"]["code"] == "sandbox_not_found"


SANDBOX_ROUTES = [r for r in ROUTES if "{id}" in r.path]


def test_route_table_has_sandbox_routes() -> None:
    assert len(SANDBOX_ROUTES) >= 25  # the table walked below is the real one
    # Every admin-only name is a route's handler: a renamed handler cannot silently open up.
    from corral.daemon.tenancy import ADMIN_ONLY

    assert ADMIN_ONLY <= {r.handler.__name__ for r in ROUTES}


@pytest.mark.parametrize("route", SANDBOX_ROUTES, ids=lambda r: f"{r.method} {r.path}")
def test_every_sandbox_route_hides_another_tenants_sandbox(world: dict[str, Any],
                                                           route: Any) -> None:
    bob, alice, sa, pid = world["bob"], world["alice"], world["sa"], world["pid"]
    guess = "sb-" + os.urandom(8).hex()
    params = {"path": "/root/secret"}
    body = b"{}"
    for headers in ({}, {"Idempotency-Key": "traj-a:0"}):
        foreign = bob.c.request(route.method, _fill(route.path, sa, pid), params=params,
                                content=body, headers=headers)
        unknown = bob.c.request(route.method, _fill(route.path, guess, pid), params=params,
                                content=body, headers=headers)
        _same_as_unknown(foreign, unknown, sa, guess)
    # Alice's sandbox is untouched: running, its file and background process there.
    info = alice.c.get(f"/v1/sandboxes/{sa}").json()
    assert info["state"] == "running", info
    assert alice.exec(sa, "cat /root/secret")["stdout"] == "secret\n"
    assert alice.c.get(f"/v1/sandboxes/{sa}/procs/{pid}").json()["running"] is True


def test_foreign_sandbox_is_unknown_for_the_trajectory_key_of_its_owner(world: dict[str, Any]
                                                                         ) -> None:
    bob, st = world["bob"], world["st"]
    # Replaying alice's keyed exec on her trajectory's sandbox: not found, nothing returned.
    r = bob.c.post(f"/v1/sandboxes/{st}/exec", json={"cmd": "true"},
                   headers={"Idempotency-Key": "traj-a:0"})
    expect_error(r, "sandbox_not_found", 404)
    # Her trajectory is unknown to bob, as one that never existed.
    foreign = bob.c.get("/v1/trajectories/traj-a")
    unknown = bob.c.get("/v1/trajectories/traj-zz")
    assert foreign.status_code == unknown.status_code == 404
    assert foreign.text.replace("traj-a", "T") == unknown.text.replace("traj-zz", "T")
    assert world["alice"].c.get("/v1/trajectories/traj-a").json()["sandbox_id"] == st
    # Her create key: bob's create under it makes nothing and tells no sandbox id.
    r = bob.c.post("/v1/sandboxes", json={}, headers={"Idempotency-Key": "traj-a:create"})
    err = expect_error(r, "replay_divergence", 409)
    assert st not in r.text and "sandbox_id" not in err.get("details", {})


def test_snapshots_of_another_tenant_are_unknown(world: dict[str, Any]) -> None:
    bob, alice, snap, sb = world["bob"], world["alice"], world["snap"], world["sb"]
    for key in (snap, "alice-snap"):
        for method in ("GET", "DELETE"):
            expect_error(bob.c.request(method, f"/v1/snapshots/{key}"), "snapshot_not_found",
                         404)
        expect_error(bob.c.post("/v1/sandboxes", json={"snapshot": key}),
                     "snapshot_not_found", 404)
        expect_error(bob.c.post("/v1/sandboxes/batch", json={"count": 1,
                                                             "spec": {"snapshot": key}}),
                     "snapshot_not_found", 404)
        expect_error(bob.c.post(f"/v1/sandboxes/{sb}/restore", json={"snapshot": key}),
                     "snapshot_not_found", 404)
    assert snap not in bob.c.get("/v1/snapshots").text
    assert alice.c.get(f"/v1/snapshots/{snap}").json()["name"] == "alice-snap"
    assert [s["id"] for s in alice.c.get("/v1/snapshots").json()["snapshots"]] == [snap]
    # Names are shared, but the conflict names no id of hers.
    r = bob.c.post(f"/v1/sandboxes/{sb}/snapshot", json={"name": "alice-snap"})
    expect_error(r, "snapshot_exists", 409)
    assert snap not in r.text


def test_lists_show_only_the_tenants_own(world: dict[str, Any]) -> None:
    bob, alice, admin = world["bob"], world["alice"], world["admin"]
    sa, sb, st = world["sa"], world["sb"], world["st"]
    # A label naming another tenant is overwritten: the sandbox stays bob's.
    spoof = bob.create(labels={TENANT_LABEL: "alice"})
    try:
        assert spoof["labels"][TENANT_LABEL] == "bob"
        mine = {s["id"] for s in bob.c.get("/v1/sandboxes").json()["sandboxes"]}
        assert mine == {sb, spoof["id"]}
        filtered = bob.c.get("/v1/sandboxes", params={"label": f"{TENANT_LABEL}=alice"})
        assert {s["id"] for s in filtered.json()["sandboxes"]} == {sb, spoof["id"]}
        assert {s["id"] for s in alice.c.get("/v1/sandboxes").json()["sandboxes"]} == {sa, st}
        dash = bob.c.get("/v1/dashboard").json()
        assert {s["id"] for s in dash["sandboxes"]} == {sb, spoof["id"]}
        everyone = {s["id"] for s in admin.c.get("/v1/sandboxes").json()["sandboxes"]}
        assert {sa, sb, st, spoof["id"]} <= everyone
        expect_error(alice.c.get(f"/v1/sandboxes/{spoof['id']}"), "sandbox_not_found", 404)
    finally:
        bob.c.delete(f"/v1/sandboxes/{spoof['id']}")


def test_batches_mixing_ids_touch_only_the_tenants_own(world: dict[str, Any]) -> None:
    bob, alice, sa, sb = world["bob"], world["alice"], world["sa"], world["sb"]
    guess = "sb-" + os.urandom(8).hex()
    r = bob.c.post("/v1/sandboxes/batch/exec", json={
        "ids": [sb, sa, guess], "exec": {"cmd": "cat /root/secret 2>&1; echo ran"}})
    assert r.status_code == 200, r.text
    res = r.json()["results"]
    assert res[0]["stdout"].endswith("ran\n")
    assert res[1]["error"]["code"] == res[2]["error"]["code"] == "sandbox_not_found"
    assert json.dumps(res[1]).replace(sa, "ID") == json.dumps(res[2]).replace(guess, "ID")
    assert "stdout" not in res[1] and res[0]["stdout"].startswith("cat:")
    victim = alice.create()["id"]
    own = bob.create()["id"]
    r = bob.c.post("/v1/sandboxes/batch/destroy", json={"ids": [victim, own, guess]})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["killed"] == 1 and out["failed"] == 2, out
    assert {e["id"] for e in out["not_killed"]} == {victim, guess}
    assert all(e["error"]["code"] == "sandbox_not_found" for e in out["not_killed"])
    assert alice.c.get(f"/v1/sandboxes/{victim}").json()["state"] == "running"
    # An ended sandbox stays the owner's: alice sees it killed, bob as unknown.
    assert alice.c.delete(f"/v1/sandboxes/{victim}").json()["killed"] is True
    expect_error(alice.c.get(f"/v1/sandboxes/{victim}"), "sandbox_not_running", 409)
    expect_error(bob.c.get(f"/v1/sandboxes/{victim}"), "sandbox_not_found", 404)
    expect_error(bob.c.get(f"/v1/sandboxes/{own}"), "sandbox_not_running", 409)


def test_fork_children_and_their_snapshot_are_the_tenants(world: dict[str, Any]) -> None:
    bob, alice, sa = world["bob"], world["alice"], world["sa"]
    r = alice.c.post(f"/v1/sandboxes/{sa}/fork", json={"count": 1, "keep_snapshot": True})
    assert r.status_code == 201, r.text
    child, snap = r.json()["sandboxes"][0]["id"], r.json()["snapshot"]["id"]
    try:
        assert r.json()["sandboxes"][0]["labels"][TENANT_LABEL] == "alice"
        expect_error(bob.c.post(f"/v1/sandboxes/{child}/exec", json={"cmd": "true"}),
                     "sandbox_not_found", 404)
        expect_error(bob.c.get(f"/v1/snapshots/{snap}"), "snapshot_not_found", 404)
        assert alice.exec(child, "cat /root/secret")["stdout"] == "secret\n"
    finally:
        alice.c.delete(f"/v1/sandboxes/{child}")
        alice.c.delete(f"/v1/snapshots/{snap}")


def test_a_fork_childs_trajectory_cannot_be_squatted(world: dict[str, Any]) -> None:
    """Bob creates a sandbox keyed with the trajectory id alice's fork child will have: alice
    still resumes her child by it, and bob never finds it."""
    bob, alice = world["bob"], world["alice"]
    r = bob.c.post("/v1/sandboxes", json={}, headers={"Idempotency-Key": "sq-t/fork1/0:create"})
    assert r.status_code == 201, r.text
    squat = r.json()["id"]
    r = alice.c.post("/v1/sandboxes", json={}, headers={"Idempotency-Key": "sq-t:create"})
    assert r.status_code == 201, r.text
    parent = r.json()["id"]
    r = alice.c.post(f"/v1/sandboxes/{parent}/fork", json={"count": 1},
                     headers={"Idempotency-Key": "sq-t:1"})
    assert r.status_code == 201, r.text
    child = r.json()["sandboxes"][0]["id"]
    try:
        r = alice.c.get("/v1/trajectories/sq-t%2Ffork1%2F0")
        assert r.status_code == 200 and r.json()["sandbox_id"] == child, r.text
        expect_error(bob.c.get("/v1/trajectories/sq-t%2Ffork1%2F0"), "not_found", 404)
    finally:
        for sid in (child, parent):
            alice.c.delete(f"/v1/sandboxes/{sid}")
        bob.c.delete(f"/v1/sandboxes/{squat}")


def test_admin_only_routes_refuse_tenants(world: dict[str, Any]) -> None:
    bob, admin = world["bob"], world["admin"]
    expect_error(bob.c.post("/v1/images/prune"), "forbidden", 403)
    expect_error(bob.c.get("/metrics"), "forbidden", 403)
    # the daemon's pid, state directory and every tenant's counts
    r = bob.c.get("/v1/status")
    expect_error(r, "forbidden", 403)
    assert "state_dir" not in r.text
    assert bob.c.get("/v1/substrates").status_code == 200
    assert bob.c.get("/v1/health").status_code == 200
    expect_error(bob.c.post(f"/v1/sandboxes/{world['sb']}/commit", json={"name": "x-bob"}),
                 "forbidden", 403)
    assert admin.c.get("/metrics").status_code == 200
    assert admin.c.get("/v1/status").json()["pid"] > 0
    assert bob.c.get("/v1/images").status_code == 200  # images are shared, read-only


def test_snapshot_export_and_import_are_the_admins_and_an_import_names_its_owner(
        world: dict[str, Any]) -> None:
    """Node-to-node copies (the cluster gateway's): a tenant can neither export another's
    (or its own) snapshot nor plant one; the admin's import belongs to the tenant it names,
    never to what the stream says, and an id another tenant has is a conflict that tells
    nothing of it."""
    bob, alice, admin, snap = world["bob"], world["alice"], world["admin"], world["snap"]
    for who in (bob, alice):
        expect_error(who.c.get(f"/v1/snapshots/{snap}/export"), "forbidden", 403)
        expect_error(who.c.post("/v1/snapshots", content=b"x"), "forbidden", 403)
    r = admin.c.get(f"/v1/snapshots/{snap}/export")
    assert r.status_code == 200, r.text
    stream = r.content
    # This node has that id (alice's): the same owner is answered as it is, another not.
    r = admin.c.post("/v1/snapshots", content=stream, params={"tenant": "alice"},
                     headers={"Content-Type": "application/x-tar"})
    assert r.status_code == 200 and r.json()["id"] == snap, r.text
    r = admin.c.post("/v1/snapshots", content=stream, params={"tenant": "bob"},
                     headers={"Content-Type": "application/x-tar"})
    expect_error(r, "conflict", 409)
    assert "alice" not in r.text and "layers" not in r.text
    assert snap not in bob.c.get("/v1/snapshots").text


def test_tokens_no_token_wrong_token_and_removed_token(world: dict[str, Any]) -> None:
    base, path = world["base"], world["tokens"]
    for token in (None, "wrong-token-0123456789", TOKENS["bob"][:-1], TOKENS["bob"] + "x"):
        expect_error(Tenant(base, token).c.get("/v1/sandboxes"), "unauthorized", 401)
    expect_error(httpx.get(base + "/v1/sandboxes", headers={
        "Authorization": f"Basic {TOKENS['bob']}"}), "unauthorized", 401)
    lower = httpx.get(base + "/v1/sandboxes", headers={
        "Authorization": f"bearer {TOKENS['bob']}"})
    assert lower.status_code == 200
    carol = Tenant(base, TOKENS["carol"])
    cid = carol.create()["id"]
    try:
        # Carol's token is removed from the file: it stops working, the others do not.
        _write_tokens(path, {k: v for k, v in TOKENS.items() if k != "carol"})
        assert wait_until(lambda: carol.c.get("/v1/sandboxes").status_code == 401, 10)
        expect_error(carol.c.post(f"/v1/sandboxes/{cid}/exec", json={"cmd": "true"}),
                     "unauthorized", 401)
        assert world["bob"].c.get("/v1/sandboxes").status_code == 200
        # A broken file admits no tenant (fail closed); the admin still gets in.
        with open(path, "w") as f:
            f.write("{not json")
        assert wait_until(lambda: world["bob"].c.get("/v1/sandboxes").status_code == 401, 10)
        assert world["admin"].c.get("/v1/sandboxes").status_code == 200
        # A token given as its sha256 works as the token does.
        import hashlib

        digest = hashlib.sha256(TOKENS["bob"].encode()).hexdigest()
        _write_tokens(path, {**{k: v for k, v in TOKENS.items() if k != "bob"},
                             "bob": f"sha256:{digest}"})
        assert wait_until(lambda: world["bob"].c.get("/v1/sandboxes").status_code == 200, 10)
        assert wait_until(lambda: carol.c.get("/v1/sandboxes").status_code == 200, 10)
    finally:
        _write_tokens(path, TOKENS)
        world["admin"].c.delete(f"/v1/sandboxes/{cid}")


def test_guessed_ids_answer_the_same(world: dict[str, Any]) -> None:
    bob, sa = world["bob"], world["sa"]
    answers = set()
    for sid in (sa, "sb-" + os.urandom(8).hex(), sa[:-1] + ("0" if sa[-1] != "0" else "1")):
        r = bob.c.get(f"/v1/sandboxes/{sid}")
        answers.add((r.status_code, re.sub(r"sb-[0-9a-f]+", "ID", r.text)))
    assert len(answers) == 1, answers


def test_only_the_admin_may_act_for_a_tenant(world: dict[str, Any]) -> None:
    """The cluster gateway checks a tenant's token and calls the node with the admin (cluster)
    token and X-Corral-Tenant; a tenant naming another tenant there is still itself."""
    bob, admin, sa, sb = world["bob"], world["admin"], world["sa"], world["sb"]
    as_alice = {"X-Corral-Tenant": "alice"}
    expect_error(bob.c.get(f"/v1/sandboxes/{sa}", headers=as_alice), "sandbox_not_found", 404)
    listed = bob.c.get("/v1/sandboxes", headers=as_alice).json()["sandboxes"]
    assert sa not in {s["id"] for s in listed} and sb in {s["id"] for s in listed}
    seen = {s["id"] for s in admin.c.get("/v1/sandboxes", headers=as_alice).json()["sandboxes"]}
    assert sa in seen and sb not in seen
    expect_error(admin.c.get(f"/v1/sandboxes/{sb}", headers=as_alice), "sandbox_not_found", 404)
    made = admin.c.post("/v1/sandboxes", json={}, headers=as_alice)
    assert made.status_code == 201, made.text
    try:
        assert made.json()["labels"][TENANT_LABEL] == "alice"
        assert world["alice"].c.get(f"/v1/sandboxes/{made.json()['id']}").status_code == 200
    finally:
        admin.c.delete(f"/v1/sandboxes/{made.json()['id']}")
    expect_error(admin.c.get("/v1/sandboxes", headers={"X-Corral-Tenant": "bad name"}),
                 "unauthorized", 401)


def test_the_gateway_forwards_a_tenant_no_client_can_forge(world: dict[str, Any]) -> None:
    """A gateway (in this process) with the private daemon as its node: a tenant's create
    through it is the tenant's on the node; a forged X-Corral-Tenant is not forwarded; ids
    batches through it reach only the tenant's own."""
    import asyncio

    from corral.cluster.gateway import Gateway

    alice, sa = world["alice"], world["sa"]

    async def run() -> list[str]:
        gw = Gateway("tenants-test", ADMIN, deploy={"tokens_file": world["tokens"]})
        made: list[str] = []
        try:
            url = await gw.serve("127.0.0.1", free_port())

            def report() -> None:  # the node's load report (its supervisor's, in a cluster)
                gw._take({"node": "n1", "endpoint": world["base"], "live": 0,
                          "capacity": 100, "mem_free_mb": 1 << 20}, time.monotonic())
            async with httpx.AsyncClient(base_url=url, timeout=120) as c:
                bob = {"Authorization": f"Bearer {TOKENS['bob']}"}
                report()
                r = await c.post("/v1/sandboxes", json={}, headers={**bob,
                                                                    "X-Corral-Tenant": "alice"})
                assert r.status_code == 201, r.text
                made.append(r.json()["id"])
                assert r.json()["labels"][TENANT_LABEL] == "bob"
                r = await c.post("/v1/sandboxes/batch/destroy", json={"ids": [sa]}, headers=bob)
                assert r.status_code == 200, r.text
                assert r.json()["killed"] == 0 and r.json()["failed"] == 1, r.text
                # connect() by id through the gateway: another tenant's is unknown.
                r = await c.get(f"/v1/sandboxes/{sa}", headers=bob)
                assert r.status_code == 404 and "sandbox_not_found" in r.text, r.text
                r = await c.get(f"/v1/sandboxes/{sa}",
                                headers={"Authorization": f"Bearer {TOKENS['alice']}"})
                assert r.status_code == 200 and r.json()["endpoint"] == world["base"], r.text
                report()
                r = await c.post("/v1/sandboxes", json={"snapshot": world["snap"]},
                                 headers=bob)
                assert r.status_code == 404 and "snapshot_not_found" in r.text, r.text
                r = await c.post("/v1/sandboxes", json={},
                                 headers={"Authorization": "Bearer wrong-token-0123456789"})
                assert r.status_code == 401
                report()
                r = await c.post("/v1/sandboxes", json={},
                                 headers={"Authorization": f"Bearer {TOKENS['alice']}"})
                assert r.status_code == 201, r.text
                made.append(r.json()["id"])
                assert r.json()["labels"][TENANT_LABEL] == "alice"
        finally:
            await gw.close()
        return made

    made = asyncio.run(run())
    try:
        assert alice.c.get(f"/v1/sandboxes/{sa}").json()["state"] == "running"
        expect_error(alice.c.get(f"/v1/sandboxes/{made[0]}"), "sandbox_not_found", 404)
        assert world["bob"].c.get(f"/v1/sandboxes/{made[0]}").status_code == 200
        assert alice.c.get(f"/v1/sandboxes/{made[1]}").status_code == 200
    finally:
        for sid in made:
            world["admin"].c.delete(f"/v1/sandboxes/{sid}")


def _gateway_of(world: dict[str, Any]) -> tuple[Any, Any]:
    """A gateway (in this process) with the private daemon as its one node, and a function
    that feeds it the node's load report (its supervisor's, in a cluster)."""
    from corral.cluster.gateway import Gateway

    gw = Gateway("tenants-test", ADMIN, deploy={"tokens_file": world["tokens"]})

    def report() -> None:
        gw._take({"node": "n1", "endpoint": world["base"], "live": 0, "capacity": 100,
                  "mem_free_mb": 1 << 20, "labels": {"rack": "r1"}}, time.monotonic())
    return gw, report


def test_the_cluster_status_is_the_admins(world: dict[str, Any]) -> None:
    """GET /v1/cluster names every node, its labels, load and images: a tenant is refused
    (the SDK never asks for it), the admin gets it."""
    import asyncio

    async def run() -> None:
        gw, report = _gateway_of(world)
        try:
            url = await gw.serve("127.0.0.1", free_port())
            report()
            async with httpx.AsyncClient(base_url=url, timeout=120) as c:
                for who in ("alice", "bob"):
                    r = await c.get("/v1/cluster",
                                    headers={"Authorization": f"Bearer {TOKENS[who]}"})
                    expect_error(r, "forbidden", 403)
                    assert world["base"] not in r.text and "r1" not in r.text
                r = await c.get("/v1/cluster", headers={"Authorization": f"Bearer {ADMIN}"})
                assert r.status_code == 200, r.text
                assert r.json()["nodes"][0]["endpoint"] == world["base"]
        finally:
            await gw.close()
    asyncio.run(run())


def test_a_tenants_unused_placements_leave_room_for_the_others(world: dict[str, Any]) -> None:
    """A placement holds a slot on its node until the node's next report though nothing is
    made: alice asking for placements she never uses, as fast as she can, must not make the
    node look full to bob. Past her share of the free room (a quarter), her asks are made by
    the gateway (real sandboxes, hers), and bob is still placed."""
    import asyncio

    made: list[str] = []

    async def run() -> int:
        gw, report = _gateway_of(world)
        try:
            url = await gw.serve("127.0.0.1", free_port())
            report()
            async with httpx.AsyncClient(base_url=url, timeout=120) as c:
                alice = {"Authorization": f"Bearer {TOKENS['alice']}"}
                taken, code = 0, 0
                for _ in range(20):  # 9 placements an ask: 180 > the node's 100 slots
                    r = await c.post("/v1/sandboxes", json={"labels": {"who": "alice"}},
                                     headers={**alice, placing.HEADER: "node; ahead=8"})
                    code = r.status_code
                    if code != placing.STATUS:
                        break
                    taken += 1 + len(r.json().get("ahead", []))
                last = r
                if code == 201:
                    made.append(last.json()["id"])
                r = await c.post("/v1/sandboxes", json={},
                                 headers={"Authorization": f"Bearer {TOKENS['bob']}",
                                          placing.HEADER: "node"})
                assert r.status_code == placing.STATUS, r.text
                assert code == 201, last.text  # made by the gateway, on the node
                assert last.json()["labels"][TENANT_LABEL] == "alice"
                return taken
        finally:
            await gw.close()
    try:
        assert asyncio.run(run()) <= 100 // 4
    finally:
        for sid in made:
            world["admin"].c.delete(f"/v1/sandboxes/{sid}")


@pytest.mark.parametrize("content", ['{"alice": "short"}', '{"bad name": "x-0123456789abcdef"}',
                                     '["not", "a", "map"]', '{"a": "same-0123456789abcdef", '
                                     '"b": "same-0123456789abcdef"}'])
def test_a_bad_tokens_file_stops_the_daemon_at_start(content: str) -> None:
    import subprocess
    import sys

    state = tempfile.mkdtemp(prefix="corral-test-tenants-bad-", dir="/var/tmp")
    try:
        path = os.path.join(state, "tokens.json")
        with open(path, "w") as f:
            f.write(content)
        r = subprocess.run([sys.executable, "-m", "corral.daemon", "--state-dir", state,
                            "--socket", os.path.join(state, "s.sock"), "--tcp",
                            f"127.0.0.1:{free_port()}", "--tokens", path],
                           capture_output=True, timeout=60)
        assert r.returncode != 0
        assert b"tokens file" in r.stderr, r.stderr
    finally:
        subprocess.run(["rm", "-rf", state], check=False)


def test_ownership_survives_a_restart(world: dict[str, Any]) -> None:
    """Last (it restarts the module's daemon): after a restart, alice's ended sandbox's log,
    her trajectory and her snapshot are still hers only (the log and the snapshot store
    keep the tenant)."""
    bob, alice, sa, st, snap = world["bob"], world["alice"], world["sa"], world["st"], world["snap"]
    d = world["daemon"]
    d.stop()
    d.start()
    for sid in (sa, st):
        assert alice.c.get(f"/v1/sandboxes/{sid}/log").status_code == 200
        expect_error(bob.c.get(f"/v1/sandboxes/{sid}/log"), "sandbox_not_found", 404)
        expect_error(bob.c.delete(f"/v1/sandboxes/{sid}"), "sandbox_not_found", 404)
        expect_error(bob.c.delete(f"/v1/sandboxes/{sid}", headers={"Idempotency-Key": "k"}),
                     "sandbox_not_found", 404)
    assert alice.c.get("/v1/trajectories/traj-a").json()["sandbox_id"] == st
    expect_error(bob.c.get("/v1/trajectories/traj-a"), "not_found", 404)
    assert alice.c.get(f"/v1/snapshots/{snap}").status_code == 200
    expect_error(bob.c.get(f"/v1/snapshots/{snap}"), "snapshot_not_found", 404)
    assert snap not in bob.c.get("/v1/snapshots").text


def test_a_tenant_holds_at_most_its_quota_of_live_sandboxes() -> None:
    """One tenant must not fill the daemon and starve the others. bob's tokens file entry
    gives him 2 live sandboxes, alice has none of her own so the default share (50 % of the
    daemon's 8) gives her 4; past it a create, a batch and a fork answer quota_exceeded (429,
    infra) and make nothing; one destroyed frees a place; a daemon restart keeps the count;
    the admin is bound only by the daemon's limit."""
    tokdir = tempfile.mkdtemp(prefix="corral-test-quota-tok-", dir="/var/tmp")
    path = os.path.join(tokdir, "tokens.json")
    with open(path, "w") as f:
        json.dump({"alice": TOKENS["alice"],
                   "bob": {"token": TOKENS["bob"], "max_sandboxes": 2}}, f)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with private_daemon("corral-test-quota-", f"{CGROUP_NAME}-quota",
                        CORRAL_TCP=f"127.0.0.1:{port}", CORRAL_TOKEN=ADMIN,
                        CORRAL_TOKENS=path, CORRAL_MAX_SANDBOXES="8") as d:
        alice, bob, admin = (Tenant(base, TOKENS["alice"]), Tenant(base, TOKENS["bob"]),
                             Tenant(base, ADMIN))
        try:
            def over_quota(r: httpx.Response, tenant: str, in_use: int, limit: int,
                           requested: int) -> None:
                err = expect_error(r, "quota_exceeded", 429)
                assert err["category"] == "infra", err
                assert err["details"] == {"tenant": tenant, "in_use": in_use,
                                                    "limit": limit, "requested": requested}

            def count(t: Tenant) -> int:
                return len(t.c.get("/v1/sandboxes").json()["sandboxes"])

            mine = [bob.create()["id"] for _ in range(2)]
            over_quota(bob.c.post("/v1/sandboxes", json={}), "bob", 2, 2, 1)
            over_quota(bob.c.post("/v1/sandboxes/batch", json={"count": 2, "spec": {}}),
                       "bob", 2, 2, 2)
            over_quota(bob.c.post(f"/v1/sandboxes/{mine[0]}/fork", json={"count": 1}),
                       "bob", 2, 2, 1)
            assert count(bob) == 2  # nothing was made past the quota
            r = alice.c.post("/v1/sandboxes/batch", json={"count": 4, "spec": {}})
            assert r.status_code == 201, r.text
            over_quota(alice.c.post("/v1/sandboxes", json={}), "alice", 4, 4, 1)
            # The admin (and only the admin) takes the rest of the daemon's 8.
            admin.create()
            admin.create()
            expect_error(admin.c.post("/v1/sandboxes", json={}), "capacity_exceeded", 429)

            assert bob.c.delete(f"/v1/sandboxes/{mine.pop()}").status_code in (200, 204)
            mine.append(bob.create()["id"])  # the place it freed
            over_quota(bob.c.post("/v1/sandboxes", json={}), "bob", 2, 2, 1)

            d.kill9()  # the count is rebuilt from the sandboxes a restarted daemon adopts
            d.start()
            over_quota(bob.c.post("/v1/sandboxes", json={}), "bob", 2, 2, 1)
            over_quota(alice.c.post("/v1/sandboxes", json={}), "alice", 4, 4, 1)
            _over_quota_through_a_gateway(base, path)
        finally:
            for sb in admin.c.get("/v1/sandboxes").json()["sandboxes"]:
                admin.c.delete(f"/v1/sandboxes/{sb['id']}")


def _over_quota_through_a_gateway(base: str, tokens: str) -> None:
    """Through a gateway, bob at his quota on its one node gets the node's quota_exceeded,
    not capacity_exceeded, and his refusal is not demand for more nodes."""
    import asyncio

    from corral.cluster.gateway import Gateway

    async def run() -> None:
        gw = Gateway("quota-test", ADMIN, deploy={"tokens_file": tokens})
        refused: list[int] = []
        gw.refused = lambda err, count: refused.append(count)  # type: ignore[method-assign]
        try:
            url = await gw.serve("127.0.0.1", free_port())
            gw._take({"node": "n1", "endpoint": base, "live": 0, "capacity": 100,
                      "mem_free_mb": 1 << 20, "labels": {}}, time.monotonic())
            async with httpx.AsyncClient(base_url=url, timeout=120) as c:
                r = await c.post("/v1/sandboxes", json={},
                                 headers={"Authorization": f"Bearer {TOKENS['bob']}"})
                err = expect_error(r, "quota_exceeded", 429)
                assert err["details"]["tenant"] == "bob", err
            assert refused == []
        finally:
            await gw.close()
    asyncio.run(run())


def test_one_tenant_cannot_take_the_tcp_listener_from_the_others():
    """The TCP listener holds at most CORRAL_TCP_MAX_CONNECTIONS; a tenant whose client
    keeps opening connections (a leak, a pool sized for a bigger daemon) took all of them,
    and every other tenant's connection was closed at once. A tenant holds at most its share
    (here 50 % of 16): its request on one more is quota_exceeded and that connection closed;
    the others get in, and the tenant does again once it lets one go."""
    import http.client

    tokdir = tempfile.mkdtemp(prefix="corral-test-tcpshare-tok-", dir="/var/tmp")
    path = os.path.join(tokdir, "tokens.json")
    _write_tokens(path, TOKENS)
    port = free_port()

    def ask(token: str, **headers: str
            ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        c.request("GET", "/v1/sandboxes",
                  headers={"Authorization": f"Bearer {token}", **headers})
        r = c.getresponse()
        r.body = r.read()  # type: ignore[attr-defined]
        return c, r

    held: list[http.client.HTTPConnection] = []
    try:
        with private_daemon("corral-test-tcpshare-", f"{CGROUP_NAME}-tcpshare",
                            CORRAL_TCP=f"127.0.0.1:{port}", CORRAL_TOKEN=ADMIN,
                            CORRAL_TOKENS=path, CORRAL_TCP_MAX_CONNECTIONS="16"):
            for _ in range(8):  # alice's share: kept alive, each answered
                c, r = ask(TOKENS["alice"])
                held.append(c)
                assert r.status == 200 and not r.will_close, r.body  # type: ignore[attr-defined]
            for _ in range(12):  # past it: refused, each closed by the daemon
                c, r = ask(TOKENS["alice"])
                held.append(c)
                err = json.loads(r.body)["error"]  # type: ignore[attr-defined]
                assert r.status == 429 and err["code"] == "quota_exceeded", err
                assert err["details"] == {"resource": "connections", "max": 8} and err["infra"]
                assert r.will_close
            for token in (TOKENS["bob"], TOKENS["carol"], ADMIN):  # the others get in
                c, r = ask(token)
                held.append(c)
                assert r.status == 200, r.body  # type: ignore[attr-defined]
            # the admin acting for alice (the cluster gateway) is not counted as hers
            c, r = ask(ADMIN, **{"X-Corral-Tenant": "alice"})
            held.append(c)
            assert r.status == 200, r.body  # type: ignore[attr-defined]
            held.pop(0).close()  # alice lets one go: her next connection is served

            def served() -> bool:
                c, r = ask(TOKENS["alice"])
                held.append(c)
                return r.status == 200
            assert wait_until(served, 10)
    finally:
        for c in held:
            c.close()
        os.unlink(path)
        os.rmdir(tokdir)


def test_connections_without_a_token_cannot_keep_a_tenant_out():
    """No token is needed to connect: a client that holds more idle connections than
    CORRAL_TCP_MAX_CONNECTIONS (here 256), sending nothing and reconnecting each time one
    is closed, had every slot, and 9 of 10 of a tenant's requests failed (its new connection
    closed at once). Unauthenticated connections are capped apart and the oldest is closed to
    make room: every request of a tenant gets through during the squat, on new connections
    from the squatter's address and from another, and on one kept alive from before it."""
    import asyncio
    import subprocess
    import sys

    tcp_max, squatters = 256, 256 + 128
    tokdir = tempfile.mkdtemp(prefix="corral-test-tcpsquat-tok-", dir="/var/tmp")
    path = os.path.join(tokdir, "tokens.json")
    _write_tokens(path, TOKENS)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {TOKENS['alice']}"}

    # The squat runs in a process of its own: in this one's event loop, its reconnects held
    # the tenant's requests back from being sent (a busy client is not the daemon's doing).
    squatter = f"""
import asyncio, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (8 * {squatters}, resource.getrlimit(
    resource.RLIMIT_NOFILE)[1]))
opened = 0
async def squat():
    global opened
    while True:
        try:
            r, w = await asyncio.open_connection("127.0.0.1", {port})
        except OSError:
            await asyncio.sleep(0.05)
            continue
        opened += 1
        try:
            await asyncio.wait_for(r.read(1), timeout=30)  # b"": the daemon closed it
        except (asyncio.TimeoutError, OSError):
            pass
        w.close()
async def main():
    tasks = [asyncio.ensure_future(squat()) for _ in range({squatters})]
    while True:
        await asyncio.sleep(0.5)
        print(opened, flush=True)
asyncio.run(main())
"""

    async def ask(source: str) -> str:
        transport = httpx.AsyncHTTPTransport(local_address=source)
        try:
            async with httpx.AsyncClient(base_url=base, headers=auth, timeout=10,
                                         transport=transport) as c:
                return str((await c.get("/v1/sandboxes")).status_code)
        except httpx.HTTPError as e:
            return type(e).__name__

    async def run() -> None:
        async with httpx.AsyncClient(base_url=base, headers=auth, timeout=10) as kept:
            assert (await kept.get("/v1/sandboxes")).status_code == 200
            proc = subprocess.Popen([sys.executable, "-c", squatter], stdout=subprocess.PIPE,
                                    text=True)
            try:
                assert proc.stdout is not None
                while int(proc.stdout.readline() or tcp_max) < tcp_max:
                    pass  # the squat holds the listener once it has opened as many
                results = []
                for i in range(20):  # new connections, from the squatter's address or not
                    results.append(await ask("127.0.0.1" if i % 2 else "127.0.0.2"))
                    results.append(str((await kept.get("/v1/sandboxes")).status_code))
                    await asyncio.sleep(0.2)
                assert results == ["200"] * 40, results
            finally:
                proc.kill()
                proc.wait()

    try:
        with private_daemon("corral-test-tcpsquat-", f"{CGROUP_NAME}-tcpsquat",
                            CORRAL_TCP=f"127.0.0.1:{port}", CORRAL_TOKEN=ADMIN,
                            CORRAL_TOKENS=path, CORRAL_TCP_MAX_CONNECTIONS=str(tcp_max)):
            asyncio.run(run())
    finally:
        os.unlink(path)
        os.rmdir(tokdir)
