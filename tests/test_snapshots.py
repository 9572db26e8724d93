"""Snapshots, fork, restore and pause/resume on the container substrate (docs/snapshots.md)."""

from __future__ import annotations

import asyncio
import json
import pickle
import time
from pathlib import Path

import pytest

import corral
from corral import AsyncSandbox, Sandbox, Snapshot, _core
from corral.daemon.snapshots import layer_digest
from corral.errors import (
    InvalidRequest,
    SandboxNotRunning,
    SnapshotExists,
    SnapshotNotFound,
)

from conftest import CGROUP_NAME, STATE_DIR, wait_until

LAYERS = Path(STATE_DIR, "layers")


def layer_dirs() -> set[str]:
    return {p.name for p in LAYERS.iterdir() if not p.name.startswith(".")}



@pytest.fixture
def sb():
    with Sandbox(timeout=120) as box:
        yield box


def prepare(sb: Sandbox) -> None:
    """Files of every kind of change: new, modified, deleted (file and dir), renamed."""
    sb.exec("mkdir -p /work/d /work/gone && echo one > /work/a && echo keep > /work/d/k "
            "&& echo x > /work/gone/x && echo moved > /work/old && ln -s a /work/link "
            "&& mkfifo /work/fifo && chmod 600 /work/a").check()
    # Deletions of files that come from the image (host /usr, /etc of the skeleton).
    sb.exec("rm /etc/hostname 2>/dev/null; rm -f /usr/share/common-licenses/GPL-3; "
            "mv /work/old /work/new && rm -r /work/gone").check()


def check_prepared(box: Sandbox) -> None:
    assert box.files.read("/work/a") == "one\n"
    assert box.files.stat("/work/a").mode & 0o777 == 0o600
    assert box.files.read("/work/d/k") == "keep\n"
    assert box.files.read("/work/new") == "moved\n"
    assert not box.files.exists("/work/old")
    assert not box.files.exists("/work/gone")
    assert box.files.stat("/work/link").type == "symlink"
    assert box.exec("test -p /work/fifo").exit_code == 0
    assert box.exec("test -e /usr/share/common-licenses/GPL-3").exit_code == 1
    assert box.exec("test -e /usr/share/common-licenses/GPL-2").exit_code == 0


def test_snapshot_content_carries_over(sb):
    prepare(sb)
    snap = sb.snapshot(name="content-test")
    assert snap.id.startswith("snap-") and snap.name == "content-test"
    assert snap.image == "host" and snap.parent is None and snap.sandbox_id == sb.id
    assert snap.size >= len("one\nkeep\nmoved\n") and len(snap.layers) == 1
    assert (LAYERS / snap.digest).is_dir()
    # The digest the Rust core computed while copying is the one the stored files give.
    assert layer_digest(str(LAYERS / snap.digest)) == snap.digest
    # Changes after the snapshot are not in it.
    sb.files.write("/work/a", "changed\n")
    with Sandbox(snapshot=snap, timeout=60) as box:
        assert box.last_info.snapshot == snap.id and box.last_info.image == "host"
        check_prepared(box)
        # The new sandbox writes on its own upper; the snapshot stays read-only.
        box.files.write("/work/a", "mine\n")
        box.exec("rm /work/new").check()
    with Sandbox(snapshot="content-test", timeout=60) as box:
        check_prepared(box)
    assert Snapshot.get("content-test") == snap
    assert snap.delete()
    with pytest.raises(SnapshotNotFound) as ei:
        Sandbox(snapshot=snap.id)
    assert ei.value.code == "snapshot_not_found"


