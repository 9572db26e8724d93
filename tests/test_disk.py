"""Each sandbox's disk is bounded by its own ``disk_mb``, in the kernel (corral.daemon.scratch):
its writable layer is a btrfs subvolume with a quota, so a write past it fails with EDQUOT
("Disk quota exceeded") wherever it lands and however it is made, the sandbox and its later
commands keep working, nothing is OOM-killed, and the files are page cache, not memory the
sandbox pins. Every test attacks from inside a sandbox (or through the files API)."""

from __future__ import annotations

import os
import subprocess
import uuid

import pytest

from corral import Sandbox
from corral.errors import SandboxNotFound, SandboxNotRunning, TooLarge

import apiclient
from conftest import CGROUP_NAME, STATE_DIR, loops_backed_under, private_daemon, wait_until

MiB = 1 << 20
SANDBOXES = os.path.join(STATE_DIR, "sandboxes")
FULL = "Disk quota exceeded"


def _scratch_is_btrfs() -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == SANDBOXES and " - btrfs " in line for line in f)


def test_the_scratch_is_btrfs_where_the_host_can_have_it():
    """The fallback (a tmpfs, bounded by memory only) is for hosts without btrfs or loop
    devices; this one has both (scripts/setup.sh installs btrfs-progs)."""
    with open("/proc/filesystems") as f:
        if "btrfs" not in f.read() or not os.path.exists("/dev/loop-control"):
            pytest.skip("no btrfs or no loop devices on this host")
    assert _scratch_is_btrfs()

# Each attack writes past a 32 MiB disk in its own way; it prints the errno it met.
ATTACKS = {
    "root_dir": "dd if=/dev/zero of=/big bs=1M count=64",
    "home": "dd if=/dev/zero of=/root/big bs=1M count=64",
    "tmp": "dd if=/dev/zero of=/tmp/big bs=1M count=64",
    "dev_shm": "dd if=/dev/zero of=/dev/shm/big bs=1M count=64",
    "var_tmp": "head -c 64M /dev/zero > /var/tmp/big",
    "fallocate": "fallocate -l 64M /root/f",
    "sparse_then_filled": ("truncate -s 4G /root/s && ls -ls /root/s && "
                           "dd if=/dev/zero of=/root/s bs=1M count=64 conv=notrunc"),
    "small_files": ("python3 -c \"\nn = 0\nwhile True:\n"
                    "    open(f'/root/f{n}', 'w').write('x' * 3000); n += 1\""),
    "empty_dirs": "python3 -c \"\nimport os\nn = 0\nwhile True:\n    os.mkdir(f'/x{n}'); n += 1\"",
    "hard_links": ("dd if=/dev/zero of=/root/a bs=1M count=20 && "
                   "for i in $(seq 200); do ln /root/a /root/l$i || exit 1; done && "
                   "rm /root/a && dd if=/dev/zero of=/root/b bs=1M count=20"),
    # copy-up: opening lower files for writing copies them whole into the upper
    "copy_up": ("python3 -c \"\nimport os\nfor d, _, fs in os.walk('/usr'):\n"
                "    for f in fs:\n        p = os.path.join(d, f)\n"
                "        if os.path.isfile(p) and not os.path.islink(p):\n"
                "            os.close(os.open(p, os.O_WRONLY | os.O_APPEND))\""),
}


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_a_write_past_disk_mb_is_a_disk_full_error_not_an_oom_kill(name):
    with Sandbox(disk_mb=32, memory_mb=64, timeout=300) as sb:
        r = sb.exec(ATTACKS[name], timeout=240)
        assert r.exit_code != 0, r
        assert FULL in r.stderr or FULL in r.stdout, r
        assert not r.oom_killed and r.signal is None, r
        # The sandbox keeps working: reads, a command, and writes once room is made (the
        # copied-up files stay: they are the sandbox's files now).
        assert sb.exec("echo alive").stdout == "alive\n"
        if name == "copy_up":
            return
        r = sb.exec("rm -rf /big /root/* /tmp/* /var/tmp/big /dev/shm/big /x[0-9]* 2>/dev/null; "
                    "dd if=/dev/zero of=/root/again bs=1M count=8 2>&1 && echo wrote")
        assert r.stdout.endswith("wrote\n"), r


