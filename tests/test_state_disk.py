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
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import imagefix as fx
import pytest

from conftest import CGROUP_NAME, DaemonProcess, _force_cleanup, _unmount_under, free_port

ADMIN = "admin-token-0123456789"
TOKENS = {"alice": "alice-token-0123456789", "bob": "bob-token-0123456789"}
MiB = 1 << 20


@contextlib.contextmanager
def small_disk_daemon(size_mb: int, tokens_file: dict[str, Any] | None = None,
                      inodes: int | None = None, **env: str) -> Iterator[tuple[DaemonProcess, str]]:
    """A daemon whose state dir is a tmpfs of ``size_mb`` (its scratch image inside it) and
    ``inodes`` inodes (None: the tmpfs default); ``tokens_file``: its tokens file's content
    (TOKENS)."""
    top = tempfile.mkdtemp(prefix="corral-test-disk-", dir="/var/tmp")
    opts = f"size={size_mb}m,mode=0700" + (f",nr_inodes={inodes}" if inodes else "")
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", top], check=True)
    state = os.path.join(top, "state")
    os.mkdir(state, 0o700)
    tokens = os.path.join(top, "tokens.json")
    with open(tokens, "w") as f:
        json.dump(TOKENS if tokens_file is None else tokens_file, f)
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
            # No copy cut into the reserve (a capture whose claim came from an estimate that
            # lagged did: -81 MB); the log's own entries may use a few KiB of it.
            assert refused["details"].get("available", 0) >= -(1 << 20), refused
            # The reserve is left: the daemon's own state has room.
            assert free_mb(d.state_dir) >= 256 + 300, free_mb(d.state_dir)
            # Bob's sandbox disk still takes what its quota allows, written back to the
            # scratch image (sync): the image always finds its blocks.
            r = ok(bob.post(f"/v1/sandboxes/{sb}/exec", json={
                "cmd": "head -c 200000000 /dev/urandom > /root/g && sync && touch /root/h "
                       "&& ls /root"}))
            assert r["exit_code"] == 0 and "g\nh" in r["stdout"], r
            # What the daemon cannot store for bob is infra, never his task's error: an upload
            # is received on the state dir first (what alice left may be short of 50 MB).
            for r in (bob.put(f"/v1/sandboxes/{sb}/files", params={"path": "/root/u"},
                              content=b"x" * (50 * MiB)),
                      bob.post(f"/v1/sandboxes/{sb}/snapshot", json={})):
                assert r.status_code in (200, 201) or (
                    error(r)["code"] == "capacity_exceeded" and error(r)["infra"]), r.text
            assert ok(bob.post(f"/v1/sandboxes/{sb}/exec", json={"cmd": "echo hi"}))[
                "stdout"] == "hi\n"
            d.restart(kill9=True)
            log = ok(bob.get(f"/v1/sandboxes/{sb}/log"))
            assert [e["op"] for e in log["entries"]][:2] == ["create", "exec"], log
            assert ok(bob.post(f"/v1/sandboxes/{sb}/exec", json={"cmd": "cat /root/h; echo ok"}))[
                "stdout"] == "ok\n"
        finally:
            clean(base)