def test_capture_layer_copies_exactly_and_hashes_what_it_wrote(tmp_path):
    """The one-pass copy + hash (rust/src/layer.rs) on every kind of entry an upper holds:
    big (copied in the kernel, hashed on a second thread) and small files, hard links,
    symlinks (never followed), whiteouts, FIFOs, kept and dropped overlay xattrs, set-id bits
    with foreign owners, dir mtimes; an empty or missing upper makes no part."""
    import os

    src, empty = tmp_path / "src", tmp_path / "empty"
    (src / "d" / "e").mkdir(parents=True)
    empty.mkdir()
    big = os.urandom(3 << 20)
    (src / "big").write_bytes(big)
    (src / "small").write_text("hi")
    os.link(src / "big", src / "d" / "big2")
    os.link(src / "small", src / "d" / "small2")
    os.symlink("/etc", src / "d" / "etc-link")  # a link to a host dir: copied as a link
    os.mknod(src / "wh", 0o20000 | 0o600, 0)  # an overlayfs whiteout
    os.mkfifo(src / "d" / "fifo")
    os.setxattr(src / "d", "trusted.overlay.opaque", b"y")
    os.setxattr(src / "d", "trusted.overlay.origin", b"mount-specific")
    os.setxattr(src / "small", "user.k", b"v")
    suid = src / "d" / "e" / "suid"
    suid.write_text("x")
    os.chown(suid, 1000, 1000)
    os.chmod(suid, 0o4755)
    os.utime(src / "d", ns=(1, 123_456_789_123))
    out = tmp_path / "layer"
    out.mkdir()
    digest, size = _core.capture_layer([(0, str(src), str(out / "0")),
                                        (1, str(empty), str(out / "1")),
                                        (2, str(tmp_path / "missing"), str(out / "2"))])
    assert sorted(os.listdir(out)) == ["0"]
    assert size == len(big) + len("hi") + len("x")  # hard links count once
    assert layer_digest(str(out)) == digest and len(digest) == 64
    c = out / "0"
    assert (c / "big").read_bytes() == big and (c / "d" / "small2").read_text() == "hi"
    assert os.stat(c / "big").st_ino == os.stat(c / "d" / "big2").st_ino
    assert os.readlink(c / "d" / "etc-link") == "/etc"
    assert os.stat(c / "wh", follow_symlinks=False).st_rdev == 0
    assert Path(c / "d" / "fifo").is_fifo()
    assert os.getxattr(c / "d", "trusted.overlay.opaque") == b"y"
    assert "trusted.overlay.origin" not in os.listxattr(c / "d")
    assert os.getxattr(c / "small", "user.k") == b"v"
    st = os.stat(c / "d" / "e" / "suid")
    # Set-id bits never reach a stored layer (nothing in it may run with privilege).
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (1000, 1000, 0o755)
    assert os.stat(c / "d").st_mtime_ns == 123_456_789_123
    # Same content elsewhere: same digest (content addressing); one byte more: another.
    out2 = tmp_path / "layer2"
    out2.mkdir()
    assert _core.capture_layer([(0, str(src), str(out2 / "0"))])[0] == digest
    with open(src / "big", "r+b") as f:
        f.seek(1 << 20)
        f.write(b"!")
    os.utime(src / "big", ns=(1, 1))
    os.utime(src / "d" / "big2", ns=(1, 1))
    out3 = tmp_path / "layer3"
    out3.mkdir()
    assert _core.capture_layer([(0, str(src), str(out3 / "0"))])[0] != digest


