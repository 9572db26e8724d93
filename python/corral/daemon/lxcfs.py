"""One lxcfs per daemon: /proc files that show each sandbox its own limits, not the host's.

lxcfs (Debian's package, made for containers) is a FUSE filesystem whose /proc/meminfo,
cpuinfo, stat, uptime, loadavg and swaps answer each reader from the cgroups of the init of the
reader's pid namespace: MemTotal is the sandbox's memory limit, cpuinfo and stat list the CPUs
of its cpuset (capped by its CFS quota), stat's times are its cpuacct usage, uptime counts from
its start, loadavg counts its own tasks. The daemon starts one on a mount point of its own,
binds each of those files onto a plain file of its state directory (the spawn binds these over
the sandbox's /proc entries: a path walk that ends at a mount's root sends nothing to the FUSE
server, so a stalled lxcfs cannot stall a spawn), and restarts it if it dies.

The daemon never reads a file of lxcfs on any path a request waits for; the supervisor's probe
runs in a thread of its own with a deadline, and an lxcfs that does not answer in time is
killed and started again. lxcfs outlives a daemon that stops with sandboxes left running (or
crashes): the next daemon finds it by its pid file and mounts, and keeps it. While lxcfs is
down (not installed, starting, restarting), new sandboxes get the real files. A sandbox made
before an lxcfs restart has its binds replaced by the new connection's once lxcfs is up again
(``on_restart``: the substrate binds them into every live sandbox); until then its reads of
those files fail (ENOTCONN).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable

from corral import _core

log = logging.getLogger("corral.lxcfs")

# The /proc entries lxcfs serves that a sandbox gets (diskstats is left masked: without a
# blkio cgroup per sandbox lxcfs would show the host's disks; slabinfo likewise).
PROC_FILES = ("meminfo", "cpuinfo", "stat", "uptime", "loadavg", "swaps")
START_TIMEOUT_S = 10.0
PROBE_EVERY_S = 5.0
PROBE_TIMEOUT_S = 5.0
RESTART_BACKOFF_S = (0.1, 0.5, 2.0, 5.0, 30.0, 60.0)  # an lxcfs that cannot start: rarely


def _mounted(path: str) -> str | None:
    """The filesystem type mounted at ``path`` (the last mount there), from mountinfo: no
    access to the mount itself."""
    fstype = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            if len(fields) > 4 and fields[4].replace("\\040", " ") == path:
                fstype = right.split()[0] if right else None
    return fstype


def _make_dir(path: str) -> None:
    """mkdir -p, past a dead FUSE mount on ``path`` (an lxcfs that died while no daemon
    watched it leaves one: stat answers ENOTCONN, so the directory 'exists' but is no dir)."""
    try:
        os.makedirs(path, mode=0o755, exist_ok=True)
    except FileExistsError:
        while _mounted(path):
            _core.umount_detach(path)
        os.makedirs(path, mode=0o755, exist_ok=True)


class Lxcfs:
    """Starts, watches and restarts one lxcfs; ``proc_binds()`` is what a spawn binds now."""

    def __init__(self, state_dir: str, binary: str | None = None,
                 on_restart: Callable[[list[tuple[str, str]]], None] | None = None) -> None:
        self.dir = os.path.join(state_dir, "lxcfs")
        self.mnt = os.path.join(self.dir, "mnt")
        self.view = os.path.join(self.dir, "view")
        self.binary = binary or shutil.which("lxcfs")
        self.proc: subprocess.Popen[bytes] | None = None  # ours; None if adopted
        self._pidfd = -1  # the running lxcfs (ours or adopted)
        self._pid: int | None = None
        self.restarts = 0
        self.generation = 0  # +1 at each launch: binds of an older one point at a dead server
        self._on_restart = on_restart
        self._binds: list[tuple[str, str]] = []  # replaced whole, read without a lock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # ---- what spawns use --------------------------------------------------------------
    def proc_binds(self) -> list[tuple[str, str]]:
        """(host file, /proc entry) pairs to bind into a new sandbox; empty while down."""
        return self._binds

    @property
    def up(self) -> bool:
        return bool(self._binds)

    @property
    def pid(self) -> int | None:
        return self._pid if self._alive() else None

    def _alive(self) -> bool:
        if self.proc is not None:
            self.proc.poll()  # reap ours
        if self._pidfd < 0:
            return False
        import select

        return not select.select([self._pidfd], [], [], 0)[0]

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> bool:
        """Start lxcfs and its supervisor; False (sandboxes get the real files) if lxcfs is
        not installed or does not come up."""
        if not self.binary:
            log.warning("lxcfs not found: sandboxes see the host's /proc/meminfo, cpuinfo...")
            return False
        _make_dir(self.mnt)
        _make_dir(self.view)
        ok = self._adopt() or self._launch()
        self._thread = threading.Thread(target=self._supervise, name="corral-lxcfs",
                                        daemon=True)
        self._thread.start()
        return ok

    def stop(self, keep: bool = False) -> None:
        """Stop supervising; ``keep``: leave lxcfs running for the sandboxes that outlive
        this daemon (the next one adopts it), else end it and unmount."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        with self._lock:
            if not keep:
                self._kill()
            if self._pidfd >= 0:
                os.close(self._pidfd)
                self._pidfd = -1
        self._binds = []

    def _pidfile(self) -> str:
        return os.path.join(self.dir, "lxcfs.pid")

    def _adopt(self) -> bool:
        """Keep the lxcfs a previous daemon left (its sandboxes' binds point at it)."""
        try:
            with open(self._pidfile()) as f:
                pid = int(f.read().strip())
            fd = os.pidfd_open(pid)
        except (OSError, ValueError):
            return False
        try:
            with open(f"/proc/{pid}/comm") as f:
                ours = f.read().strip() == "lxcfs"
            views = all(_mounted(os.path.join(self.view, n)) == "fuse.lxcfs"
                        for n in PROC_FILES)
        except OSError:
            ours = views = False
        if not (ours and views and _mounted(self.mnt) == "fuse.lxcfs"):
            os.close(fd)
            return False
        with self._lock:
            self._pidfd, self._pid, self.proc = fd, pid, None
            self._binds = [(os.path.join(self.view, n), n) for n in PROC_FILES]
        log.info("lxcfs adopted", extra={"pid": pid})
        return True

    def _launch(self) -> bool:
        with self._lock:
            if self._stop.is_set():
                return False
            self._kill()  # whatever is left: a previous lxcfs, its mounts
            # -f: a child we supervise; -l: loadavg per sandbox; --enable-cfs: the CPU
            # count capped by the CFS quota; -p: a pid file of ours, not /run/lxcfs.pid.
            argv = [self.binary or "lxcfs", "-f", "-l", "--enable-cfs",
                    "-p", self._pidfile(), self.mnt]
            try:
                self.proc = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
            except OSError as e:
                log.warning("cannot start lxcfs: %s", e)
                return False
            self._pid = self.proc.pid
            self._pidfd = os.pidfd_open(self.proc.pid)
            deadline = time.monotonic() + START_TIMEOUT_S
            while _mounted(self.mnt) != "fuse.lxcfs":
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    log.warning("lxcfs did not come up (exit %s)", self.proc.poll())
                    self._kill()
                    return False
                time.sleep(0.01)
            binds = []
            try:
                for name in PROC_FILES:
                    src = os.path.join(self.mnt, "proc", name)
                    dst = os.path.join(self.view, name)
                    if not os.path.exists(dst):
                        with open(dst, "x"):
                            pass
                    _core.bind_readonly(src, dst)
                    binds.append((dst, name))
            except OSError as e:
                log.warning("cannot bind lxcfs's files: %s", e)
                self._kill()
                return False
            self.generation += 1
            self._binds = binds
            log.info("lxcfs up", extra={"pid": self.proc.pid})
            return True

    def _kill(self) -> None:
        """(under _lock) End lxcfs (ours or adopted), unpublish and unmount its files."""
        self._binds = []
        if self._pidfd >= 0:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            select.select([self._pidfd], [], [], 5.0)
            os.close(self._pidfd)
            self._pidfd = -1
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(1.0)
            self.proc = None
        self._pid = None
        self._cleanup_mounts()

    def _cleanup_mounts(self) -> None:
        for name in PROC_FILES:
            dst = os.path.join(self.view, name)
            while _mounted(dst):
                try:
                    _core.umount_detach(dst)
                except OSError:
                    break
        while _mounted(self.mnt):
            try:
                _core.umount_detach(self.mnt)
            except OSError:
                break

    # ---- supervision --------------------------------------------------------------------
    def _supervise(self) -> None:
        failures = 0
        next_probe = time.monotonic() + PROBE_EVERY_S
        while not self._stop.is_set():
            if not self._alive():
                self._binds = []  # at once: new sandboxes get the real files meanwhile
                delay = RESTART_BACKOFF_S[min(failures, len(RESTART_BACKOFF_S) - 1)]
                if self._stop.wait(delay):
                    return
                log.warning("lxcfs ended: restarting")
                if self._launch():
                    self.restarts += 1
                    failures = 0
                    if self._on_restart is not None:
                        try:
                            self._on_restart(self._binds)
                        except Exception:  # noqa: BLE001 - the next restart tries again
                            log.exception("rebinding lxcfs's files into sandboxes failed")
                else:
                    failures += 1
                continue
            if time.monotonic() >= next_probe:
                next_probe = time.monotonic() + PROBE_EVERY_S
                if not self._probe():
                    log.warning("lxcfs did not answer in %.0f s: restarting", PROBE_TIMEOUT_S)
                    with self._lock:
                        self._kill()
                    continue
            self._stop.wait(0.2)

    def _probe(self) -> bool:
        """Does lxcfs answer a read? In a thread of its own: a stalled FUSE server blocks
        the reader, and the reader must not be this loop."""
        binds = self._binds
        if not binds:
            return True
        done = threading.Event()

        def read() -> None:
            with contextlib.suppress(OSError):
                with open(binds[0][0], "rb") as f:
                    f.read(64)
            done.set()

        threading.Thread(target=read, name="corral-lxcfs-probe", daemon=True).start()
        return done.wait(PROBE_TIMEOUT_S)