def test_a_tenant_cannot_take_the_state_dirs_last_inodes_with_empty_files():
    """Snapshots of empty files cost no bytes: 250,000 of them took a 4 GiB state dir's last
    inode, and bob's uploads, snapshots and trajectory log entries failed (commands ran and
    were not logged). A capture claims only the inodes above the daemon's reserve."""
    with small_disk_daemon(2048, inodes=16000, CORRAL_SCRATCH_SIZE="600m",
                           CORRAL_DISK_RESERVE_MB="64", CORRAL_OUTPUT_DISK_MB="16") as (d, base):
        try:
            alice, bob = client(base, TOKENS["alice"]), client(base, TOKENS["bob"])
            sa = ok(alice.post("/v1/sandboxes", json={}), 201)["id"]
            sb = ok(bob.post("/v1/sandboxes", json={}), 201)["id"]
            refused, n = None, 0
            for size in (4000, 1000, 250, 60, 15, 1):  # snapshots of fewer files, to the end
                ok(alice.post(f"/v1/sandboxes/{sa}/exec", json={
                    "cmd": f"rm -rf /root/e && mkdir /root/e && cd /root/e && "
                           f"seq {size} | xargs touch"}))
                for _ in range(40):  # each snapshot a layer of its own
                    n += 1
                    ok(alice.post(f"/v1/sandboxes/{sa}/exec", json={"cmd": f"touch /root/n{n}"}))
                    r = alice.post(f"/v1/sandboxes/{sa}/snapshot", json={})
                    if r.status_code != 201:
                        refused = error(r)
                        break
            assert refused is not None and refused["code"] == "capacity_exceeded", refused
            assert os.statvfs(d.state_dir).f_favail >= 512  # the reserve is kept
            r = bob.put(f"/v1/sandboxes/{sb}/files", params={"path": "/root/u"}, content=b"x")
            assert r.status_code == 200 or error(r)["code"] == "capacity_exceeded", r.text
            for i in range(5):
                ok(bob.post(f"/v1/sandboxes/{sb}/exec", json={"cmd": f"echo {i}"}))
            log = ok(bob.get(f"/v1/sandboxes/{sb}/log"))
            assert [e["op"] for e in log["entries"]].count("exec") == 5, log
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