def test_layer_digest_tells_apart_trees_a_sandbox_crafted_to_collide(tmp_path):
    """Every field a sandbox chooses is terminated or length-prefixed in the manifest: trees
    whose fields would run together into the same bytes (an xattr value holding the next
    xattr, a symlink target holding the next field, a root with other metadata) hash apart,
    so a capture reusing a stored layer by digest always gets its own tree."""
    import os

    def capture(build) -> str:
        n = len(list(tmp_path.iterdir()))
        src, out = tmp_path / f"src{n}", tmp_path / f"out{n}"
        src.mkdir()
        out.mkdir()
        build(src)
        os.utime(src, ns=(1, 1))
        for p in src.rglob("*"):
            os.utime(p, ns=(1, 1), follow_symlinks=False)
        digest = _core.capture_layer([(0, str(src), str(out / "0"))])[0]
        assert layer_digest(str(out)) == digest
        return digest

    def one_value(src):
        (src / "f").write_text("x")
        os.setxattr(src / "f", "user.a", b"1;user.b=2")

    def two_values(src):
        (src / "f").write_text("x")
        os.setxattr(src / "f", "user.a", b"1")
        os.setxattr(src / "f", "user.b", b"2")

    def link_with_xattr_text(src):
        os.symlink("t" + "trusted.overlay.opaque=1;", src / "l")

    def link_plain(src):
        os.symlink("t", src / "l")
        os.setxattr(src / "l", "trusted.overlay.opaque", b"1", follow_symlinks=False)

    def root_0755(src):
        (src / "f").write_text("x")
        os.chmod(src, 0o755)

    def root_0700(src):
        (src / "f").write_text("x")
        os.chmod(src, 0o700)

    pairs = [(one_value, two_values), (link_with_xattr_text, link_plain),
             (root_0755, root_0700)]
    for a, b in pairs:
        assert capture(a) != capture(b), (a.__name__, b.__name__)
    assert capture(two_values) == capture(two_values)

    def not_utf8(src):  # the Python recomputation (a layer a node imports) hashes its bytes
        os.mkdir(os.path.join(os.fsencode(src), b"d\xff"))
        (src / "f").write_text("x")
        os.symlink(b"t\xfe", os.path.join(os.fsencode(src), b"d\xff", b"l\xfe"))

    capture(not_utf8)


def test_snapshot_of_unchanged_sandboxes_share_one_layer():
    with Sandbox(timeout=60) as a, Sandbox(timeout=60) as b:
        sa, sb_ = a.snapshot(), b.snapshot()
        assert sa.digest == sb_.digest and sa.id != sb_.id
        sa.delete()
        assert (LAYERS / sb_.digest).is_dir()  # still referenced by the other
        sb_.delete()


def test_chains_and_opaque_dirs(sb):
    sb.exec("mkdir -p /work/dir && echo 1 > /work/dir/a && echo 1 > /work/level").check()
    s1 = sb.snapshot()
    with Sandbox(snapshot=s1, timeout=60) as child:
        # Replace a directory from the lower layer wholesale: overlayfs marks it opaque.
        child.exec("rm -r /work/dir && mkdir /work/dir && echo 2 > /work/dir/b "
                   "&& echo 2 > /work/level").check()
        s2 = child.snapshot()
    assert s2.parent == s1.id and s2.layers[:1] == s1.layers and len(s2.layers) == 2
    with Sandbox(snapshot=s2, timeout=60) as g:
        assert g.files.read("/work/level") == "2\n"
        assert g.exec("ls /work/dir").stdout.split() == ["b"]
        g.files.write("/work/level", "3\n")
        s3 = g.snapshot()
    assert len(s3.layers) == 3
    # Deleting the middle of the chain leaves its layers to the child that stands on them.
    s2.delete()
    s1.delete()
    assert all((LAYERS / d).is_dir() for d in s3.layers)
    with Sandbox(snapshot=s3, timeout=60) as g:
        assert g.files.read("/work/level") == "3\n"
        assert g.exec("ls /work/dir").stdout.split() == ["b"]
    s3.delete()
    assert wait_until(lambda: not (set(s3.layers) & layer_dirs()))


