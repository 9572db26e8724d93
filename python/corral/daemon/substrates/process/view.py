"""What a run_code zygote's root holds: the host's OS directories and the interpreter
(wherever it lives), read-only; a few files of /etc; the harmless devices; a /proc of its own;
a private /tmp. Nothing else of the host (no /home, /root, /var, /work, /sys, the daemon's
state dir).

Its /proc has the container's masks (corral.daemon.procpolicy, the one list): every top-level
entry outside the allow list is covered, a file by /dev/null, a directory by the daemon's empty
mask directory, once when the zygote builds its root; every request and command of the zygote
shares that mount namespace, so a request pays nothing for it. The policy's read-only binds
(/proc/sys, pid 1's OOM score) guard against root in a container; here every request and
command runs as an unprivileged uid with no capability, which can write neither."""

from __future__ import annotations

import os
import sys

from corral.daemon import procpolicy

OS_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# The loader's cache (multiarch libraries), names of users and groups, the time zone.
ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/passwd",
             "/etc/group", "/etc/nsswitch.conf", "/etc/localtime", "/etc/hosts",
             "/etc/alternatives", "/etc/bash.bashrc", "/etc/inputrc", "/etc/mime.types")
DEVICES = ("null", "zero", "full", "random", "urandom")


def _under(path: str, dirs: list[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)


def proc_masks(policy: procpolicy.ProcPolicy, mask_dir: str) -> list[tuple[str, str, str]]:
    """The entries that cover ``policy``'s masked /proc entries (made after the procfs)."""
    return ([("mask", "/dev/null", f"/proc/{name}") for name in policy.mask_files]
            + [("mask", mask_dir, f"/proc/{name}") for name in policy.mask_dirs])


def session_entries(disk_mb: int, uid: int,
                    masks: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """A session's view: the same, with /tmp its own tmpfs of ``disk_mb`` owned by its uid
    (its home and working directory; /root leads there too unless the interpreter lives
    under /root). Of the interpreter, only its base prefix (the standard library the session
    zygote runs on): a session's commands run the host's programs, never the daemon's own
    environment, and a daemon installed in a venv under /tmp would otherwise sit in the
    session's home, counted in its ``du`` and in the way of its ``rm -rf /tmp/*``."""
    out = [("tmpfs", f"mode=0700,uid={uid},gid={uid},size={disk_mb}m,nr_inodes=262144",
            "/tmp") if e[0] == "tmpfs" and e[2] == "/tmp" else e
           for e in entries(0, masks, prefixes=(sys.base_prefix, sys.base_exec_prefix))]
    if not any(_under(dst, ["/root"]) for _, _, dst in out):
        out.append(("symlink", "/tmp", "/root"))
    return out


# Inodes of one request's scratch: a tmpfs's inodes are a count of its own, and a request that
# could take the inodes of a /tmp shared with others would fail their files (and their
# scratch's wipe) for them.
SCRATCH_INODES = 65536


def entries(tmp_mb: int, masks: list[tuple[str, str, str]], slot_uids: list[int] | None = None,
            prefixes: tuple[str, ...] | None = None) -> list[tuple[str, str, str]]:
    """The zygote's root (``masks``: ``proc_masks``; ``prefixes``: the interpreter's to bind,
    all of them by default).
    ``slot_uids``: a scratch tmpfs per slot, ``/tmp/s<i>`` (of ``tmp_mb`` and SCRATCH_INODES):
    nothing a request writes takes room or inodes from
    another's. Its root is the zygote's, mode 0710 with the slot's group: the slot's uid
    reaches its working directory in it (made by the zygote), no other slot's uid reaches
    anything in it, whatever modes a request gives its files. Its pages are charged to the
    request's memory cgroup."""
    out: list[tuple[str, str, str]] = []
    bound: list[str] = []
    for d in OS_DIRS:
        if os.path.islink(d):
            out.append(("symlink", os.readlink(d), d))
        elif os.path.isdir(d):
            out.append(("ro", d, d))
            bound.append(d)
    out.append(("dir", "", "/etc"))
    for f in ETC_FILES:
        if os.path.exists(f):
            out.append(("ro", f, f))
    out.append(("tmpfs", "mode=0755,size=64k,nr_inodes=64", "/dev"))
    for name in DEVICES:
        out.append(("dev", f"/dev/{name}", f"/dev/{name}"))
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        out.append(("symlink", target, f"/dev/{name}"))
    out.append(("proc", "", "/proc"))
    out += masks
    if slot_uids is None:
        out.append(("tmpfs", f"mode=0755,size={tmp_mb}m,nr_inodes=65536", "/tmp"))
    else:
        out.append(("tmpfs", f"mode=0755,size=64k,nr_inodes={len(slot_uids) + 16}", "/tmp"))
        for i, uid in enumerate(slot_uids):
            out.append(("tmpfs", f"mode=0710,uid=0,gid={uid},size={tmp_mb}m,"
                                 f"nr_inodes={SCRATCH_INODES}", f"/tmp/s{i}"))
    # The interpreter and its packages, wherever they live (a venv, pyenv under /root, a
    # checkout under /tmp): bound last, so no mount above (/tmp, /dev) hides them.
    if prefixes is None:
        prefixes = (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)
    for p in sorted({os.path.realpath(p) for p in prefixes}):
        if not _under(p, bound) and os.path.isdir(p):
            out.append(("ro", p, p))
            bound.append(p)
    return out