def test_a_tenants_trajectory_log_is_bounded_by_its_budget():
    """Alice's sandboxes print 1 MiB of binary a command (~4.5 MB an entry as JSON). Before,
    nothing bounded her log: it filled the 768 MiB state dir in ~40 s and every tenant's
    calls failed `internal` (the journal could not grow), bob's and the admin's too. Now her
    log holds at most CORRAL_TENANT_LOG_MB: her ended sandbox's log goes first, then her
    entries keep 4 KiB of each output, then her calls are quota_exceeded (log_bytes); her
    keys still replay, bob's calls run and are logged whole, and a kill -9 keeps the
    accounting."""
    budget_mb = 16
    binary = "head -c 1048576 /dev/urandom"
    with small_disk_daemon(768, CORRAL_SCRATCH="tmpfs", CORRAL_DISK_RESERVE_MB="128",
                           CORRAL_OUTPUT_DISK_MB="32", CORRAL_TENANT_LOG_MB=str(budget_mb)
                           ) as (d, base):
        try:
            alice, bob = client(base, TOKENS["alice"]), client(base, TOKENS["bob"])
            adm = client(base, ADMIN)
            old = ok(alice.post("/v1/sandboxes", json={}), 201)["id"]
            for _ in range(3):
                ok(alice.post(f"/v1/sandboxes/{old}/exec", json={"cmd": binary}))
            ok(alice.delete(f"/v1/sandboxes/{old}"))
            # Within her budget its log stays; reading it waits for the ingester, whose batch
            # also sees that her live sandboxes hold nothing now.
            assert len(ok(alice.get(f"/v1/sandboxes/{old}/log"))["entries"]) == 5
            live = [ok(alice.post("/v1/sandboxes", json={}), 201)["id"] for _ in range(2)]
            sb_bob = ok(bob.post("/v1/sandboxes", json={}), 201)["id"]
            early = ok(alice.post(f"/v1/sandboxes/{live[0]}/exec", json={"cmd": binary},
                                  headers={"Idempotency-Key": "early"}))
            # The flood: keyed, so that a compact entry's replay can be checked.
            first: dict[str, dict[str, Any]] = {}
            refused = None
            for i in range(1500):
                sid = live[i % 2]
                r = alice.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": binary},
                               headers={"Idempotency-Key": f"f{i}"})
                if r.status_code != 200:
                    refused = error(r)
                    break
                first[f"f{i}"] = {"sid": sid, **r.json()}
            assert refused is not None, "1500 execs of 1 MiB fit in alice's log"
            assert refused["code"] == "quota_exceeded" and refused["infra"], refused
            assert refused["details"]["resource"] == "log_bytes", refused
            assert refused["details"]["limit"] == budget_mb << 20
            assert free_mb(d.state_dir) > 128 + 100, free_mb(d.state_dir)
            # Her ended sandbox's log went first.
            assert alice.get(f"/v1/sandboxes/{old}/log").status_code == 404
            # Her keys replay: the early one whole, a compact one as its first 4 KiB.
            again = ok(alice.post(f"/v1/sandboxes/{live[0]}/exec", json={"cmd": binary},
                                  headers={"Idempotency-Key": "early"}))
            assert again["stdout"] == early["stdout"] and not again["truncated"]
            # Which of her entries were kept compact follows the log's ingester (the half
            # budget is seen once the entries before are counted): either sandbox's.
            compact = [e for sid in live for e in ok(alice.get(f"/v1/sandboxes/{sid}/log"))[
                "entries"] if (e["result"] or {}).get("log_budget")]
            assert compact, "no entry of alice's was kept compact"
            key = compact[-1]["idempotency_key"]
            then = first[key]
            replayed = ok(alice.post(f"/v1/sandboxes/{then['sid']}/exec", json={"cmd": binary},
                                     headers={"Idempotency-Key": key}))
            assert replayed["stdout"] == then["stdout"][:4096] and replayed["truncated"]
            assert replayed["stdout_bytes"] == then["stdout_bytes"] == 1 << 20
            assert len(compact[-1]["result"]["stdout_tail"]) == 4096
            # Bob and the admin are untouched, logged whole.
            r = ok(bob.post(f"/v1/sandboxes/{sb_bob}/exec", json={"cmd": binary}))
            last = ok(bob.get(f"/v1/sandboxes/{sb_bob}/log"))["entries"][-1]
            assert last["result"]["stdout"] == r["stdout"], "bob's output was cut"
            assert "log_budget" not in last["result"]
            sb_adm = ok(adm.post("/v1/sandboxes", json={}), 201)["id"]
            ok(adm.post(f"/v1/sandboxes/{sb_adm}/exec", json={"cmd": binary}))
            # A kill -9 keeps the accounting: she is refused at once, bob is not.
            d.restart(kill9=True)
            e = error(alice.post(f"/v1/sandboxes/{live[0]}/exec", json={"cmd": "true"}))
            assert e["code"] == "quota_exceeded" and e["details"]["resource"] == "log_bytes"
            assert ok(bob.post(f"/v1/sandboxes/{sb_bob}/exec", json={"cmd": "echo hi"}))[
                "stdout"] == "hi\n"
            # A kill is never refused; once her sandboxes end, their logs make room.
            for sid in live:
                ok(alice.delete(f"/v1/sandboxes/{sid}"))
            deadline = time.monotonic() + 30
            while True:
                r = alice.post("/v1/sandboxes", json={})
                if r.status_code == 201 or time.monotonic() > deadline:
                    break
                time.sleep(0.1)  # the ingester's next batch prunes her ended logs
            assert r.status_code == 201, r.text
            out = ok(alice.post(f"/v1/sandboxes/{r.json()['id']}/exec", json={"cmd": binary}))
            assert out["stdout_bytes"] == 1 << 20
        finally:
            clean(base)