def test_fork_children_are_isolated(sb):
    sb.files.write("/work/state", "parent\n")
    before = layer_dirs()  # other tests' layers (a kept snapshot) are not this fork's
    kids = sb.fork(4)
    try:
        assert len(kids) == 4 and len({k.id for k in kids}) == 4
        assert all(k.last_info.snapshot for k in kids)
        for i, k in enumerate(kids):
            assert k.files.read("/work/state") == "parent\n"
            k.files.write("/work/state", f"kid {i}\n")
        sb.files.write("/work/state", "parent changed\n")
        for i, k in enumerate(kids):
            assert k.files.read("/work/state") == f"kid {i}\n"
        assert sb.files.read("/work/state") == "parent changed\n"
        # Not kept: the fork's snapshot is not listed, its layer lives through the kids.
        snap_id = kids[0].last_info.snapshot
        assert snap_id not in {s.id for s in Snapshot.list()}
        digest_dirs = layer_dirs() - before
        assert digest_dirs
    finally:
        for k in kids:
            k.kill()
    assert wait_until(lambda: not (digest_dirs & layer_dirs()), timeout=60)


def test_fork_keep_snapshot_and_errors(sb):
    kids = sb.fork(2, name="fork-kept", keep_snapshot=True)
    try:
        snap = Snapshot.get("fork-kept")
        assert {k.last_info.snapshot for k in kids} == {snap.id}
        with pytest.raises(SnapshotExists):
            sb.snapshot(name="fork-kept")
    finally:
        for k in kids:
            k.kill()
    snap.delete()
    with pytest.raises(SnapshotNotFound):
        snap.delete()
    with pytest.raises(InvalidRequest):
        sb.fork(0)


def test_restore_in_place(sb):
    sb.files.write("/work/f", "v1\n")
    snap = sb.snapshot()
    sb.files.write("/work/f", "v2\n")
    sb.files.write("/work/extra", "x\n")
    proc = sb.exec("sleep 600", background=True)
    old_pid = sb.info().init_pid
    info = sb.restore(snap)
    assert info.id == sb.id and info.state == "running" and info.snapshot == snap.id
    assert info.init_pid != old_pid
    assert sb.files.read("/work/f") == "v1\n"
    assert not sb.files.exists("/work/extra")
    assert sb.exec("pgrep -x sleep").exit_code == 1  # its processes were restarted
    with pytest.raises(corral.CorralError):
        proc.status()
    # Restore again after more changes, and restore works on a paused sandbox too.
    sb.files.write("/work/f", "v3\n")
    sb.pause()
    assert sb.restore(snap.id).state == "running"
    assert sb.files.read("/work/f") == "v1\n"
    snap.delete()
    # The sandbox still holds the layer it was restored onto.
    assert (LAYERS / snap.digest).is_dir()
    with pytest.raises(SnapshotNotFound):
        sb.restore("snap-0000000000000000")


def test_restore_of_a_sandbox_at_its_pids_limit():
    """A fork bomb fills the pids limit; restore still starts the new init (joining a cgroup
    is not limited by pids.max) and none of the old processes survives it."""
    with Sandbox(timeout=60, pids=40) as box:
        snap = box.snapshot()
        box.exec("while true; do sleep 600 & done", background=True)
        current = [p for base in ("/sys/fs/cgroup/pids", "/sys/fs/cgroup")
                   if (p := Path(base, CGROUP_NAME, box.id, "pids.current")).exists()]
        assert current, "the sandbox's pids cgroup"
        assert wait_until(lambda: int(current[0].read_text()) >= 38, timeout=10)
        info = box.restore(snap)
        assert info.state == "running"
        assert box.exec("pgrep -c -x sleep").stdout.strip() == "0"
        assert box.exec("echo ok").stdout == "ok\n"
        assert int(current[0].read_text()) < 10
        snap.delete()


def _rss_kib(box: Sandbox, name: str) -> int:
    out = box.exec(f"awk '/^VmRSS/{{print $2}}' /proc/$(pgrep -x {name})/status").stdout
    return int(out) if out.strip().isdigit() else 0


