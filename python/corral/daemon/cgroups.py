"""One interface over cgroup v1 and v2 for per-sandbox resource limits.

v2 is used only when the cgroup2 mount offers memory, pids and cpu; otherwise the v1 hierarchies
(memory, pids, cpu, and freezer when mounted) hold one directory per sandbox:
``<hierarchy>/<name>/<sandbox_id>``. Sandbox creation is a hot path (thousands per second), so
hierarchy paths are found once at init and every call is plain ``os`` syscalls, no subprocess.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import itertools
import os
import re
import signal
import threading
import time

from corral.daemon import kernel

_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,127}$")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*$")
_V1_REQUIRED = ("memory", "pids", "cpu")
_V2_REQUIRED = {"memory", "pids", "cpu"}
CFS_PERIOD_US = 100_000
# Emptied v1 memory cgroups kept for the next sandbox (see CgroupManager.recycle_memory). A
# memcg's mkdir + rmdir costs ~4 ms of CPU on a host that has ever mounted many superblocks
# (its shrinker_info is sized by the most memcg-aware shrinkers, i.e. superblocks, ever alive
# at once: ~7 MB of 1 KiB allocations per memcg after 50,000 sandboxes of 8 mounts each),
# against ~0.1 ms for the rename + limit writes of reuse.
MEMCG_SPARES = int(os.environ.get("CORRAL_MEMCG_SPARES", "16"))
# The pids, cpu and freezer cgroups of a destroyed sandbox are recycled too (v1, one spare list
# per hierarchy, see CgroupManager.recycle_rest): ~0.3-0.5 ms of mkdir + rmdir (and the kworker
# offline work) per sandbox saved. They charge nothing, so no cooling: usable at once.
CGROUP_SPARES = int(os.environ.get("CORRAL_CGROUP_SPARES", "32"))
DAEMON_CGROUP = ".daemon"  # the daemon's own cgroup under <name> (never matches _ID_RE)
_SPARE = ".spare-"  # never matches _ID_RE: list_ids and cleanup_orphans do not see spares
_COOLING = ".cooling-"
_DRAINING = ".drain-"  # removed memory cgroups with page cache, waiting for the drainer
COOL_S = 1.0
# At a stop, queued drains run for at most this long; the rest are removed undrained (they
# stay dying until the kernel evicts their pages).
DRAIN_AT_STOP_S = 10.0
# memory.stat fields (this cgroup's own) of charges that reclaim cannot drop while no task is
# left: tmpfs/shm pages (no swap here) and locked pages. A cgroup with any of these is never
# handed on; page cache and slab are (see _settle).
_UNRECLAIMABLE = ("rss", "shmem", "unevictable", "swap")
# Usage counters that start again at 0 for the next tenant (limits are set at every reuse).
_MEM_RESETS = ("memory.max_usage_in_bytes", "memory.failcnt", "memory.memsw.max_usage_in_bytes",
               "memory.memsw.failcnt", "memory.kmem.max_usage_in_bytes", "memory.kmem.failcnt")


_write = kernel.write_knob  # every cgroup file write and read goes through the kernel seam
_read = kernel.read_knob


def _read_pids(path: str) -> list[int]:
    try:
        return [int(x) for x in _read(os.path.join(path, "cgroup.procs")).split()]
    except FileNotFoundError:
        return []


def _own_cgroup(version: int, pid: int) -> tuple[str, str]:
    """(directory of ``pid``'s cgroup, the hierarchy's mount point) in the memory hierarchy
    (v1) or the unified one (v2); the directory is the mount point if it cannot be told."""
    v1, v2 = _mounts()
    mount = (v1.get("memory") if version == 1 else v2) or "/sys/fs/cgroup"
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            for line in f:
                _, ctrls, path = line.rstrip("\n").split(":", 2)
                if (ctrls == "") if version == 2 else ("memory" in ctrls.split(",")):
                    d = os.path.join(mount, path.lstrip("/"))
                    if os.path.isdir(d):
                        return d, mount
    except (OSError, ValueError):
        pass
    return mount, mount


def _controllers() -> set[str]:
    """The controllers this kernel has (/proc/cgroups), and named hierarchies never."""
    try:
        with open("/proc/cgroups") as f:
            return {ln.split()[0] for ln in f if ln.strip() and not ln.startswith("#")}
    except OSError:
        return set()


def parse_cpulist(text: str) -> list[int]:
    """A kernel cpulist ("0-3,6") as a sorted list of CPU numbers."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return sorted(out)


def check_id(sandbox_id: str) -> str:
    """Refuse anything that could walk out of our directory (``..``, ``/``, odd bytes)."""
    if not isinstance(sandbox_id, str) or not _ID_RE.match(sandbox_id):
        raise ValueError(f"invalid sandbox id {sandbox_id!r}: only [a-z0-9-] allowed")
    return sandbox_id


def _mounts() -> tuple[dict[str, str], str | None]:
    """v1 controller -> mount point (first mount wins) and the cgroup2 mount point."""
    v1: dict[str, str] = {}
    v2: str | None = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            if len(fields) < 5 or len(rfields) < 3:
                continue
            mnt = fields[4].replace("\\040", " ")
            if rfields[0] == "cgroup2" and v2 is None:
                v2 = mnt
            elif rfields[0] == "cgroup":
                for opt in rfields[2].split(","):
                    v1.setdefault(opt, mnt)
    return v1, v2