def test_a_tenants_tokens_file_entry_sets_its_own_snapshot_and_log_quotas():
    """Carol's entry gives her 1 snapshot of at most 10 MB and a 2 MiB log in place of the
    daemon's defaults (4 snapshots, 250 MB, 64 MiB of log), which alice keeps."""
    carol = "carol-token-0123456789"
    tokens = {**TOKENS, "carol": {"token": carol, "max_snapshots": 1, "snapshot_mb": 10,
                                  "log_mb": 2}}
    with small_disk_daemon(1024, tokens, CORRAL_SCRATCH="tmpfs",
                           CORRAL_DISK_RESERVE_MB="128", CORRAL_OUTPUT_DISK_MB="32",
                           CORRAL_TENANT_MAX_SNAPSHOTS="4", CORRAL_TENANT_SNAPSHOT_MB="250",
                           CORRAL_TENANT_LOG_MB="64") as (_, base):
        try:
            alice, cl = client(base, TOKENS["alice"]), client(base, carol)
            sa = ok(alice.post("/v1/sandboxes", json={}), 201)["id"]
            sc = ok(cl.post("/v1/sandboxes", json={}), 201)["id"]
            # Bytes: a 20 MB layer passes her 10 MB, not alice's 250.
            for c, sid in ((alice, sa), (cl, sc)):
                ok(c.post(f"/v1/sandboxes/{sid}/exec", json={
                    "cmd": "head -c 20000000 /dev/urandom > /root/f"}))
            ok(alice.post(f"/v1/sandboxes/{sa}/snapshot", json={}), 201)
            e = error(cl.post(f"/v1/sandboxes/{sc}/snapshot", json={}))
            assert (e["code"], e["details"]["resource"]) == ("quota_exceeded",
                                                             "snapshot_bytes"), e
            assert e["details"]["limit"] == 10 * MiB, e
            # Count: one small snapshot, then none; alice makes her second.
            ok(cl.post(f"/v1/sandboxes/{sc}/exec", json={"cmd": "rm /root/f"}))
            ok(cl.post(f"/v1/sandboxes/{sc}/snapshot", json={}), 201)
            e = error(cl.post(f"/v1/sandboxes/{sc}/snapshot", json={}))
            assert (e["code"], e["details"]["resource"]) == ("quota_exceeded", "snapshots"), e
            assert e["details"]["limit"] == 1, e
            ok(alice.post(f"/v1/sandboxes/{sa}/snapshot", json={}), 201)
            # Log: 1 MiB outputs reach her 2 MiB budget within a few calls; alice's 64 MiB
            # takes the same calls.
            binary = "head -c 1048576 /dev/urandom"
            refused = None
            for _ in range(40):
                r = cl.post(f"/v1/sandboxes/{sc}/exec", json={"cmd": binary})
                ok(alice.post(f"/v1/sandboxes/{sa}/exec", json={"cmd": binary}))
                if r.status_code != 200:
                    refused = error(r)
                    break
            assert refused is not None, "40 outputs of 1 MiB fit in carol's 2 MiB log"
            assert refused["details"]["resource"] == "log_bytes", refused
            assert refused["details"]["limit"] == 2 * MiB, refused
            assert ok(alice.post(f"/v1/sandboxes/{sa}/exec", json={"cmd": "echo hi"}))[
                "stdout"] == "hi\n"
        finally:
            clean(base)


@pytest.mark.skipif(not all(os.path.exists(p) for p in ("/usr/bin/docker-registry",
                                                       "/usr/bin/skopeo")),
                    reason="needs docker-registry and skopeo (scripts/setup.sh)")
def test_a_pull_stops_before_the_reserve_not_only_at_its_start():
    """A pull was checked against the disk's reserve once, at its start: alice's pull of an
    image of 2 x 160 MB (zeros, a few hundred KB compressed) with ~150 MB left above the
    reserve unpacked and converted into the reserve until the disk was full. Its layers are
    checked as they unpack: the pull is capacity_exceeded, leaves nothing, and the disk never
    comes within 64 MiB of the reserve's edge."""
    layout = fx.oci_layout("diskfill", [("zstd", [fx.f("a", 160 << 20)]),
                                        ("zstd", [fx.f("b", 160 << 20)])])
    reserve_mb = 512
    with fx.registry() as reg:
        reg.push(layout, "team/diskfill")
        with small_disk_daemon(704, CORRAL_SCRATCH="tmpfs",
                               CORRAL_DISK_RESERVE_MB=str(reserve_mb),
                               CORRAL_OUTPUT_DISK_MB="16", CORRAL_IMAGE_MAX_BYTES=str(1 << 30),
                               CORRAL_REGISTRIES=",".join(reg.names)) as (d, base):
            lowest = [free_mb(d.state_dir)]
            done = threading.Event()

            def watch() -> None:
                while not done.wait(0.005):
                    lowest[0] = min(lowest[0], free_mb(d.state_dir))

            watcher = threading.Thread(target=watch)
            watcher.start()
            try:
                with client(base, TOKENS["alice"]) as alice:
                    e = error(alice.post("/v1/images/pull", json={
                        "reference": f"{reg.addr}/team/diskfill:latest"}))
            finally:
                done.set()
                watcher.join()
            assert e["code"] == "capacity_exceeded" and e["infra"], e
            assert lowest[0] > reserve_mb - 64, lowest[0]
            assert os.listdir(os.path.join(d.state_dir, "oci", "tmp")) == []
            with client(base, TOKENS["bob"]) as bob:  # the daemon still works for others
                sid = ok(bob.post("/v1/sandboxes", json={}), 201)["id"]
                assert ok(bob.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo hi"}))[
                    "stdout"] == "hi\n"
            clean(base)


