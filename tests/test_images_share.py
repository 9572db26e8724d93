"""One store for what images and snapshots share: a commit lists each snapshot part that needs
no cleaning (and its own capture) as the same files, not a copy; the two stores' reference
counts know about each other, across daemon restarts (a crash too), so deleting snapshots
never removes a part an image lists and removing the image frees the part once no snapshot
holds it. A part that needs cleaning (the sandbox made a setuid file) is copied and cleaned,
the snapshot's own files untouched. Pushing an image with shared layers re-tars them for a
fresh node. A module daemon of its own (restarts) and a registry on this machine."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import time
from collections.abc import Iterator

import imagefix as fx
import pytest

import corral
from corral.errors import ImageNotFound, SnapshotNotFound
from corral.sdk import admin

from conftest import CGROUP_NAME, private_daemon

pytestmark = pytest.mark.skipif(
    not all(os.path.exists(p) for p in ("/usr/bin/docker-registry", "/usr/bin/skopeo",
                                        fx.BUSYBOX)),
    reason="needs docker-registry, skopeo and busybox-static (scripts/setup.sh)")


@pytest.fixture(scope="module")
def env() -> Iterator[dict]:
    base = fx.oci_layout("sharebase", [("gzip", fx.busybox_base()),
                                       ("gzip", [fx.d("opt"), fx.f("opt/base.txt", b"b\n")])],
                        {"Env": ["PATH=/bin"], "Cmd": ["sh"]})
    with contextlib.ExitStack() as stack:
        reg = stack.enter_context(fx.registry())
        reg.push(base, "team/sharebase")
        d = stack.enter_context(private_daemon("corral-imgs-", f"{CGROUP_NAME}-imgs",
                                               CORRAL_REGISTRIES=reg.addr))
        ep = f"unix://{d.socket_path}"
        admin.pull_image(f"{reg.addr}/team/sharebase:latest", endpoint=ep)
        yield {"reg": reg, "daemon": d, "ep": ep, "state": d.state_dir,
               "base": f"{reg.addr}/team/sharebase:latest"}


def _rm(ep: str, *names: str) -> None:
    for n in names:
        with contextlib.suppress(ImageNotFound):
            admin.remove_image(n, endpoint=ep)


def _entry(state: str, layer: str) -> tuple[dict, list[str]]:
    """A layer store entry's record and its files."""
    hexd = layer.removeprefix("sha256:")
    path = os.path.join(state, "oci", "layers", hexd)
    with open(os.path.join(path, "layer.json")) as f:
        return json.load(f), sorted(os.listdir(path))


def _part(state: str, layer: str) -> str:
    return os.path.join(state, "layers", layer.removeprefix("sha256:"), "0")


def _assert_clean(root: str) -> None:
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            m = st.st_mode
            assert not (stat.S_ISREG(m) and m & (stat.S_ISUID | stat.S_ISGID)), p
            assert not (stat.S_ISDIR(m) and m & stat.S_ISUID), p
            assert not stat.S_ISBLK(m) and not stat.S_ISSOCK(m), p
            assert not (stat.S_ISCHR(m) and st.st_rdev != 0), p
            if not stat.S_ISLNK(m):
                assert "security.capability" not in os.listxattr(p, follow_symlinks=False), p