# The calls that make a subvolume in /dev/shm (a directory of the sandbox's own subvolume),
# each with its btrfs_ioctl_vol_args(_v2): 4096 bytes, the source fd first, the new name at 8
# (at 56 in the v2 form).
BTRFS_CALLS = """
import errno, fcntl, os, struct
fd = os.open("/dev/shm", os.O_RDONLY | os.O_DIRECTORY)
for name, cmd, name_at in (("subvol_create", 0x5000940E, 8),
                           ("subvol_create_v2", 0x50009418, 56),
                           ("snap_create_v2", 0x50009417, 56)):
    args = bytearray(4096)
    args[0:8] = struct.pack("q", fd if name.startswith("snap") else 0)
    args[name_at:name_at + 2] = b"sv"
    try:
        fcntl.ioctl(fd, cmd, args)
        print(name, "made")
    except OSError as e:
        print(name, errno.errorcode[e.errno])
"""


def test_a_sandbox_cannot_make_a_subvolume_of_its_own():
    """A subvolume made inside the sandbox's own (no privilege needed) has a quota group of
    its own, with no limit: 200 MiB went into one in a 64 MiB sandbox, its own "disk full"
    became the whole scratch's (infra), and its destroy left it all (ENOTEMPTY). btrfs' own
    calls are refused as a filesystem refuses a call it does not know; reflinks, counted by
    the sandbox's quota, still work."""
    with Sandbox(disk_mb=32, timeout=120) as sb:
        sb.files.write("/root/calls.py", BTRFS_CALLS)
        r = sb.exec("python3 /root/calls.py")
        assert r.stdout.split() == ["subvol_create", "ENOTTY", "subvol_create_v2", "ENOTTY",
                                    "snap_create_v2", "ENOTTY"], r
        r = sb.exec("dd if=/dev/zero of=/dev/shm/sv bs=1M count=64")
        assert FULL in r.stderr, r  # a plain file: the sandbox's quota
        if _scratch_is_btrfs():
            r = sb.exec("rm /dev/shm/sv; head -c 4M /dev/urandom > /dev/shm/a && "
                        "cp --reflink=always /dev/shm/a /dev/shm/b && cmp /dev/shm/a /dev/shm/b "
                        "&& echo cloned")
            assert r.stdout == "cloned\n", r


def test_a_snapshot_of_shared_blocks_is_bounded_by_disk_mb():
    """Reflinks cost the sandbox's quota once and a snapshot's copy each time: 60 of 100 MB in
    a 1 GiB sandbox made a 5.7 GB copy that filled the state dir (the sandboxes' scratch
    went read-only for everyone). A copy past the sandbox's disk_mb is its own limit."""
    if not _scratch_is_btrfs():
        pytest.skip("reflinks need the btrfs scratch")
    with Sandbox(disk_mb=64, timeout=180) as sb:
        r = sb.exec("head -c 20M /dev/urandom > /root/a && for i in $(seq 6); do "
                    "cp --reflink=always /root/a /root/r$i || exit 1; done")
        assert r.exit_code == 0, r
        with pytest.raises(TooLarge) as err:
            sb.snapshot()
        assert err.value.details == {"limit": "disk_mb", "max": 64}, err.value.details
        assert err.value.category == "limit"
        assert sb.exec("rm /root/r* && echo ok").stdout == "ok\n"
        snap = sb.snapshot()  # 20 MB: within
        snap.delete()


def test_files_written_are_page_cache_not_pinned_memory():
    """1 GiB written in a 128 MiB sandbox: the pages are written back and reclaimed; on a
    tmpfs they would be charged to the sandbox and could not be (OOM kill)."""
    with Sandbox(disk_mb=2048, memory_mb=128, timeout=300) as sb:
        r = sb.exec("dd if=/dev/zero of=/root/big bs=1M count=1024 && stat -c %s /root/big",
                    timeout=240)
        assert r.exit_code == 0 and r.stdout.split()[-1] == str(1 << 30), r
        assert not r.oom_killed
        assert sb.exec("cmp -n 1048576 /root/big /dev/zero && echo same").stdout == "same\n"


def test_the_files_api_and_uploads_meet_the_same_quota():
    with Sandbox(disk_mb=16, timeout=120) as sb:
        sb.exec("dd if=/dev/zero of=/root/fill bs=1M count=12")
        with pytest.raises(TooLarge) as err:
            sb.files.write("/root/more", bytes(8 * MiB))
        assert err.value.details["limit"] == "disk_mb" and err.value.category == "limit"
        assert not sb.files.exists("/root/more")  # no partial file left to fill the disk
        sb.exec("rm /root/fill")
        sb.files.write("/root/more", bytes(8 * MiB))  # room again
        assert sb.files.stat("/root/more").size == 8 * MiB


