"""The OCI bundle of one gVisor sandbox: its root (an overlay the daemon mounts on the host,
one per image overlay, each with a private upper dir) and config.json (limits, namespaces, no
capabilities, the long-running init)."""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
from typing import Any

from corral import _core
from corral.daemon.cgroups.common import MEMSW_SLACK
from corral.daemon.initexec import candidates
from corral.daemon.substrates.types import NO_CORE
from corral.models import SandboxSpec

# The sentry and the gofer are Go programs: their own threads count against the host pids
# cgroup on top of the sandbox's processes (gVisor runs each in the sentry, not on the host).
PIDS_OVERHEAD = 192
CPU_PERIOD_US = 100_000
# Every process the daemon starts in the sandbox is the lock-down binary (init/corral-lockdown.c)
# first: rlimits, no capabilities, no_new_privs and the container substrate's seccomp filter,
# then the command. It and the filter are bound read-only at LOCKDOWN_DIR, a mount point the
# sandbox cannot remove, replace or cover (no mount, no capability).
LOCKDOWN_DIR = "/dev/.corral"
LOCKDOWN = f"{LOCKDOWN_DIR}/lockdown"
FILTER = f"{LOCKDOWN_DIR}/seccomp.bpf"
# The sandbox's PID 1: the lock-down binary's init (reaps orphans, ignores every signal it can,
# not dumpable); commands come in through `runsc exec`.
INIT = [LOCKDOWN, "i", FILTER]
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# How commands start: "t", under the lock-down binary's tracer that takes AT_NO_AUTOMOUNT out
# of statx and newfstatat (this runsc refuses it with EINVAL, and coreutils 9 passes it: `ls
# DIR`, `stat`, which then fail); "x", exec'd directly (the tracer exists on x86_64 only).
EXEC_MODE = "t" if platform.machine() == "x86_64" else "x"
# The rlimits of every command: the container substrate's core and nofile (DEFAULT_RLIMITS
# there), by number; the per-user sums it lifts are the sentry's own, one sandbox's, here.
RLIMITS: dict[int, tuple[int, int]] = {resource.RLIMIT_CORE: NO_CORE,
                                       resource.RLIMIT_NOFILE: (1024, 524288)}
NO_CAPS: dict[str, list[str]] = {k: [] for k in
                                 ("bounding", "effective", "permitted", "inheritable", "ambient")}


class MountError(OSError):
    pass


def _mount_overlay(lowers: list[str], upper: str, work: str, target: str) -> None:
    opts = f"lowerdir={':'.join(lowers)},upperdir={upper},workdir={work}"
    r = subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, target],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise MountError(f"overlay on {target}: {r.stderr.strip() or r.returncode}")


def mounts_under(path: str) -> list[str]:
    """Mount points at or below ``path`` in the daemon's mount namespace, deepest first."""
    path = path.rstrip("/")
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4].replace("\\040", " ")
            if mp == path or mp.startswith(path + "/"):
                out.append(mp)
    return sorted(out, key=len, reverse=True)


def unmount_all(path: str) -> None:
    for mp in mounts_under(path):
        subprocess.run(["umount", "-l", mp], capture_output=True)


def make_root(gdir: str, image: Any, disk_mb: int) -> str:
    """Mount the image's overlays (target "/" first) at ``gdir``/root, each with its own
    upper and work dir on a tmpfs of ``disk_mb`` at ``gdir``/rw (the sandbox's disk: a write
    past it is ENOSPC inside, its pages are charged to the memory cgroup of the gofer that
    writes them, the sandbox's); returns the root. Nothing stays mounted on failure."""
    root = os.path.join(gdir, "root")
    rw = os.path.join(gdir, "rw")
    os.makedirs(root, mode=0o755, exist_ok=True)
    os.makedirs(rw, mode=0o700, exist_ok=True)
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o",
                            f"size={disk_mb}m,mode=0700,nosuid,nodev", "corral-gvisor", rw],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise MountError(f"tmpfs on {rw}: {r.stderr.strip() or r.returncode}")
        for n, (target, lowers) in enumerate(image.overlays):
            upper = os.path.join(rw, "upper", str(n))
            work = os.path.join(rw, "work", str(n))
            os.makedirs(upper, mode=0o755, exist_ok=True)
            os.makedirs(work, mode=0o700, exist_ok=True)
            where = os.path.join(root, target.lstrip("/"))
            os.makedirs(where, exist_ok=True)
            _mount_overlay(list(lowers), upper, work, where)
    except BaseException:
        unmount_all(gdir)
        raise
    tmp = os.path.join(root, "tmp")
    if not os.path.isdir(tmp):
        os.mkdir(tmp)
    os.chmod(tmp, 0o1777)
    return root


