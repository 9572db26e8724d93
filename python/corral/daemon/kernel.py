"""The daemon's kernel calls made from Python, in one place: pidfds (open, signal, wait, reap,
the exit status a non-parent reads through PIDFD_GET_INFO), process groups, /proc facts of a
process, the control files of cgroupfs/procfs, and a null device node of the daemon's own.
Everything else (namespaces, mounts, seccomp, exec) is the Rust core's (``corral._core``).

Each function is a thin, typed wrapper with one rule for "the process is gone": a boolean or
None, never an exception the caller has to know the errno of.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import select
import signal
import stat
import struct
import threading

# ioctl(pidfd, PIDFD_GET_INFO, struct pidfd_info) = _IOWR(0xFF, 11, 64 bytes), Linux 6.15+
PIDFD_GET_INFO = (3 << 30) | (64 << 16) | (0xFF << 8) | 11
PIDFD_INFO_PID = 1
PIDFD_INFO_EXIT = 8
_INFO_PID_OFF = 16        # after u64 mask, u64 cgroupid
_INFO_EXIT_OFF = 60       # s32 exit_code, a wait(2) status
PF_EXITING = 0x4          # task flags (/proc/PID/stat field 9): in do_exit
CLONE_FILES = 0x400
_libc = ctypes.CDLL(None, use_errno=True)


# ---- pidfds ------------------------------------------------------------------------------------
def pidfd_open(pid: int) -> int:
    """A pidfd of ``pid`` (O_CLOEXEC); OSError (ESRCH) if there is no such process."""
    return os.pidfd_open(pid)


def pidfd_signal(pidfd: int, sig: int) -> bool:
    """Send ``sig`` through a pidfd; False if the process is gone (or was never ours to
    signal)."""
    try:
        signal.pidfd_send_signal(pidfd, sig)
    except OSError:
        return False
    return True


def pidfd_exited(pidfd: int, timeout_s: float = 0.0) -> bool:
    """Wait up to ``timeout_s`` for the pidfd's process to exit (the fd turns readable)."""
    p = select.poll()
    p.register(pidfd, select.POLLIN)
    return bool(p.poll(max(0, int(timeout_s * 1000))))


def reap(pidfd: int) -> tuple[int, int | None] | None:
    """Reap our exited child through its pidfd: (exit code, terminating signal) as
    ``decode`` gives them; None if it has not exited yet. ChildProcessError if it is not our
    child (or was reaped elsewhere)."""
    res = os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG)
    if res is None:
        return None
    if res.si_code == os.CLD_EXITED:
        return res.si_status, None
    return 128 + res.si_status, res.si_status


def peek_child(pid: int) -> os.waitid_result | None:
    """Our child's exit, read without reaping it (WNOWAIT): None while it runs.
    ChildProcessError if it is not our child."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)


def _info(pidfd: int, mask: int) -> bytearray | None:
    buf = bytearray(64)
    struct.pack_into("=Q", buf, 0, mask)
    try:
        fcntl.ioctl(pidfd, PIDFD_GET_INFO, buf)
    except OSError:  # ESRCH: reaped, and no exit status was asked for
        return None
    return buf


def host_pid(pidfd: int) -> int:
    """The pidfd's process's pid in the daemon's pid namespace; 0 once it is reaped."""
    buf = _info(pidfd, PIDFD_INFO_PID)
    if buf is None or not struct.unpack_from("=Q", buf, 0)[0] & PIDFD_INFO_PID:
        return 0
    return struct.unpack_from("=I", buf, _INFO_PID_OFF)[0]


def wait_status(pidfd: int) -> int | None:
    """The reaped process's wait(2) status (whoever reaped it); None if not reaped yet."""
    buf = _info(pidfd, PIDFD_INFO_EXIT)
    if buf is None or not struct.unpack_from("=Q", buf, 0)[0] & PIDFD_INFO_EXIT:
        return None
    return struct.unpack_from("=i", buf, _INFO_EXIT_OFF)[0]


def decode(status: int) -> tuple[int, int | None]:
    """A wait(2) status as (exit code, terminating signal): (128 + n, n) if killed by signal
    n, (code, None) if it exited."""
    if status & 0x7F == 0:
        return (status >> 8) & 0xFF, None
    return 128 + (status & 0x7F), status & 0x7F


