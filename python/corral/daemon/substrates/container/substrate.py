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
import dataclasses
import errno
import logging
import os
import resource
import signal
import threading
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from corral import _core
from corral.daemon import (
    cpuplace,
    initexec,
    kernel,
    lxcfs,
    oserrors,
    procpolicy,
    removal,
    scratch,
    thrash,
    uploads,
)
from corral.daemon.kernel import pidfd_exited as _pidfd_exited
from corral.daemon.kernel import proc_alive, proc_starttime
from corral.daemon.network.manager import NetworkManager
from corral.daemon.substrates.types import NO_CORE, OomCount, oom_verdict
from corral.errors import (
    CapacityExceeded,
    CorralError,
    InternalError,
    InvalidRequest,
    SandboxAtLimit,
    SandboxNotRunning,
)
from corral.models import SandboxSpec, network_kind

from ..base import Capabilities, ExecSpec, SandboxRuntime, Spawned, Substrate
from .daemonpath import DaemonExec, _unix_only
from .files import Files
from .initpath import InitExec, Launch
from .layout import (
    OVL_OPAQUE,
    MountWatch,
    _image_tmp_unfit,
    make_dev_dir,
    make_sys_dir,
)
from .netns import NetnsPool, SharedNetns
from .rootcache import RootCache, _RootRef
from .threads import _dup, _reap_later

if TYPE_CHECKING:  # pragma: no cover
    from corral.daemon.cgroups import CgroupManager
    from corral.daemon.images import Image, ImageStore
    from corral.daemon.snapshots import CaptureControl, SnapshotStore


log = logging.getLogger("corral.container")


