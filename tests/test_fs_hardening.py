"""Attacks on the daemon through what a sandbox's files hold: deep trees, sparse files,
decompression bombs, pseudo-filesystems and special files, set-id bits, disk use, and tars
that would write outside the client's directory. The daemon must stay up, keep its memory
and the host's disk independent of what a sandbox holds, and answer with clear error codes."""

from __future__ import annotations

import gzip
import io
import os
import re
import signal
import stat
import subprocess
import tarfile
import threading
import time
from pathlib import Path

import pytest

from corral import Sandbox
from corral.errors import (
    CorralError,
    DirectoryNotEmpty,
    ForbiddenPath,
    InvalidRequest,
    TooLarge,
)
from corral.sdk import tarball

import apiclient
from conftest import STATE_DIR, wait_until

LAYERS = Path(STATE_DIR, "layers")
SANDBOXES = Path(STATE_DIR, "sandboxes")
MiB = 1 << 20



def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def sh(sb: Sandbox, cmd: str, timeout: float = 120) -> str:
    r = sb.exec("mkdir -p /work && " + cmd, timeout=timeout)
    assert r.exit_code == 0, (cmd, r.stdout, r.stderr)
    return r.stdout


DEEP = """python3 - <<'EOF'
import os
import re
os.makedirs('/work/deep', exist_ok=True)
d = os.open('/work/deep', os.O_RDONLY)
for i in range({n}):
    os.mkdir('d', dir_fd=d)
    if i % 1000 == 0:
        os.close(os.open('f', os.O_CREAT | os.O_WRONLY, dir_fd=d))
    nd = os.open('d', os.O_RDONLY, dir_fd=d)
    os.close(d)
    d = nd
print('ok')
EOF"""