def test_sparse_files_weigh_in_a_tenants_snapshot_quota_what_they_take_of_the_disk():
    """A snapshot's size was the larger of its files' apparent sizes and what the copy took:
    a sandbox's 15 GiB sparse files on 29 MB of disk took its tenant's quota, and her honest
    snapshots and forks were quota_exceeded (infra, masked). The copy keeps the holes, and
    the quota counts what it took."""
    tokens = {**TOKENS, "alice": {"token": TOKENS["alice"], "snapshot_mb": 64}}
    with small_disk_daemon(2048, tokens_file=tokens, CORRAL_SCRATCH_SIZE="600m",
                           CORRAL_DISK_RESERVE_MB="64", CORRAL_OUTPUT_DISK_MB="16") as (_, base):
        try:
            alice = client(base, TOKENS["alice"])
            sparse = ok(alice.post("/v1/sandboxes", json={}), 201)["id"]
            ok(alice.post(f"/v1/sandboxes/{sparse}/exec", json={
                "cmd": "truncate -s 1G /root/s && printf x >> /root/s"}))
            snap = ok(alice.post(f"/v1/sandboxes/{sparse}/snapshot", json={}), 201)
            assert snap["size"] < 1 << 20, snap
            honest = ok(alice.post("/v1/sandboxes", json={}), 201)["id"]
            ok(alice.post(f"/v1/sandboxes/{honest}/exec", json={
                "cmd": "head -c 10000000 /dev/urandom > /root/d"}))
            snap = ok(alice.post(f"/v1/sandboxes/{honest}/snapshot", json={}), 201)
            assert 10_000_000 <= snap["size"] < 11 << 20, snap
        finally:
            clean(base)


def test_a_tenants_snapshots_of_empty_files_count_against_her_quota():
    """A snapshot's size was its file data: seven snapshots of trees of empty files held
    every inode above the daemon's reserve at 0 bytes of a 1 MB quota, and the other
    tenant's snapshots were capacity_exceeded until she deleted them. A layer weighs what
    its copy took of the disk: a block for each entry."""
    tokens = {**TOKENS, "alice": {"token": TOKENS["alice"], "snapshot_mb": 8}}
    with small_disk_daemon(2048, tokens_file=tokens, CORRAL_SCRATCH_SIZE="600m",
                           CORRAL_DISK_RESERVE_MB="64", CORRAL_OUTPUT_DISK_MB="16") as (_, base):
        try:
            alice = client(base, TOKENS["alice"])
            sa = ok(alice.post("/v1/sandboxes", json={}), 201)["id"]
            ok(alice.post(f"/v1/sandboxes/{sa}/exec", json={
                "cmd": "mkdir /root/e && cd /root/e && seq 1500 | xargs touch"}))
            snap = ok(alice.post(f"/v1/sandboxes/{sa}/snapshot", json={}), 201)
            assert snap["size"] >= 1500 * 4096, snap  # not 0: its entries take the disk
            ok(alice.post(f"/v1/sandboxes/{sa}/exec", json={
                "cmd": "mkdir /root/f && cd /root/f && seq 1500 | xargs touch"}))
            e = error(alice.post(f"/v1/sandboxes/{sa}/snapshot", json={}))
            assert e["code"] == "quota_exceeded" and e["details"]["resource"] == "snapshot_bytes", e
        finally:
            clean(base)
