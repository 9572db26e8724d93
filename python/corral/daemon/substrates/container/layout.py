"""What every sandbox's mounts are made of on the host: /sys and /proc mask skeletons, the
image's /tmp check."""

from __future__ import annotations

import os
import re
import select
import shutil
import stat as stat_mod
import threading

from corral.daemon import scratch

# The sandboxes' scratch area (btrfs with a quota per sandbox, or a tmpfs): corral.daemon.scratch.
SCRATCH_SOURCE = scratch.SCRATCH_SOURCE
_mount_of = scratch.mount_of
# xattr that makes an overlay upper dir hide what the lower layers hold at its path.
OVL_OPAQUE = "trusted.overlay.opaque"


def _image_tmp_unfit(lowers: list[str]) -> bool:
    """Whether the /tmp these image layers (top first) make is not an empty 1777 directory."""
    top = None
    for lo in lowers:
        p = os.path.join(lo, "tmp")
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue
        if top is None:
            top = st
        if not stat_mod.S_ISDIR(st.st_mode):
            return True
        with os.scandir(p) as it:
            if any(True for _ in it):
                return True
    return top is None or stat_mod.S_IMODE(top.st_mode) != 0o1777


def make_sys_dir(path: str, views: list[str]) -> str:
    """The skeleton bound read-only at each sandbox's /sys: fs/cgroup/<view> mountpoints,
    root-owned, mode 0555, nothing else."""
    for name in views:
        os.makedirs(os.path.join(path, "fs", "cgroup", name), mode=0o555, exist_ok=True)
    for dirpath, _, _ in os.walk(path):
        os.chmod(dirpath, 0o555)
    return path


# The shared /dev every sandbox binds read-only (spawn.rs DEVICES, DEV_LINKS): character
# devices (major, minor), symlinks, and the mountpoints of each sandbox's own devpts and
# /dev/shm.
DEV_NODES = {"null": (1, 3), "zero": (1, 5), "full": (1, 7), "random": (1, 8),
             "urandom": (1, 9), "tty": (5, 0)}
DEV_LINKS = {"ptmx": "pts/ptmx", "fd": "/proc/self/fd", "stdin": "/proc/self/fd/0",
             "stdout": "/proc/self/fd/1", "stderr": "/proc/self/fd/2"}
DEV_MOUNTPOINTS = ("pts", "shm")


def make_dev_dir(path: str) -> str:
    """The directory bound read-only at every sandbox's /dev instead of a tmpfs each (one
    superblock fewer per sandbox, see procpolicy.make_mask_dir). Root-owned, mode 0755; the bind is
    nosuid, noexec and read-only, so a sandbox can neither add a node nor change one the
    others see. Made in place, entry by entry: live sandboxes of a previous daemon see the
    same directory, so only a wrong entry is replaced and nothing is taken away from them."""
    try:
        os.mkdir(path, 0o755)
    except FileExistsError:
        if not stat_mod.S_ISDIR(os.lstat(path).st_mode):
            os.unlink(path)
            os.mkdir(path, 0o755)
    want = set(DEV_NODES) | set(DEV_LINKS) | set(DEV_MOUNTPOINTS)
    for name in os.listdir(path):
        if name not in want:
            _remove(os.path.join(path, name))
    for name, (major, minor) in DEV_NODES.items():
        p = os.path.join(path, name)
        st = _lstat(p)
        if not (st and stat_mod.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(major, minor)
                and stat_mod.S_IMODE(st.st_mode) == 0o666 and st.st_uid == 0):
            if st:
                _remove(p)
            os.mknod(p, stat_mod.S_IFCHR | 0o666, os.makedev(major, minor))
            os.chmod(p, 0o666)  # mknod's mode goes through the umask
    for name, target in DEV_LINKS.items():
        p = os.path.join(path, name)
        st = _lstat(p)
        if not (st and stat_mod.S_ISLNK(st.st_mode) and os.readlink(p) == target):
            if st:
                _remove(p)
            os.symlink(target, p)
    for name in DEV_MOUNTPOINTS:
        p = os.path.join(path, name)
        st = _lstat(p)
        if not (st and stat_mod.S_ISDIR(st.st_mode)):
            if st:
                _remove(p)
            os.mkdir(p, 0o755)
        os.chmod(p, 0o755)
    for p in [path] + [os.path.join(path, n) for n in os.listdir(path)]:
        os.lchown(p, 0, 0)
    os.chmod(path, 0o755)
    return path


def _lstat(p: str) -> os.stat_result | None:
    try:
        return os.lstat(p)
    except FileNotFoundError:
        return None


def _remove(p: str) -> None:
    if stat_mod.S_ISDIR(os.lstat(p).st_mode):
        shutil.rmtree(p)
    else:
        os.unlink(p)


def _unescape(field: str) -> str:
    """A mountinfo path: octal escapes (\\040 for a space) decoded."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def detachable_mounts(keep: str, mountinfo: str = "/proc/self/mountinfo") -> list[str]:
    """The daemon's mounts a sandbox's new mount namespace copies but never reaches: the top
    of every subtree that is neither an ancestor of ``keep`` (the sandboxes' dir) nor below it.
    The spawn detaches each (recursively) once the root is built; every copied mount left
    would pin kernel memory for as long as the sandbox lives. A mount made since the last
    read, such as a parent of ``keep``, must not be detached: ``MountWatch`` reads again
    whenever the table changed."""
    with open(mountinfo) as f:
        return _tops(keep, f.read())


class MountWatch:
    """``detachable_mounts(keep)`` for each spawn, read again only when the mount table of
    the calling process's namespace changed: the kernel flags an open mountinfo file with
    POLLPRI at every mount or unmount there (proc(5)), so an unchanged table costs one poll
    instead of a read and a parse of every line (measured: ~5 % of the daemon's Python time
    under churn)."""

    def __init__(self, keep: str, mountinfo: str = "/proc/self/mountinfo") -> None:
        self.keep = keep
        self._fd = os.open(mountinfo, os.O_RDONLY | os.O_CLOEXEC)
        self._poll = select.poll()
        self._poll.register(self._fd, select.POLLPRI)  # POLLERR comes with it
        self._lock = threading.Lock()
        self._tops: list[str] | None = None
        self.reads = 0

    def get(self) -> list[str]:
        with self._lock:
            if self._fd < 0:
                raise ValueError("MountWatch is closed")
            # The flag is cleared as poll reports it: a change after this poll and before
            # the read below is read now and flagged again at the next call.
            if self._poll.poll(0) or self._tops is None:
                self._tops = _tops(self.keep, self._read())
                self.reads += 1
            return list(self._tops)

    def _read(self) -> str:
        os.lseek(self._fd, 0, os.SEEK_SET)
        chunks = []
        while data := os.read(self._fd, 1 << 16):
            chunks.append(data)
        return b"".join(chunks).decode()

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def _tops(keep: str, mountinfo: str) -> list[str]:
    keep = os.path.realpath(keep).rstrip("/") + "/"
    points: list[str] = []
    for line in mountinfo.splitlines():
        fields = line.split(" ", 5)
        if len(fields) > 4:
            points.append(_unescape(fields[4]))
    tops: list[str] = []
    for p in points:
        d = p.rstrip("/") + "/"
        if keep.startswith(d) or d.startswith(keep):
            continue  # on the way to the sandboxes' dir, or below it
        if any(d.startswith(t.rstrip("/") + "/") and d != t.rstrip("/") + "/" for t in tops):
            continue  # inside a subtree already detached
        tops.append(p)
    return tops