def _gone(path: str, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while os.path.lexists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_commit_shares_parts_and_the_refcounts_hold_across_restarts(env: dict) -> None:
    ep, state, d = env["ep"], env["state"], env["daemon"]
    data = "dd if=/dev/urandom of=/home/app/big bs=64k count=16 2>/dev/null"
    try:
        with corral.Sandbox(image=env["base"], endpoint=ep) as sb:
            sb.exec(f"mkdir -p /home/app && echo one > /home/app/one && {data}",
                    user="root").check()
            snap = sb.snapshot(name="share-snap")
        with corral.Sandbox(snapshot=snap, endpoint=ep) as kid:
            kid.exec("echo two > /home/app/two; rm /opt/base.txt", user="root").check()
            info = kid.commit("shared")
            big = kid.exec("md5sum /home/app/big").stdout.split()[0]
        layers = info.layers or []
        assert len(layers) == 4 and layers[2] == "sha256:" + snap.digest, (layers, snap.digest)
        part = _part(state, layers[2])
        ino = os.stat(os.path.join(part, "home/app/big")).st_ino
        for layer in layers[2:]:  # the snapshot's part and the commit's capture: no copy
            meta, files = _entry(state, layer)
            assert meta["format"] == "snapshot" and files == ["layer.json"], (meta, files)
        assert os.path.isfile(os.path.join(_part(state, layers[3]), "home/app/two"))
        assert admin.image_info("shared", endpoint=ep).size_bytes >= 1 << 20

        snap.delete()  # the image still lists the part: it stays
        d.restart(kill9=True)  # a crash: both stores reload and agree
        assert os.stat(os.path.join(part, "home/app/big")).st_ino == ino
        with corral.Sandbox(image="shared", endpoint=ep) as c:
            r = c.exec("cat /home/app/one /home/app/two; md5sum /home/app/big;"
                       " test -e /opt/base.txt && echo WHITEOUT-LOST")
            assert r.stdout.split() == ["one", "two", big, "/home/app/big"], r.stderr
            # a commit of a sandbox of the committed image lists the shared layers as they are
            c.exec("echo three > /home/app/three").check()
            again = c.commit("shared-again")
        assert (again.layers or [])[:4] == layers and len(again.layers or []) == 5
        admin.tag_image("shared", "shared-tag", endpoint=ep)
        d.restart()

        _rm(ep, "shared", "shared-again")  # the tag still lists them
        assert os.path.isdir(part)
        with corral.Sandbox(image="shared-tag", endpoint=ep) as c:
            assert c.exec("cat /home/app/two").stdout == "two\n"
        _rm(ep, "shared-tag")  # no image, no snapshot: freed
        for layer in layers[2:]:
            assert _gone(_part(state, layer)), layer
            assert not os.path.exists(os.path.join(state, "oci", "layers", layer[7:]))
        d.restart()  # and nothing comes back
        assert not os.path.exists(part)
    finally:
        _rm(ep, "shared", "shared-again", "shared-tag")
        with contextlib.suppress(SnapshotNotFound):
            corral.Snapshot.get("share-snap", endpoint=ep).delete()


def test_removing_the_image_first_leaves_the_snapshot_whole(env: dict) -> None:
    ep, state, d = env["ep"], env["state"], env["daemon"]
    try:
        with corral.Sandbox(image=env["base"], endpoint=ep) as sb:
            sb.exec("echo kept > /opt/kept", user="root").check()
            snap = sb.snapshot(name="share-first")
        with corral.Sandbox(snapshot=snap, endpoint=ep) as kid:
            layers = kid.commit("share-img").layers or []
        part = _part(state, "sha256:" + snap.digest)
        assert layers[2] == "sha256:" + snap.digest
        _rm(ep, "share-img")
        admin.prune_images(endpoint=ep)
        d.restart()  # GC at start: the snapshot record still holds the part
        assert os.path.isfile(os.path.join(part, "opt/kept"))
        with corral.Sandbox(snapshot=snap, endpoint=ep) as kid:
            assert kid.exec("cat /opt/kept").stdout == "kept\n"
        snap.delete()
        assert _gone(part)
    finally:
        _rm(ep, "share-img")
        with contextlib.suppress(SnapshotNotFound):
            corral.Snapshot.get("share-first", endpoint=ep).delete()


def test_a_part_with_a_setuid_file_is_copied_and_cleaned(env: dict) -> None:
    """Attack: root in a sandbox makes a setuid-root shell and a setuid directory, snapshots
    it and commits a child; the image's sandboxes get no setuid bit. The capture already
    clears setuid/setgid on files; the directory's bit is the rules' to clear, so that part
    is copied and cleaned, the snapshot's own files untouched; every part shared holds
    nothing the rules would remove."""
    ep, state = env["ep"], env["state"]
    try:
        with corral.Sandbox(image=env["base"], endpoint=ep) as sb:
            r = sb.exec("cp /bin/busybox /opt/rootsh && chmod 4755 /opt/rootsh &&"
                        " mkdir /opt/sd && chmod 4755 /opt/sd && stat -c %a /opt/rootsh",
                        user="root")
            assert r.stdout.strip() == "4755", (r.stdout, r.stderr)
            snap = sb.snapshot(name="suid-snap")
        with corral.Sandbox(snapshot=snap, endpoint=ep) as kid:
            kid.exec("echo clean > /opt/clean").check()
            layers = kid.commit("suid-share").layers or []
            # the sandbox itself commits its own setuid file directly too
            kid.exec("cp /bin/busybox /opt/rootsh2 && chmod 6755 /opt/rootsh2 &&"
                     " mkdir /opt/sd2 && chmod 4755 /opt/sd2", user="root").check()
            top = kid.commit("suid-top").layers or []
        meta, files = _entry(state, layers[2])
        assert meta["format"] != "snapshot" and meta["skipped"].get("setuid", 0) >= 1, meta
        assert _entry(state, top[-1])[0]["format"] != "snapshot"
        assert _entry(state, layers[3])[0]["format"] == "snapshot"  # /opt/clean: shared
        for layer in {*layers, *top}:  # whatever is shared holds nothing the rules remove
            if _entry(state, layer)[0]["format"] == "snapshot":
                _assert_clean(_part(state, layer))
        mode = os.stat(os.path.join(_part(state, layers[2]), "opt/sd")).st_mode
        assert stat.S_IMODE(mode) == 0o4755  # the snapshot's own copy is untouched
        for name in ("suid-share", "suid-top"):
            with corral.Sandbox(image=name, endpoint=ep) as c:
                r = c.exec("stat -c %a /opt/rootsh /opt/sd; cat /opt/clean;"
                           " test -e /opt/rootsh2 && stat -c %a /opt/rootsh2 /opt/sd2")
                want = ["755", "755", "clean"] + (["755"] * 2 if name == "suid-top" else [])
                assert r.stdout.split() == want, (name, r.stdout, r.stderr)
    finally:
        _rm(ep, "suid-share", "suid-top")
        with contextlib.suppress(SnapshotNotFound):
            corral.Snapshot.get("suid-snap", endpoint=ep).delete()


def test_push_of_shared_layers_and_pull_on_a_fresh_node(env: dict) -> None:
    ep, reg, state = env["ep"], env["reg"], env["state"]
    target = f"{reg.addr}/team/sharedpush:v1"
    try:
        with corral.Sandbox(image=env["base"], endpoint=ep) as sb:
            sb.exec("mkdir -p /opt/d && echo pushed > /opt/d/f && ln /opt/d/f /opt/d/hl &&"
                    " rm /opt/base.txt", user="root").check()
            snap = sb.snapshot(name="push-snap")
        with corral.Sandbox(snapshot=snap, endpoint=ep) as kid:
            kid.exec("echo top > /opt/top").check()
            layers = kid.commit("sharedpush").layers or []
        assert all(_entry(state, h)[0]["format"] == "snapshot" for h in layers[2:])
        snap.delete()
        res = admin.push_image("sharedpush", target, endpoint=ep)
        assert len(res.layers) == 4 and res.uploaded >= 2
        with private_daemon("corral-imgsp-", f"{CGROUP_NAME}-imgsp",
                            CORRAL_REGISTRIES=reg.addr) as fresh:
            fep = f"unix://{fresh.socket_path}"
            with corral.Sandbox(image=target, endpoint=fep) as c:
                r = c.exec("cat /opt/d/f /opt/top; stat -c %h /opt/d/hl;"
                           " test -e /opt/base.txt && echo WHITEOUT-LOST")
                assert r.stdout == "pushed\ntop\n2\n", r.stderr
    finally:
        _rm(ep, "sharedpush")
        with contextlib.suppress(SnapshotNotFound):
            corral.Snapshot.get("push-snap", endpoint=ep).delete()


def _pool_ready(socket_path: str) -> float:
    import re

    import httpx

    t = httpx.HTTPTransport(uds=socket_path)
    with httpx.Client(transport=t, base_url="http://corral", timeout=10) as c:
        text = c.get("/metrics").text
    m = re.search(r"^corral_pool_ready ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_warm_pool_of_the_image_keeps_its_shared_layers(env: dict,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A pooled sandbox stacks the image's shared parts as plain directories (no mount of
    its own to outlive them): removing the image and pruning while the pool holds one keeps
    them; once the pool is gone, a prune frees them."""
    ep, state, d = env["ep"], env["state"], env["daemon"]
    try:
        with corral.Sandbox(image=env["base"], endpoint=ep) as sb:
            sb.exec("echo pooled > /opt/pooled", user="root").check()
            layers = sb.commit("pooled").layers or []
        part = _part(state, layers[-1])
        assert _entry(state, layers[-1])[0]["format"] == "snapshot"
        monkeypatch.setenv("CORRAL_POOL", "static")
        monkeypatch.setenv("CORRAL_POOL_SIZES", "pooled:1")
        monkeypatch.setenv("CORRAL_POOL_IDLE_S", "600")
        d.restart()
        deadline = time.monotonic() + 60
        while _pool_ready(d.socket_path) < 1:
            assert time.monotonic() < deadline, "the pool never filled"
            time.sleep(0.05)
        _rm(ep, "pooled")
        admin.prune_images(endpoint=ep)
        assert os.path.isfile(os.path.join(part, "opt/pooled"))
        monkeypatch.undo()
        d.restart()  # the pool and its sandbox go with the stop
        admin.prune_images(endpoint=ep)
        assert _gone(part)
    finally:
        monkeypatch.undo()
        _rm(ep, "pooled")


def test_a_pool_follows_its_image_name_to_new_content(env: dict,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """An image name given other content (a commit that replaces it, a pull of a moved
    tag): every create after it gets the new content, none a pooled sandbox of the old (28
    creates in 30 s after a replace all got the old files, with no error); the pool refills
    with the new."""
    ep, d = env["ep"], env["daemon"]
    try:
        with corral.Sandbox(image=env["base"], endpoint=ep) as sb:
            sb.exec("echo A > /VERSION", user="root").check()
            sb.commit("moving")
        monkeypatch.setenv("CORRAL_POOL", "static")
        monkeypatch.setenv("CORRAL_POOL_SIZES", "moving:1")
        monkeypatch.setenv("CORRAL_POOL_IDLE_S", "600")
        d.restart()
        _wait_pool(d.socket_path)
        with corral.Sandbox(image="moving", endpoint=ep) as sb:
            assert sb.exec("cat /VERSION").stdout == "A\n"
        _wait_pool(d.socket_path)  # refilled: a sandbox of A is ready
        with corral.Sandbox(image=env["base"], endpoint=ep) as sb:
            sb.exec("echo B > /VERSION", user="root").check()
            sb.commit("moving", replace=True)
        for _ in range(3):
            with corral.Sandbox(image="moving", endpoint=ep) as sb:
                assert sb.exec("cat /VERSION").stdout == "B\n"
        _wait_pool(d.socket_path)
        with corral.Sandbox(image="moving", endpoint=ep) as sb:  # the pool's, of B
            assert sb.exec("cat /VERSION").stdout == "B\n"
    finally:
        monkeypatch.undo()
        d.restart()
        _rm(ep, "moving")


def test_a_pull_never_replaces_an_image_made_here(env: dict) -> None:
    """Any tenant may pull. An image made here under a registry name (a commit, to push
    later) is someone's work: a pull of that name replaced it with whatever the registry
    served there (an older push), and every later sandbox of the name ran that. The pull is
    a conflict; the image made here stays."""
    from corral.errors import Conflict

    ep, reg = env["ep"], env["reg"]
    ref = f"{reg.addr}/team/made:v1"
    try:
        with corral.Sandbox(image=env["base"], endpoint=ep) as sb:
            sb.exec("echo A > /VERSION", user="root").check()
            sb.commit(ref)
            admin.push_image(ref, endpoint=ep)  # the registry serves A there
            sb.exec("echo B > /VERSION", user="root").check()
            made = sb.commit(ref, replace=True)  # B, not pushed
        with pytest.raises(Conflict):
            admin.pull_image(ref, endpoint=ep)
        assert admin.image_info(ref, endpoint=ep).layers == made.layers
        with corral.Sandbox(image=ref, endpoint=ep) as sb:
            assert sb.exec("cat /VERSION").stdout == "B\n"
        _rm(ep, ref)
        admin.pull_image(ref, endpoint=ep)  # once removed, the name pulls again
        with corral.Sandbox(image=ref, endpoint=ep) as sb:
            assert sb.exec("cat /VERSION").stdout == "A\n"
    finally:
        _rm(ep, ref)


def _wait_pool(socket_path: str) -> None:
    deadline = time.monotonic() + 60
    while _pool_ready(socket_path) < 1:
        assert time.monotonic() < deadline, "the pool never filled"
        time.sleep(0.05)


def test_commits_racing_prunes_and_snapshot_removal_lose_nothing(env: dict) -> None:
    """Prunes run back to back while sandboxes on a snapshot commit and the snapshot is
    deleted under them: every committed image still runs with all its files."""
    import threading

    ep = env["ep"]
    names = [f"race-{i}" for i in range(4)]
    stop = threading.Event()
    errors: list[BaseException] = []

    def prune() -> None:
        while not stop.is_set():
            try:
                admin.prune_images(endpoint=ep)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
                return

    pruner = threading.Thread(target=prune)
    try:
        with corral.Sandbox(image=env["base"], endpoint=ep) as sb:
            sb.exec("echo base-part > /opt/part", user="root").check()
            snap = sb.snapshot(name="race-snap")
        pruner.start()
        for i, name in enumerate(names):
            with corral.Sandbox(snapshot=snap, endpoint=ep) as kid:
                if i == len(names) - 1:
                    snap.delete()  # the kid still stands on it
                kid.exec(f"echo {i} > /opt/mine").check()
                kid.commit(name)
        stop.set()
        pruner.join(60)
        assert not errors, errors
        for i, name in enumerate(names):
            with corral.Sandbox(image=name, endpoint=ep) as c:
                assert c.exec("cat /opt/part /opt/mine").stdout == f"base-part\n{i}\n"
    finally:
        stop.set()
        if pruner.is_alive():
            pruner.join(60)
        _rm(ep, *names)
        with contextlib.suppress(SnapshotNotFound):
            corral.Snapshot.get("race-snap", endpoint=ep).delete()