def test_one_sandbox_filling_its_disk_leaves_others_alone():
    with Sandbox(disk_mb=16, timeout=120) as a, Sandbox(disk_mb=64, timeout=120) as b:
        r = a.exec("dd if=/dev/zero of=/root/fill bs=1M count=64")
        assert FULL in r.stderr
        r = b.exec("dd if=/dev/zero of=/root/x bs=1M count=48 && echo ok")
        assert r.stdout.endswith("ok\n"), r
        r = b.exec("dd if=/dev/zero of=/root/y bs=1M count=32")
        assert FULL in r.stderr  # b's own limit, not a's
        assert a.exec("rm /root/fill && echo freed").stdout == "freed\n"


def test_the_limit_holds_after_snapshot_restore_and_fork():
    """A fork or a restore gets a new layer with the same quota: what it writes on top of its
    snapshot is bounded by the same disk_mb."""
    with Sandbox(disk_mb=24, timeout=180) as sb:
        sb.exec("dd if=/dev/zero of=/root/keep bs=1M count=8; echo t > /tmp/t")
        snap = sb.snapshot()
        try:
            kids = sb.fork(2)
            try:
                for k in kids:
                    assert k.files.stat("/root/keep").size == 8 * MiB
                    assert k.files.read("/tmp/t") == "t\n"  # /tmp is on the disk: captured
                    r = k.exec("dd if=/dev/zero of=/root/more bs=1M count=64")
                    assert FULL in r.stderr and not r.oom_killed, r
                    assert k.exec("echo alive").stdout == "alive\n"
            finally:
                for k in kids:
                    k.kill()
            sb.restore(snap)
            r = sb.exec("dd if=/dev/zero of=/tmp/more bs=1M count=64")
            assert FULL in r.stderr and not r.oom_killed, r
            assert sb.files.stat("/root/keep").size == 8 * MiB
        finally:
            snap.delete()


def test_tmp_is_on_the_sandboxs_disk_and_hides_the_images():
    with Sandbox(disk_mb=16, timeout=120) as sb:
        r = sb.exec("stat -c '%a %F' /tmp; ls -A /tmp | wc -l; grep -c ' /tmp ' /proc/mounts")
        assert r.stdout.split("\n")[:3] == ["1777 directory", "0", "0"], r
        assert sb.exec("su nobody -s /bin/sh -c 'echo hi > /tmp/n && cat /tmp/n'"
                       ).stdout == "hi\n"


def test_an_images_own_tmp_never_shows_and_tmp_has_the_quota(tmp_path):
    """An image whose /tmp holds files (and is not 1777) gets an empty, 1777, opaque /tmp on
    the sandbox's disk: the image's files are hidden, writes there meet the quota."""
    src = tmp_path / "rootfs"
    (src / "tmp").mkdir(parents=True)
    (src / "tmp" / "image-secret").write_text("from the image")
    (src / "tmp").chmod(0o755)
    name = f"disk-test-{uuid.uuid4().hex[:8]}"
    with apiclient.client() as c:
        r = c.post("/v1/images", json={"name": name, "source": str(src)})
        assert r.status_code == 201, r.text
    with Sandbox(image=name, disk_mb=16, timeout=120) as sb:
        assert sb.files.list("/tmp") == []
        assert sb.files.stat("/tmp").mode & 0o7777 == 0o1777
        with pytest.raises(TooLarge):
            sb.files.write("/tmp/big", bytes(24 * MiB))


def _subvolumes() -> set[str]:
    out = subprocess.run(["btrfs", "subvolume", "list", "-o", SANDBOXES],
                         capture_output=True, text=True, check=True).stdout
    return {line.split(" path ", 1)[1].strip() for line in out.splitlines() if " path " in line}


def test_no_subvolume_outlives_its_sandbox():
    sbs = [Sandbox(disk_mb=8, timeout=120) for _ in range(3)]
    ids = {sb.id for sb in sbs}
    try:
        assert {f"{i}/disk" for i in ids} <= _subvolumes()
        sbs[0].files.write("/root/a", "1")
        snap = sbs[0].snapshot()
        sbs[0].restore(snap)  # the old layer goes to the trash and is deleted
        snap.delete()
    finally:
        for sb in sbs:
            sb.kill()
    assert wait_until(lambda: not any(p.split("/")[0] in ids or p.startswith(".trash")
                                      for p in _subvolumes()))
    assert not any(n in ids for n in os.listdir(SANDBOXES))


