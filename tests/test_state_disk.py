"""The state dir's disk is shared by every tenant (docs/daemon.md, "The state dir's disk").

A private daemon runs on a state dir that is a small tmpfs of its own (never this machine's
disk), with two tenants over TCP. Alice tries to fill the disk through the daemon; bob must
keep a working sandbox disk (the btrfs scratch on its sparse image never meets a full disk),
get infra errors (never the task's) for what the daemon cannot store for him, and the daemon
must keep its log and restart.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from conftest import CGROUP_NAME, DaemonProcess, _force_cleanup, _unmount_under

ADMIN = "admin-token-0123456789"
TOKENS = {"alice": "alice-token-0123456789", "bob": "bob-token-0123456789"}
MiB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def small_disk_daemon(size_mb: int, **env: str) -> Iterator[tuple[DaemonProcess, str]]:
    """A daemon whose state dir is a tmpfs of ``size_mb`` (its scratch image inside it)."""
    top = tempfile.mkdtemp(prefix="corral-test-disk-", dir="/var/tmp")
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0700", "tmpfs", top],
                   check=True)
    state = os.path.join(top, "state")
    os.mkdir(state, 0o700)
    tokens = os.path.join(top, "tokens.json")
    with open(tokens, "w") as f:
        json.dump(TOKENS, f)
    port = free_port()
    cgroup = f"{CGROUP_NAME}-disk"
    d = DaemonProcess(state, os.path.join(state, "run", "corrald.sock"))
    with pytest.MonkeyPatch.context() as mp:
        for k, v in dict(CORRAL_CGROUP=cgroup, CORRAL_TCP=f"127.0.0.1:{port}",
                         CORRAL_TOKEN=ADMIN, CORRAL_TOKENS=tokens, **env).items():
            mp.setenv(k, v)
        try:
            d.start()
            yield d, f"http://127.0.0.1:{port}"
            d.stop()
        finally:
            d.kill9()
            _force_cleanup(cgroup)
            _unmount_under(state)
            subprocess.run(["umount", "-l", top], check=False)
            shutil.rmtree(top, ignore_errors=True)


def client(base: str, token: str) -> httpx.Client:
    return httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"},
                        timeout=300)


def ok(r: httpx.Response, status: int = 200) -> dict[str, Any]:
    assert r.status_code == status, r.text
    return r.json()


def error(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code >= 400, r.text
    return r.json()["error"]


def free_mb(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize // MiB


def clean(base: str) -> None:
    with client(base, ADMIN) as adm:
        for sb in adm.get("/v1/sandboxes").json()["sandboxes"]:
            adm.delete(f"/v1/sandboxes/{sb['id']}")
        for s in adm.get("/v1/snapshots").json()["snapshots"]:
            adm.delete(f"/v1/snapshots/{s['id']}")


def test_a_tenant_cannot_fill_the_state_dir_disk_under_the_others():
    """Alice snapshots a sandbox whose 100 MB change every time (no layer is shared) until
    the daemon refuses: before, she filled the disk (her 24th snapshot was ENOSPC as
    invalid_request, a task error), the sparse scratch image under every sandbox then hit
    the full disk, btrfs aborted and went read-only (bob's own disk: EIO), bob's upload was
    invalid_request and the daemon could not restart."""
    with small_disk_daemon(2048, CORRAL_SCRATCH_SIZE="600m", CORRAL_DISK_RESERVE_MB="256",
                           CORRAL_OUTPUT_DISK_MB="64", CORRAL_TENANT_SNAPSHOT_MB="100000"
                           ) as (d, base):
        try:
            alice, bob = client(base, TOKENS["alice"]), client(base, TOKENS["bob"])
            sa = ok(alice.post("/v1/sandboxes", json={"disk_mb": 300}), 201)["id"]
            sb = ok(bob.post("/v1/sandboxes", json={"disk_mb": 300}), 201)["id"]
            refused = None
            for _ in range(30):
                ok(alice.post(f"/v1/sandboxes/{sa}/exec", json={
                    "cmd": "head -c 100000000 /dev/urandom > /root/f"}))
                r = alice.post(f"/v1/sandboxes/{sa}/snapshot", json={})
                if r.status_code != 201:
                    refused = error(r)
                    break
            assert refused is not None, "30 snapshots of 100 MB fit on a 2 GiB disk"
            assert refused["code"] == "capacity_exceeded" and refused["infra"], refused
            assert refused["details"]["disk"] == "state_dir"
            # The reserve is left: the daemon's own state has room.
            assert free_mb(d.state_dir) >= 256 + 300, free_mb(d.state_dir)
            # Bob's sandbox disk still takes what its quota allows, written back to the
            # scratch image (sync): the image always finds its blocks.
            r = ok(bob.post(f"/v1/sandboxes/{sb}/exec", json={
                "cmd": "head -c 200000000 /dev/urandom > /root/g && sync && touch /root/h "
                       "&& ls /root"}))
            assert r["exit_code"] == 0 and "g\nh" in r["stdout"], r
            # What the daemon cannot store for bob is infra, never his task's error.
            for r in (bob.put(f"/v1/sandboxes/{sb}/files", params={"path": "/root/u"},
                              content=b"x" * (200 * MiB)),
                      bob.post(f"/v1/sandboxes/{sb}/snapshot", json={})):
                e = error(r)
                assert e["code"] == "capacity_exceeded" and e["infra"], e
            assert ok(bob.post(f"/v1/sandboxes/{sb}/exec", json={"cmd": "echo hi"}))[
                "stdout"] == "hi\n"
            d.restart(kill9=True)
            log = ok(bob.get(f"/v1/sandboxes/{sb}/log"))
            assert [e["op"] for e in log["entries"]][:2] == ["create", "exec"], log
            assert ok(bob.post(f"/v1/sandboxes/{sb}/exec", json={"cmd": "cat /root/h; echo ok"}))[
                "stdout"] == "ok\n"
        finally:
            clean(base)


def test_a_tenants_snapshots_are_bounded_in_count_and_bytes():
    """Before, a tenant's snapshots were bounded one at a time (16 GiB each) and never
    together: 24 of alice's 100 MB ones filled a 2 GiB state dir. Now each tenant's snapshots
    hold at most CORRAL_TENANT_MAX_SNAPSHOTS records and CORRAL_TENANT_SNAPSHOT_MB of
    distinct layers (its chains' too, the records deleted or not); past either, its snapshot
    and fork are quota_exceeded with nothing kept, and another tenant is untouched."""
    with small_disk_daemon(2048, CORRAL_SCRATCH_SIZE="600m", CORRAL_DISK_RESERVE_MB="256",
                           CORRAL_OUTPUT_DISK_MB="64", CORRAL_TENANT_MAX_SNAPSHOTS="4",
                           CORRAL_TENANT_SNAPSHOT_MB="250") as (d, base):
        try:
            alice, bob = client(base, TOKENS["alice"]), client(base, TOKENS["bob"])
            sa = ok(alice.post("/v1/sandboxes", json={"disk_mb": 300}), 201)["id"]
            sb = ok(bob.post("/v1/sandboxes", json={}), 201)["id"]

            def layers_on_disk() -> int:
                return len(os.listdir(os.path.join(d.state_dir, "layers")))

            # Bytes: two 100 MB snapshots fit in 250 MB, the third does not.
            made = []
            for _ in range(2):
                ok(alice.post(f"/v1/sandboxes/{sa}/exec", json={
                    "cmd": "head -c 100000000 /dev/urandom > /root/f"}))
                made.append(ok(alice.post(f"/v1/sandboxes/{sa}/snapshot", json={}), 201))
            ok(alice.post(f"/v1/sandboxes/{sa}/exec", json={
                "cmd": "head -c 100000000 /dev/urandom > /root/f"}))
            before = layers_on_disk()
            for r in (alice.post(f"/v1/sandboxes/{sa}/snapshot", json={"name": "a3"}),
                      alice.post(f"/v1/sandboxes/{sa}/fork", json={"count": 1})):
                e = error(r)
                assert e["code"] == "quota_exceeded" and e["infra"], e
                assert e["details"]["resource"] == "snapshot_bytes", e
            assert layers_on_disk() == before  # nothing kept
            assert len(ok(alice.get("/v1/snapshots"))["snapshots"]) == 2
            assert ok(alice.get("/v1/sandboxes"))["sandboxes"][0]["id"] == sa  # no child
            # A sandbox on a snapshot whose record is deleted still holds its layer: a
            # snapshot of it counts that layer (its chain).
            child = ok(alice.post("/v1/sandboxes", json={"snapshot": made[1]["id"]}),
                       201)["id"]
            ok(alice.delete(f"/v1/snapshots/{made[1]['id']}"))
            ok(alice.delete(f"/v1/snapshots/{made[0]['id']}"))
            ok(alice.post(f"/v1/sandboxes/{child}/exec", json={
                "cmd": "head -c 100000000 /dev/urandom > /root/g"}))
            ok(alice.post(f"/v1/sandboxes/{child}/snapshot", json={}), 201)  # 200 MB
            ok(alice.post(f"/v1/sandboxes/{child}/exec", json={
                "cmd": "head -c 100000000 /dev/urandom > /root/g"}))
            e = error(alice.post(f"/v1/sandboxes/{child}/snapshot", json={}))
            assert e["code"] == "quota_exceeded" and e["details"]["resource"] == "snapshot_bytes"
            # Count: small snapshots, at most 4 records.
            ok(alice.post(f"/v1/sandboxes/{child}/exec", json={"cmd": "rm /root/g"}))
            for s in ok(alice.get("/v1/snapshots"))["snapshots"]:
                ok(alice.delete(f"/v1/snapshots/{s['id']}"))
            ok(alice.post(f"/v1/sandboxes/{sa}/exec", json={"cmd": "rm /root/f"}))
            for i in range(4):
                ok(alice.post(f"/v1/sandboxes/{sa}/exec", json={"cmd": f"echo {i} > /root/n"}))
                ok(alice.post(f"/v1/sandboxes/{sa}/snapshot", json={}), 201)
            e = error(alice.post(f"/v1/sandboxes/{sa}/snapshot", json={}))
            assert e["code"] == "quota_exceeded" and e["details"]["resource"] == "snapshots", e
            # Bob's quota is his own.
            ok(bob.post(f"/v1/sandboxes/{sb}/exec", json={
                "cmd": "head -c 100000000 /dev/urandom > /root/f"}))
            ok(bob.post(f"/v1/sandboxes/{sb}/snapshot", json={}), 201)
            kids = ok(bob.post(f"/v1/sandboxes/{sb}/fork", json={"count": 2}), 201)
            assert len(kids["sandboxes"]) == 2
        finally:
            clean(base)
