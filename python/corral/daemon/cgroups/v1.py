"""cgroup v1: a directory per sandbox in each hierarchy (memory, pids, cpu, and cpuacct,
cpuset, freezer where mounted); memory and cpu made at the first exec; pids, cpu and freezer
cgroups recycled here, memory cgroups by corral.daemon.cgroups.recycler."""

from __future__ import annotations

import errno
import os
import time

from .common import (
    _V1_REQUIRED,
    CFS_PERIOD_US,
    MEMSW_SLACK,
    CgroupManager,
    _controllers,
    _mounts,
    _read,
    _write,
    check_id,
    parse_cpulist,
    socket_memory,
)
from .recycler import _COOLING, _DRAINING, _SPARE, DRAIN_AT_STOP_S, MEMCG_SPARES, MemcgRecycler

# The pids, cpu and freezer cgroups of a destroyed sandbox are recycled too (one spare list
# per hierarchy, see CgroupsV1.recycle_rest): ~0.3-0.5 ms of mkdir + rmdir (and the kworker
# offline work) per sandbox saved. They charge nothing, so no cooling: usable at once.
CGROUP_SPARES = int(os.environ.get("CORRAL_CGROUP_SPARES", "32"))


class CgroupsV1(CgroupManager):
    version = 1
    _procs_file = "tasks"
    _threads_file = "tasks"
    _usage_file = "memory.usage_in_bytes"
    _oom_file = "memory.oom_control"

    def __init__(self, name: str = "corral") -> None:
        super().__init__(name)
        v1, v2 = _mounts()
        missing = [c for c in _V1_REQUIRED if c not in v1]
        if missing:
            raise RuntimeError(
                f"no usable cgroups: cgroup2 at {v2} does not offer memory, pids and cpu, "
                f"v1 hierarchies missing {missing}")
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
        self._sockets = os.path.exists(os.path.join(self._mem,
                                                    "memory.kmem.tcp.limit_in_bytes"))
        self.recycler = MemcgRecycler(self._mem, MEMCG_SPARES, self._oom_kills_at)
        self.spares_max = self.recycler.spares_max
        self.spare_stats = self.recycler.stats
        # pids/cpu/freezer spares: hierarchy dir -> ready cgroups (no task, thawed).
        self._set_spares: dict[str, list[str]] = {b: [] for b in self._bases if b != self._mem}
        self.set_spares_max = CGROUP_SPARES if self._set_spares else 0
        self._spare_lock = self.recycler.lock  # one lock over both kinds of spares
        self._spare_seq = self.recycler.seq
        self._closed = False  # drop_spares ran (stop): nothing is kept any more
        self.drop_spares(all_on_disk=True)  # a previous daemon's: not ours to trust
        self._closed = self.recycler.closed = False

    # The memory spares, as the recycler holds them.
    @property
    def _spares(self) -> list[str]:
        return self.recycler.spares

    @property
    def _cooling(self) -> list[tuple[float, str]]:
        return self.recycler.cooling

    def _settle(self) -> None:
        self.recycler.settle()

    def _setup_cpuset(self, mount: str) -> None:
        """A new v1 cpuset has no CPUs and no memory nodes: fill ours top down from the
        hierarchy's root, so that sandbox cpusets can be made below them."""
        d = mount
        for part in self.name.split("/"):
            parent, d = d, os.path.join(d, part)
            for f in ("cpuset.cpus", "cpuset.mems"):
                if not _read(os.path.join(d, f)).strip():
                    _write(os.path.join(d, f), _read(os.path.join(parent, f)).strip())

    @property
    def _memcgs(self) -> str:
        return self._mem

    @property
    def lazy_memory_ok(self) -> bool:
        """v1 keeps memory and cpu in their own hierarchies, so their cgroups can come later
        (``later``)."""
        return True

    @property
    def memory_base(self) -> str | None:
        return self._mem

    def host_cpus(self) -> list[int] | None:
        if self._cpuset is None:
            return None
        return parse_cpulist(_read(os.path.join(self._cpuset, "cpuset.cpus")))

    def later_paths(self, sandbox_id: str) -> list[str]:
        """The cgroups ``create(..., later=True)`` leaves for ``ensure_later`` (memory, cpu,
        cpuacct, cpuset)."""
        return [os.path.join(b, sandbox_id)
                for b in (self._mem, self._cpu, self._acct, self._cpuset) if b is not None]

    def create(self, sandbox_id: str, cpu: float, memory_mb: int, pids: int,
               later: bool = False, cpus: str | None = None) -> list[str]:
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
                if os.path.dirname(p) == self._mem and self.recycler.take(p):
                    reused = True  # a recycled memory cgroup (recycle_memory)
                elif not self._take_set_spare(p):
                    os.mkdir(p, 0o755)
                made.append(p)
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
            self.recycler.drain(m)
            _write(m + "/memory.limit_in_bytes", str(mem))
        if self._memsw:  # memsw must be >= limit, so it comes second
            _write(m + "/memory.memsw.limit_in_bytes", str(mem + MEMSW_SLACK))
            _write(m + "/memory.swappiness", "0")  # see MEMSW_SLACK
        if self._sockets:
            self._socket_limit(m, socket_memory(mem))

    @staticmethod
    def _socket_limit(m: str, limit: int) -> None:
        """Socket buffers charged to ``m`` (SOCKET_MEMORY_SHARE). A recycled cgroup may still
        be charged for its last sandbox's sockets (an orphan sending what it was left): the
        kernel refuses a limit under that (EBUSY), so the limit goes on top of it."""
        f = m + "/memory.kmem.tcp.limit_in_bytes"
        for _ in range(8):
            try:
                _write(f, str(limit))
                return
            except OSError as e:
                if e.errno != errno.EBUSY:
                    raise
                limit = int(_read(m + "/memory.kmem.tcp.usage_in_bytes")) + limit
        _write(f, str(limit))

    def adopt_limits(self, sandbox_id: str) -> None:
        """A sandbox made with memory+swap equal to memory (before MEMSW_SLACK) would show no
        fail count at its own limit, so its own OOMs would read as the host's (infra): give it
        the page. Best effort: a memory cgroup not made yet (lazy) gets it when it is made."""
        if not self._memsw:
            return
        m = os.path.join(self._mem, check_id(sandbox_id))
        try:
            mem = int(_read(m + "/memory.limit_in_bytes"))
            if int(_read(m + "/memory.memsw.limit_in_bytes")) < mem + MEMSW_SLACK:
                _write(m + "/memory.memsw.limit_in_bytes", str(mem + MEMSW_SLACK))
                _write(m + "/memory.swappiness", "0")
        except (OSError, ValueError):
            pass

    # ---- recycled cgroups --------------------------------------------------------------------
    def recycle_memory(self, sandbox_id: str) -> bool:
        return self.recycler.recycle(sandbox_id)

    def spare_ready(self) -> bool:
        return self.recycler.ready()

    def _is_memcg(self, path: str) -> bool:
        """A sandbox's memory cgroup (removed through the recycler: not left dying)."""
        return os.path.dirname(path) == self._mem

    def _remove_memcg(self, path: str) -> bool:
        return self.recycler.remove(path)

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
        r = self.recycler
        with r.drain_cv, self._spare_lock:  # drain_cv: nothing is queued after this
            spares = r.spares + [p for _, p in r.cooling]
            r.spares, r.cooling = [], []
            for lst in self._set_spares.values():
                spares += lst
                lst.clear()
            self._closed = r.closed = True
        deadline = time.monotonic() + DRAIN_AT_STOP_S
        r.finish_drains(deadline)
        if all_on_disk:
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
            if os.path.dirname(p) == self._mem and time.monotonic() < deadline:
                r.drain(p)
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
                reused = path == mem and self.recycler.take(path)
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

    def _after_kill_round(self, paths: list[str]) -> None:
        self.thaw(paths, wait=False)  # v1 frozen tasks do not act on SIGKILL until thawed

    # ---- freezer ---------------------------------------------------------------------------
    def _freezer_path(self, paths: list[str]) -> str:
        if self._freezer is None:
            raise OSError(errno.ENOTSUP, "no v1 freezer hierarchy mounted")
        for p in paths:
            if os.path.dirname(p) == self._freezer:
                return p
        raise OSError(errno.ENOENT, "no freezer cgroup among the sandbox's paths")

    def is_frozen(self, paths: list[str]) -> bool:
        return _read(self._freezer_path(paths) + "/freezer.state").strip() == "FROZEN"

    def freeze_requested(self, paths: list[str]) -> bool:
        return _read(self._freezer_path(paths) + "/freezer.state").strip() != "THAWED"

    def _set_frozen(self, path: str, frozen: bool) -> None:
        _write(path + "/freezer.state", "FROZEN" if frozen else "THAWED")