def make_log_dir(gdir: str, memory_mb: int) -> str:
    """A tmpfs at ``gdir``/log for the sentry's info log, which the sandbox can make grow
    without bound (a line naming the path of each failed execve, each unsupported syscall):
    its pages are charged to the memory cgroup of the sentry that writes them, the
    sandbox's, so a flood ends the sandbox at its own memory limit (an OOM), never fills the
    state dir's disk. Sized past that limit, so the limit is reached first and the last
    line, how the init ended, is never refused for room."""
    path = os.path.join(gdir, "log")
    os.makedirs(path, mode=0o700, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o",
                        f"size={2 * memory_mb}m,mode=0700,nosuid,nodev,noexec",
                        "corral-gvisor-log", path], capture_output=True, text=True)
    if r.returncode != 0:
        raise MountError(f"tmpfs on {path}: {r.stderr.strip() or r.returncode}")
    return path


def install_lockdown(path: str) -> None:
    """The lock-down binary and the filter in ``path`` (a directory bound read-only into every
    sandbox), each written whole and renamed into place: a sandbox never sees half a file."""
    os.makedirs(path, mode=0o755, exist_ok=True)  # bound read-only: its owner's w bit is moot
    for name, data, mode in (("lockdown", _core.lockdown_binary(), 0o555),
                             ("seccomp.bpf", _core.seccomp_filter(False), 0o444)):
        dest = os.path.join(path, name)
        try:
            with open(dest, "rb") as f:
                if f.read() == data:
                    continue
        except OSError:
            pass
        tmp = f"{dest}.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
        with open(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, dest)


def config(sandbox_id: str, spec: SandboxSpec, root: str, cgroup: str,
           lockdown_dir: str) -> dict[str, Any]:
    """config.json: the root read-write (the overlay above holds the writes), /tmp from the
    same overlay (runsc would otherwise put a tmpfs there the daemon cannot see into), proc,
    sys read-only, a tmpfs /dev with the lock-down directory bound read-only in it; every
    namespace; the spec's limits as the sandbox's cgroup."""
    env = [f"PATH={DEFAULT_PATH}"]
    return {
        "ociVersion": "1.0.2",
        "process": {"args": INIT, "env": env, "cwd": "/", "user": {"uid": 0, "gid": 0},
                    "capabilities": NO_CAPS, "noNewPrivileges": True},
        "root": {"path": root, "readonly": False},
        "hostname": spec.hostname or sandbox_id[:63],
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "mode=755"]},
            {"destination": LOCKDOWN_DIR, "type": "bind", "source": lockdown_dir,
             "options": ["rbind", "ro", "nosuid", "nodev"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs",
             "options": ["ro", "nosuid", "noexec", "nodev"]},
            {"destination": "/tmp", "type": "bind", "source": os.path.join(root, "tmp"),
             "options": ["rbind", "rw", "nosuid", "nodev"]},
        ],
        "linux": {
            "namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")],
            "cgroupsPath": cgroup,
            "resources": {
                "memory": {"limit": spec.memory_mb << 20,
                           # MEMSW_SLACK: the memory counter refuses first, its fail
                           # count shows the sandbox's own limit hit (end_cause)
                           "swap": (spec.memory_mb << 20) + MEMSW_SLACK, "swappiness": 0},
                "pids": {"limit": spec.pids + PIDS_OVERHEAD},
                "cpu": {"quota": max(1000, int(spec.cpu * CPU_PERIOD_US)),
                        "period": CPU_PERIOD_US},
            },
        },
    }


def exec_argv(argv: list[str], env: dict[str, str]) -> list[str]:
    """The command ``argv`` started through the lock-down binary (the exec candidates of its
    argv[0] resolved on ``env``'s PATH, as the container substrate resolves them)."""
    limits = [str(x) for r, (soft, hard) in sorted(RLIMITS.items()) for x in (r, soft, hard)]
    cands = candidates(argv[0], env, DEFAULT_PATH)
    return [LOCKDOWN, EXEC_MODE, FILTER, str(len(RLIMITS)), *limits, str(len(cands)), *cands, *argv]


def kill_argv(pid: int) -> list[str]:
    """SIGKILL, from inside the sandbox, to process group ``pid`` and to ``pid``."""
    return [LOCKDOWN, "k", FILTER, str(pid)]


def process(argv: list[str], env: dict[str, str], cwd: str, uid: int, gid: int,
            groups: list[int]) -> dict[str, Any]:
    """process.json of one `runsc exec`: no capabilities, no new privileges (as in config);
    ``argv`` is the lock-down binary's (exec_argv, kill_argv)."""
    return {"args": argv, "env": [f"{k}={v}" for k, v in env.items()], "cwd": cwd,
            "user": {"uid": uid, "gid": gid, "additionalGids": list(groups)},
            "capabilities": NO_CAPS, "noNewPrivileges": True}


def write(path: str, doc: dict[str, Any]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with open(fd, "w") as f:
        json.dump(doc, f)