def test_restore_of_a_sandbox_near_its_memory_limit():
    """The old processes hold most of memory_mb while the new init starts beside them."""
    with Sandbox(timeout=60, memory_mb=64) as box:
        snap = box.snapshot()
        for _ in range(3):
            box.exec("head -c 50M /dev/zero | tail > /dev/null", background=True)
            assert wait_until(lambda: box.exec("pgrep -x tail").exit_code == 0, timeout=5)
            # tail's buffer grows to ~50 MB (one line without its newline), or the sandbox's
            # memory limit ends it on the way: either way the old processes filled it
            assert wait_until(lambda: _rss_kib(box, "tail") > 40_000
                              or box.exec("pgrep -x tail").exit_code != 0, timeout=30)
            assert box.restore(snap).state == "running"
            assert box.exec("echo ok").stdout == "ok\n"
        snap.delete()


def _cpu_usage(sid: str) -> int:
    """utime + stime (clock ticks) of every process in the sandbox, read on the host."""
    total = 0
    for base in Path("/sys/fs/cgroup").iterdir():
        procs = base / CGROUP_NAME / sid / "cgroup.procs"
        if procs.exists():
            for pid in procs.read_text().split():
                try:
                    stat = Path(f"/proc/{pid}/stat").read_text()
                except OSError:
                    continue
                fields = stat[stat.rindex(")") + 2:].split()
                total += int(fields[11]) + int(fields[12])
            return total
    raise AssertionError("sandbox cgroup not found")


def test_pause_stops_cpu_and_calls_resume(sb):
    sb.exec("while :; do :; done", background=True)
    assert wait_until(lambda: _cpu_usage(sb.id) > 0)  # the loop runs
    info = sb.pause()
    assert info.state == "paused" and info.paused_at
    assert sb.info().state == "paused"  # info does not resume it
    assert sb.id in {s.id for s in Sandbox.list()}
    before = _cpu_usage(sb.id)  # final: pause returns once every process is frozen
    time.sleep(0.5)  # the window measured
    assert _cpu_usage(sb.id) == before  # not one nanosecond while frozen
    assert sb.resume().state == "running"
    assert wait_until(lambda: _cpu_usage(sb.id) > before)
    sb.pause()
    # Any exec or file call resumes it transparently.
    assert sb.exec("echo hi").stdout == "hi\n"
    assert sb.info().state == "running"
    sb.pause()
    sb.files.write("/work/x", "y")
    assert sb.info().state == "running"


def test_pause_ttl_stop_and_count():
    with Sandbox(timeout=1.0, pause_ttl="stop") as stop, Sandbox(timeout=1.0) as count:
        stop.pause()
        count.pause()

        def expired() -> bool:
            try:
                count.info()
            except SandboxNotRunning as e:
                assert e.details["reason"] == "expired"
                return True
            return False

        # The reaper's pass that expires count (its TTL ran on while paused) would have
        # expired stop too (made first, the same TTL) had its clock not stopped.
        assert wait_until(expired, 10)
        assert stop.info().state == "paused"
        exp = stop.resume().expires_at
        assert exp > time.time() + 0.2  # the paused time was added back
    with pytest.raises(InvalidRequest):
        Sandbox(pause_ttl="sometimes")


def test_snapshots_survive_daemon_restart(daemon):
    box = Sandbox(timeout=120)
    try:
        box.files.write("/work/r", "before\n")
        snap = box.snapshot(name="restart-test")
        child = Sandbox(snapshot=snap, timeout=120)
        child.pause()
        snap2 = child.snapshot()
        snap.delete()  # only the child and snap2 keep the layer now
        daemon.restart(kill9=True)
        assert Snapshot.get(snap2.id).layers == snap2.layers
        assert {snap2.id} <= {s.id for s in Snapshot.list()}
        with pytest.raises(SnapshotNotFound):
            Snapshot.get("restart-test")
        child = Sandbox.connect(child.id)
        assert child.info().state == "paused"  # still frozen, still known as paused
        assert child.files.read("/work/r") == "before\n"
        snap2.delete()
        # The re-adopted child still references its base layer: it must not be collected;
        # snap2's own layer was referenced by snap2 alone.
        assert (LAYERS / snap2.layers[0]).is_dir()
        assert wait_until(lambda: not (LAYERS / snap2.layers[1]).exists(), timeout=60)
        snap3 = child.snapshot()
        with Sandbox(snapshot=snap3, timeout=60) as g:
            assert g.files.read("/work/r") == "before\n"
        snap3.delete()
        child.kill()
        assert wait_until(lambda: not (set(snap2.layers) & layer_dirs()), timeout=60)
    finally:
        box.kill()