class CgroupManager:
    """Creates, fills, kills and removes the cgroup directories of sandboxes."""

    version: int

    def __init__(self, name: str = "corral") -> None:
        if not _NAME_RE.match(name) or ".." in name.split("/"):
            raise ValueError(f"invalid cgroup name {name!r}")
        self.name = name
        v1, v2 = _mounts()
        controllers: set[str] = set()
        if v2:
            try:
                controllers = set(_read(os.path.join(v2, "cgroup.controllers")).split())
            except OSError:
                controllers = set()
        self._views: dict[str, tuple[str, str, str]] = {}  # base -> (name, fstype, options)
        if v2 and _V2_REQUIRED <= controllers:
            self.version = 2
            self._root = v2
            self._bases = [os.path.join(v2, name)]
            self._freezer: str | None = None
            self._setup_v2()
            self._views[self._bases[0]] = ("", "cgroup2", "")
        else:
            missing = [c for c in _V1_REQUIRED if c not in v1]
            if missing:
                raise RuntimeError(
                    f"no usable cgroups: cgroup2 at {v2} offers {sorted(controllers)}, "
                    f"v1 hierarchies missing {missing}")
            self.version = 1
            # One directory per distinct hierarchy (cpu may be co-mounted with cpuacct, etc.).
            mounts: list[str] = []
            for c in (*_V1_REQUIRED, "cpuacct", "cpuset", "freezer"):
                if c in v1 and v1[c] not in mounts:
                    mounts.append(v1[c])
            self._bases = [os.path.join(m, name) for m in mounts]
            self._mem = os.path.join(v1["memory"], name)
            self._pids = os.path.join(v1["pids"], name)
            self._cpu = os.path.join(v1["cpu"], name)
            self._freezer = os.path.join(v1["freezer"], name) if "freezer" in v1 else None
            # cpuacct and cpuset in hierarchies of their own (None when absent or co-mounted
            # with cpu): what a sandbox sees of its CPUs through lxcfs is read from the
            # cgroups at its cpuset's path (corral.daemon.lxcfs).
            self._acct = (os.path.join(v1["cpuacct"], name)
                          if v1.get("cpuacct") not in (None, v1["cpu"]) else None)
            self._cpuset = (os.path.join(v1["cpuset"], name)
                            if v1.get("cpuset") not in (None, v1["cpu"], v1["memory"])
                            else None)
            for b in self._bases:
                os.makedirs(b, exist_ok=True)
            self._cpuacct = os.path.exists(os.path.join(self._cpu, "cpuacct.usage"))
            if self._cpuset is not None:
                self._setup_cpuset(v1["cpuset"])
            known = _controllers()
            for m in mounts:
                ctrls = sorted(c for c, at in v1.items() if at == m and c in known)
                if ctrls == ["cpuacct"]:
                    continue  # usage_percpu has a value per host CPU: the host's count
                self._views[os.path.join(m, name)] = (os.path.basename(m), "cgroup",
                                                      ",".join(ctrls))
            # Whether memory+swap can be limited (swap accounting on) is fixed per host.
            self._memsw = os.path.exists(os.path.join(self._mem, "memory.memsw.limit_in_bytes"))
            self._usages = ["memory.usage_in_bytes"] + (
                ["memory.memsw.usage_in_bytes"] if self._memsw else [])
            self._resets = [f for f in _MEM_RESETS
                            if os.path.exists(os.path.join(self._mem, f))]
        # Processes the daemon killed for thrashing at the limit (corral.daemon.thrash),
        # counted with the kernel's OOM kills of the sandbox.
        self.thrash_kills: collections.Counter[str] = collections.Counter()
        self._spares: list[str] = []
        self._cooling: list[tuple[float, str]] = []  # (since, path): not yet known uncharged
        self._spare_lock = threading.Lock()
        self._spare_seq = itertools.count()
        self.spares_max = MEMCG_SPARES if self.version == 1 else 0
        self.spare_stats = {"reused": 0, "kept": 0, "kept_charged": 0, "discarded": 0,
                            "drained": 0}
        # Memory cgroups to drain and remove, off every caller's path (see _remove_memcg).
        self._drain_q: collections.deque[str] = collections.deque()
        self._drain_cv = threading.Condition()
        self._drainer: threading.Thread | None = None
        # v1 pids/cpu/freezer spares: hierarchy dir -> ready cgroups (no task, thawed).
        self._set_spares: dict[str, list[str]] = (
            {b: [] for b in self._bases if b != self._mem} if self.version == 1 else {})
        self.set_spares_max = CGROUP_SPARES if self._set_spares else 0
        self.set_spare_stats = {"reused": 0, "kept": 0}
        self._closed = False  # drop_spares ran (stop): nothing is kept any more
        # Where the daemon's process was before enter_daemon_cgroup: (cgroup, hierarchy root).
        self._daemon_home: tuple[str, str] | None = None
        self.drop_spares(all_on_disk=True)  # a previous daemon's: not ours to trust
        self._closed = False

    # ---- setup -----------------------------------------------------------------------------
    def _setup_v2(self) -> None:
        """Make <root>/<name> and enable memory, pids, cpu down the chain to our sandboxes."""
        chain = [self._root]
        for part in self.name.split("/"):
            chain.append(os.path.join(chain[-1], part))
        for d in chain[1:]:
            os.makedirs(d, exist_ok=True)
        for d in chain:
            self._enable_v2(d)
        self._swap: bool | None = None  # learnt on the first create (memory.swap.max exists or not)

    def _enable_v2(self, d: str) -> None:
        ctl = os.path.join(d, "cgroup.subtree_control")
        if _V2_REQUIRED <= set(_read(ctl).split()):
            return
        try:
            _write(ctl, "+memory +pids +cpu")
        except OSError as e:
            # "No internal processes": a non-root cgroup (typically the root of a container's
            # cgroup namespace) that holds processes cannot delegate controllers. Move those
            # processes to a leaf, as docker-in-docker does, and retry once.
            if e.errno != errno.EBUSY or d != self._root:
                raise
            leaf = os.path.join(d, "init")
            os.makedirs(leaf, exist_ok=True)
            for pid in _read_pids(d):
                try:
                    _write(os.path.join(leaf, "cgroup.procs"), str(pid))
                except OSError:
                    pass  # exited, or a kernel thread
            _write(ctl, "+memory +pids +cpu")

    def _setup_cpuset(self, mount: str) -> None:
        """A new v1 cpuset has no CPUs and no memory nodes: fill ours top down from the
        hierarchy's root, so that sandbox cpusets can be made below them."""
        d = mount
        for part in self.name.split("/"):
            parent, d = d, os.path.join(d, part)
            for f in ("cpuset.cpus", "cpuset.mems"):
                if not _read(os.path.join(d, f)).strip():
                    _write(os.path.join(d, f), _read(os.path.join(parent, f)).strip())

    def view_names(self) -> list[str]:
        """The directories of /sys/fs/cgroup a sandbox gets ("" on v2: /sys/fs/cgroup)."""
        return [n for n, _, _ in self._views.values()]

    def view_mounts(self, paths: list[str]) -> list[tuple[str, str, str]]:
        """(target below /sys/fs/cgroup, fstype, options) of the hierarchies of ``paths``
        (a sandbox's cgroups): mounted in its cgroup namespace, each shows its own."""
        out = []
        for p in paths:
            v = self._views.get(os.path.dirname(p))
            if v is not None:
                name, fstype, opts = v
                out.append((os.path.join("sys/fs/cgroup", name).rstrip("/"), fstype, opts))
        return out

    def host_cpus(self) -> list[int] | None:
        """The CPUs sandboxes may be placed on (our parent cpuset's), or None without a
        cpuset hierarchy of its own (then sandboxes get no cpuset)."""
        if self.version != 1 or self._cpuset is None:
            return None
        return parse_cpulist(_read(os.path.join(self._cpuset, "cpuset.cpus")))

    # ---- per sandbox -----------------------------------------------------------------------
    def paths_for(self, sandbox_id: str) -> list[str]:
        check_id(sandbox_id)
        return [os.path.join(b, sandbox_id) for b in self._bases]

    @property
    def lazy_memory_ok(self) -> bool:
        """v1 keeps memory and cpu in their own hierarchies, so their cgroups can come later
        (``later``)."""
        return self.version == 1

    def later_paths(self, sandbox_id: str) -> list[str]:
        """The cgroups ``create(..., later=True)`` leaves for ``ensure_later`` (v1: memory,
        cpu)."""
        if self.version != 1:
            return []
        return [os.path.join(b, sandbox_id)
                for b in (self._mem, self._cpu, self._acct, self._cpuset) if b is not None]

    def create(self, sandbox_id: str, cpu: float, memory_mb: int, pids: int,
               later: bool = False, cpus: str | None = None) -> list[str]:
        """Make the sandbox's cgroup dirs with limits written; all or nothing. All its paths
        are returned; with ``later`` (v1 only) the memory and cpu cgroups are not made now but
        by ``ensure_later`` (see ContainerSubstrate.lazy_memcg). ``cpus``: the cpuset's CPUs
        (a cpulist, "0,2"); None: all of ours."""
        paths = self.paths_for(sandbox_id)
        made: list[str] = []
        mem = int(memory_mb) * 1024 * 1024
        quota = max(1000, int(round(cpu * CFS_PERIOD_US)))
        skip = set(self.later_paths(sandbox_id)) if later else set()
        reused = False
        try:
            for p in paths:
                if p in skip:
                    continue
                if self.version == 1 and os.path.dirname(p) == self._mem and \
                        self._take_spare(p):
                    reused = True  # a recycled memory cgroup (recycle_memory)
                elif not self._take_set_spare(p):
                    os.mkdir(p, 0o755)
                made.append(p)
            if self.version == 2:
                p = paths[0]
                _write(p + "/memory.max", str(mem))
                if self._swap is None:
                    self._swap = os.path.exists(p + "/memory.swap.max")
                if self._swap:
                    _write(p + "/memory.swap.max", "0")
                _write(p + "/pids.max", str(int(pids)))
                _write(p + "/cpu.max", f"{quota} {CFS_PERIOD_US}")
            else:
                _write(os.path.join(self._pids, sandbox_id) + "/pids.max", str(int(pids)))
                if not skip:
                    self._memory_limits(os.path.join(self._mem, sandbox_id), mem, reused)
                    self._cpu_limits(os.path.join(self._cpu, sandbox_id), quota)
                    if self._cpuset is not None:
                        self._cpuset_limits(os.path.join(self._cpuset, sandbox_id), cpus)
        except BaseException:
            for p in reversed(made):
                try:
                    os.rmdir(p)
                except OSError:
                    pass
            raise
        return paths

    def _memory_limits(self, m: str, mem: int, reused: bool = False) -> None:
        if reused and self._memsw:  # memsw must stay >= limit: lift it before a new limit
            _write(m + "/memory.memsw.limit_in_bytes", "-1")
        try:
            _write(m + "/memory.limit_in_bytes", str(mem))
        except OSError as e:
            # A recycled cgroup charged with page cache over the new limit: the kernel
            # reclaims on the write, and says EBUSY if it could not get under; drain it all.
            if not reused or e.errno != errno.EBUSY:
                raise
            self._drain(m)
            _write(m + "/memory.limit_in_bytes", str(mem))
        if self._memsw:  # memsw must be >= limit, so it comes second
            _write(m + "/memory.memsw.limit_in_bytes", str(mem))

    # ---- recycled memory cgroups (v1) --------------------------------------------------------
    def recycle_memory(self, sandbox_id: str) -> bool:
        """Keep the sandbox's v1 memory cgroup for a later sandbox instead of removing it.
        Call once the sandbox's processes are gone and its files deleted. The cgroup is renamed
        out of the sandbox's name at once and becomes a spare as soon as what is still charged
        to it is only reclaimable (see _settle): page cache of files its processes read first
        (host image, volumes), slab, per-cpu charge caches. Right after the exit, the tmpfs
        pages of its mounts may still be on their way out: it cools for up to COOL_S. Such a
        charge is not the tenant's data, and the next tenant's limit reclaims it. Removed, the
        cgroup would stay *dying* (the kernel keeps it, with its shrinker_info, until those
        pages are evicted: ~7 MB each on this host) for every sandbox that read a file no one
        had read before. A cgroup with unreclaimable charges (tmpfs pages of a host volume)
        is drained and removed. Usage peaks and fail counts are reset; limits are written at
        reuse. True if kept for now (or already gone, or removed here), False if the caller
        should remove it (a task is still in it)."""
        if not self.spares_max or self._closed:
            return False
        path = os.path.join(self._mem, check_id(sandbox_id))
        with self._spare_lock:
            full = len(self._spares) + len(self._cooling) >= 2 * self.spares_max
        try:
            if _read(path + "/tasks").strip():
                self.spare_stats["discarded"] += 1
                return False
            if full or self._oom_kills_at(path):
                # An OOM kill count cannot be reset: a cgroup that has one is not handed on,
                # so a sandbox's count is its own (see oom_kills), also after a restart.
                self.spare_stats["discarded"] += 1
                return self._remove_memcg(path)
            dest = os.path.join(self._mem, f"{_COOLING}{next(self._spare_seq)}")
            os.rename(path, dest)  # cgroup v1 renames within a parent
        except FileNotFoundError:
            return True  # never made (no exec) or already removed
        except OSError:
            self.spare_stats["discarded"] += 1
            return False
        with self._spare_lock:
            self._cooling.append((time.monotonic(), dest))
        self._settle()
        return True

    def _uncharged(self, path: str) -> bool:
        return all(_read(f"{path}/{f}").strip() == "0" for f in self._usages)

    @staticmethod
    def _own_stat(path: str) -> dict[str, str]:
        """This v1 memory cgroup's own ``memory.stat`` fields (not the ``total_`` ones)."""
        out = {}
        for line in _read(path + "/memory.stat").splitlines():
            k, _, v = line.partition(" ")
            out[k] = v
        return out

    def _reclaimable_only(self, path: str) -> bool:
        """Is everything charged to this (task-less) v1 memory cgroup reclaimable?"""
        own = self._own_stat(path)
        return all(own.get(k, "0") == "0" for k in _UNRECLAIMABLE)

    def _page_cache(self, path: str) -> int:
        """Bytes of page cache (tmpfs pages excepted) charged to this v1 memory cgroup."""
        own = self._own_stat(path)
        return int(own.get("cache", "0")) - int(own.get("shmem", "0"))

    def _drain(self, path: str) -> None:
        """Reclaim the page cache charged to a task-less v1 memory cgroup
        (``memory.force_empty``), so that its rmdir frees it instead of leaving it dying
        until the kernel evicts those pages (slab charges do not keep it: they move to the
        parent). Best effort: force_empty walks the cgroup's shrinkers, ~50 ms of CPU on this
        host (see MEMCG_SPARES); tmpfs pages cannot be reclaimed without swap."""
        try:
            if self._page_cache(path) > 0:
                _write(path + "/memory.force_empty", "0")
                self.spare_stats["drained"] += 1
        except (OSError, ValueError):
            pass

    def _remove_memcg(self, path: str) -> bool:
        """Remove a v1 memory cgroup: at once if no page cache is charged to it, else renamed
        out of the way (``.drain-N``: its name, a sandbox's id, is free again) and left to the
        drainer thread, which drains then removes it. A drain is ~50 ms of CPU here: a burst
        of destroys must not wait for them. False if a task is still in it (the caller kills
        it and removes the cgroup)."""
        try:
            if _read(path + "/tasks").strip():
                return False
            cached = self._page_cache(path) > 0
        except FileNotFoundError:
            return True
        except (OSError, ValueError):
            cached = False
        if cached:
            dest = os.path.join(self._mem, f"{_DRAINING}{next(self._spare_seq)}")
            with self._drain_cv:
                if not self._closed:
                    try:
                        os.rename(path, dest)
                    except OSError:
                        pass
                    else:
                        self._drain_q.append(dest)
                        self._start_drainer()
                        self._drain_cv.notify()
                        return True
        try:
            os.rmdir(path)
        except FileNotFoundError:
            pass
        except OSError:
            return False
        return True

    def _start_drainer(self) -> None:
        """(under _drain_cv)"""
        if self._drainer is None or not self._drainer.is_alive():
            self._drainer = threading.Thread(target=self._drain_loop, daemon=True,
                                             name="corral-memcg-drain")
            self._drainer.start()

    def _drain_loop(self) -> None:
        with contextlib.suppress(OSError):  # lowest CPU priority: work nobody waits for
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        while True:
            with self._drain_cv:
                while not self._drain_q and not self._closed:
                    self._drain_cv.wait()
                if not self._drain_q:
                    return
                path = self._drain_q.popleft()
            self._drain(path)
            with contextlib.suppress(OSError):
                os.rmdir(path)

    def _finish_drains(self, deadline: float) -> None:
        """At a stop (``_closed`` set): the queued drains, until ``deadline``; then the rest
        are removed undrained."""
        with self._drain_cv:
            self._drain_cv.notify_all()
            drainer = self._drainer
        if drainer is not None:
            drainer.join(max(0.0, deadline - time.monotonic()))
        with self._drain_cv:
            rest, self._drain_q = list(self._drain_q), collections.deque()
        for path in rest:  # out of time: removed undrained
            with contextlib.suppress(OSError):
                os.rmdir(path)
        if drainer is not None:
            drainer.join(1.0)  # its last one (one drain): it then finds the queue empty

    def _settle(self) -> None:
        """Cooling cgroups with nothing charged, or only reclaimable charges (page cache,
        slab), become spares; those with others (tmpfs pages) still after COOL_S are drained
        and removed."""
        now = time.monotonic()
        with self._spare_lock:
            cooling, self._cooling = self._cooling, []
        keep: list[tuple[float, str]] = []
        for t, path in cooling:
            try:
                if _read(path + "/tasks").strip():
                    raise OSError(errno.EBUSY, "a task joined a cooling cgroup")
                clean = self._uncharged(path)
                if clean or self._reclaimable_only(path):
                    for f in self._resets:
                        _write(f"{path}/{f}", "0")
                    spare = os.path.join(self._mem, f"{_SPARE}{next(self._spare_seq)}")
                    os.rename(path, spare)
                    with self._spare_lock:
                        kept = not self._closed
                        if kept:
                            self._spares.append(spare)
                    if kept:
                        self.spare_stats["kept"] += 1
                        if not clean:
                            self.spare_stats["kept_charged"] += 1
                        continue
                    path = spare  # closed meanwhile: removed below
                elif now - t < COOL_S:  # tmpfs pages of the sandbox's mounts, still freeing
                    keep.append((t, path))
                    continue
            except OSError:
                pass
            self.spare_stats["discarded"] += 1
            self._remove_memcg(path)
        with self._spare_lock:
            if not self._closed:
                self._cooling[:0] = keep
                keep = []
        # drop_spares ran while this settle held some (a worker thread still running at
        # stop): they are removed here, or they would outlive the daemon.
        for _, path in keep:
            self._remove_memcg(path)

    def spare_ready(self) -> bool:
        """Is a recycled memory cgroup ready (making one costs ~nothing then)?"""
        if self.spares_max and not self._spares and self._cooling:
            self._settle()
        return bool(self._spares)

    def _take_spare(self, path: str) -> bool:
        """Rename a spare memory cgroup to ``path`` (True), or False if there is none."""
        if self.spares_max and not self._spares and self._cooling:
            self._settle()
        while True:
            with self._spare_lock:
                if not self._spares:
                    return False
                spare = self._spares.pop()
            try:
                os.rename(spare, path)
            except FileExistsError:
                with self._spare_lock:
                    self._spares.append(spare)
                raise
            except OSError:
                continue  # removed behind our back: try the next one
            self.spare_stats["reused"] += 1
            return True

    def recycle_rest(self, sandbox_id: str) -> None:
        """Keep the sandbox's v1 pids, cpu and freezer cgroups for later sandboxes (like
        recycle_memory, once its processes are gone): each is renamed aside if it has no task
        (and, freezer, is thawed); its limits are written again at reuse and cpuacct's usage
        is reset. Those not kept are left for the caller's rmdir. Nothing of a tenant shows
        to the next: these controllers charge nothing, and cpuacct's usage (which a sandbox
        reads through lxcfs's /proc/stat) starts again at 0."""
        if not self.set_spares_max or self._closed:
            return
        check_id(sandbox_id)
        for base, lst in self._set_spares.items():
            if len(lst) >= self.set_spares_max:
                continue
            path = os.path.join(base, sandbox_id)
            try:
                if _read(path + "/tasks").strip():
                    continue
                if base == self._freezer and \
                        _read(path + "/freezer.state").strip() != "THAWED":
                    continue
                if (base == self._cpu and self._cpuacct) or base == self._acct:
                    _write(path + "/cpuacct.usage", "0")  # the next tenant sees its own
                spare = os.path.join(base, f"{_SPARE}{next(self._spare_seq)}")
                os.rename(path, spare)
            except OSError:
                continue  # never made (no exec: cpu), or busy: removed by the caller
            with self._spare_lock:
                closed = self._closed
                if not closed:
                    lst.append(spare)
                    self.set_spare_stats["kept"] += 1
            if closed:
                try:
                    os.rmdir(spare)
                except OSError:
                    pass

    def _take_set_spare(self, path: str) -> bool:
        """Rename a spare pids/cpu/freezer cgroup of ``path``'s hierarchy to ``path``."""
        lst = self._set_spares.get(os.path.dirname(path))
        while lst:
            with self._spare_lock:
                if not lst:
                    return False
                spare = lst.pop()
            try:
                os.rename(spare, path)
            except FileExistsError:
                with self._spare_lock:
                    lst.append(spare)
                raise
            except OSError:
                continue
            self.set_spare_stats["reused"] += 1
            return True
        return False

    def drop_spares(self, all_on_disk: bool = False) -> None:
        """rmdir the spares (at stop; ``all_on_disk`` at start: those a crashed daemon left)."""
        with self._drain_cv, self._spare_lock:  # _drain_cv: nothing is queued after this
            spares = self._spares + [p for _, p in self._cooling]
            self._spares, self._cooling = [], []
            for lst in self._set_spares.values():
                spares += lst
                lst.clear()
            self._closed = True
        deadline = time.monotonic() + DRAIN_AT_STOP_S
        self._finish_drains(deadline)
        if all_on_disk and self.version == 1:
            for base in self._bases:
                try:
                    spares += [e.path for e in os.scandir(base)
                               if e.name.startswith((_SPARE, _COOLING, _DRAINING))
                               and e.is_dir(follow_symlinks=False)]
                except FileNotFoundError:
                    pass
        for p in spares:
            # Memory spares may hold page cache: drained first (while time is left), so they
            # do not stay dying.
            if self.version == 1 and os.path.dirname(p) == self._mem and \
                    time.monotonic() < deadline:
                self._drain(p)
            try:
                os.rmdir(p)
            except OSError:
                pass

    @staticmethod
    def _cpu_limits(c: str, quota: int) -> None:
        # Setting a CFS quota walks every cpu cgroup of the host (tg_set_cfs_bandwidth ->
        # walk_tg_tree): O(number of sandboxes), one more reason to make it at first exec.
        _write(c + "/cpu.cfs_period_us", str(CFS_PERIOD_US))
        _write(c + "/cpu.cfs_quota_us", str(quota))

    def _cpuset_limits(self, c: str, cpus: str | None) -> None:
        assert self._cpuset is not None  # only called when there is a cpuset hierarchy
        # Load balancing off first, while the new cpuset has no CPU: with it on, every write
        # of cpuset.cpus rebuilds the scheduler's domains, a walk of every cpuset on the host
        # (the root cpuset's balancing still spreads the sandbox's tasks over its CPUs).
        if _read(c + "/cpuset.sched_load_balance").strip() != "0":
            _write(c + "/cpuset.sched_load_balance", "0")
        if not _read(c + "/cpuset.mems").strip():
            _write(c + "/cpuset.mems", _read(self._cpuset + "/cpuset.mems").strip())
        _write(c + "/cpuset.cpus", cpus or _read(self._cpuset + "/cpuset.cpus").strip())

    def ensure_later(self, sandbox_id: str, cpu: float, memory_mb: int,
                     pids: list[int], cpus: str | None = None) -> None:
        """Make the v1 memory, cpu (cpuacct, cpuset) cgroups of a sandbox created with
        ``later`` (limits first, then ``pids`` moved in). Each one that exists already is
        left as it is."""
        check_id(sandbox_id)
        later = self.later_paths(sandbox_id)
        mem = later[0]
        quota = max(1000, int(round(cpu * CFS_PERIOD_US)))
        for path in later:
            try:
                reused = path == mem and self._take_spare(path)
                if not reused and not (path != mem and self._take_set_spare(path)):
                    os.mkdir(path, 0o755)
            except FileExistsError:
                continue
            try:
                base = os.path.dirname(path)
                if path == mem:
                    self._memory_limits(path, int(memory_mb) << 20, reused=reused)
                elif base == self._cpu:
                    self._cpu_limits(path, quota)
                elif base == self._cpuset:
                    self._cpuset_limits(path, cpus)
                for pid in pids:
                    try:
                        _write(path + "/cgroup.procs", str(pid))
                    except ProcessLookupError:
                        pass
            except BaseException:
                try:
                    os.rmdir(path)
                except OSError:
                    pass
                raise

    def procs_files(self, paths: list[str]) -> list[str]:
        """The files a new (single-threaded) child joins ``paths`` through, writing "0". v1:
        ``tasks``, not ``cgroup.procs``: moving the calling thread itself (pid 0 to
        ``tasks``) skips the global cgroup_threadgroup_rwsem, whose write side waits for an
        RCU grace period whenever no migration happened in the last one (0.7-7 ms measured
        here on the first exec after a pause). The child is a process of one thread, so this
        moves the whole process. v2's cgroup.threads is for threaded subtrees only."""
        name = "tasks" if self.version == 1 else "cgroup.procs"
        return [os.path.join(p, name) for p in paths]

    def pids(self, paths: list[str]) -> set[int]:
        out: set[int] = set()
        for p in paths:
            out.update(_read_pids(p))
        return out

    def kill_all(self, paths: list[str], timeout: float = 2.0) -> None:
        """SIGKILL every process in the cgroups until they are empty (or ``timeout``)."""
        if self.version == 2 and paths:
            try:
                _write(paths[0] + "/cgroup.kill", "1")
            except FileNotFoundError:
                pass  # no cgroup.kill (kernel < 5.14) or no cgroup: the loop below does it
        deadline = time.monotonic() + timeout
        delay = 0.0005
        while True:
            pids = self.pids(paths)
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            # v1 frozen tasks do not act on SIGKILL until thawed.
            if self.version == 1:
                self.thaw(paths, wait=False)
            if time.monotonic() >= deadline:
                return
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def remove(self, paths: list[str], timeout: float = 1.0) -> None:
        """rmdir each path (children first). A dying process may keep a cgroup busy for a few
        ms, so EBUSY is retried; missing dirs are fine. Raises OSError if one stays busy."""
        deadline = time.monotonic() + timeout
        for p in paths:
            memcg = self._is_memcg(p)
            delay = 0.0005
            while True:
                try:
                    if not memcg:
                        os.rmdir(p)
                    elif not self._remove_memcg(p):
                        raise OSError(errno.EBUSY, "a task is still in the memory cgroup")
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno not in (errno.EBUSY, errno.ENOTEMPTY):
                        raise
                    self._remove_children(p)
                    if time.monotonic() >= deadline:
                        raise
                    time.sleep(delay)
                    delay = min(delay * 2, 0.05)

    def try_remove(self, paths: list[str]) -> bool:
        """rmdir each path once, no waiting: True if none is left (missing ones count as
        removed). For the common case of cgroups already empty; fall back to kill_all and
        remove on False."""
        ok = True
        for p in paths:
            if self._is_memcg(p):  # drained if need be (see _remove_memcg)
                ok = self._remove_memcg(p) and ok
                continue
            try:
                os.rmdir(p)
            except FileNotFoundError:
                pass
            except OSError:
                ok = False
        return ok

    def _is_memcg(self, path: str) -> bool:
        """A sandbox's v1 memory cgroup (removed through _remove_memcg: not left dying)."""
        return self.version == 1 and os.path.dirname(path) == self._mem

    def _remove_children(self, path: str) -> None:
        try:
            entries = list(os.scandir(path))
        except FileNotFoundError:
            return
        for e in entries:
            if e.is_dir(follow_symlinks=False):
                self._remove_children(e.path)
                try:
                    os.rmdir(e.path)
                except OSError:
                    pass

    # ---- the daemon's own cgroup --------------------------------------------------------------
    def daemon_cgroup(self) -> str:
        """``<memory hierarchy>/<name>/.daemon`` (v2: the one hierarchy). The dot keeps it out
        of list_ids, orphan cleanup and the spare lists."""
        return os.path.join(self._mem if self.version == 1 else self._bases[0], DAEMON_CGROUP)

    def enter_daemon_cgroup(self, pid: int, reserve_bytes: int) -> str:
        """Move process ``pid`` (the daemon: every thread) into the daemon's cgroup, with
        ``reserve_bytes`` of memory protected on v2 (memory.min, and memory.low at twice that,
        on the cgroup and on each of our directories above it: protection only reaches a cgroup
        through ancestors that have it). v1's memory controller has no reservation; there the
        cgroup keeps the daemon's memory apart from the sandboxes' limits and the OOM killer's
        choice rests on oom_score_adj. Returns the cgroup's path."""
        d = self.daemon_cgroup()
        self._daemon_home = _own_cgroup(self.version, pid)
        os.makedirs(d, exist_ok=True)
        if self.version == 2:
            chain = [self._root]
            for part in [*self.name.split("/"), DAEMON_CGROUP]:
                chain.append(os.path.join(chain[-1], part))
            for c in chain[1:]:  # top down: a child's protection is capped by its parent's
                for f, want in (("memory.min", reserve_bytes),
                                ("memory.low", 2 * reserve_bytes)):
                    try:
                        have = _read(os.path.join(c, f)).strip()
                        if have != "max" and int(have) < want:
                            _write(os.path.join(c, f), str(want))
                    except (OSError, ValueError):
                        pass  # an ancestor we do not control: protection stops there
        _write(os.path.join(d, "cgroup.procs"), str(pid))
        return d

    def leave_daemon_cgroup(self, pid: int) -> None:
        """Move ``pid`` back where it came from and remove the daemon's cgroup (at stop)."""
        home = self._daemon_home
        if home is None:
            return
        for target in home:  # where it came from; if that is gone, the hierarchy's root
            try:
                _write(os.path.join(target, "cgroup.procs"), str(pid))
                break
            except OSError:
                continue
        else:
            return
        self._daemon_home = None
        try:
            os.rmdir(self.daemon_cgroup())
        except OSError:
            pass  # a helper process still in it: it goes with the next stop

    def remove_parents(self) -> None:
        """Remove our (empty) top-level directories; best effort, a busy one stays."""
        self.leave_daemon_cgroup(os.getpid())
        self.drop_spares()
        for base in self._bases:
            try:
                os.rmdir(base)
            except OSError:
                pass

    def list_ids(self) -> set[str]:
        ids: set[str] = set()
        for b in self._bases:
            try:
                with os.scandir(b) as it:
                    for e in it:
                        if e.is_dir(follow_symlinks=False) and _ID_RE.match(e.name):
                            ids.add(e.name)
            except FileNotFoundError:
                pass
        return ids

    def memory_usage(self, paths: list[str]) -> int:
        fname = "memory.current" if self.version == 2 else "memory.usage_in_bytes"
        for p in paths:
            try:
                return int(_read(os.path.join(p, fname)))
            except FileNotFoundError:
                continue
        return 0

    def oom_kills(self, sandbox_id: str) -> int | None:
        """How many processes the kernel's OOM killer has killed in the sandbox's memory
        cgroup since the cgroup was made (v2 ``memory.events``; v1 ``memory.oom_control``).
        A recycled v1 cgroup never has any (recycle_memory discards those); a cgroup kept
        across a restore in place does, and callers keep a baseline. None when the sandbox
        has no memory cgroup (yet) or the kernel does not count."""
        extra = self.thrash_kills.get(sandbox_id, 0)
        if self.version == 2:
            kills = self._oom_kills_at(os.path.join(self._bases[0], check_id(sandbox_id)))
        else:
            kills = self._oom_kills_at(os.path.join(self._mem, check_id(sandbox_id)))
        return kills + extra if kills is not None else None

    @property
    def memory_base(self) -> str | None:
        """The v1 memory hierarchy's directory of ours (None on v2)."""
        return self._mem if self.version == 1 else None

    def record_thrash_kill(self, sandbox_id: str) -> None:
        self.thrash_kills[sandbox_id] += 1

    def forget_thrash_kills(self, sandbox_id: str) -> None:
        self.thrash_kills.pop(sandbox_id, None)

    def _oom_kills_at(self, path: str) -> int | None:
        fname = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            text = _read(os.path.join(path, fname))
        except OSError:
            return None
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return None

    # ---- freezer ---------------------------------------------------------------------------
    def _freezer_path(self, paths: list[str]) -> str:
        if self.version == 2:
            return paths[0]
        if self._freezer is None:
            raise OSError(errno.ENOTSUP, "no v1 freezer hierarchy mounted")
        for p in paths:
            if os.path.dirname(p) == self._freezer:
                return p
        raise OSError(errno.ENOENT, "no freezer cgroup among the sandbox's paths")

    def is_frozen(self, paths: list[str]) -> bool:
        p = self._freezer_path(paths)
        if self.version == 2:
            return "frozen 1" in _read(p + "/cgroup.events")
        return _read(p + "/freezer.state").strip() == "FROZEN"

    def freeze_requested(self, paths: list[str]) -> bool:
        """Frozen, or on the way (v1 FREEZING; v2 cgroup.freeze set): either way a process
        that joins it now freezes."""
        p = self._freezer_path(paths)
        if self.version == 2:
            return _read(p + "/cgroup.freeze").strip() == "1"
        return _read(p + "/freezer.state").strip() != "THAWED"

    def freeze(self, paths: list[str], timeout: float = 5.0) -> None:
        """Stop every process in the sandbox; returns once the kernel reports it frozen."""
        p = self._freezer_path(paths)
        if self.version == 2:
            _write(p + "/cgroup.freeze", "1")
        else:
            _write(p + "/freezer.state", "FROZEN")
        self._wait_state(paths, True, timeout)

    def thaw(self, paths: list[str], wait: bool = True, timeout: float = 5.0) -> None:
        try:
            p = self._freezer_path(paths)
        except OSError:
            if wait:
                raise
            return
        try:
            if self.version == 2:
                _write(p + "/cgroup.freeze", "0")
            else:
                _write(p + "/freezer.state", "THAWED")
        except FileNotFoundError:
            if wait:
                raise
            return
        if wait:
            self._wait_state(paths, False, timeout)

    def _wait_state(self, paths: list[str], frozen: bool, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        delay = 0.0005
        while self.is_frozen(paths) != frozen:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"cgroup did not become {'frozen' if frozen else 'thawed'}")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