def test_a_sandbox_dir_nested_in_the_trash_or_quarantine_is_removed_with_its_subvolume():
    """A restore interrupted by a crash leaves a sandbox's dir (with its ``disk`` subvolume)
    in the trash; the next start may quarantine the whole trash. remove_tree never crosses
    into another filesystem, so it must delete the subvolumes of our own layout first."""
    if not _scratch_is_btrfs():
        pytest.skip("the scratch is not btrfs here")
    from corral import _core
    from corral.daemon import removal

    top = os.path.join(SANDBOXES, f".test-nested-{uuid.uuid4().hex[:8]}")
    sbdir = os.path.join(top, "q.1234", "sb-x")
    os.makedirs(sbdir)
    _core.btrfs_subvol_create(sbdir, "disk", 8 * MiB)
    with open(os.path.join(sbdir, "disk", "f"), "w") as f:
        f.write("x")
    removal.remove_tree(top)
    assert not os.path.exists(top)
    assert not any(p.startswith(os.path.basename(top)) for p in _subvolumes())


def test_the_scratch_and_its_quotas_survive_a_daemon_crash(daemon):
    sb = Sandbox(disk_mb=16, timeout=180)
    try:
        sb.files.write("/root/kept", "yes")
        device = next(line.split(" - ")[1].split()[1] for line in open("/proc/self/mountinfo")
                      if line.split()[4] == SANDBOXES)
        daemon.restart(kill9=True)
        assert sb.files.read("/root/kept") == "yes"  # re-adopted, same filesystem
        now = next(line.split(" - ")[1].split()[1] for line in open("/proc/self/mountinfo")
                   if line.split()[4] == SANDBOXES)
        assert now == device
        r = sb.exec("dd if=/dev/zero of=/root/fill bs=1M count=64")
        assert FULL in r.stderr and not r.oom_killed
    finally:
        sb.kill()


def test_the_tmpfs_fallback_still_bounds_tmp_and_the_daemons_writes():
    """CORRAL_SCRATCH=tmpfs (what a host without btrfs or loop devices gets): /tmp is a tmpfs
    of disk_mb (ENOSPC), the daemon counts its own writes against disk_mb, and the stop leaves
    no mount behind."""
    with private_daemon("corral-test-disk-", f"{CGROUP_NAME}-disk",
                        CORRAL_SCRATCH="tmpfs") as d:
        sandboxes = os.path.join(d.state_dir, "sandboxes")
        with open("/proc/self/mountinfo") as f:
            assert any(line.split()[4] == sandboxes and " - tmpfs " in line for line in f)
        with Sandbox(endpoint=f"unix://{d.socket_path}", disk_mb=8, timeout=120) as sb:
            r = sb.exec("dd if=/dev/zero of=/tmp/fill bs=1M count=16")
            assert "No space left" in r.stderr and not r.oom_killed, r
            with pytest.raises(TooLarge) as err:
                sb.files.write("/root/big", bytes(12 * MiB))
            assert err.value.details["limit"] == "disk_mb"
            assert sb.exec("echo alive").stdout == "alive\n"


def test_a_lost_scratch_is_made_anew_at_the_next_start():
    """As after a reboot: the daemon, its sandboxes and the scratch mount are gone, the image
    file is still there. The next start makes a fresh filesystem on a new image (never reuses
    the old inode), reports the old sandbox gone, and new sandboxes get their quota."""
    def fsid(image: str) -> bytes:  # the btrfs superblock (at 64 KiB) holds the fs UUID at 0x20
        with open(image, "rb") as f:
            f.seek((64 << 10) + 0x20)
            return f.read(16)

    from conftest import _force_cleanup, _unmount_under

    cgroup = f"{CGROUP_NAME}-diskre"
    with private_daemon("corral-test-disk-", cgroup) as d:
        ep = f"unix://{d.socket_path}"
        old = Sandbox(endpoint=ep, disk_mb=16, timeout=120)
        old.files.write("/root/x", "1")
        image = os.path.join(d.state_dir, "scratch.img")
        before = fsid(image)
        d.kill9()
        _force_cleanup(cgroup)
        _unmount_under(d.state_dir)
        assert wait_until(lambda: not loops_backed_under(d.state_dir + "/"))
        d.start()
        # A fresh filesystem (mkfs gives a new UUID); the inode number alone may be reused
        # once the old file is freed.
        assert fsid(image) != before
        with Sandbox(endpoint=ep, disk_mb=16, timeout=120) as sb:
            r = sb.exec("dd if=/dev/zero of=/root/fill bs=1M count=32")
            assert FULL in r.stderr and not r.oom_killed, r
        # Its record was on the lost filesystem, as on the tmpfs before it: unknown now.
        with pytest.raises((SandboxNotFound, SandboxNotRunning)):
            old.exec("true")
