"""The container substrate: Linux namespaces + overlayfs + cgroups, driven by ``corral._core``.

One sandbox = a tiny init (PID 1 of new mnt/pid/uts/ipc/net/cgroup namespaces) whose root is an
overlay of the image's read-only layers and a private upper dir, assembled inside its own mount
namespace (the host mount table never sees it). Commands are forked straight from the daemon
into the namespaces (``_core.exec_in``); files are read and written from the daemon through an
O_PATH fd of the init's root with openat2(RESOLVE_IN_ROOT) (``_core.fs_*``).

On disk: ``<state_dir>/sandboxes/<id>/{meta.json, root, disk/{upper/<n>, work/<n>}}`` where
``sandboxes`` is a btrfs the substrate mounts and ``disk`` a subvolume with the sandbox's quota
(or, on the tmpfs fallback, ``<id>/{root, upper/<n>, work/<n>}``: corral.daemon.scratch);
cgroups from
:class:`~corral.daemon.cgroups.CgroupManager`. Everything a sandbox owns can be found again from
its id alone, which is what :meth:`cleanup_orphans` relies on after a crash.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import errno
import io
import logging
import lzma
import os
import shutil
import signal
import stat as stat_mod
import tarfile
import threading
import time
import zlib
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, BinaryIO, cast

from corral import _core
from corral.daemon import (
    cpuplace,
    initexec,
    kernel,
    lxcfs,
    procpolicy,
    removal,
    scratch,
    streams,
    thrash,
    uploads,
)
from corral.daemon.kernel import pidfd_exited as _pidfd_exited
from corral.daemon.kernel import proc_alive, proc_starttime
from corral.errors import (
    CapacityExceeded,
    CorralError,
    DirectoryNotEmpty,
    ExecStalled,
    FileExists,
    FileNotFound,
    ForbiddenPath,
    InternalError,
    InvalidPath,
    InvalidRequest,
    IsADirectory,
    IsASymlink,
    NotADirectory,
    PermissionDenied,
    SandboxNotRunning,
    TooLarge,
    Unsupported,
)
from corral.models import DEFAULT_DISK_MB, NETWORK_MODES, FileEntry, SandboxSpec

from .base import Capabilities, ExecSpec, SandboxRuntime, Spawned, Substrate

if TYPE_CHECKING:  # pragma: no cover
    from corral._core import ExecConfig, SpawnConfig
    from corral.daemon.cgroups import CgroupManager
    from corral.daemon.images import Image, ImageStore
    from corral.daemon.snapshots import SnapshotStore

# What one start of a command gives on the container's paths: our child's pid, the init's
# child, or (with a loop) the init's answer to come.
Launch = int | Spawned | Awaitable[Spawned]

log = logging.getLogger("corral.container")

# Limits every process of a sandbox starts with. No core dumps (a crash must not reach the
# host's core_pattern helper with a sandbox's memory); a generous but finite fd limit.
DEFAULT_RLIMITS: dict[str, int | tuple[int, int]] = {"core": (0, 0), "nofile": (1024, 524288)}

# The first Landlock ABI with scopes (LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET): network "disabled".
LANDLOCK_ABI_SCOPES = 6

# errno -> CorralError class for file operations.
_FILE_ERRORS: dict[int, type[CorralError]] = {
    errno.ENOENT: FileNotFound,
    errno.EEXIST: FileExists,
    errno.ENOTDIR: NotADirectory,
    errno.EISDIR: IsADirectory,
    errno.ENOTEMPTY: DirectoryNotEmpty,
    errno.EXDEV: InvalidPath,
    errno.ELOOP: IsASymlink,
    errno.ENAMETOOLONG: InvalidPath,
    errno.EINVAL: InvalidPath,
    errno.EACCES: PermissionDenied,
    errno.EPERM: PermissionDenied,
    errno.EROFS: PermissionDenied,
    errno.EBUSY: InvalidRequest,
    errno.EFBIG: InvalidRequest,
    errno.EOPNOTSUPP: InvalidRequest,
}
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}
_OUT_OF_RESOURCES = {errno.EAGAIN, errno.ENOMEM, errno.ENOSPC, errno.EMFILE, errno.ENFILE,
                     errno.EUSERS}

TAR_MAX_MEMBERS = streams.TAR_MAX_MEMBERS
# What a corrupt or truncated upload raises while it is decompressed and parsed (bzip2 says
# OSError; the file writes raise CorralErrors, never these).
_BAD_ARCHIVE = (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError, OSError, ValueError)
TAR_MAX_BYTES = streams.TAR_MAX_BYTES


# Open root fds kept for sandboxes used recently (exec and file operations reuse them); the rest
# are opened on demand: the daemon's fd table must not grow with the number of sandboxes (its
# RLIMIT_NOFILE may be as low as 20,000 where it cannot raise its hard limit).
ROOT_CACHE = int(os.environ.get("CORRAL_ROOT_FD_CACHE", "1024"))
# The daemon's own exec path takes well under a millisecond; a command not started after this
# fails with ExecStalled (and is killed if it appears later).
SPAWN_TIMEOUT_S = 30.0


# destroy_many: inits signalled ahead of their destroy (each holds a pidfd until destroyed).
KILL_AHEAD = 64


def background_priority() -> None:
    """Lowest CPU priority (nice 19) for the calling thread: a refill that runs while a batch
    of creates is in flight would take CPU from those creates, on the path, for work meant
    to be off it."""
    kernel.nice_thread(19)


class NetnsPool:
    """Ready network namespaces (fds with loopback up), so creating a sandbox does not pay the
    ~0.8 ms a new netns costs. Refilled by a background thread with fresh namespaces only.

    A destroyed sandbox's namespace is never handed to another sandbox: part of what a
    sandbox does to it outlives its processes and cannot be reset without CAP_NET_ADMIN games
    that do not exist for counters: lo's packet and byte counters (/proc/net/dev, netlink),
    the TCP/IP MIB counters (/proc/net/snmp, netstat), and sockets left in TIME_WAIT by the
    side that closed first (60 s, visible in /proc/net/tcp and sock_diag, and holding their
    ports). tests/test_isolation.py::test_network_namespace_never_shows_a_previous_sandbox
    checks all three. The only reuse is a restore (``reset``), where the tenant is the same."""

    def __init__(self, size: int, most: int | None = None, window_s: float = 30.0) -> None:
        self.base = self.size = max(0, size)
        # A batch of creates (create_many, fork) raises the target to its size, up to
        # ``most``, for ``window_s`` after the last such batch: a GRPO trainer forks groups
        # of the same size again and again, and each netns made on the request path costs
        # ~0.8 ms of CPU. Each idle one costs ~180 KiB, hence the cap and the decay.
        self.most = max(self.base, most if most is not None else 2 * self.base)
        self.window_s = window_s
        self._raised_until = 0.0
        self._fds: collections.deque[int] = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        if self.size:
            self._thread = threading.Thread(target=self._run, name="corral-netns-pool",
                                            daemon=True)
            self._thread.start()

    def take(self) -> int | None:
        """A ready namespace, or None if empty."""
        with self._cv:
            fd = self._fds.pop() if self._fds else None
            self._cv.notify()
        return fd

    def expect(self, n: int) -> None:
        """A batch of ``n`` creates is starting: keep up to ``n`` ready for the next one."""
        if not self.base:
            return  # pooling is off
        with self._cv:
            self._raised_until = time.monotonic() + self.window_s
            want = min(self.most, max(self.base, n))
            if want > self.size:
                self.size = want
                self._cv.notify()

    def _decay(self) -> None:
        """Back to the base size once no batch came for a while (the lock is held)."""
        if self.size > self.base and time.monotonic() >= self._raised_until:
            self.size = self.base
            while len(self._fds) > self.size:
                os.close(self._fds.popleft())

    def give(self, fd: int) -> None:
        """Keep a namespace for later: only one no sandbox code has used (that of a create that
        failed before its init ran anything of the sandbox's). Kept up to twice ``size``."""
        with self._cv:
            if not self._closed and len(self._fds) < 2 * self.size:
                self._fds.append(fd)
                return
        os.close(fd)

    def __len__(self) -> int:
        return len(self._fds)

    def _run(self) -> None:
        background_priority()
        while True:
            with self._cv:
                while not self._closed and len(self._fds) >= self.size:
                    # Woken by takes and raises; the timeout lets a raised size decay.
                    self._cv.wait(timeout=self.window_s if self.size > self.base else None)
                    self._decay()
                if self._closed:
                    return
            try:
                fd = _core.netns_new()
            except OSError:
                time.sleep(1.0)  # e.g. out of memory: try again later, creates fall back
                continue
            with self._cv:
                if not self._closed and len(self._fds) < self.size:
                    self._fds.appendleft(fd)
                    continue
            os.close(fd)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            fds = list(self._fds)
            self._fds.clear()
            self._cv.notify_all()
        for fd in fds:
            os.close(fd)
        if self._thread is not None:
            self._thread.join(timeout=5)


# The sandboxes' scratch area (btrfs with a quota per sandbox, or a tmpfs): corral.daemon.scratch.
SCRATCH_SOURCE = scratch.SCRATCH_SOURCE
_mount_of = scratch.mount_of
# xattr that makes an overlay upper dir hide what the lower layers hold at its path.
OVL_OPAQUE = "trusted.overlay.opaque"


class SharedNetns:
    """The one network namespace every sandbox with network "disabled" joins, made on first
    use and held by the daemon. A network namespace costs ~180 KiB and ~0.8 ms of CPU to tear
    down; these sandboxes need none of their own because they cannot make a socket other than
    AF_UNIX (seccomp). What a shared namespace would still share is the namespace of abstract
    unix socket names: every process of such a sandbox runs in a Landlock domain scoped for
    abstract sockets (ABI >= 6), so it cannot connect to one bound outside its domain. Hence the
    mode is refused where Landlock lacks scopes.

    After a daemon restart, re-adopted sandboxes keep the namespace they were made in (the old
    daemon's); new ones join this daemon's. Both hold no interfaces but a loopback that nobody
    can use."""

    def __init__(self) -> None:
        self._fd = -1
        self._lock = threading.Lock()

    @staticmethod
    def check_supported() -> None:
        abi = _core.landlock_abi()
        if abi < LANDLOCK_ABI_SCOPES:
            why = (f"Landlock ABI {abi}" if abi >= 0
                   else f"Landlock unavailable ({os.strerror(-abi)})")
            raise Unsupported(
                "network 'disabled' needs Landlock ABI >= 6 (abstract unix socket scoping; "
                f"Linux >= 6.12 with landlock in CONFIG_LSM / lsm=): this host has {why}",
                details={"landlock_abi": abi})

    def fd(self) -> int:
        """The namespace's fd (owned here: callers must not close it)."""
        with self._lock:
            if self._fd < 0:
                self.check_supported()
                self._fd = _core.netns_new()
            return self._fd

    def same(self, fd: int) -> bool:
        """Whether ``fd`` is this namespace (belt and braces: never pool it)."""
        shared = self._fd
        if shared < 0:
            return False
        a, b = os.fstat(fd), os.fstat(shared)
        return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def _unix_only(runtime: SandboxRuntime) -> bool:
    return runtime.extra.get("network") == "disabled"


def _dup(fd: int) -> int:
    """A close-on-exec copy of ``fd`` (-1 stays -1)."""
    return os.dup(fd) if fd >= 0 else -1


def _kill_abandoned(job: asyncio.Future[int]) -> None:
    """A command the daemon started for a caller that is gone: kill its group, reap it."""
    if job.cancelled() or job.exception() is not None:
        return
    pid = job.result()
    kernel.killpg(pid, signal.SIGKILL)
    threading.Thread(target=_reap_later, args=(pid,), daemon=True).start()


async def _within(fut: asyncio.Future[Any], timeout: float, what: str) -> Any:
    """Await ``fut``; after ``timeout`` cancel it and raise ExecStalled(what). Unlike
    wait_for, a cancelled caller always gets CancelledError, even if ``fut`` just finished."""
    expired = False

    def expire() -> None:
        nonlocal expired
        expired = True
        fut.cancel()

    timer = asyncio.get_running_loop().call_later(timeout, expire)
    try:
        return await fut
    except asyncio.CancelledError:
        if expired:
            raise ExecStalled(what) from None
        raise
    finally:
        timer.cancel()


def _in_thread(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> asyncio.Future[Any]:
    """Run ``fn(*args)`` in a new thread (no pool shared across sandboxes); a future of the
    loop's. A pid it returns after the loop closed is killed and reaped."""
    fut: asyncio.Future[Any] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if fut.done():
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def run() -> None:
        try:
            out: tuple[bool, Any] = (True, fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            out = (False, e)
        try:
            loop.call_soon_threadsafe(settle, *out)
        except RuntimeError:  # the loop is closed: nobody will watch the command
            if out[0] and isinstance(out[1], int):
                kernel.killpg(out[1], signal.SIGKILL)
                _reap_later(out[1])

    threading.Thread(target=run, name="corral-exec", daemon=True).start()
    return fut


def _reap_later(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def _file_error(e: OSError, path: str, disk_quota: bool = False) -> CorralError:
    if isinstance(e, _core.ForbiddenPath):
        return ForbiddenPath(f"{e.strerror}: {path}", details={"path": path})
    reason = e.strerror or str(e)
    msg = f"{reason}: {path}" if path else reason
    if e.errno in _DISK_FULL:
        # The sandbox's own disk is full (its quota, or its /tmp on the tmpfs fallback): its
        # limit, as a write inside it sees it. A full host disk is the same errno on the
        # tmpfs fallback and ENOSPC on btrfs: then it is the scratch area's, CapacityExceeded.
        if e.errno == errno.ENOSPC and disk_quota:
            return CapacityExceeded(f"the sandboxes' scratch area is full: {msg}",
                                    details={"path": path, "errno": e.errno})
        return TooLarge(f"the sandbox's disk is full (disk_mb): {msg}",
                        details={"path": path, "errno": e.errno, "limit": "disk_mb"})
    cls = _FILE_ERRORS.get(e.errno or 0, InternalError)
    return cls(msg, details={"path": path, "errno": e.errno})


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


def _check_path(path: str) -> str:
    if not isinstance(path, str) or not path.startswith("/"):
        raise InvalidPath(f"paths must be absolute inside the sandbox: {path!r}",
                          details={"path": path})
    if "\0" in path:
        raise InvalidPath("NUL byte in path", details={"path": path})
    if len(path) > 4096:
        raise InvalidPath("path longer than 4096 bytes", details={"path": path[:100] + "..."})
    return path


def make_sys_dir(path: str, views: list[str]) -> str:
    """The skeleton bound read-only at each sandbox's /sys: fs/cgroup/<view> mountpoints,
    root-owned, mode 0555, nothing else."""
    for name in views:
        os.makedirs(os.path.join(path, "fs", "cgroup", name), mode=0o555, exist_ok=True)
    for dirpath, _, _ in os.walk(path):
        os.chmod(dirpath, 0o555)
    return path


def make_mask_dir(path: str) -> str:
    """The empty directory every sandbox binds (read-only) over the /proc directories it
    masks, instead of mounting a tmpfs of its own there: one superblock fewer per sandbox, and
    each superblock alive costs every memory cgroup of the host a slot in its shrinker table
    until the host reboots (docs/daemon.md, "Recycled memory cgroups"). Root-owned, mode 0555,
    emptied if anything is found in it."""
    try:
        os.mkdir(path, 0o555)
    except FileExistsError:
        st = os.lstat(path)
        if not stat_mod.S_ISDIR(st.st_mode):
            os.unlink(path)
            os.mkdir(path, 0o555)
        elif os.listdir(path):
            shutil.rmtree(path)
            os.mkdir(path, 0o555)
    os.chown(path, 0, 0)
    os.chmod(path, 0o555)
    return path


class _RootRef:
    __slots__ = ("fd", "users", "closing")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.users = 0
        self.closing = False


class ContainerSubstrate(Substrate):
    name = "container"
    capabilities = Capabilities(files=True, snapshot=True, restore=True, pause=True,
                                oom_kills=True, exit_watch=True, warm_pool=True,
                                networks=NETWORK_MODES)

    def __init__(self, state_dir: str, cgroups: CgroupManager, images: ImageStore,
                 netns_pool: int | None = None) -> None:
        self.state_dir = state_dir
        self.sandboxes_dir = os.path.join(state_dir, "sandboxes")
        os.makedirs(self.sandboxes_dir, mode=0o700, exist_ok=True)
        self.scratch = scratch.Scratch(state_dir, self.sandboxes_dir)
        self.layers_dir = os.path.join(state_dir, "layers") + "/"  # snapshots' (lowerdirs)
        self._tmp_needed: dict[tuple[str, ...], bool] = {}  # see _tmp_on_layer
        # What one upload may decompress to, and (without a kernel quota: the tmpfs
        # fallback) the bytes the daemon wrote into each sandbox against its disk_mb.
        self.upload_max_bytes = 1 << 30
        self.disk = uploads.DiskBudget()
        self.cgroups = cgroups
        # The CPUs of each sandbox's cpuset (none without a v1 cpuset hierarchy of our own).
        host_cpus = cgroups.host_cpus()
        self.cpu_placer = cpuplace.CpuPlacer(host_cpus) if host_cpus else None
        self.images = images
        self.init_fd = _core.init_memfd()
        self.mask_dir = make_mask_dir(os.path.join(state_dir, "mask"))
        # /sys: a read-only skeleton holding only the mountpoints of the sandbox's own cgroups
        # (/sys/fs/cgroup/<hierarchy>), mounted in its cgroup namespace at spawn, or at the
        # first exec for those made then (see _mount_later_views).
        views: list[str] = cgroups.view_names()
        self.sys_dir = make_sys_dir(os.path.join(state_dir, "sys"), views) if views else None
        self.proc_policy = procpolicy.compute().spawn_config()  # what sandboxes see of /proc
        # /proc/meminfo, cpuinfo, stat... by each sandbox's own cgroups (corral.daemon.lxcfs);
        # CORRAL_LXCFS=0 leaves sandboxes the host's.
        self.lxcfs = lxcfs.Lxcfs(state_dir, on_restart=self._rebind_lxcfs)
        # Live sandboxes' inits (id -> pid, start time), for lxcfs's binds after a restart.
        self._live: dict[str, tuple[int, int]] = {}
        if os.environ.get("CORRAL_LXCFS", "1") != "0":
            self.lxcfs.start()
        # A sandbox thrashing at its memory limit is OOM-killed (corral.daemon.thrash).
        self.thrash: thrash.ThrashWatcher | None = None
        mem_base = cgroups.memory_base
        if mem_base:
            self.thrash = thrash.ThrashWatcher(
                mem_base, lambda name: not name.startswith("."),  # spares, the daemon's
                cgroups.record_thrash_kill)
            self.thrash.start()
        self.rlimits = dict(DEFAULT_RLIMITS)
        self.overlay_options = [o for o in os.environ.get(
            "CORRAL_OVERLAY_OPTIONS", "volatile").replace(",", " ").split() if o]
        # O_PATH fds of sandbox roots, opened on first use, reference-counted so destroy never
        # closes one under a concurrent file operation (a reused fd number would point that
        # operation at another file); never persisted.
        self._roots: collections.OrderedDict[str, _RootRef] = collections.OrderedDict()
        self._closing: set[str] = set()
        self._lock = threading.Lock()
        # Exec through the sandbox's init (corral.daemon.initexec): the daemon's end of each
        # init's channel, taken at the first exec and closed with the root fd; None for an
        # init without one (started by an older corral, re-adopted). CORRAL_INIT_EXEC=0 (or
        # a kernel before 6.15, which cannot give us the status of a process the init reaps)
        # keeps every exec on the daemon's own path (_core.exec_in).
        self.init_exec = (os.environ.get("CORRAL_INIT_EXEC", "1") != "0"
                          and initexec.supported())
        self._chans: collections.OrderedDict[str, initexec.Channel | None] = \
            collections.OrderedDict()
        self.exec_paths = {"init": 0, "daemon": 0}  # commands started each way (/metrics)
        # The daemon's own path when an event loop waits for it (see _spawn_off_loop): a
        # thread per command, one command at a time per sandbox; nothing shared across them.
        self._fallback_gates: dict[str, asyncio.Lock] = {}
        if netns_pool is None:
            netns_pool = int(os.environ.get("CORRAL_NETNS_POOL", "32"))
        self.netns = NetnsPool(netns_pool, most=int(os.environ.get("CORRAL_NETNS_POOL_MAX",
                                                                  str(2 * netns_pool))))
        self.shared_netns = SharedNetns()
        # A pidfd per sandbox (runtime.pidfd) unless watch_exits() was called: then the
        # daemon's own fd table holds none (corral.daemon.initwatch keeps them elsewhere). An
        # init is our child and nobody but destroy reaps it, so until then its pid cannot be
        # reused: a pidfd opened from the pid on demand (_open_pidfd) is the right process.
        self.keep_pidfds = True
        # cgroup v1: a sandbox's memory (and cpu) cgroup is made at its first exec. Each
        # memory cgroup carries kernel bookkeeping that grows with the number of superblocks
        # on the host (shrinker_info: ~1 KiB per 64 mounted filesystems, and each sandbox
        # mounts ~10), so a memcg per idle sandbox made memory quadratic in the sandbox count
        # (~0.8 MiB each at 5,000, ~8 MiB at 50,000). Nothing runs in an idle sandbox but its
        # init (which never allocates), so no limit is lost: every process enters through
        # exec, which makes the cgroup (limits first) and moves the init in before it starts.
        # The cpu cgroup likewise: setting a CFS quota walks every cpu cgroup on the host.
        self.lazy_memcg = (cgroups.lazy_memory_ok
                           and os.environ.get("CORRAL_LAZY_MEMCG", "1") != "0")
        self._kids: dict[int, str] = {}       # init pid -> sandbox id, until destroy reaps it
        self._kid_lock = threading.Lock()
        self._watcher: Any = None             # corral.daemon.initwatch.InitWatcher
        self._on_lost: Any = None

    def watch_exits(self, loop: Any, on_lost: Any) -> bool:
        """Watch inits without an fd per sandbox in this process's fd table (see
        corral.daemon.initwatch); ``on_lost`` gets the ids of sandboxes whose init died.
        CORRAL_PIDFD_PER_SANDBOX=1 keeps a pidfd per sandbox instead."""
        from corral.daemon.initwatch import InitWatcher

        if os.environ.get("CORRAL_PIDFD_PER_SANDBOX") == "1":
            return False
        try:
            self._watcher = InitWatcher(loop, self._inits_dead)
        except OSError:
            return False
        self._on_lost = on_lost
        self.keep_pidfds = False
        return True

    def _inits_dead(self, pids: list[int]) -> None:
        with self._kid_lock:
            ids = [self._kids[p] for p in pids if p in self._kids]
        if ids and self._on_lost is not None:
            self._on_lost(ids)

    def expect(self, count: int, spec: SandboxSpec) -> None:
        if spec.network != "disabled":  # "disabled" shares one namespace: nothing to pool
            self.netns.expect(count)

    def close(self, *, retire: bool = False) -> None:
        """Release what the substrate holds (not the sandboxes): pooled netns, root fds, the
        init memfd. ``retire`` (a graceful stop, every sandbox destroyed) also removes the
        parent cgroups, so a stopped corral leaves nothing in the host's cgroup tree."""
        if self._watcher is not None:
            self._watcher.close()
            self._watcher = None
        self.netns.close()
        if self.thrash is not None:
            self.thrash.stop()
        # Sandboxes kept for the next daemon keep their lxcfs too (it adopts it).
        self.lxcfs.stop(keep=not retire)
        self.cgroups.drop_spares()  # recycled memory cgroups are this daemon's cache only
        self.shared_netns.close()
        if retire:
            self.cgroups.remove_parents()
            self.scratch.close()
        for sid in list(self._roots):
            self._close_root(sid)
        if self.init_fd >= 0:
            os.close(self.init_fd)
            self.init_fd = -1

    # ---- lifecycle -----------------------------------------------------------------------
    def create(self, sandbox_id: str, spec: SandboxSpec, image: Any,
               cgroup_paths: list[str] | None = None,
               net_fd: int | None = None) -> SandboxRuntime:
        """``cgroup_paths``: reuse these (empty) cgroups instead of making new ones (reset);
        ``net_fd``: the network namespace to use (reset: the sandbox's own; this call owns
        the fd), else one from the pool."""
        from corral.daemon.cgroups import check_id

        try:
            check_id(sandbox_id)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        img: Image = self.images.get(image) if isinstance(image, str) else image
        if not img.overlays or img.overlays[0][0] != "/":
            raise InvalidRequest(f"image {img.name!r} has no root overlay")
        sdir = os.path.join(self.sandboxes_dir, sandbox_id)
        root = os.path.join(sdir, "root")
        paths: list[str] = []
        pid, pidfd = -1, -1
        unix_only = spec.network == "disabled"
        own_net = net_fd is not None  # the sandbox's own (reset): never into the pool
        if unix_only:
            # the shared namespace of network "disabled" stays the daemon's: join, never own
            if net_fd is not None:
                os.close(net_fd)
            net_fd, own_net = None, False
        elif net_fd is None:
            net_fd = self.netns.take()
        try:
            join_fd = self.shared_netns.fd() if unix_only else net_fd
            os.makedirs(sdir, mode=0o700, exist_ok=True)
            os.mkdir(root, 0o755)
            layer = self.scratch.make_layer(sdir, spec.disk_mb)
            os.mkdir(os.path.join(layer, "upper"), 0o700)
            os.mkdir(os.path.join(layer, "work"), 0o700)
            overlays = []
            for n, (target, lowers) in enumerate(img.overlays):
                upper = os.path.join(layer, "upper", str(n))
                work = os.path.join(layer, "work", str(n))
                os.mkdir(upper, 0o755)
                os.mkdir(work, 0o700)
                overlays.append({"target": target, "lower": list(lowers), "upper": upper,
                                 "work": work, "options": self.overlay_options})
            if self.scratch.quota:
                self._tmp_on_layer(overlays[0])
            # Lazy unless a recycled memory cgroup is at hand: then the init joins every
            # cgroup itself at spawn (through `tasks`, cheap), and neither the first exec nor
            # a warm pool has to move it in by pid later, which takes the global threadgroup
            # rwsem (an RCU grace period, with cgroup_mutex held: every cgroup operation on
            # the host waits). Spares are few, so idle sandboxes rarely get a memcg this way.
            lazy = self.lazy_memcg and not (cgroup_paths is None and
                                            self.cgroups.spare_ready())
            later: dict[str, Any] = {"later": True} if lazy else {}
            cpus = (self.cpu_placer.take(sandbox_id, spec.cpu)
                    if self.cpu_placer is not None else None)
            if cpus is not None:
                later["cpus"] = cpus
            paths = cgroup_paths or self.cgroups.create(sandbox_id, spec.cpu, spec.memory_mb,
                                                        spec.pids, **later)
            join = paths
            if lazy:
                skip = self.cgroups.later_paths(sandbox_id)
                join = [p for p in paths if p not in skip or os.path.isdir(p)]
            gen, binds = self.lxcfs.generation, self.lxcfs.proc_binds()
            cfg = {
                "init_fd": self.init_fd,
                "root": root,
                "overlays": overlays,
                "hostname": spec.hostname or sandbox_id[:63],
                "cgroup_procs": self.cgroups.procs_files(join),
                "rlimits": self.rlimits,
                "netns_fd": join_fd,
                "unix_only": unix_only,
                "mask_dir": self.mask_dir,
                **self.proc_policy,
                "proc_binds": binds,
                "sys_dir": self.sys_dir,
                "cgroup_mounts": (self.cgroups.view_mounts(join)
                                  if self.sys_dir is not None else []),
                "tmp_size_mb": spec.disk_mb,
                "tmp_tmpfs": not self.scratch.quota,
            }
            pid, pidfd = _core.spawn_sandbox(cast("SpawnConfig", cfg))
            if not self.keep_pidfds:
                with self._kid_lock:
                    self._kids[pid] = sandbox_id
                self._watcher.add(pid)
            if net_fd is not None:
                os.close(net_fd)  # the sandbox holds it now
                net_fd = None
            starttime = proc_starttime(pid)
            # Registered first, checked after: a death after this check is an exit event.
            if starttime is None or not proc_alive(pid, starttime):
                raise OSError(errno.ESRCH, "spawn_sandbox: the init died right after exec")
            if not self.keep_pidfds:
                os.close(pidfd)  # opened again when needed (see keep_pidfds)
                pidfd = -1
            extra: dict[str, Any] = {"image": img.name, "disk_mb": spec.disk_mb}
            if layer != sdir:
                extra["upper"] = os.path.join(scratch.LAYER, "upper")  # below sandbox_dir
            if cpus is not None:
                extra["cpus"] = cpus
            if unix_only:
                extra["network"] = "disabled"  # exec applies the same walls; never pooled
            if lazy:
                extra["memory_mb"] = spec.memory_mb
                extra["cpu"] = spec.cpu
            self._oom_baseline(sandbox_id, extra)
            runtime = SandboxRuntime(sandbox_id=sandbox_id, init_pid=pid,
                                     init_starttime=starttime, sandbox_dir=sdir,
                                     cgroup_paths=paths, pidfd=pidfd, extra=extra)
            self._live[sandbox_id] = (pid, starttime)
            if self.lxcfs.generation != gen and self.lxcfs.up:
                # lxcfs restarted during the spawn, after the others were rebound: this one too
                self._rebind_one(sandbox_id, self.lxcfs.proc_binds())
            return runtime
        except BaseException as e:
            if net_fd is not None:
                # Unused by any sandbox code yet (the init never ran user code), unless it is
                # the restored sandbox's own: that one is closed, never pooled.
                if own_net:
                    os.close(net_fd)
                else:
                    self.netns.give(net_fd)
            self._undo_create(sandbox_id, sdir, paths, pid, pidfd)
            if isinstance(e, CorralError) or not isinstance(e, Exception):
                raise
            if isinstance(e, ValueError):
                raise InvalidRequest(f"cannot create sandbox: {e}") from e
            if isinstance(e, OSError):
                details = {"errno": e.errno}
                if e.errno in _OUT_OF_RESOURCES:
                    raise CapacityExceeded(f"host out of resources: {e.strerror or e}",
                                           details=details) from e
                raise InternalError(f"cannot create sandbox: {e.strerror or e}",
                                    details=details) from e
            raise InternalError(f"cannot create sandbox: {e}") from e

    def _tmp_on_layer(self, root_overlay: dict[str, Any]) -> None:
        """/tmp without a tmpfs of its own: a directory of the root overlay, on the sandbox's
        disk with its quota. The image's own /tmp serves when it is an empty 1777 directory
        (the host image's skeleton, most images); otherwise (missing, not 1777, or holding
        files: the image's) an empty, overlay-opaque /tmp is made in the upper. A restored
        sandbox keeps the /tmp its snapshot holds. Decided once per stack of lowers (they are
        read-only)."""
        lowers = tuple(root_overlay["lower"])
        need = self._tmp_needed.get(lowers)
        if need is None:
            need = _image_tmp_unfit([lo for lo in lowers if not lo.startswith(self.layers_dir)])
            if any(lo.startswith(self.layers_dir) and os.path.lexists(os.path.join(lo, "tmp"))
                   for lo in lowers):
                need = False  # the snapshot's own /tmp
            if len(self._tmp_needed) > 4096:
                self._tmp_needed.clear()
            self._tmp_needed[lowers] = need
        if need:
            tmp = os.path.join(root_overlay["upper"], "tmp")
            os.mkdir(tmp)
            os.chmod(tmp, 0o1777)  # mkdir's mode goes through the umask
            os.setxattr(tmp, OVL_OPAQUE, b"y")

    def _undo_create(self, sandbox_id: str, sdir: str, paths: list[str], pid: int,
                     pidfd: int) -> None:
        if pidfd >= 0:
            self._kill_and_wait(pid, pidfd)
            os.close(pidfd)
        if pid > 0:
            self._forget(pid, sandbox_id)
        if paths:
            try:
                self.cgroups.kill_all(paths)
                self.cgroups.remove(paths)
            except OSError:
                pass
        if self.cpu_placer is not None:
            self.cpu_placer.release(sandbox_id)
        self._live.pop(sandbox_id, None)
        removal.quiet_remove(sdir)

    def _kill_and_wait(self, pid: int, pidfd: int, timeout_s: float = 10.0) -> bool:
        """SIGKILL the init (the kernel then kills every process of its pid namespace) and
        wait until it is gone. The init only turns into a zombie once every process of the
        namespace has been reaped, and processes started with exec_in are the daemon's children,
        so this needs the daemon to keep reaping them meanwhile: bounded by ``timeout_s``.
        True if the init has exited (so its whole pid namespace is gone)."""
        kernel.pidfd_signal(pidfd, signal.SIGKILL)
        if _pidfd_exited(pidfd, timeout_s):
            try:
                kernel.reap(pidfd)
            except ChildProcessError:
                pass  # adopted after a restart: not our child, someone else reaps it
            return True
        # Still there (children of ours in its namespace not reaped yet?): reap it whenever it
        # goes, so it never lingers as a zombie once the caller has closed the pidfd.
        threading.Thread(target=_reap_later, args=(pid,), name=f"corral-reap-{pid}",
                         daemon=True).start()
        return False

    def adopt(self, runtime: SandboxRuntime) -> bool:
        pid = runtime.init_pid
        if pid <= 0 or not proc_alive(pid, runtime.init_starttime):
            return False
        try:
            fd = kernel.pidfd_open(pid)
        except (ProcessLookupError, OSError):
            return False
        # The pid could have been reused between the check and pidfd_open: check again now
        # that the pidfd pins the process.
        if proc_starttime(pid) != runtime.init_starttime or _pidfd_exited(fd, 0):
            os.close(fd)
            return False
        runtime.pidfd = fd
        if self.cpu_placer is not None:
            self.cpu_placer.hold(runtime.sandbox_id, runtime.extra.get("cpus"))
        self._live[runtime.sandbox_id] = (pid, runtime.init_starttime)
        return True

    def destroy_many(self, runtimes: list[SandboxRuntime]) -> list[BaseException | None]:
        """SIGKILL every init first, so the kernel tears the namespaces down (in the dying
        inits' own contexts, on any core) while the first destroys wait and clean up."""
        out: list[BaseException | None] = []
        for i in range(0, len(runtimes), KILL_AHEAD):  # bounded: a pidfd each meanwhile
            chunk = runtimes[i:i + KILL_AHEAD]
            for rt in chunk:
                # The cached root fd goes first, as in destroy: closed after the init's death
                # it would be the last reference to the sandbox's mounts, and their teardown
                # (an RCU grace period) would run here instead of in the dying init.
                self._close_root(rt.sandbox_id)
                if rt.pidfd < 0:
                    rt.pidfd = self._open_pidfd(rt)  # destroy uses and closes it
            # Unwatched before they die, as destroy does: a death report must never be
            # matched (by pid) to a later sandbox that reuses the pid once it is reaped.
            self._forget_many([(rt.init_pid, rt.sandbox_id) for rt in chunk])
            for rt in chunk:
                if rt.pidfd >= 0:
                    # gone already: destroy handles it (a frozen one: thawed there)
                    kernel.pidfd_signal(rt.pidfd, signal.SIGKILL)
            out += super().destroy_many(chunk)
        return out

    def destroy(self, runtime: SandboxRuntime) -> None:
        with self._lock:
            self._closing.add(runtime.sandbox_id)
        try:
            self._destroy(runtime)
        finally:
            with self._lock:
                self._closing.discard(runtime.sandbox_id)

    def _destroy(self, runtime: SandboxRuntime) -> None:
        self._close_root(runtime.sandbox_id)
        self.disk.forget(runtime.sandbox_id)
        self.cgroups.forget_thrash_kills(runtime.sandbox_id)
        self._live.pop(runtime.sandbox_id, None)
        if self.cpu_placer is not None:
            self.cpu_placer.release(runtime.sandbox_id)
        pidfd = runtime.pidfd
        if pidfd < 0:
            pidfd = self._open_pidfd(runtime)
        # Out of _kids before the reap below frees the pid: from now on a pidfd is only opened
        # with the start-time checks of an adopted init.
        self._forget(runtime.init_pid, runtime.sandbox_id)
        paths = runtime.cgroup_paths or self.cgroups.paths_for(runtime.sandbox_id)
        reaped = False
        if pidfd >= 0:
            self._kill_thawed(pidfd, paths)
            reaped = self._kill_and_wait(runtime.init_pid, pidfd)
        # Once the init is gone, so is every process of its pid namespace (the kernel waits for
        # all of them before the init can be reaped), and only those ever join the cgroups: try
        # rmdir first. Reading cgroup.procs is not free (v1 builds a pid list per read and a
        # kworker frees it later), so kill_all runs only when something is still there.
        sdir = os.path.join(self.sandboxes_dir, runtime.sandbox_id)
        if reaped:
            # Files first: on the scratch tmpfs they are charged to the sandbox's memory
            # cgroup, which is kept for the next sandbox only if nothing is charged to it.
            self._remove_dir(runtime.sandbox_id)
            self.cgroups.recycle_memory(runtime.sandbox_id)
            self.cgroups.recycle_rest(runtime.sandbox_id)
        if not (reaped and self.cgroups.try_remove(paths)):
            self.cgroups.kill_all(paths)
            self.cgroups.remove(paths)
        if pidfd >= 0:
            os.close(pidfd)
        runtime.pidfd = -1
        if reaped:
            return  # removed above; nothing of the sandbox can write there any more
        removal.remove_or_quarantine(sdir)

    def _remove_dir(self, sandbox_id: str) -> None:
        """rm -rf the sandbox's directory in the Rust core (GIL released, iterative at any
        depth, never following a symlink: the upper dir holds what the tenant wrote); what
        cannot go is quarantined (corral.daemon.removal)."""
        try:
            removal.drop_layer(os.path.join(self.sandboxes_dir, sandbox_id))
            fd = os.open(self.sandboxes_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            removal.remove_or_quarantine(os.path.join(self.sandboxes_dir, sandbox_id))
            return
        try:
            _core.fs_remove(fd, "/" + sandbox_id, True)
        except FileNotFoundError:
            pass
        except (OSError, ValueError):
            removal.remove_or_quarantine(os.path.join(self.sandboxes_dir, sandbox_id))
        finally:
            os.close(fd)

    # ---- inits without a pidfd each (see keep_pidfds) -------------------------------------
    def _open_pidfd(self, runtime: SandboxRuntime) -> int:
        """A new pidfd of the sandbox's init (the caller closes it), or -1 if it is gone."""
        pid = runtime.init_pid
        if pid <= 0:
            return -1
        with self._kid_lock:
            if self._kids.get(pid) == runtime.sandbox_id:
                try:  # our unreaped child: the pid is pinned
                    return kernel.pidfd_open(pid)
                except OSError:
                    return -1
        # Not our child (adopted after a restart): the pid could be reused; check after.
        if proc_starttime(pid) != runtime.init_starttime:
            return -1
        try:
            fd = kernel.pidfd_open(pid)
        except OSError:
            return -1
        if proc_starttime(pid) != runtime.init_starttime:
            os.close(fd)
            return -1
        return fd

    def _forget(self, pid: int, sandbox_id: str) -> None:
        """Before the init is reaped (which frees its pid): no more pidfds from its pid."""
        self._forget_many([(pid, sandbox_id)])

    def _forget_many(self, kids: list[tuple[int, str]]) -> None:
        with self._kid_lock:
            mine = [pid for pid, sid in kids if self._kids.get(pid) == sid]
            for pid in mine:
                del self._kids[pid]
        if mine and self._watcher is not None:
            self._watcher.remove_many(mine)

    def reset(self, runtime: SandboxRuntime, spec: SandboxSpec, image: Any) -> SandboxRuntime:
        """Restart a sandbox in place (restore to a snapshot): kill every process, set the old
        directories aside (deleted in the background), and start a new init with a fresh upper
        on ``image`` under the same id, cgroup and network namespace. Returns the new runtime;
        the old one is dead either way.

        The new init starts while the old processes are still dying (their pid namespace goes
        with its init: ~1.5 ms of teardown, on another core). Joining a cgroup is not limited
        by pids.max, so a fork bomb that filled it does not stop the new init; the call still
        returns only once the old init, and with it every old process, is gone."""
        sid = runtime.sandbox_id
        with self._lock:
            self._closing.add(sid)
        try:
            self._close_root(sid)
            pidfd = runtime.pidfd if runtime.pidfd >= 0 else self._open_pidfd(runtime)
            self._forget(runtime.init_pid, sid)  # before the reap frees the pid
            net_fd = self._netns_of(runtime, pidfd) if pidfd >= 0 else None
            paths = runtime.cgroup_paths or self.cgroups.paths_for(sid)
            if pidfd >= 0:
                self._kill_thawed(pidfd, paths)  # the kernel kills its whole pid namespace
                # Anything in the cgroup but not in that namespace gets one SIGKILL now; the
                # wait for the cgroup to empty would be a wait for the new init too.
                self.cgroups.kill_all(paths, timeout=0)
            else:  # no handle on the old init: wait for the cgroup to be empty
                self.cgroups.kill_all(paths)
            sdir = os.path.join(self.sandboxes_dir, sid)
            # In the sandboxes dir, so the rename stays on one filesystem (the scratch tmpfs);
            # a crash before the rmtree leaves it to the engine's recovery, which removes
            # every entry there that is not a sandbox it re-adopts.
            trash = os.path.join(self.sandboxes_dir, ".trash", f"{sid}.{os.urandom(4).hex()}")
            os.makedirs(os.path.dirname(trash), mode=0o700, exist_ok=True)
            os.rename(sdir, trash)
        finally:
            with self._lock:
                self._closing.discard(sid)
        try:
            # The new init joins the same network namespace (the same tenant): handed over
            # directly, never through the pool, where a concurrent create could take it.
            return self.create(sid, spec, image, cgroup_paths=paths, net_fd=net_fd)
        finally:
            if pidfd >= 0:  # by now the old init is gone, or nearly: reap it
                self._kill_and_wait(runtime.init_pid, pidfd)
                os.close(pidfd)
            runtime.pidfd = -1
            # Only once the old mounts are gone with their namespace: no file is deleted
            # under a live overlay.
            removal.remove_later(trash)

    def _kill_thawed(self, pidfd: int, paths: list[str]) -> None:
        """SIGKILL the init, then thaw its cgroup: a frozen (paused) task does not act on a
        signal until thawed, and thawing after the signal lets no user code run."""
        if not kernel.pidfd_signal(pidfd, signal.SIGKILL):
            return
        try:
            if self.cgroups.is_frozen(paths):
                self.cgroups.thaw(paths, wait=False)
        except OSError:
            pass

    def _netns_of(self, runtime: SandboxRuntime, pidfd: int) -> int | None:
        """An fd of a live sandbox's network namespace, for its restart in place (reset).
        Never the shared one of network "disabled" (a reset sandbox rejoins it by itself)."""
        if _unix_only(runtime):
            return None
        pid = runtime.init_pid
        try:
            fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        if _pidfd_exited(pidfd, 0) or self.shared_netns.same(fd):  # reused pid: not ours
            os.close(fd)
            return None
        return fd

    def cleanup_orphans(self, known_ids: set[str]) -> list[str]:
        ids = set(self.cgroups.list_ids())
        try:
            ids.update(n for n in os.listdir(self.sandboxes_dir)
                       if os.path.isdir(os.path.join(self.sandboxes_dir, n)))
        except FileNotFoundError:
            pass
        removed = []
        for sid in sorted(ids - set(known_ids)):
            try:
                paths = self.cgroups.paths_for(sid)
            except ValueError:
                continue  # not one of ours
            self._close_root(sid)
            self.cgroups.kill_all(paths)
            try:
                self.cgroups.remove(paths)
            except OSError:
                pass
            removal.remove_or_quarantine(os.path.join(self.sandboxes_dir, sid))
            removed.append(sid)
        return removed

    # ---- why an init died (corral.daemon.engine: sandbox_crashed or sandbox_lost) ----------
    def _oom_baseline(self, sandbox_id: str, extra: dict[str, Any]) -> None:
        """Remember the OOM kills a (recycled, or restored-in-place) memory cgroup already
        counts: only later ones are this sandbox's."""
        kills = self.cgroups.oom_kills(sandbox_id)
        if kills:
            extra["oom_base"] = kills
        else:
            extra.pop("oom_base", None)

    def oom_kills(self, runtime: SandboxRuntime) -> int | None:
        """The memory cgroup's OOM kill counter (v2 ``memory.events``, v1
        ``memory.oom_control``); before the cgroup is made (a lazy one, before the first
        exec) the baseline it will start from. Only differences mean anything."""
        kills = self.cgroups.oom_kills(runtime.sandbox_id)
        if kills is None and not runtime.extra.get("memcg"):
            return int(runtime.extra.get("oom_base", 0))
        return kills

    def end_cause(self, runtime: SandboxRuntime) -> dict[str, Any] | None:
        """Why the sandbox's (dead) init died, when the sandbox itself is the cause; None when
        the cause is outside it. Call before destroy: it reads the memory cgroup and peeks at
        the init's exit status without reaping it.

        - an OOM kill recorded in its memory cgroup: ``{"cause": "oom"}``, whatever killed
          the init (the OOM killer itself, or the pid namespace going with it);
        - the init ended by a signal other than SIGKILL, or exited non-zero: ``{"cause":
          "init_exited", "status": ...}`` (nothing outside does that: the host stops an init
          with SIGKILL, or SIGTERM, on which it exits 0);
        - SIGKILL or exit 0 with no OOM kill: the host's doing, None."""
        kills = self.cgroups.oom_kills(runtime.sandbox_id)
        if kills is not None and kills > int(runtime.extra.get("oom_base", 0)):
            return {"cause": "oom", "oom_kills": kills - int(runtime.extra.get("oom_base", 0))}
        try:  # WNOWAIT: destroy still reaps it
            st = kernel.peek_child(runtime.init_pid)
        except (ChildProcessError, OSError):
            return None  # not our child (adopted after a restart): no status to read
        if st is None or st.si_pid != runtime.init_pid:
            return None  # still running
        if st.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
            if st.si_status == signal.SIGKILL:
                return None
            try:
                name = signal.Signals(st.si_status).name
            except ValueError:
                name = f"signal {st.si_status}"
            return {"cause": "init_exited", "status": f"killed by {name}",
                    "signal": st.si_status}
        if st.si_code == os.CLD_EXITED and st.si_status != 0:
            return {"cause": "init_exited", "status": f"exit code {st.si_status}",
                    "exit_code": st.si_status}
        return None

    def is_alive(self, runtime: SandboxRuntime) -> bool:
        if runtime.pidfd >= 0:
            return not _pidfd_exited(runtime.pidfd, 0)
        return proc_alive(runtime.init_pid, runtime.init_starttime)

    # ---- exec ----------------------------------------------------------------------------
    def spawn(self, runtime: SandboxRuntime, spec: ExecSpec,
              loop: asyncio.AbstractEventLoop) -> Awaitable[Spawned]:
        # With a loop every path answers later: through the init, or the daemon's own path
        # in a thread (_spawn_off_loop).
        started = self.launch(runtime, spec, loop)
        assert not isinstance(started, int | Spawned)
        return started

    def launch(self, runtime: SandboxRuntime, spec: ExecSpec,
               loop: asyncio.AbstractEventLoop | None = None) -> Launch:
        """``spawn`` on any path; without a loop it blocks and gives our child's pid or the
        init's child."""
        try:  # the same limits on every path: what execve would take
            initexec.check_size(list(spec.argv), spec.env)
        except initexec.Invalid as e:
            raise InvalidRequest(str(e)) from None
        via_init = self._spawn_via_init(runtime, spec, loop)
        if via_init is not None:
            self.exec_paths["init"] += 1
            return via_init
        self.exec_paths["daemon"] += 1
        if loop is not None:
            # The caller closes its stdio fds once we return: the worker gets copies.
            own = dataclasses.replace(spec, stdin_fd=_dup(spec.stdin_fd),
                                      stdout_fd=_dup(spec.stdout_fd),
                                      stderr_fd=_dup(spec.stderr_fd))
            return self._spawn_off_loop(runtime, own, loop)
        return self._spawn_here(runtime, spec)

    async def _spawn_off_loop(self, runtime: SandboxRuntime, spec: ExecSpec,
                              loop: asyncio.AbstractEventLoop) -> Spawned:
        """The daemon's own path, in a thread of its own, one command at a time per sandbox.
        Nothing a sandbox does can hold the thread (exec_in's helper is outside its pid
        namespace and returns once the command is forked); should the kernel hold it anyway,
        the caller gets ExecStalled after SPAWN_TIMEOUT_S, only this sandbox's next command
        waits for the thread, and the command is killed once it appears."""
        sid = runtime.sandbox_id
        with self._lock:
            gate = self._fallback_gates.get(sid)
            if gate is None:
                gate = self._fallback_gates[sid] = asyncio.Lock()
        fds = [fd for fd in (spec.stdin_fd, spec.stdout_fd, spec.stderr_fd) if fd >= 0]
        abandoned = False

        def done(job: asyncio.Future[int]) -> None:
            gate.release()
            for fd in fds:  # our copies: only once the thread is done with them
                os.close(fd)
            if abandoned:
                _kill_abandoned(job)

        try:
            await _within(loop.create_task(gate.acquire()), SPAWN_TIMEOUT_S,
                          "this sandbox's previous command has not started yet")
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        job = _in_thread(loop, self._spawn_here, runtime, spec)
        job.add_done_callback(done)
        try:
            pid = await _within(asyncio.shield(job), SPAWN_TIMEOUT_S,
                                f"the command did not start within {SPAWN_TIMEOUT_S:.0f}s")
        except (ExecStalled, asyncio.CancelledError):  # no unobserved command
            abandoned = True
            raise
        return Spawned(pidfd=-1, pid=pid, ns_pid=0, own_child=True)

    def _spawn_here(self, runtime: SandboxRuntime, spec: ExecSpec) -> int:
        with self._rooted(runtime) as root:
            if runtime.pidfd >= 0:
                return self._spawn(runtime, spec, root, runtime.pidfd)
            pidfd = self._open_pidfd(runtime)
            if pidfd < 0:
                raise SandboxNotRunning("the sandbox's init is gone")
            try:
                return self._spawn(runtime, spec, root, pidfd)
            finally:
                os.close(pidfd)

    def _channel(self, runtime: SandboxRuntime) -> initexec.Channel | None:
        """The init's exec channel (destroy and reset close it with the root fd). At most
        ROOT_CACHE are held open, least recently used first out, as root fds are."""
        sid = runtime.sandbox_id
        with self._lock:
            if sid in self._closing:
                raise SandboxNotRunning("the sandbox is being destroyed")
            if sid in self._chans:
                self._chans.move_to_end(sid)
                return self._chans[sid]
        pidfd = runtime.pidfd if runtime.pidfd >= 0 else self._open_pidfd(runtime)
        if pidfd < 0:
            raise SandboxNotRunning("the sandbox's init is gone")
        try:
            chan: initexec.Channel | None = initexec.Channel(_core.init_channel(pidfd))
        except OSError:  # EBADF: an init without a channel (an older corral's)
            chan = None
        finally:
            if pidfd != runtime.pidfd:
                os.close(pidfd)
        evicted: list[initexec.Channel | None] = []
        with self._lock:
            if sid in self._closing:
                evicted.append(chan)
                chan = None
            elif sid in self._chans:  # another thread won the race
                evicted.append(chan)
                chan = self._chans[sid]
            else:
                self._chans[sid] = chan
                # Least recently used first; never one with answers still to come (closing
                # it would fail commands that are running): the bound may pass for a while.
                extra = len(self._chans) - ROOT_CACHE
                for old_sid in list(self._chans)[:extra] if extra > 0 else []:
                    old = self._chans[old_sid]
                    if old_sid != sid and (old is None or not old.waiting):
                        evicted.append(self._chans.pop(old_sid))
            closing = sid in self._closing
        for old in evicted:
            if old is not None:
                with old.lock:  # not under a spawn waiting for its answer
                    old.close()
        if closing:
            raise SandboxNotRunning("the sandbox is being destroyed")
        return chan

    def _close_channel(self, sandbox_id: str) -> None:
        with self._lock:
            chan = self._chans.pop(sandbox_id, None)
            self._fallback_gates.pop(sandbox_id, None)
        if chan is not None:
            with chan.lock:  # not under a spawn waiting for its answer
                chan.close()

    def _spawn_via_init(self, runtime: SandboxRuntime, spec: ExecSpec,
                        loop: asyncio.AbstractEventLoop | None) -> Launch | None:
        """Start the command through the init (with a loop: a coroutine that gives the
        Spawned); None when it must take the daemon's own path (no channel, a command beyond
        the init's limits, 16 answers awaited)."""
        if not self.init_exec or spec.stdout_fd < 0 or spec.stderr_fd < 0:
            return None
        chan = self._channel(runtime)
        if chan is None:
            return None
        self._ensure_memcg(runtime)  # the init joins them: its children start there
        cands = initexec.candidates(spec.argv[0], spec.env, _core.DEFAULT_PATH) \
            if spec.argv else []
        args = (list(spec.argv), spec.env, spec.cwd or "/", spec.uid, spec.gid,
                list(spec.groups), cands, (spec.stdin_fd, spec.stdout_fd, spec.stderr_fd),
                _unix_only(runtime))
        try:
            if loop is None:
                return chan.spawn(*args)
            try:
                return self._answer(runtime, chan.submit(loop, *args))
            except initexec.Full:  # wait for room: never the daemon's path because of load
                return self._submit_later(runtime, chan, loop, args)
        except initexec.Invalid as e:
            raise InvalidRequest(str(e)) from None
        except initexec.Busy:
            return None
        except (initexec.Gone, OSError) as e:
            raise self._spawn_error(runtime, e) from e

    def _submit_later(self, runtime: SandboxRuntime, chan: initexec.Channel,
                      loop: asyncio.AbstractEventLoop,
                      args: tuple[Any, ...]) -> Awaitable[initexec.Spawned]:
        """Send once the init has room (copies of the stdio fds: the caller closes its own
        when we return), then await the answer; ExecStalled after WAIT_TIMEOUT_S."""
        stdio = tuple(_dup(fd) for fd in args[7])
        own = (*args[:7], stdio, *args[8:])

        async def later() -> initexec.Spawned:
            try:
                deadline = loop.time() + initexec.WAIT_TIMEOUT_S
                fut = await chan.submit_when_ready(loop, deadline, *own)
            except initexec.Stalled as e:
                raise ExecStalled(str(e)) from None
            except (initexec.Gone, OSError) as e:
                raise self._spawn_error(runtime, e) from e
            finally:
                for fd in stdio:
                    if fd >= 0:
                        os.close(fd)
            return await self._answer(runtime, fut)

        return later()

    async def _answer(self, runtime: SandboxRuntime,
                      fut: asyncio.Future[initexec.Spawned]) -> initexec.Spawned:
        try:  # on timeout fut is cancelled: the command is killed when its answer comes
            return await _within(fut, initexec.WAIT_TIMEOUT_S, "the sandbox's init did not "
                                 f"answer within {initexec.WAIT_TIMEOUT_S:.0f}s")
        except (initexec.Gone, OSError) as e:
            raise self._spawn_error(runtime, e) from e

    def _spawn_error(self, runtime: SandboxRuntime, e: BaseException) -> CorralError:
        """The API's error for a command that could not be started."""
        if isinstance(e, initexec.Gone) or not self.is_alive(runtime):
            return SandboxNotRunning("the sandbox's init is gone")
        err = getattr(e, "errno", None)
        msg = getattr(e, "strerror", None) or str(e)
        if err in _OUT_OF_RESOURCES:
            return CapacityExceeded(f"cannot start the process: {msg}", details={"errno": err})
        return InternalError(f"cannot start the process: {msg}", details={"errno": err})

    def warm(self, runtime: SandboxRuntime) -> None:
        """Make what a first exec would (a warm pool's sandboxes are few: their exec should
        not pay for their cgroups or their init's channel)."""
        self._ensure_memcg(runtime)
        if self.init_exec:
            try:
                self._channel(runtime)
            except SandboxNotRunning:
                pass  # its first exec will say so

    def _ensure_memcg(self, runtime: SandboxRuntime) -> None:
        """The sandbox's memory and cpu cgroups, made at its first exec (see lazy_memcg)."""
        mb = runtime.extra.get("memory_mb")
        if mb is None or runtime.extra.get("memcg"):
            return
        later = self.cgroups.later_paths(runtime.sandbox_id)
        if not all(os.path.isdir(p) for p in later):
            self.cgroups.ensure_later(runtime.sandbox_id, float(runtime.extra.get("cpu", 1.0)),
                                      int(mb), [runtime.init_pid],
                                      cpus=runtime.extra.get("cpus"))
            self._oom_baseline(runtime.sandbox_id, runtime.extra)
            self._mount_later_views(runtime, later)
        runtime.extra["memcg"] = True  # made: later execs skip the two cgroupfs lookups

    def _rebind_lxcfs(self, binds: list[tuple[str, str]]) -> None:
        """lxcfs restarted: every live sandbox's /proc entries get the new connection's files
        (their old binds point at the dead one)."""
        for sid in list(self._live):
            self._rebind_one(sid, binds)

    def _rebind_one(self, sandbox_id: str, binds: list[tuple[str, str]]) -> None:
        live = self._live.get(sandbox_id)
        if live is None or not binds:
            return
        pid, starttime = live
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return
        try:
            if proc_starttime(pid) != starttime:
                return  # gone, its pid reused
            _core.rebind_in(fd, [(src, "/proc/" + name) for src, name in binds])
        except (OSError, ValueError) as e:
            log.warning("cannot bind lxcfs's files into a sandbox: %s", e,
                        extra={"sandbox": sandbox_id})
        finally:
            os.close(fd)

    def _mount_later_views(self, runtime: SandboxRuntime, later: list[str]) -> None:
        """The sandbox's /sys/fs/cgroup/<hierarchy> of the cgroups made at its first exec
        (the init's cgroup namespace is rooted at the daemon's there: it unshared it before
        they existed). Best effort: without them the sandbox sees empty directories."""
        if self.sys_dir is None:
            return
        mounts = [("/" + t, f, o) for t, f, o in self.cgroups.view_mounts(later)]
        if not mounts:
            return
        pidfd = runtime.pidfd if runtime.pidfd >= 0 else self._open_pidfd(runtime)
        if pidfd < 0:
            return
        try:
            _core.mount_cgroups_in(pidfd, self.cgroups.procs_files(later), mounts)
        except (OSError, ValueError) as e:
            log.warning("cannot mount the sandbox's cgroups at /sys/fs/cgroup: %s", e,
                        extra={"sandbox": runtime.sandbox_id})
        finally:
            if pidfd != runtime.pidfd:
                os.close(pidfd)

    def _spawn(self, runtime: SandboxRuntime, spec: ExecSpec, root: int,
               pidfd: int) -> int:
        self._ensure_memcg(runtime)
        cfg = {
            "init_pid": runtime.init_pid,
            "pidfd": pidfd,
            "root_fd": root,
            "argv": list(spec.argv),
            "env": [f"{k}={v}" for k, v in spec.env.items()],
            "cwd": spec.cwd or "/",
            "uid": spec.uid,
            "gid": spec.gid,
            "groups": list(spec.groups),
            "stdin": spec.stdin_fd,
            "stdout": spec.stdout_fd,
            "stderr": spec.stderr_fd,
            "cgroup_procs": self.cgroups.procs_files(runtime.cgroup_paths),
            "rlimits": self.rlimits,
            "unix_only": _unix_only(runtime),
        }
        try:
            return _core.exec_in(cast("ExecConfig", cfg))
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        except OSError as e:
            raise self._spawn_error(runtime, e) from e

    # ---- freeze, snapshots (the overlay uppers are the sandbox's own files) ---------------
    def freeze(self, runtime: SandboxRuntime) -> None:
        self.cgroups.freeze(runtime.cgroup_paths)

    def thaw(self, runtime: SandboxRuntime, wait: bool = True) -> None:
        self.cgroups.thaw(runtime.cgroup_paths, wait=wait)

    def is_frozen(self, runtime: SandboxRuntime) -> bool:
        """Frozen or freezing (v1 FREEZING, v2 cgroup.freeze=1)."""
        return bool(self.cgroups.freeze_requested(runtime.cgroup_paths))

    def image_on(self, image: Any, layers: list[str], store: SnapshotStore) -> Any:
        """The snapshot layers as lowerdirs over the image's own, in each overlay."""
        overlays = store.stack(image.overlays, layers)
        store.check_fits(overlays, self.sandboxes_dir)
        return dataclasses.replace(image, overlays=overlays,
                                   meta={**image.meta, "layers": list(layers)})

    def _uppers(self, runtime: SandboxRuntime) -> list[str]:
        # "upper" below the sandbox's dir, or where spawn put it (its disk layer)
        base = os.path.join(runtime.sandbox_dir, runtime.extra.get("upper", "upper"))
        return [os.path.join(base, str(i)) for i in range(len(os.listdir(base)))]

    def capture(self, runtime: SandboxRuntime, image: Any, store: SnapshotStore,
                paused: bool) -> tuple[str, str, int]:
        """The overlay uppers, copied while the cgroup freezer holds the sandbox (a host
        without a freezer: a best-effort copy of a live tree)."""
        store.check_fits(image.overlays, self.sandboxes_dir, extra_layers=1)
        paths = runtime.cgroup_paths

        def freeze() -> None:
            if not paused:
                try:
                    self.cgroups.freeze(paths)
                except OSError:
                    pass
            # Tests only (tests/test_chaos.py): while this file exists the capture holds the
            # sandbox frozen, so a test can act during it.
            hold = os.environ.get("CORRAL_SNAPSHOT_TEST_HOLD_FILE")
            while hold and os.path.exists(hold):
                time.sleep(0.01)

        def thaw() -> None:
            if not paused:
                try:
                    self.cgroups.thaw(paths)
                except OSError:
                    pass

        return store.capture(self._uppers(runtime), freeze, thaw)

    def metrics(self) -> dict[str, int]:
        out = {f"execs_via_{k}": v for k, v in self.exec_paths.items()}
        for k, v in getattr(self.cgroups, "spare_stats", {}).items():
            out[f"memcg_spares_{k}"] = v  # recycled memory cgroups (cgroups.recycle_memory)
        for k, v in getattr(self.cgroups, "set_spare_stats", {}).items():
            out[f"cgroup_spares_{k}"] = v  # recycled pids/cpu/freezer cgroups (recycle_rest)
        return out

    def status(self) -> dict[str, Any]:
        version = getattr(self.cgroups, "version", 1)
        return {"cgroup_version": version if version in (1, 2) else 1}

    # ---- files ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def _rooted(self, runtime: SandboxRuntime):
        """The sandbox's root fd, held open for the duration of the block."""
        ref = self._acquire_root(runtime)
        try:
            yield ref.fd
        finally:
            with self._lock:
                ref.users -= 1
                close = ref.closing and ref.users == 0
            if close:
                os.close(ref.fd)

    def _acquire_root(self, runtime: SandboxRuntime) -> _RootRef:
        sid = runtime.sandbox_id
        with self._lock:
            ref = self._roots.get(sid)
            if ref is not None:
                ref.users += 1
                self._roots.move_to_end(sid)
                return ref
        if sid in self._closing or (runtime.pidfd < 0 and runtime.init_pid <= 0):
            raise SandboxNotRunning("the sandbox is not running")
        try:
            fd = _core.root_fd(runtime.init_pid)
        except OSError as e:
            raise SandboxNotRunning(f"the sandbox's root is gone: {e.strerror}") from e
        # Same pid-reuse argument as in exec_in: the init still runs after the open, so the
        # pid was its pid then (an unreaped child's pid is never reused: see keep_pidfds).
        if not self.is_alive(runtime):
            os.close(fd)
            raise SandboxNotRunning("the sandbox's init is gone")
        evict: list[int] = []
        with self._lock:
            if sid in self._closing:
                os.close(fd)
                raise SandboxNotRunning("the sandbox is being destroyed")
            ref = self._roots.get(sid)
            if ref is not None:  # another thread won the race
                os.close(fd)
            else:
                ref = self._roots[sid] = _RootRef(fd)
                if len(self._roots) > ROOT_CACHE:
                    evict = self._evict_roots()
            ref.users += 1
        for old in evict:
            os.close(old)
        return ref

    def _evict_roots(self) -> list[int]:
        """Drop the least recently used root fds beyond ROOT_CACHE (under _lock); fds in use
        close when their last user is done. Returns the fds to close now."""
        out = []
        for sid in list(self._roots)[:len(self._roots) - ROOT_CACHE]:
            ref = self._roots.pop(sid)
            ref.closing = True
            if ref.users == 0:
                out.append(ref.fd)
        return out

    def _close_root(self, sandbox_id: str) -> None:
        """Close the sandbox's root fd (once no file operation uses it) and its exec channel."""
        self._close_channel(sandbox_id)
        with self._lock:
            ref = self._roots.pop(sandbox_id, None)
            if ref is None:
                return
            ref.closing = True
            close = ref.users == 0
        if close:
            os.close(ref.fd)

    def _fs(self, runtime: SandboxRuntime, fn: Any, path: str, *args: Any) -> Any:
        try:
            with self._rooted(runtime) as root:
                return fn(root, *args)
        except ValueError as e:
            raise InvalidPath(str(e), details={"path": path}) from None
        except OSError as e:
            raise _file_error(e, path, self.scratch.quota) from None
        except _core.LayerLimit as e:  # a listing past fs.rs LIST_MAX
            what, limit = e.args
            raise TooLarge(f"{path} has more than {limit} {what}",
                           details={"path": path, "limit": what, "max": limit}) from None

    def read_file(self, runtime: SandboxRuntime, path: str, max_bytes: int) -> bytes:
        _check_path(path)
        return self._fs(runtime, _core.fs_read, path, path, max(0, int(max_bytes)))

    def write_file(self, runtime: SandboxRuntime, path: str, data: bytes | BinaryIO,
                   mode: int = 0o644, make_parents: bool = True) -> None:
        """``data``: bytes, or a binary file at its start (a spooled request body), copied in
        chunks so the daemon holds one chunk of it at a time."""
        _check_path(path)
        if self.scratch.quota:  # the kernel bounds it (EDQUOT: TooLarge, see _file_error)
            try:
                self._write(runtime, path, data, mode, make_parents)
            except TooLarge:
                # No partial file stays behind to fill the disk the write could not fit in.
                with contextlib.suppress(CorralError):
                    self._fs(runtime, _core.fs_remove, path, path, False)
                raise
            return
        size = (os.fstat(data.fileno()).st_size if not isinstance(data, (bytes, bytearray))
                else len(data))
        try:  # what the write replaces is freed (lstat: a symlink is replaced, not followed)
            kind, old, *_ = self._fs(runtime, _core.fs_stat, path, path)
            old = old if kind == "file" else 0
        except CorralError:
            old = 0
        self._charge(runtime, size - old)
        try:
            self._write(runtime, path, data, mode, make_parents)
        except BaseException:
            self._charge(runtime, old - size)
            raise

    def _write(self, runtime: SandboxRuntime, path: str, data: bytes | BinaryIO, mode: int,
               make_parents: bool) -> None:
        if isinstance(data, (bytes, bytearray)):
            self._fs(runtime, _core.fs_write, path, path, bytes(data), mode & 0o7777,
                     make_parents)
        else:
            self._copy_in(runtime, path, mode & 0o7777, make_parents, data)

    def _copy_in(self, runtime: SandboxRuntime, path: str, mode: int, make_parents: bool,
                 src: BinaryIO) -> None:
        """The body of write_file from a file (already charged to the disk budget whole)."""
        fd = self._fs(runtime, _core.fs_open_write, path, path, mode, make_parents)
        try:
            while chunk := src.read(uploads.CHUNK):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view):]
        except OSError as e:
            raise _file_error(e, path, self.scratch.quota) from None
        finally:
            os.close(fd)

    def list_dir(self, runtime: SandboxRuntime, path: str) -> list[FileEntry]:
        _check_path(path)
        base = path.rstrip("/") or ""
        return [FileEntry(name=name, path=f"{base}/{name}", type=kind, size=size, mode=mode,
                          mtime=mtime)
                for name, kind, size, mode, mtime in self._fs(runtime, _core.fs_list, path, path)]

    def stat(self, runtime: SandboxRuntime, path: str) -> FileEntry:
        _check_path(path)
        kind, size, mode, mtime = self._fs(runtime, _core.fs_stat, path, path)
        norm = os.path.normpath(path)
        if norm.startswith("//"):
            norm = norm[1:]
        return FileEntry(name=os.path.basename(norm) or "/", path=norm, type=kind, size=size,
                         mode=mode, mtime=mtime)

    def mkdir(self, runtime: SandboxRuntime, path: str, parents: bool = True) -> None:
        _check_path(path)
        self._fs(runtime, _core.fs_mkdir, path, path, parents)

    def remove(self, runtime: SandboxRuntime, path: str, recursive: bool = False) -> None:
        _check_path(path)
        self._fs(runtime, _core.fs_remove, path, path, recursive)

    def rename(self, runtime: SandboxRuntime, src: str, dst: str) -> None:
        _check_path(src)
        _check_path(dst)
        self._fs(runtime, _core.fs_rename, src, src, dst)

    # ---- tar -----------------------------------------------------------------------------
    def upload_tar(self, runtime: SandboxRuntime, path: str,
                   tar_bytes: bytes | BinaryIO) -> None:
        """Extract into ``path`` through the fs primitives only (never via host paths):
        members are normalized below ``path``, ``..`` refused, devices/FIFOs/sockets refused,
        hard links copied from an already extracted member, symlinks made verbatim (they
        resolve inside the sandbox's root)."""
        _check_path(path)
        base = path.rstrip("/")
        self._fs(runtime, _core.fs_mkdir, path, path, True)
        # Streamed (r|: no seek, so nothing is decompressed twice), decompressed lazily and
        # bounded (uploads.Bounded): the daemon never holds more than a chunk of a member.
        src = uploads.open_bounded(tar_bytes, self.upload_max_bytes)
        try:
            tf = tarfile.open(fileobj=src, mode="r|", tarinfo=uploads.BoundedTarInfo)
        except _BAD_ARCHIVE as e:
            raise InvalidRequest(f"not a tar archive: {e}") from None
        dirs: list[tuple[str, int]] = []
        try:
            with tf:
                for count, m in enumerate(tf):
                    if count >= TAR_MAX_MEMBERS:
                        raise TooLarge(f"tar has more than {TAR_MAX_MEMBERS} members",
                                       details={"limit": "members", "max": TAR_MAX_MEMBERS})
                    self._extract(runtime, tf, m, base, dirs)
        except _BAD_ARCHIVE as e:
            raise InvalidRequest(f"bad tar archive: {e}") from None
        # Directory modes last, deepest first, so a read-only dir does not block its contents.
        for dest, mode in reversed(dirs):
            self._fs(runtime, _core.fs_chmod, dest, dest, mode)

    def _extract(self, runtime: SandboxRuntime, tf: tarfile.TarFile, m: tarfile.TarInfo,
                 base: str, dirs: list[tuple[str, int]]) -> None:
        rel = self._tar_rel(m.name)
        if rel is None:
            return
        dest = f"{base}/{rel}"
        mode = m.mode & 0o7777 & ~(stat_mod.S_ISUID | stat_mod.S_ISGID)
        if m.isdir():
            self._fs(runtime, _core.fs_mkdir, dest, dest, True, 0o755)
            dirs.append((dest, mode or 0o755))
        elif m.isreg():
            f = tf.extractfile(m)
            self._replace(runtime, dest)
            self._write_from(runtime, dest, mode, f if f is not None else io.BytesIO())
        elif m.issym():
            self._parent(runtime, dest)
            self._replace(runtime, dest)
            self._fs(runtime, _core.fs_symlink, dest, m.linkname, dest)
        elif m.islnk():
            target_rel = self._tar_rel(m.linkname)
            if target_rel is None:
                raise InvalidRequest(f"tar hard link {m.name!r} points at the root")
            src = f"{base}/{target_rel}"
            fd, _ = self._fs(runtime, _core.fs_open_read, src, src)
            with open(fd, "rb", buffering=0) as f:  # a copy of the member extracted before
                self._replace(runtime, dest)
                self._write_from(runtime, dest, mode, f)
        else:
            raise InvalidRequest(
                f"tar member {m.name!r} is a device, FIFO or other special file")

    def _write_from(self, runtime: SandboxRuntime, dest: str, mode: int, src: Any) -> None:
        """Write ``src`` to ``dest`` in chunks, each charged to the sandbox's disk budget."""
        fd = self._fs(runtime, _core.fs_open_write, dest, dest, mode, True)
        try:
            while chunk := src.read(uploads.CHUNK):
                self._charge(runtime, len(chunk))
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view):]
        except OSError as e:
            raise _file_error(e, dest, self.scratch.quota) from None
        finally:
            os.close(fd)

    def _charge(self, runtime: SandboxRuntime, delta: int) -> None:
        if self.scratch.quota:
            return  # the kernel bounds the sandbox's layer: EDQUOT (see _file_error)
        limit = int(runtime.extra.get("disk_mb", DEFAULT_DISK_MB)) << 20
        self.disk.charge(runtime.sandbox_id, delta, limit)

    @staticmethod
    def _tar_rel(name: str) -> str | None:
        parts = [p for p in name.split("/") if p not in ("", ".")]
        if any(p == ".." for p in parts):
            raise InvalidPath(f"tar member {name!r} contains '..'", details={"member": name})
        if any("\0" in p for p in parts):
            raise InvalidPath(f"tar member {name!r} has a NUL byte")
        return "/".join(parts) or None

    def _parent(self, runtime: SandboxRuntime, dest: str) -> None:
        parent = dest.rsplit("/", 1)[0] or "/"
        self._fs(runtime, _core.fs_mkdir, parent, parent, True)

    def _replace(self, runtime: SandboxRuntime, dest: str) -> None:
        """Remove a non-directory at ``dest`` (tar semantics: a member replaces what is
        there); a symlink is removed, never followed."""
        try:
            kind, *_ = self._fs(runtime, _core.fs_stat, dest, dest)
        except FileNotFound:
            return
        if kind != "dir":
            self._fs(runtime, _core.fs_remove, dest, dest, False)

    def open_read(self, runtime: SandboxRuntime, path: str) -> tuple[int, int]:
        """(fd, size) of a regular file, checked as read_file checks it, to stream from (the
        caller closes the fd)."""
        _check_path(path)
        return self._fs(runtime, _core.fs_open_read, path, path)

    def download_tar(self, runtime: SandboxRuntime, path: str) -> bytes:
        """The whole tar in memory, for in-process callers (the API streams it instead)."""
        ops = self.tree_ops(runtime, path)
        root = path.rstrip("/") or "/"
        streams.plan(ops, root, TAR_MAX_BYTES, TAR_MAX_MEMBERS)
        return b"".join(streams.chunks(ops, root, TAR_MAX_BYTES))

    def tree_ops(self, runtime: SandboxRuntime, path: str) -> streams.TreeOps:
        """The primitives a streamed tar download of ``path`` walks the sandbox's files with."""
        _check_path(path)
        def stat(p: str) -> tuple[str, int, int, float]:
            return self._fs(runtime, _core.fs_stat, p, p)

        def ls(p: str) -> list[tuple[str, str]]:
            return [(e[0], e[1]) for e in self._fs(runtime, _core.fs_list, p, p)]

        def readlink(p: str) -> str:
            return self._fs(runtime, _core.fs_readlink, p, p)

        def open_read(p: str) -> tuple[int, int]:
            return self._fs(runtime, _core.fs_open_read, p, p)

        return streams.TreeOps(stat=stat, list=ls, readlink=readlink, open_read=open_read)