# Limits every process of a sandbox starts with. No core dumps (a crash must not reach the
# host's core_pattern helper with a sandbox's memory); a generous but finite fd limit.
# msgqueue, memlock and sigpending bound a sum over every process of the same host user,
# checked against the caller's own limit: every container sandbox is uid 0 on the host, so at
# the host's defaults one sandbox's POSIX message queues (800 KiB), SHM_LOCKed segments (8 MiB)
# or queued real-time signals left every other sandbox none. Unlimited, each is bounded by
# what bounds it inside the sandbox: its IPC namespace's queue count, and its memory cgroup,
# which is charged for the messages, locked pages and signals.
UNLIMITED = (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
DEFAULT_RLIMITS: dict[str, int | tuple[int, int]] = {
    "core": NO_CORE, "nofile": (1024, 524288),
    "msgqueue": UNLIMITED, "memlock": UNLIMITED, "sigpending": UNLIMITED}


def unliftable(names: list[str]) -> list[str]:
    """Of the rlimits ``names``, those this daemon cannot make unlimited for the sandboxes:
    without CAP_SYS_RESOURCE a spawn gets at most the daemon's own hard limit. Tried on the
    daemon itself (a higher hard limit of its own changes nothing it does)."""
    out = []
    for name in names:
        res = getattr(resource, "RLIMIT_" + name.upper())
        soft, hard = resource.getrlimit(res)
        if hard == resource.RLIM_INFINITY:
            continue
        try:
            resource.setrlimit(res, (soft, resource.RLIM_INFINITY))
        except (ValueError, OSError):
            out.append(name)
    return out


def split_nofile(limits: dict[str, int | tuple[int, int]]
                 ) -> tuple[dict[str, int | tuple[int, int]], dict[str, int | tuple[int, int]]]:
    """(the commands' limits, the init's) from the limits commands are to have. The init is
    started with twice the commands' hard fd limit (at most the daemon's own, the most a spawn
    gets) and gives its children half of what it got (corral-init.c), so both exec paths give
    commands the same. Why: the init's pidfd answers fail (ETOOMANYREFS) once the fds in flight
    in unix sockets of uid 0, every sandbox's, pass the init's limit, and a command can keep
    as many in flight as its own limit allows; at half the init's, no sandbox, nor all of them
    together, can stop every sandbox's commands from starting (an error of the platform's,
    which a trainer masks)."""
    nofile = limits.get("nofile", 1024)
    soft, hard = nofile if isinstance(nofile, tuple) else (nofile, nofile)
    own = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    init_hard = 2 * hard if own == resource.RLIM_INFINITY else min(2 * hard, own)
    init_soft = min(soft, init_hard)
    cmd_hard = init_hard // 2
    return (dict(limits, nofile=(min(init_soft, cmd_hard), cmd_hard)),
            dict(limits, nofile=(init_soft, init_hard)))


# destroy_many: inits signalled ahead of their destroy (each holds a pidfd until destroyed).
KILL_AHEAD = 64

def _oom_base(runtime: SandboxRuntime) -> OomCount:
    """The OOM counts the sandbox's memory cgroup had when it became the sandbox's."""
    return OomCount(int(runtime.extra.get("oom_base", 0)),
                    int(runtime.extra.get("oom_own_base", 0)))


class ContainerSubstrate(DaemonExec, InitExec, Files, RootCache, Substrate):
    name = "container"
    capabilities = Capabilities(files=True, snapshot=True, restore=True, pause=True,
                                oom_kills=True, exit_watch=True, warm_pool=True,
                                networks=("none", "disabled", "internet", "policy"))

    def __init__(self, state_dir: str, cgroups: CgroupManager, images: ImageStore,
                 netns_pool: int | None = None) -> None:
        self.state_dir = state_dir
        self.sandboxes_dir = os.path.join(state_dir, "sandboxes")
        os.makedirs(self.sandboxes_dir, mode=0o700, exist_ok=True)
        # The daemon's mounts each sandbox detaches from its copy of the table.
        self.mounts = MountWatch(self.sandboxes_dir)
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
        self.mask_dir = procpolicy.make_mask_dir(os.path.join(state_dir, "mask"))
        self.dev_dir = make_dev_dir(os.path.join(state_dir, "dev"))
        # /sys: a read-only skeleton holding only the mountpoints of the sandbox's own cgroups
        # (/sys/fs/cgroup/<hierarchy>), mounted in its cgroup namespace at spawn, or at the
        # first exec for those made then (see _mount_later_views).
        views: list[str] = cgroups.view_names()
        self.sys_dir = make_sys_dir(os.path.join(state_dir, "sys"), views) if views else None
        self.proc_policy = procpolicy.compute()  # what sandboxes see of /proc
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
        # The commands' limits (the daemon's exec path sets them) and the init's (spawn).
        self.rlimits, self.init_rlimits = split_nofile(DEFAULT_RLIMITS)
        self.shared_rlimits = unliftable([k for k, v in DEFAULT_RLIMITS.items()
                                          if v == UNLIMITED])
        if self.shared_rlimits:
            log.warning("cannot lift the sandboxes' per-user rlimits %s (no CAP_SYS_RESOURCE): "
                        "one sandbox can take those sums from the others",
                        ", ".join(self.shared_rlimits))
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
        # Namespaces taken by destroy_many before its kills, for each destroy (recycle).
        self._held_netns: dict[str, int] = {}
        # Modes "internet" and policies (corral.daemon.network): started on first use.
        self.network = NetworkManager()
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

    def claim(self, runtime: SandboxRuntime, spec: SandboxSpec) -> None:
        """A pooled networked sandbox gets the create's policy and group (corral.daemon.pools:
        it was made with a policy that allows nothing)."""
        if network_kind(spec.network) in ("internet", "policy"):
            self.network.claim(runtime.sandbox_id, spec.network, spec.network_group)

    def networking(self) -> NetworkManager:
        """Modes internet and policies (corral.daemon.network), started on first use."""
        return self.network

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
        self.network.close()
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
        self.mounts.close()
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
        networked = network_kind(spec.network) in ("internet", "policy")
        own_net = net_fd is not None  # the sandbox's own (reset): never into the pool
        if unix_only:
            # the shared namespace of network "disabled" stays the daemon's: join, never own
            if net_fd is not None:
                os.close(net_fd)
            net_fd, own_net = None, False
        elif networked and net_fd is None:
            net_fd, own_net = self.network.attach(sandbox_id, spec.network,
                                                  spec.network_group,
                                                  spec.bandwidth_mbit), True
        elif net_fd is None:
            net_fd = self.netns.take()
        try:
            join_fd = self.shared_netns.fd() if unix_only else net_fd
            os.makedirs(sdir, mode=0o700, exist_ok=True)
            os.mkdir(root, 0o755)
            layer = self.scratch.make_layer(sdir, spec.disk_mb)
            os.mkdir(os.path.join(layer, "upper"), 0o700)
            os.mkdir(os.path.join(layer, "work"), 0o700)
            # /dev/shm: a directory of the disk layer (its quota), bound over the shared /dev;
            # without a quota a 64 MiB tmpfs, as /tmp
            shm = os.path.join(layer, "shm") if self.scratch.quota else None
            if shm is not None:
                os.mkdir(shm)
                os.chmod(shm, 0o1777)  # mkdir's mode goes through the umask
            overlays: list[dict[str, Any]] = []
            for n, (target, lowers) in enumerate(img.overlays):
                upper = os.path.join(layer, "upper", str(n))
                work = os.path.join(layer, "work", str(n))
                os.mkdir(upper, 0o755)
                os.mkdir(work, 0o700)
                overlays.append({"target": target, "lower": list(lowers), "upper": upper,
                                 "work": work, "options": self.overlay_options})
            if self.scratch.quota:
                self._tmp_on_layer(overlays[0])
            if networked:
                self.network.write_resolv_conf(str(overlays[0]["upper"]))
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
            policy = self.proc_policy
            cfg = _core.SpawnConfig(
                init_fd=self.init_fd,
                root=root,
                overlays=[_core.Overlay(**o) for o in overlays],
                hostname=spec.hostname or sandbox_id[:63],
                cgroup_procs=self.cgroups.procs_files(join),
                rlimits=self.init_rlimits,
                netns_fd=join_fd,
                unix_only=unix_only,
                mask_dir=self.mask_dir,
                proc_readonly=list(policy.readonly),
                proc_mask_files=list(policy.mask_files),
                proc_mask_dirs=list(policy.mask_dirs),
                proc_binds=binds,
                sys_dir=self.sys_dir,
                cgroup_mounts=(self.cgroups.view_mounts(join)
                               if self.sys_dir is not None else []),
                tmp_size_mb=spec.disk_mb,
                tmp_tmpfs=not self.scratch.quota,
                dev_dir=self.dev_dir,
                shm_dir=shm,
                detach=self.mounts.get(),
            )
            pid, pidfd = _core.spawn_sandbox(cfg)
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
            elif not own_net and spec.network == "none":
                extra["netns"] = "pool"  # its namespace may go back to the pool (recycle)
            if networked:  # what a daemon after a restart needs to take its network over
                net_state = self.network.state_of(sandbox_id)
                if net_state is not None:
                    extra["net"] = net_state
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
            if networked and cgroup_paths is None:  # not a reset: the attachment was ours
                self.network.detach(sandbox_id)
            self._undo_create(sandbox_id, sdir, paths, pid, pidfd)
            if isinstance(e, CorralError) or not isinstance(e, Exception):
                raise
            if isinstance(e, ValueError):
                raise InvalidRequest(f"cannot create sandbox: {e}") from e
            if isinstance(e, OSError):
                details = {"errno": e.errno}
                if e.errno in oserrors.OUT_OF_RESOURCES:
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

    def _kill_and_wait(self, pid: int, pidfd: int, timeout_s: float = 10.0,
                       ending: list[str] | None = None) -> bool:
        """SIGKILL the init (the kernel then kills every process of its pid namespace) and
        wait until it is gone. The init only turns into a zombie once every process of the
        namespace has been reaped, and processes started with exec_in are the daemon's children,
        so this needs the daemon to keep reaping them meanwhile: bounded by ``timeout_s``.
        ``ending``: the sandbox's cgroups, on their way out: not gone within 50 ms, their CPU
        quota is lifted (throttled processes act on SIGKILL only once their debt is paid).
        True if the init has exited (so its whole pid namespace is gone)."""
        kernel.pidfd_signal(pidfd, signal.SIGKILL)
        if ending and not _pidfd_exited(pidfd, 0.05):
            self.cgroups.lift_cpu_quota(ending)
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
        self.cgroups.adopt_limits(runtime.sandbox_id)
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
                    net = self._netns_to_recycle(rt, rt.pidfd)  # before the kill, as destroy
                    if net is not None:
                        self._held_netns[rt.sandbox_id] = net
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
        # A networked sandbox's slot (link and namespace) is held for ``recycle`` below.
        held = self.network.detach(runtime.sandbox_id, hold=True)
        try:
            self._destroy_held(runtime, held)
        finally:
            if held:  # not handed back below (an error on the way): released, not reused
                self.network.recycle(runtime.sandbox_id, None)

    def _destroy_held(self, runtime: SandboxRuntime, held: bool) -> None:
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
        net = self._held_netns.pop(runtime.sandbox_id, None)
        if net is None and pidfd >= 0:
            net = self._netns_to_recycle(runtime, pidfd)
        if pidfd >= 0:
            self._kill_thawed(pidfd, paths)
            reaped = self._kill_and_wait(runtime.init_pid, pidfd, ending=paths)
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
        clean = reaped and self.cgroups.try_remove(paths)
        if not clean:
            self.cgroups.kill_all(paths)
            self.cgroups.remove(paths)
        if held:  # its slot: back to the network's ready ones if nothing of it shows there
            self.network.recycle(runtime.sandbox_id, net if clean else None)
            if net is not None and not clean:
                os.close(net)
        elif net is not None:
            if clean and runtime.extra.get("netns") == "pool":
                # every process of the sandbox is gone: nothing can act in it now
                self.netns.recycle(net)
            else:
                os.close(net)
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
                self.cgroups.kill_all(paths, timeout=0, lift=False)  # kept: keep its quota
            else:  # no handle on the old init: wait for the cgroup to be empty
                self.cgroups.kill_all(paths, lift=False)
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
            if self.cgroups.freeze_requested(paths):  # frozen, or held while freezing
                self.cgroups.thaw(paths, wait=False)
        except OSError:
            pass

    def _netns_to_recycle(self, runtime: SandboxRuntime, pidfd: int) -> int | None:
        """The namespace of a sandbox about to be destroyed, if it came from the pool (network
        "none", for NetnsPool.recycle) or is networked (NetworkManager.recycle); taken through
        the pidfd while the init lives."""
        pooled = runtime.extra.get("netns") == "pool" and self.netns.base
        if not pooled and "net" not in runtime.extra:
            return None
        try:
            return _core.netns_of(pidfd)
        except OSError:
            return None  # gone already, or a kernel without the pidfd ioctl

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

    def restore_networks(self, adopted: list[tuple[SandboxRuntime, SandboxSpec]]
                         ) -> dict[str, str]:
        from corral.daemon.network.manager import Readopted

        return self.network.restore([
            Readopted(rt.sandbox_id, spec.network, spec.network_group, spec.bandwidth_mbit,
                      rt.extra.get("net"), rt.init_pid)
            for rt, spec in adopted if network_kind(spec.network) in ("internet", "policy")])

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
        """Remember the OOM counts a (recycled, or restored-in-place) memory cgroup already
        has: only later ones are this sandbox's."""
        count = self.cgroups.oom_kills(sandbox_id)
        for key, value in (("oom_base", count.kills if count else 0),
                           ("oom_own_base", count.own if count else 0)):
            if value:
                extra[key] = value
            else:
                extra.pop(key, None)

    def oom_kills(self, runtime: SandboxRuntime) -> OomCount | None:
        """The memory cgroup's OOM counts (cgroups.OomCount); before the cgroup is made (a
        lazy one, before the first exec) the baseline it will start from. Only differences
        mean anything."""
        count = self.cgroups.oom_kills(runtime.sandbox_id)
        if count is None and not runtime.extra.get("memcg"):
            return _oom_base(runtime)
        return count

    def end_cause(self, runtime: SandboxRuntime) -> dict[str, Any] | None:
        """Why the sandbox's (dead) init died, when the sandbox itself is the cause; None when
        the cause is outside it. Call before destroy: it reads the memory cgroup and peeks at
        the init's exit status without reaping it.

        - an OOM kill recorded in its memory cgroup at its own limit: ``{"cause": "oom"}``,
          whatever killed the init (the OOM killer itself, or the pid namespace going with
          it);
        - an OOM kill with no sign of its own limit hit (a host-wide OOM, an ancestor
          cgroup's limit): ``{"cause": "host_oom"}``, an infra cause (sandbox_lost);
        - the init ended by a signal other than SIGKILL, or exited non-zero: ``{"cause":
          "init_exited", "status": ...}`` (nothing outside does that: the host stops an init
          with SIGKILL, or SIGTERM, on which it exits 0);
        - SIGKILL or exit 0 with no OOM kill: the host's doing, None."""
        base = _oom_base(runtime)
        count = self.cgroups.oom_kills(runtime.sandbox_id)
        verdict = oom_verdict(base, count)
        if verdict is not None:
            assert count is not None
            return {"cause": "oom" if verdict == "own" else "host_oom",
                    "oom_kills": count.kills - base.kills}
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

    def _pids_paths(self, runtime: SandboxRuntime) -> list[str]:
        return runtime.cgroup_paths or self.cgroups.paths_for(runtime.sandbox_id)

    def _pids_base(self, runtime: SandboxRuntime) -> int | None:
        """The sandbox's count of refused forks, read before a spawn (see _spawn_error)."""
        return self.cgroups.pids_refusals(self._pids_paths(runtime))

    def _spawn_error(self, runtime: SandboxRuntime, e: BaseException,
                     pids_base: int | None = None) -> CorralError:
        """The API's error for a command that could not be started (``pids_base``:
        ``_pids_base`` before the spawn)."""
        if isinstance(e, initexec.Gone) or not self.is_alive(runtime):
            return SandboxNotRunning("the sandbox's init is gone")
        if getattr(e, "errno", None) == errno.EAGAIN:
            # A fork refused at the sandbox's own pids limit is its own doing, not the host's.
            # The evidence is the kernel's count of refusals, which rose during the spawn: its
            # processes may all end before this read (an agent that churns at its limit made
            # a count of processes now read as the host's refusal, infra).
            limit = self.cgroups.pids_at_own_limit(self._pids_paths(runtime), pids_base)
            if limit is not None:
                return SandboxAtLimit(
                    f"cannot start the process: the sandbox's processes fill its process "
                    f"limit ({limit})", details={"limit": "pids", "max": limit})
        if isinstance(e, initexec.ChildFailed) and e.step == "set_ids" \
                and e.errno in (errno.EINVAL, errno.EPERM):
            # The ids come from the sandbox's own /etc/passwd and /etc/group (users.resolve
            # refuses those no process can have): what is left is theirs too.
            return InvalidRequest(f"cannot start the process as that user: {e.strerror}",
                                  details={"errno": e.errno, "step": e.step})
        return oserrors.start_error(e, "cannot start the process")

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

    def capture_estimate(self, runtime: SandboxRuntime) -> int:
        """The disk use of its writable layer on a btrfs scratch (holes and unchanged image
        files cost nothing there either); 0 where the scratch cannot tell."""
        used = self.scratch.used_bytes(os.path.join(runtime.sandbox_dir, scratch.LAYER))
        return used or 0

    def capture(self, runtime: SandboxRuntime, image: Any, store: SnapshotStore,
                paused: bool, control: CaptureControl | None = None) -> tuple[str, str, int]:
        """The overlay uppers, copied while the cgroup freezer holds the sandbox (a host
        without a freezer: a best-effort copy of a live tree)."""
        store.check_fits(image.overlays, self.sandboxes_dir, extra_layers=1)
        paths = runtime.cgroup_paths

        def freeze() -> bool:
            """Whether the sandbox is held (a timeout, or no freezer: a live copy)."""
            if not paused:
                try:
                    self.cgroups.freeze(paths)
                except OSError:  # TimeoutError too
                    return False
            return True

        def thaw() -> None:
            if not paused:
                try:
                    self.cgroups.thaw(paths)
                except OSError:
                    pass

        return store.capture(self._uppers(runtime), freeze, thaw, control)

    def metrics(self) -> dict[str, int]:
        out = {f"execs_via_{k}": v for k, v in self.exec_paths.items()}
        for k, v in self.cgroups.spare_stats.items():
            out[f"memcg_spares_{k}"] = v  # recycled memory cgroups (cgroups.recycle_memory)
        for k, v in self.cgroups.set_spare_stats.items():
            out[f"cgroup_spares_{k}"] = v  # recycled pids/cpu/freezer cgroups (recycle_rest)
        out["netns_recycled"] = self.netns.recycled  # namespaces reused (NetnsPool.recycle)
        out["netns_not_recycled"] = self.netns.not_recycled
        out.update(self.network.metrics())
        return out

    def status(self) -> dict[str, Any]:
        return {"cgroup_version": self.cgroups.version,
                "shared_rlimits": self.shared_rlimits}