# ---- deep trees ------------------------------------------------------------------------------
def test_deep_tree_snapshot_fork_destroy_and_restart(daemon):
    """A 9,000-deep tree: snapshot and fork fail with a clear code, the daemon stays up, and
    destroying the sandbox (and recovering after kill -9) removes it all."""
    sb = Sandbox(memory_mb=256)
    try:
        assert "ok" in sh(sb, DEEP.format(n=9000))
        layers_before = set(os.listdir(LAYERS))
        for attempt in (sb.snapshot, lambda: sb.fork(1)):
            with pytest.raises(TooLarge) as e:
                attempt()
            assert e.value.code == "too_large" and e.value.details["limit"] == "depth"
        assert set(os.listdir(LAYERS)) == layers_before  # nothing half-made kept
        with apiclient.client() as c:  # a tar of it: refused before the first byte
            r = c.get(f"/v1/sandboxes/{sb.id}/files/tar", params={"path": "/work/deep"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_large"
        assert sh(sb, "echo alive").strip() == "alive"  # thawed after the failed capture
        # kill -9 the daemon and the sandbox's init: recovery finds a dead sandbox whose
        # upper holds the deep tree, and must remove it and start.
        init_pid = sb.info().init_pid
        sid = sb.id
        daemon.kill9()
        os.kill(init_pid, signal.SIGKILL)
        daemon.start()
        assert wait_until(lambda: not (SANDBOXES / sid).exists(), 20.0)
        assert not (SANDBOXES / ".quarantine").exists()
        with apiclient.client() as c:
            metrics = c.get("/metrics").text
        assert re.search(r"^corral_quarantined_trees_total 0(\.0)?$", metrics, re.M)
    finally:
        try:
            sb.kill()
        except CorralError:
            pass


def test_deep_tree_destroy_frees_everything(daemon):
    with Sandbox(memory_mb=256) as sb:
        sh(sb, "echo before > /work/mark")
        snap = sb.snapshot()
        assert "ok" in sh(sb, DEEP.format(n=9000))
        sb.restore(snap)  # the old upper, deep tree and all, goes to the trash
        assert sh(sb, "cat /work/mark; ls /work").split() == ["before", "mark"]
        assert wait_until(lambda: not any((SANDBOXES / ".trash").iterdir()), 60)
        snap.delete()
        assert "ok" in sh(sb, DEEP.format(n=9000))
        sid = sb.id
        # A files-API recursive remove walks it too (iteratively).
        sb.files.remove("/work/deep", recursive=True)
        assert not sb.files.exists("/work/deep")
        assert "ok" in sh(sb, DEEP.format(n=9000))
    assert wait_until(lambda: not (SANDBOXES / sid).exists(), 20.0)
    assert daemon.proc.poll() is None


GROW = """python3 - <<'EOF'
import os
os.makedirs('/work/grow', exist_ok=True)
for p in range(3):
    if os.fork() == 0:
        os.chdir('/work/grow')
        i = 0
        while i < 50_000_000 and not os.path.exists('/work/stop'):
            i += 1
            try:
                os.close(os.open(f'{p}_{i}', os.O_CREAT | os.O_WRONLY))
            except OSError:
                pass
            if i == 2000:
                open(f'/work/started{p}', 'w').close()
        os._exit(0)
EOF"""


def test_a_directory_the_sandbox_keeps_filling_does_not_hold_its_removal(daemon):
    """A recursive remove of a directory that processes in the sandbox keep filling ends: as
    soon as it is empty for a moment, or with directory_not_empty. One that never ended held
    a worker thread of the daemon and, since a destroy waits for the sandbox's file
    operations, made the sandbox impossible to kill, its TTL included. (A tree made ever
    deeper ahead of the walk is bounded by the names a removal handles: rust/src/tree.rs.)"""
    with Sandbox(timeout=600) as sb:
        sb.exec(GROW, background=True)
        assert wait_until(lambda: all(sb.files.exists(f"/work/started{p}") for p in range(3)),
                          60)
        outcome: list[object] = []

        def remove() -> None:
            try:
                sb.files.remove("/work/grow", recursive=True)
                outcome.append("removed")
            except CorralError as e:
                outcome.append(e)

        t = threading.Thread(target=remove, daemon=True)
        t.start()
        t.join(90)
        ended = not t.is_alive()
        sb.files.write("/work/stop", b"")  # the writers stop: an old daemon's walk ends too
        t.join(300)
        assert ended, "the removal did not end while the sandbox kept writing"
        assert outcome == ["removed"] or isinstance(outcome[0], DirectoryNotEmpty), outcome
        assert wait_until(lambda: sb.exec("pgrep -c python3 || true").stdout.strip() == "0",
                          60)
        if sb.files.exists("/work/grow"):
            sb.files.remove("/work/grow", recursive=True)
        assert not sb.files.exists("/work/grow")
    assert daemon.proc.poll() is None


def test_a_huge_directory_listing_is_refused(daemon):
    with Sandbox() as sb:
        sh(sb, "python3 -c \"import os; os.makedirs('/work/many'); "
               "[open(f'/work/many/{i}', 'w').close() for i in range(100001)]\"")
        with pytest.raises(TooLarge) as e:
            sb.files.list("/work/many")
        assert e.value.details["limit"] == "entries"
        sb.files.remove("/work/many", recursive=True)


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100


def test_paging_through_a_big_directory_costs_each_entry_once(daemon):
    """A listing is paged (1,000 entries a page): each page stats only its own entries, in a
    worker thread. Stat'ing and building every entry for every page made 30,000 names cost
    the daemon ~13 s of CPU on its event loop (100,000: ~140 s), stalling every sandbox.
    Every name comes once, in byte order, also across names that are not UTF-8."""
    with Sandbox() as sb:
        n = 30_000
        sh(sb, f"python3 -c \"import os; os.makedirs('/work/many'); "
               f"[open(f'/work/many/{{i:05}}', 'w').close() for i in range({n})]; "
               f"open(b'/work/many/00500\\\\xff', 'w').close()\"")
        pid = daemon.proc.pid
        before = _cpu_s(pid)
        names = [e.name for e in sb.files.list("/work/many")]
        spent = _cpu_s(pid) - before
        want = sorted([f"{i:05}" for i in range(n)] + ["00500\udcff"], key=os.fsencode)
        assert names == want, (len(names), names[:3])
        assert spent < 4.0, spent
        sb.files.remove("/work/many", recursive=True)


# ---- sparse files: daemon memory and host disk -------------------------------------------------
def test_sparse_file_read_and_tar_keep_daemon_memory_flat(daemon):
    pid = daemon.proc.pid
    with Sandbox() as sb:
        sh(sb, "mkdir -p /work/sp && truncate -s 1G /work/one && "
               "truncate -s 900M /work/sp/a /work/sp/b")
        sid = sb.id
        with apiclient.client(timeout=300) as c:
            before = rss_kib(pid)
            peak, got = before, 0
            with c.stream("GET", f"/v1/sandboxes/{sid}/files",
                          params={"path": "/work/one"}) as r:
                assert r.status_code == 200
                for chunk in r.iter_bytes(1 << 20):
                    got += len(chunk)
                    if got % (64 * MiB) < len(chunk):
                        peak = max(peak, rss_kib(pid))
            assert got == 1 << 30
            after_read = rss_kib(pid)
            tar_bytes = 0
            with c.stream("GET", f"/v1/sandboxes/{sid}/files/tar",
                          params={"path": "/work/sp"}) as r:
                assert r.status_code == 200
                for chunk in r.iter_bytes(1 << 20):
                    tar_bytes += len(chunk)
                    if tar_bytes % (64 * MiB) < len(chunk):
                        peak = max(peak, rss_kib(pid))
            assert tar_bytes >= 1800 * MiB
            after_tar = rss_kib(pid)
        growth = max(peak, after_read, after_tar) - before
        print(f"corrald RSS KiB: before {before}, after 1 GiB read {after_read}, "
              f"after 2x900 MiB tar {after_tar}, peak seen {peak}")
        assert growth < 200 * 1024, f"daemon grew by {growth} KiB"


def test_tar_download_over_the_cap_is_refused_before_streaming(daemon):
    with Sandbox() as sb:
        sh(sb, "mkdir -p /work/big && truncate -s 100G /work/big/sparse")
        with apiclient.client() as c:
            r = c.get(f"/v1/sandboxes/{sb.id}/files/tar", params={"path": "/work/big"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_large"


def test_snapshot_of_a_sparse_file_writes_little_to_disk(daemon):
    with Sandbox() as sb:
        sh(sb, "truncate -s 2G /work/sparse && echo tail >> /work/sparse && "
               "chmod 4755 /work/sparse")
        snap = sb.snapshot()
        f = LAYERS / snap.digest / "0" / "work" / "sparse"
        st = f.stat()
        assert st.st_size == (2 << 30) + 5
        assert st.st_blocks * 512 < 4 * MiB, f"{st.st_blocks * 512} bytes on disk"
        print(f"2 GiB sparse file snapshot: {st.st_blocks * 512} bytes on the host disk")
        with Sandbox(snapshot=snap) as kid:
            assert sh(kid, "tail -c 5 /work/sparse").strip() == "tail"
        snap.delete()
        # Past the snapshot size bound (16 GiB of content by default): refused at once, the
        # sandbox thawed and unchanged.
        sh(sb, "truncate -s 100G /work/huge")
        t0 = time.monotonic()
        with pytest.raises(TooLarge) as e:
            sb.snapshot()
        assert e.value.details["limit"] == "bytes" and time.monotonic() - t0 < 10
        assert sh(sb, "echo alive").strip() == "alive"


# ---- set-id bits and file capabilities -----------------------------------------------------------
def test_setid_bits_and_file_caps_never_reach_a_stored_layer(daemon):
    with Sandbox() as sb:
        sh(sb, "mkdir -p /work/s && cp /bin/true /work/s/suid && chmod 4755 /work/s/suid && "
               "cp /bin/true /work/s/sgid && chmod 2755 /work/s/sgid && "
               "mkdir /work/s/gdir && chmod 2775 /work/s/gdir")
        # A file capability from inside (root of the user namespace may set one).
        capped = sb.exec("python3 -c \"import os; os.system('cp /bin/true /work/s/cap'); "
                         "os.setxattr('/work/s/cap', 'security.capability', "
                         "bytes.fromhex('0100000200200000000000000000000000000000'))\"")
        snap = sb.snapshot()
        layer = LAYERS / snap.digest / "0" / "work" / "s"
        for name in ("suid", "sgid"):
            mode = (layer / name).stat().st_mode
            assert not mode & (stat.S_ISUID | stat.S_ISGID), (name, oct(mode))
            assert mode & 0o777 == 0o755
        if capped.exit_code == 0:
            assert "security.capability" not in os.listxattr(layer / "cap")
        with Sandbox(snapshot=snap) as kid:
            out = sh(kid, "stat -c %a /work/s/suid /work/s/sgid").split()
            assert out == ["755", "755"]
        snap.delete()


def test_capture_drops_file_capabilities(tmp_path):
    """The same on the host side, where a file capability can always be set."""
    from corral import _core

    src = tmp_path / "upper"
    src.mkdir()
    f = src / "ping"
    f.write_bytes(b"\x7fELF")
    os.setxattr(f, "security.capability",
                bytes.fromhex("0100000200200000000000000000000000000000"))
    os.chmod(f, 0o6755)
    _core.capture_layer([(0, str(src), str(tmp_path / "layer"))])
    out = tmp_path / "layer" / "ping"
    assert "security.capability" not in os.listxattr(out)
    assert out.stat().st_mode & 0o7777 == 0o755


# ---- uploads ---------------------------------------------------------------------------------
def _gzip_bomb(member_size: int) -> bytes:
    """A gzip'd tar of one member of ``member_size`` zeros, a few hundred KiB big: gzip
    members concatenated decompress as one stream."""
    ti = tarfile.TarInfo("bomb")
    ti.size = member_size
    block = gzip.compress(bytes(64 * MiB), compresslevel=9)
    return gzip.compress(ti.tobuf(tarfile.GNU_FORMAT)) + block * (member_size // (64 * MiB))


def test_gzip_bomb_upload_is_bounded(daemon):
    pid = daemon.proc.pid
    with Sandbox(disk_mb=64) as sb:
        bomb = _gzip_bomb(8 << 30)
        assert len(bomb) < 16 * MiB
        before = rss_kib(pid)
        with apiclient.client() as c:
            r = c.put(f"/v1/sandboxes/{sb.id}/files/tar", params={"path": "/work/up"},
                      content=bomb)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "too_large" and err["details"]["limit"] == "disk_mb"
        assert rss_kib(pid) - before < 200 * 1024
        size = int(sh(sb, "stat -c %s /work/up/bomb").strip())
        assert size <= 64 * MiB


def test_upload_with_a_huge_extended_header_is_refused(daemon):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        ti = tarfile.TarInfo("x")
        ti.pax_headers = {"comment": "a" * (4 * MiB)}
        tf.addfile(ti, io.BytesIO(b""))
    with Sandbox() as sb, apiclient.client() as c:
        r = c.put(f"/v1/sandboxes/{sb.id}/files/tar", params={"path": "/work/up"},
                  content=gzip.compress(buf.getvalue()))
        assert r.status_code == 400, r.text
        assert r.json()["error"]["details"]["limit"] == "header_bytes"


def test_upload_decompression_is_bounded():
    """The decompressed-size bound itself, without a sandbox: a stream of zeros past it."""
    from corral.daemon import uploads

    reader = uploads.open_bounded(gzip.compress(bytes(8 * MiB)), 4 * MiB)
    with pytest.raises(TooLarge):
        while reader.read(MiB):
            pass


# ---- files API: pseudo-filesystems and special files --------------------------------------------
def test_files_api_refuses_proc_sys_and_special_files(daemon):
    with Sandbox() as sb:
        sh(sb, "ln -s /proc/1/environ /work/env && ln -s /proc /work/p && "
               "ln -s /dev/pts /work/k && mkfifo /work/fifo")
        for path in ("/work/env", "/proc/1/environ", "/proc/self/status", "/work/p/1/environ",
                     "/proc/kpageflags", "/proc/99999/environ", "/dev/pts/ptmx", "/work/k/0",
                     "/dev/zero", "/dev/null", "/work/fifo"):
            with pytest.raises(ForbiddenPath) as e:
                sb.files.read_bytes(path)
            assert e.value.code == "forbidden_path", path
        for path in ("/proc/1/fd", "/work/p/1/fd", "/proc", "/proc/self/fd", "/dev/pts",
                     "/work/k"):
            with pytest.raises(ForbiddenPath):
                sb.files.list(path)
        for path in ("/proc/1/environ", "/proc/1"):
            with pytest.raises(ForbiddenPath):
                sb.files.stat(path)
        with pytest.raises(ForbiddenPath):
            sb.files.write("/dev/null", b"x")
        with pytest.raises(ForbiddenPath):
            sb.files.write("/proc/1/oom_score_adj", b"1000")
        with pytest.raises(ForbiddenPath):
            sb.files.mkdir("/proc/1/evil")
        with pytest.raises(ForbiddenPath):
            sb.files.remove("/proc/1/environ")
        for path in ("/proc", "/dev/pts", "/proc/1"):
            with pytest.raises((ForbiddenPath, InvalidRequest)):
                sb.files.remove(path, recursive=True)
        assert sh(sb, "cat /proc/1/comm && ls /dev/pts/ptmx")
        # lxcfs's FUSE views (/proc/meminfo ...) are answered by a daemon process, with the
        # daemon's view: not the sandbox's files either
        if "fuse" in sh(sb, "grep ' /proc/meminfo ' /proc/self/mounts || true"):
            with pytest.raises(ForbiddenPath):
                sb.files.read("/proc/meminfo")
        assert sb.files.stat("/work/env").type == "symlink"  # the link itself is fine
        assert [e.name for e in sb.files.list("/work")] == ["env", "fifo", "k", "p"]


# ---- disk_mb -------------------------------------------------------------------------------------
def test_disk_mb_bounds_tmp_and_daemon_writes(daemon):
    with Sandbox(disk_mb=16) as sb:
        r = sb.exec("dd if=/dev/zero of=/tmp/fill bs=1M count=32")
        full = ("Disk quota exceeded", "No space left")  # btrfs quota; tmpfs fallback
        assert r.exit_code != 0 and any(m in r.stderr for m in full)
        sb.exec("rm /tmp/fill")  # /tmp is on the sandbox's disk (the tmpfs fallback: its own)
        with pytest.raises(TooLarge) as e:
            sb.files.write("/work/big", bytes(20 * MiB))
        assert e.value.details["limit"] == "disk_mb"
        sb.files.write("/work/ok", bytes(8 * MiB))
        sb.files.write("/work/ok", bytes(8 * MiB))  # a rewrite frees what it replaces
        with pytest.raises(TooLarge):
            sb.files.write("/work/more", bytes(9 * MiB))


# ---- SDK download: validate every member first -----------------------------------------------
def test_sdk_download_validates_before_extracting(tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in (("good.txt", b"ok"), ("../evil.txt", b"bad")):
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    with pytest.raises(InvalidRequest):
        tarball.unpack(buf.getvalue(), tmp_path / "out")
    assert not (tmp_path / "out" / "good.txt").exists()
    assert not (tmp_path / "evil.txt").exists()


def test_sdk_download_of_a_hostile_sandbox_tree_extracts_nothing(daemon, tmp_path):
    with Sandbox() as sb:
        sh(sb, "mkdir -p /work/d && echo a > /work/d/a && ln -s /etc/passwd /work/d/z")
        with pytest.raises(InvalidRequest):
            sb.files.download("/work/d", tmp_path / "out")
        assert not (tmp_path / "out" / "a").exists()


# ---- host-side walks: image import, removal, quarantine ----------------------------------------
def _deep_host_tree(root: Path, n: int) -> None:
    d = os.open(root, os.O_RDONLY)
    for _ in range(n):
        os.mkdir("d", dir_fd=d)
        nd = os.open("d", os.O_RDONLY, dir_fd=d)
        os.close(d)
        d = nd
    os.close(d)


def test_image_import_of_a_deep_tree_fails_cleanly(tmp_path):
    from corral.daemon.images import _copy_tree

    (tmp_path / "src").mkdir()
    (tmp_path / "dst").mkdir()
    _deep_host_tree(tmp_path / "src", 2000)  # past the recursion limit and the depth bound
    with pytest.raises(InvalidRequest):
        _copy_tree(str(tmp_path / "src"), str(tmp_path / "dst"), False)
    from corral.daemon import removal

    removal.remove_tree(str(tmp_path / "src"))
    removal.remove_tree(str(tmp_path / "dst"))
    assert not (tmp_path / "src").exists() and not (tmp_path / "dst").exists()


def test_a_tree_that_cannot_be_removed_is_quarantined(tmp_path):
    from corral import _core
    from corral.daemon import removal

    victim = tmp_path / "sb-0000000000000001"
    (victim / "upper" / "mnt").mkdir(parents=True)
    _deep_host_tree(victim / "upper", 3000)
    _core.mount_tmpfs(str(victim / "upper" / "mnt"), "size=1m")  # never crossed, never removed
    try:
        before = len(removal.quarantined)
        assert removal.remove_or_quarantine(str(victim))
        assert not victim.exists()
        moved = removal.quarantined[before:]
        assert len(moved) == 1 and Path(moved[0]).parent == tmp_path / removal.QUARANTINE
        assert (Path(moved[0]) / "upper" / "mnt").is_mount()
    finally:
        for m in removal.quarantined[before:]:
            _core.umount(str(Path(m) / "upper" / "mnt"))
            removal.remove_tree(m)
        del removal.quarantined[before:]


def test_mutated_uploads_never_crash_the_daemon(daemon):
    """A brief mutation fuzz of the tar upload path (plain, gzip, bzip2, xz): every answer is
    a success or a 4xx with a code, never a 500, and the daemon stays up."""
    import bz2
    import lzma
    import random

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, data in (("a/b.txt", b"hello" * 50), ("a/c", b""), ("d/e/f", b"x" * 700)):
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
        link = tarfile.TarInfo("a/l")
        link.type, link.linkname = tarfile.SYMTYPE, "../d"
        tf.addfile(link)
    plain = buf.getvalue()
    seeds = [plain, gzip.compress(plain), bz2.compress(plain), lzma.compress(plain)]
    rng = random.Random(1234)
    with Sandbox() as sb, apiclient.client() as c:
        for i in range(160):
            data = bytearray(seeds[i % len(seeds)])
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            if i % 5 == 0:
                data = data[:rng.randrange(len(data))]
            r = c.put(f"/v1/sandboxes/{sb.id}/files/tar", params={"path": f"/work/f{i}"},
                      content=bytes(data))
            assert r.status_code in (200, 400, 404, 409), (i, r.status_code, r.text)
            if r.status_code != 200:
                assert r.json()["error"]["code"], r.text
        assert sh(sb, "echo alive").strip() == "alive"
    assert daemon.proc.poll() is None


def test_names_that_are_not_utf8_are_files_like_any_other():
    """An agent can name a file with bytes that are not UTF-8. Listing its directory (what a
    harness does to collect the agent's work) must not fail, least of all as an internal
    error (infra: the trainer would mask the episode): the name comes back as os.fsdecode
    gives it (surrogate escapes), and that name stats, reads and writes the very file,
    keyed and unkeyed; a keyed listing of it replays."""
    with Sandbox(timeout=120) as sb:
        sb.exec(["python3", "-c", "import os; os.makedirs('/w')\n"
                 "open(b'/w/bad\\xff\\xfename', 'w').write('agent')"]).check()
        for key in (None, "names-list"):
            entries = sb.files.list("/w", key=key)
            assert [e.name for e in entries] == ["bad\udcff\udcfename"], entries
        assert [e.name for e in sb.files.list("/w", key="names-list")] == ["bad\udcff\udcfename"]
        tree = sb.files.tree("/w")  # the SDK parsed it strictly: a pydantic error, no code
        assert [e.name for e in tree.entries] == ["bad\udcff\udcfename"], tree
        path = "/w/" + entries[0].name
        assert sb.files.stat(path).size == 5
        assert sb.files.stat(path, key="names-stat").size == 5
        assert sb.files.read(path) == sb.files.read(path, key="names-read") == "agent"
        sb.files.write(path + "2", "harness")
        r = sb.exec(["python3", "-c", "print(open(b'/w/bad\\xff\\xfename2').read())"])
        assert r.stdout == "harness\n", r
        # The JSON bodies carry it too (as \udcxx escapes), keyed and unkeyed.
        for tag in ("plain", "keyed"):
            def key(op: str, tag: str = tag) -> str | None:
                return None if tag == "plain" else f"names-{op}"
            sb.files.mkdir(path + f".d-{tag}", key=key("mkdir"))
            sb.files.rename(path + "2", path + f".r-{tag}", key=key("rename"))
            sb.files.write(path + "2", "again")
            sb.files.remove(path + f".d-{tag}", key=key("remove"))
        r = sb.exec(["python3", "-c", "import os; print(sorted(os.listdir(b'/w')))"])
        assert r.stdout.strip() == str(sorted([b"bad\xff\xfename", b"bad\xff\xfename2",
                                               b"bad\xff\xfename.r-plain",
                                               b"bad\xff\xfename.r-keyed"])), r


def test_a_tar_of_a_tree_that_changes_while_it_is_sent_is_never_cut(tmp_path):
    """Between a download's plan and its send, code in the sandbox can remove files, turn
    them into FIFOs and grow them past the cap. A cut stream would look like a lost daemon
    (infra): the send leaves out what it cannot read, cuts the file that crosses the cap to
    fit, and ends a valid tar within the cap."""
    import contextlib
    import io
    import tarfile

    from corral.daemon import streams
    from corral.daemon.substrates.rootfiles import RootFiles

    for d, size in (("a", 1000), ("b", 1000), ("c", 1000), ("d", 10)):
        (tmp_path / d).mkdir()
        (tmp_path / d / "f").write_bytes(b"x" * size)

    @contextlib.contextmanager
    def rooted():
        fd = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)
        try:
            yield fd
        finally:
            os.close(fd)

    ops = RootFiles(rooted, False, None, 1 << 20).tree_ops("/")
    cap = streams.plan(ops, "/", 1 << 30, 100)
    opened = ops.open_read

    def open_and_change(path: str) -> tuple[int, int]:
        if path == "/a/f":  # what the sandbox does while /a/f is sent
            (tmp_path / "b" / "f").unlink()
            os.mkfifo(tmp_path / "b" / "f")
            (tmp_path / "c" / "f").write_bytes(b"y" * 100_000)
        return opened(path)

    ops.open_read = open_and_change
    data = b"".join(streams.chunks(ops, "/", cap))
    assert len(data) <= cap, (len(data), cap)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert tar.extractfile(members["a/f"]).read() == b"x" * 1000
        assert "b/f" not in members  # a FIFO now: left out
        cut = members["c/f"]
        assert 0 < cut.size < 100_000 and tar.extractfile(cut).read() == b"y" * cut.size
        assert "d/f" not in members  # past the cap: left out


# ---- what a snapshot of a hostile tree costs, and what it keeps ------------------------------
# Python in the sandbox: ``d`` is an fd of /root/<levels x a 250-byte name>, made if asked
# (paths that long are past PATH_MAX: walked one name at a time).
_DEEP = """
import os
d = os.open('/root', os.O_RDONLY)
for _ in range({levels}):
    if {make}:
        os.mkdir('d' * 250, dir_fd=d)
    nd = os.open('d' * 250, os.O_RDONLY, dir_fd=d)
    os.close(d)
    d = nd
"""


def _deep(levels: int, body: str, make: bool = True) -> list[str]:
    return ["python3", "-c", _DEEP.format(levels=levels, make=make) + body]


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))


def test_a_hard_link_deeper_than_path_max_snapshots_and_forks(daemon):
    """A hard link under a path longer than PATH_MAX (17 levels of 250-byte names): the
    capture links it again through its directories one name at a time, where linking by the
    whole path failed every snapshot and fork as an internal (infra) error."""
    with Sandbox(timeout=120) as sb:
        sb.exec(_deep(17, "os.close(os.open('f', os.O_CREAT | os.O_WRONLY, dir_fd=d))\n"
                          "os.link('f', 'g', src_dir_fd=d, dst_dir_fd=d)")).check()
        snap = sb.snapshot()
        child = Sandbox(snapshot=snap.id, timeout=120)
        try:
            r = child.exec(_deep(17, "a = os.stat('f', dir_fd=d)\n"
                                     "b = os.stat('g', dir_fd=d)\n"
                                     "print(a.st_ino == b.st_ino, a.st_nlink)", make=False))
            assert r.stdout == "True 2\n", r
        finally:
            child.kill()
            snap.delete()


def test_a_snapshot_of_deep_long_names_is_bounded_in_the_daemons_memory(daemon):
    """Every entry's full path is in the capture's manifest: 1,100 empty files under 500
    levels of 250-byte names would be ~140 MB of it (the daemon's memory grew ~130 KiB an
    empty file). Past layer.rs MANIFEST_MAX the snapshot is too_large (task), and the daemon's
    memory stays well under what the manifest would have been."""
    pid = daemon.proc.pid
    with Sandbox(timeout=120) as sb:
        sb.exec(_deep(500, "for i in range(1100):\n"
                           "    os.close(os.open(str(i), os.O_CREAT | os.O_WRONLY, dir_fd=d))"),
                timeout=120).check()
        before = _rss_kib(pid)
        with pytest.raises(TooLarge) as err:
            sb.snapshot()
        assert "manifest" in err.value.details["limit"], err.value.details
        assert err.value.category == "task"
        assert _rss_kib(pid) - before < 300 * 1024
        assert sh(sb, "echo alive").strip() == "alive"


def test_a_file_whose_xattr_names_the_kernel_cannot_list_is_refused_not_dropped(daemon):
    """More than 64 KiB of xattr names on one file: the kernel will not list them (E2BIG),
    so a copy could not carry them. The snapshot is too_large (task), where the fork's
    children silently had none."""
    with Sandbox(timeout=120) as sb:
        sb.exec(["python3", "-c",
                 "import os\nopen('/root/x', 'w').close()\n"
                 "for i in range(400):\n"
                 "    os.setxattr('/root/x', 'user.' + 'n' * 190 + str(i), b'v')\n"]).check()
        with pytest.raises(TooLarge) as err:
            sb.snapshot()
        assert "xattr" in err.value.details["limit"], err.value.details
        assert err.value.category == "task"


def test_a_capture_of_a_directory_of_a_million_long_names_is_bounded_in_memory(tmp_path):
    """A directory's names are listed before any is copied: a million 255-byte names held
    ~280 MB of the daemon's memory (an agent makes them in a minute), past the 128 MiB the
    manifest may take, and the manifest then grew to that on top. The names waiting to be
    copied count with the manifest against that bound: the capture is too_large (manifest
    bytes) with the daemon's peak memory well under the names' size."""
    from corral import _core

    src = tmp_path / "upper"
    (src / "n").mkdir(parents=True)
    d = os.open(src / "n", os.O_RDONLY)
    try:
        for i in range(1_000_000):
            os.close(os.open(f"{i:07d}" + "x" * 248, os.O_CREAT | os.O_WRONLY, 0o644,
                             dir_fd=d))
    finally:
        os.close(d)
    Path("/proc/self/clear_refs").write_text("5")  # the peak RSS starts again from here
    before = _hwm_kib()
    with pytest.raises(_core.LayerLimit) as err:
        _core.capture_layer([(0, str(src), str(tmp_path / "layer"))], max_entries=2_000_000)
    assert err.value.args[0] == "manifest bytes", err.value.args
    grew = _hwm_kib() - before
    print(f"peak memory of the capture: {grew // 1024} MiB")
    assert grew < 200 * 1024, f"{grew} KiB"


def _hwm_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:"))


def test_a_file_time_the_layers_filesystem_cannot_hold_keeps_the_layers_digest(tmp_path):
    """A sandbox's file dated past what the state dir's filesystem holds (ext4: 2446; the
    sandbox's own disk, btrfs or tmpfs, holds any): ext4 clamped the copy's mtime without an
    error, the manifest had the source's, and the stored layer did not hash to its digest, so
    every export of it was refused on arrival (snapshot_digest_mismatch: a cluster's copy,
    snapshot_copy_failed, infra). The manifest records the copy's time."""
    import shutil
    import subprocess

    from corral import _core
    from corral.daemon.snapshots import layer_digest

    if shutil.which("mkfs.ext4") is None:
        pytest.skip("no mkfs.ext4")
    img, mnt, src = tmp_path / "img", tmp_path / "mnt", tmp_path / "src"
    with open(img, "wb") as f:
        f.truncate(64 * MiB)
    subprocess.run(["mkfs.ext4", "-q", str(img)], check=True)
    mnt.mkdir()
    src.mkdir()
    subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], check=True)
    subprocess.run(["mount", "-t", "tmpfs", "src", str(src)], check=True)  # holds any time
    try:
        (src / "far").write_text("x")
        os.link(src / "far", src / "far-link")
        (src / "old").write_text("y")
        os.utime(src / "far", ns=(2**40 * 10**9 + 7, 2**40 * 10**9 + 7))
        os.utime(src / "old", ns=(-2**35 * 10**9, -2**35 * 10**9))
        layer = mnt / "layer"
        layer.mkdir()
        digest, _ = _core.capture_layer([(0, str(src), str(layer / "0"))])
        assert (layer / "0" / "far").stat().st_mtime_ns != 2**40 * 10**9 + 7  # clamped
        assert layer_digest(str(layer)) == digest
    finally:
        subprocess.run(["umount", str(src)], check=True)
        subprocess.run(["umount", str(mnt)], check=True)


def test_a_cached_only_read_refuses_what_needs_the_disk(tmp_path: Path) -> None:
    """The Rust core's read from memory only (the event loop's try): bytes not in the page
    cache, or a path it cannot resolve from the dentry cache, are NotCached (the engine then
    reads in a file thread); once read, the same file comes from memory. A file a sandbox
    keeps cold (fadvise DONTNEED in a loop) while its disk is busy held the loop ~2-100 ms a
    1 MiB read."""
    from corral import _core

    if subprocess.run(["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True,
                      text=True).stdout.strip() == "tmpfs":
        pytest.skip("the test's directory is a tmpfs: its pages are never evicted")
    f = tmp_path / "cold"
    f.write_bytes(os.urandom(1 << 20))
    root = _core.root_fd(os.getpid())
    try:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        with pytest.raises(_core.NotCached):
            _core.fs_read(root, str(f), 1 << 20, True)
        data = _core.fs_read(root, str(f), 1 << 20)
        assert _core.fs_read(root, str(f), 1 << 20, True) == data and len(data) == 1 << 20
        assert _core.fs_read(root, str(f), 10, True) == data[:10]
        with pytest.raises(_core.NotCached):
            _core.fs_read(root, str(tmp_path / "missing"), 10, True)
        with pytest.raises(FileNotFoundError):
            _core.fs_read(root, str(tmp_path / "missing"), 10)
        (tmp_path / "empty").write_bytes(b"")
        assert _core.fs_read(root, str(tmp_path / "empty"), 10, True) == b""
    finally:
        os.close(root)