def test_snapshot_handles_pickle_and_async():
    async def main() -> None:
        async with AsyncSandbox(timeout=60) as sb:
            await sb.files.write("/work/a", "async\n")
            snap = await sb.snapshot()
            kids = await sb.fork(2)
            for k in kids:
                assert await k.files.read("/work/a") == "async\n"
                await k.kill()
            await sb.files.write("/work/a", "later\n")
            await sb.pause()
            await sb.restore(snap)
            assert await sb.files.read("/work/a") == "async\n"
            ids = {s.id for s in await corral.AsyncSnapshot.list()}
            assert snap.id in ids
            again = pickle.loads(pickle.dumps(snap))
            assert again == snap and await again.delete()

    asyncio.run(main())


def test_snapshot_errors_on_dead_sandbox():
    box = Sandbox(timeout=60)
    box.kill()
    with pytest.raises(SandboxNotRunning):
        box.snapshot()
    with pytest.raises(SandboxNotRunning):
        box.pause()


def test_layers_dir_has_no_leftovers():
    """Once no snapshot and no sandbox stands on a layer, it is gone."""
    if Snapshot.list() or any(b.last_info and b.last_info.snapshot for b in Sandbox.list()):
        pytest.skip("other snapshots or sandboxes on snapshots are still alive")
    assert wait_until(lambda: not layer_dirs())


def test_spare_layer_dirs_are_made_ahead_and_gone_after_restart(daemon):
    """A capture takes a layer dir made ahead (state/spares) and the store makes the next one
    off the request path; a restart (even kill -9) leaves no spare dir behind."""
    spares = Path(STATE_DIR, "spares")
    with Sandbox(timeout=60) as box:
        box.files.write("/work/a", "1")
        box.snapshot().delete()
        assert wait_until(lambda: len(list(spares.iterdir())) == 2)
        before = set(spares.iterdir())
        box.files.write("/work/b", "2")
        snap = box.snapshot()
        assert len(before - set(spares.iterdir())) == 1  # one of those became the layer
        assert (LAYERS / snap.layers[-1] / "0" / "work" / "b").is_file()
        assert layer_digest(str(LAYERS / snap.layers[-1])) == snap.layers[-1]
        empty = Sandbox(timeout=60)
        try:  # nothing changed: the spare's part dir does not make a part
            nothing = empty.snapshot()
            assert not (LAYERS / nothing.layers[-1] / "0").exists()
            nothing.delete()
        finally:
            empty.kill()
        snap.delete()
        daemon.restart(kill9=True)
        assert wait_until(lambda: not list(spares.iterdir()))


def test_legacy_json_records_are_imported(tmp_path):
    """Records of older versions (snapshots/<id>.json) move into snapshots.db once."""
    from corral.daemon.snapdb import SnapshotDB

    legacy = tmp_path / "snapshots"
    legacy.mkdir()
    rec = {"id": "snap-0123456789abcdef", "name": "old", "layers": ["d" * 64],
           "created_at": 1.0, "image": "host"}
    (legacy / f"{rec['id']}.json").write_text(json.dumps(rec))
    (legacy / "snap-x.json.tmp").write_text("{")  # an interrupted write of the old format
    db = SnapshotDB(str(tmp_path))
    try:
        assert list(db.records()) == [(rec["id"], rec)]
        assert not legacy.exists()
        db.delete(rec["id"])
        assert db.count() == 0
    finally:
        db.close()