# ---- memory ------------------------------------------------------------------------------------
M_MMAP_THRESHOLD = -3  # mallopt(3)
MMAP_THRESHOLD = 128 << 10


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD) -> bool:
    """Allocations of ``nbytes`` and more get their own mappings, given back when freed.
    glibc raises this threshold each time such a block is freed (up to 32 MiB), after which
    big blocks (a command's output, a response) come from the heap and a burst of them
    leaves the daemon's RSS high for good. Setting it turns that off; False if refused."""
    return bool(_libc.mallopt(M_MMAP_THRESHOLD, nbytes))


# ---- threads -----------------------------------------------------------------------------------
def unshare_files() -> None:
    """Give the calling thread an fd table of its own (a copy of the process's)."""
    if _libc.unshare(CLONE_FILES) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_FILES)")


def nice_thread(nice: int) -> bool:
    """Set the calling thread's CPU priority (setpriority on a thread id changes that thread
    alone on Linux); False if not allowed."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError:
        return False
    return True


# ---- process groups ----------------------------------------------------------------------------
def killpg(pgid: int, sig: int) -> bool:
    """Signal a process group; False if there is no such group (or not ours to signal)."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


# ---- /proc facts of one process ------------------------------------------------------------------
def _stat_fields(pid: int) -> list[bytes] | None:
    """/proc/PID/stat from field 3 (state) on; None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # comm (field 2) may hold spaces and parentheses: split after the last ')'.
    return data[data.rindex(b")") + 2:].split()


def proc_starttime(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks since boot); None if gone."""
    rest = _stat_fields(pid)
    return None if rest is None else int(rest[19])  # fields 3.. -> field 22 is index 19


def proc_alive(pid: int, starttime: int) -> bool:
    """Is PID still the process that started at ``starttime``, and neither a zombie nor on its
    way out? A pid namespace's init that is exiting waits (state D, for ever if need be) until
    every process of its namespace is reaped, and a command whose parent died with the daemon
    is reaped only when the host's init gets to it: such a sandbox is dead, not running."""
    rest = _stat_fields(pid)
    return (rest is not None and rest[0] not in (b"Z", b"X") and int(rest[19]) == starttime
            and not int(rest[6]) & PF_EXITING)


def cpu_ticks(tid: int) -> int | None:
    """The CPU time thread ``tid`` has used, user and system, in clock ticks (None if gone).
    A frozen thread uses none: one whose time grows while its cgroup freezes is running,
    in a syscall the freezer cannot stop (its state says less: a frozen thread reads R on
    some kernels)."""
    rest = _stat_fields(tid)
    return None if rest is None else int(rest[11]) + int(rest[12])  # fields 14 and 15


def exiting(tid: int) -> bool:
    """Is thread ``tid`` in do_exit (PF_EXITING) or a zombie (False if gone)?"""
    rest = _stat_fields(tid)
    return rest is not None and (rest[0] in (b"Z", b"X") or bool(int(rest[6]) & PF_EXITING))


def ns_pid(host_pid: int) -> int:
    """The pid as seen inside the process's own pid namespace (last NSpid field); the host
    pid if unknown."""
    try:
        with open(f"/proc/{host_pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError):
        pass
    return host_pid


# ---- control files (cgroupfs, procfs) -----------------------------------------------------------
def write_knob(path: str, data: str) -> None:
    """One write(2) of ``data`` to a control file: the kernel takes a knob's value whole."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, data.encode())
    finally:
        os.close(fd)


def read_knob(path: str) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while True:
            b = os.read(fd, 65536)
            if not b:
                break
            chunks.append(b)
        return b"".join(chunks).decode()
    finally:
        os.close(fd)


# ---- a null device of its own ------------------------------------------------------------------
def private_null(path: str) -> str:
    """A character device node of the null device (1:3) at ``path``, made if missing; returns
    ``path``. For the stdio of programs that change the owner of their stdio: runsc gives its
    stdio to the sandbox's user (nobody), and with the host's /dev/null as stdio it changed
    the owner of the host's /dev/null."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        tmp = f"{path}.{os.getpid()}.tmp"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        os.mknod(tmp, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        os.chmod(tmp, 0o666)
        os.rename(tmp, path)
        return path
    if not stat.S_ISCHR(st.st_mode) or st.st_rdev != os.makedev(1, 3):
        raise OSError(f"{path} is not a null device node")
    return path
