"""The cgroup interface (CgroupManager) over v1 and v2, and what both versions share.

v2 is used only when the cgroup2 mount offers memory, pids and cpu; otherwise the v1 hierarchies
(memory, pids, cpu, and freezer when mounted) hold one directory per sandbox:
``<hierarchy>/<name>/<sandbox_id>``. Sandbox creation is a hot path (thousands per second), so
hierarchy paths are found once at init and every call is plain ``os`` syscalls, no subprocess.
Constructing ``CgroupManager(name)`` gives the class for this host: ``CgroupsV2``
(corral.daemon.cgroups.v2) or ``CgroupsV1`` (corral.daemon.cgroups.v1).
"""

from __future__ import annotations

import abc
import collections
import contextlib
import errno
import os
import re
import signal
import time

from corral.daemon import kernel
from corral.daemon.substrates.types import OomCount, PauseHeldOff

_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,127}$")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*$")
_V1_REQUIRED = ("memory", "pids", "cpu")
_V2_REQUIRED = {"memory", "pids", "cpu"}
CFS_PERIOD_US = 100_000
DAEMON_CGROUP = ".daemon"  # the daemon's own cgroup under <name> (never matches _ID_RE)


_write = kernel.write_knob  # every cgroup file write and read goes through the kernel seam
_read = kernel.read_knob


# v1: a sandbox's memory+swap limit is its memory limit plus one page, and its swappiness 0.
# The kernel tries memory+swap first and (6.x) keeps no fail count for it: with both limits
# equal a charge at the limit fails there, uncounted, and nothing shows that the sandbox's
# own limit was hit (OomCount.own). One page above, the memory counter (whose fail count is
# kept) refuses first. Swappiness 0 keeps memory+swap equal to memory (memcg reclaim then
# swaps nothing), so swap cannot fill the page and make memory+swap refuse first again; it
# also keeps the "no swap" of memory_mb on hosts with swap. madvise MADV_COLD/MADV_PAGEOUT
# and process_madvise swap regardless of swappiness: the sandbox seccomp filter refuses them
# (rust/src/harden.rs, MADV_TO_SWAP).
MEMSW_SLACK = 4096

# cgroup v1 charges socket buffers to a memory cgroup only once it has a limit of its own for
# them (memory.kmem.tcp.limit_in_bytes, which covers UDP's too): without one, a sandbox of 256
# MiB held 186 MiB of TCP and 398 MiB of UDP buffers charged nowhere, up to the host-wide
# tcp_mem and udp_mem (2.2 and 4.4 GiB here). A sandbox's sockets may hold this share of its
# memory limit, at least SOCKET_MEMORY_MIN, beside it (v2 counts them inside memory.max).
SOCKET_MEMORY_SHARE = 0.25
SOCKET_MEMORY_MIN = 16 << 20


def socket_memory(memory_bytes: int) -> int:
    """The socket buffer bytes a v1 sandbox of ``memory_bytes`` may hold."""
    return max(SOCKET_MEMORY_MIN, int(memory_bytes * SOCKET_MEMORY_SHARE))

# A fork in a sandbox refused with its processes this close to its pids limit is taken as its
# own (CgroupManager.pids_at_own_limit), when no count of refusals says so.
PIDS_SLACK = 2
# How long a freeze or a removal waits in all while a thread of the sandbox is in its exit
# (the freezer cannot freeze one, nor can its cgroups go, and the exit of a process with GiBs
# of page tables takes the kernel seconds: 13 s for 1.5 GiB): it makes progress, and it is
# bounded by the sandbox's memory.
EXIT_WAIT_S = 120.0


def _key_values(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        with contextlib.suppress(ValueError):
            out[key] = int(value)
    return out


def oom_count_at(path: str, version: int) -> OomCount | None:
    """The OomCount of the memory cgroup directory ``path`` (None: no such cgroup, or a
    kernel that counts no OOM kill). ``kills``: ``oom_kill`` (v2 ``memory.events``, v1
    ``memory.oom_control``). ``own``: v2 ``memory.events`` ``oom`` (the cgroup, or one below
    it, at its ``memory.max`` with reclaim failing; an ancestor's OOM counts in the
    ancestor). v1 has no such count (``memory.oom_control``'s ``under_oom`` and its OOM
    eventfd are set for every cgroup *below* an ancestor that is out of memory too), so it
    is the cgroup's fail counts, ``memory.failcnt`` plus ``memory.memsw.failcnt``: a charge
    refused at this cgroup's own limit (see MEMSW_SLACK for why the memory counter is the one
    that refuses). They also rise when the cgroup reclaims at its limit without an OOM, so on
    v1 a kill from outside in a span where the cgroup was also at its own limit counts as
    its own."""
    try:
        if version == 2:
            ev = _key_values(_read(os.path.join(path, "memory.events")))
            return OomCount(ev["oom_kill"], ev.get("oom", 0)) if "oom_kill" in ev else None
        ctl = _key_values(_read(os.path.join(path, "memory.oom_control")))
        if "oom_kill" not in ctl:
            return None
        own = int(_read(os.path.join(path, "memory.failcnt")))
    except (OSError, ValueError):
        return None
    try:  # swap accounting off: no memsw counter
        own += int(_read(os.path.join(path, "memory.memsw.failcnt")))
    except (OSError, ValueError):
        pass
    return OomCount(ctl["oom_kill"], own)


def _rmdir_once_empty(path: str, timeout: float = 5.0) -> None:
    """rmdir a cgroup directory, waiting out EBUSY a little: a child another program removes
    (runsc's, its sandbox gone) or a dying task can hold it a moment after our own are gone.
    Best effort: still busy after ``timeout``, it stays."""
    deadline = time.monotonic() + timeout
    delay = 0.005
    while True:
        try:
            os.rmdir(path)
            return
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() >= deadline:
                return
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


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


def _v2_options(v2: str) -> set[str]:
    """The superblock options of the cgroup2 mount at ``v2`` (nsdelegate, pids_localevents...)."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            if (len(fields) >= 5 and len(rfields) >= 3 and rfields[0] == "cgroup2"
                    and fields[4].replace("\\040", " ") == v2):
                return set(rfields[2].split(","))
    return set()


def _v2_controllers(v2: str | None) -> set[str]:
    if not v2:
        return set()
    try:
        return set(_read(os.path.join(v2, "cgroup.controllers")).split())
    except OSError:
        return set()


def for_host(name: str = "corral") -> CgroupManager:
    """The cgroups of this host's kind (v2 if its cgroup2 mount offers memory, pids and cpu,
    else v1) under ``<hierarchy>/<name>``."""
    from .v1 import CgroupsV1
    from .v2 import CgroupsV2

    _, v2 = _mounts()
    cls: type[CgroupManager] = \
        CgroupsV2 if v2 and _V2_REQUIRED <= _v2_controllers(v2) else CgroupsV1
    return cls(name)


class CgroupManager(abc.ABC):
    """Creates, fills, kills and removes the cgroup directories of sandboxes.
    ``CgroupManager(name)`` makes the class this host supports (v2 if its cgroup2 mount offers
    memory, pids and cpu, else v1)."""

    version: int
    # Whether a rise of a cgroup's pids.events "max" means its own limit (or one below it)
    # refused a fork. v2 counts a refusal at the cgroup whose limit refused and at each of
    # its ancestors; v1, and v2 mounted with pids_localevents, count it in the cgroup of the
    # process that forked, whichever limit (its own or an ancestor's) refused.
    _pids_events_own = False
    # Per version: the file a new child joins through, memory usage, OOM kill count.
    _procs_file: str
    _threads_file: str  # every thread of a cgroup (the freezer's: _exiting)
    _usage_file: str
    _oom_file: str

    def __new__(cls, name: str = "corral") -> CgroupManager:
        if cls is CgroupManager:  # CgroupManager(name): for_host(name)'s class
            from .v1 import CgroupsV1
            from .v2 import CgroupsV2

            _, v2 = _mounts()
            cls = CgroupsV2 if v2 and _V2_REQUIRED <= _v2_controllers(v2) else CgroupsV1
        return super().__new__(cls)

    def __init__(self, name: str = "corral") -> None:
        if not _NAME_RE.match(name) or ".." in name.split("/"):
            raise ValueError(f"invalid cgroup name {name!r}")
        self.name = name
        self._bases: list[str] = []
        self._views: dict[str, tuple[str, str, str]] = {}  # base -> (name, fstype, options)
        self._freezer: str | None = None
        # Processes the daemon killed for thrashing at the limit (corral.daemon.thrash),
        # counted with the kernel's OOM kills of the sandbox.
        self.thrash_kills: collections.Counter[str] = collections.Counter()
        # Recycled cgroups (v1 only; the counters are exported either way).
        self.spares_max = 0
        self.spare_stats = {"reused": 0, "kept": 0, "kept_charged": 0, "discarded": 0,
                            "drained": 0}
        self.set_spares_max = 0
        self.set_spare_stats = {"reused": 0, "kept": 0}
        # Where the daemon's process was before enter_daemon_cgroup: (cgroup, hierarchy root).
        self._daemon_home: tuple[str, str] | None = None

    # ---- what each version does its own way -----------------------------------------------
    @property
    @abc.abstractmethod
    def _memcgs(self) -> str:
        """The directory holding the sandboxes' memory cgroups (and the daemon's)."""

    @property
    @abc.abstractmethod
    def lazy_memory_ok(self) -> bool:
        """Whether memory and cpu cgroups can come at a sandbox's first exec (``later``)."""

    @property
    @abc.abstractmethod
    def memory_base(self) -> str | None:
        """The v1 memory hierarchy's directory of ours (None on v2)."""

    @abc.abstractmethod
    def host_cpus(self) -> list[int] | None:
        """The CPUs sandboxes may be placed on (our parent cpuset's), or None without a
        cpuset hierarchy of its own (then sandboxes get no cpuset)."""

    @abc.abstractmethod
    def later_paths(self, sandbox_id: str) -> list[str]:
        """The cgroups ``create(..., later=True)`` leaves for ``ensure_later``."""

    @abc.abstractmethod
    def create(self, sandbox_id: str, cpu: float, memory_mb: int, pids: int,
               later: bool = False, cpus: str | None = None) -> list[str]:
        """Make the sandbox's cgroup dirs with limits written; all or nothing. All its paths
        are returned; with ``later`` (v1 only) the memory and cpu cgroups are not made now but
        by ``ensure_later`` (see ContainerSubstrate.lazy_memcg). ``cpus``: the cpuset's CPUs
        (a cpulist, "0,2"); None: all of ours."""

    @abc.abstractmethod
    def ensure_later(self, sandbox_id: str, cpu: float, memory_mb: int,
                     pids: list[int], cpus: str | None = None) -> None:
        """Make the cgroups of a sandbox created with ``later`` (limits first, then ``pids``
        moved in)."""

    def adopt_limits(self, sandbox_id: str) -> None:
        """Bring the cgroups of a sandbox a daemon adopts (made by an earlier start, maybe an
        older version) to the settings this one reads: see CgroupsV1's. v2: nothing to do."""
        return None

    @abc.abstractmethod
    def recycle_memory(self, sandbox_id: str) -> bool:
        """Keep the sandbox's memory cgroup for a later sandbox; False if the caller should
        remove it."""

    @abc.abstractmethod
    def recycle_rest(self, sandbox_id: str) -> None:
        """Keep the sandbox's other cgroups for later sandboxes (those not kept are left for
        the caller's rmdir)."""

    @abc.abstractmethod
    def spare_ready(self) -> bool:
        """Is a recycled memory cgroup ready (making one costs ~nothing then)?"""

    @abc.abstractmethod
    def drop_spares(self, all_on_disk: bool = False) -> None:
        """rmdir the spares (at stop; ``all_on_disk`` at start: those a crashed daemon left)."""

    @abc.abstractmethod
    def _freezer_path(self, paths: list[str]) -> str:
        """The sandbox's cgroup that freezes it (OSError if there is none)."""

    @abc.abstractmethod
    def is_frozen(self, paths: list[str]) -> bool: ...

    @abc.abstractmethod
    def freeze_requested(self, paths: list[str]) -> bool:
        """Frozen, or on the way: either way a process that joins it now freezes."""

    @abc.abstractmethod
    def _set_frozen(self, path: str, frozen: bool) -> None:
        """Ask the kernel to freeze or thaw the cgroup at ``path``."""

    def _kill_first(self, paths: list[str]) -> None:
        """Before kill_all's signal rounds (v2: cgroup.kill)."""
        return

    def lift_cpu_quota(self, paths: list[str]) -> None:
        """No CPU quota for the cgroups' tasks any more (a kill that does not take: a task
        throttled for CPU it used in a long syscall acts on its SIGKILL only once its debt is
        paid, minutes at a small quota). Only for cgroups on their way out: a cgroup kept for
        the same sandbox (a restore in place) would keep no quota; recycled ones get theirs
        written again when reused."""
        for p in paths:
            for name, unlimited in (("cpu.cfs_quota_us", "-1"), ("cpu.max", "max")):
                with contextlib.suppress(OSError):
                    _write(os.path.join(p, name), unlimited)

    def _throttled(self, paths: list[str]) -> int:
        """How often the cgroups' tasks have been throttled for their CPU quota (cpu.stat's
        nr_throttled; 0 where not counted)."""
        total = 0
        for p in paths:
            try:
                text = _read(os.path.join(p, "cpu.stat"))
            except OSError:
                continue
            for line in text.splitlines():
                key, _, value = line.partition(" ")
                if key == "nr_throttled":
                    total += int(value)
        return total

    def _after_kill_round(self, paths: list[str]) -> None:
        """After each of kill_all's signal rounds (v1: thaw)."""
        return

    def _is_memcg(self, path: str) -> bool:
        """A sandbox's memory cgroup removed through a recycler (v1)."""
        return False

    def _remove_memcg(self, path: str) -> bool:
        """Remove a sandbox's memory cgroup (see _is_memcg); False if a task is in it. A
        version with a recycler hands it there instead."""
        try:
            os.rmdir(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            if e.errno == errno.EBUSY:
                return False
            raise
        return True

    def _protect_daemon(self, reserve_bytes: int) -> None:
        """Protect the daemon's memory (v2: memory.min and memory.low)."""
        return

    # ---- shared ------------------------------------------------------------------------------
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

    def paths_for(self, sandbox_id: str) -> list[str]:
        check_id(sandbox_id)
        return [os.path.join(b, sandbox_id) for b in self._bases]

    def procs_files(self, paths: list[str]) -> list[str]:
        """The files a new (single-threaded) child joins ``paths`` through, writing "0". v1:
        ``tasks``, not ``cgroup.procs``: moving the calling thread itself (pid 0 to
        ``tasks``) skips the global cgroup_threadgroup_rwsem, whose write side waits for an
        RCU grace period whenever no migration happened in the last one (0.7-7 ms measured
        here on the first exec after a pause). The child is a process of one thread, so this
        moves the whole process. v2's cgroup.threads is for threaded subtrees only."""
        return [os.path.join(p, self._procs_file) for p in paths]

    def pids(self, paths: list[str]) -> set[int]:
        out: set[int] = set()
        for p in paths:
            out.update(_read_pids(p))
        return out

    def pids_count(self, paths: list[str]) -> tuple[int, int] | None:
        """(processes now, the limit) of the cgroup among ``paths`` that has the pids
        controller, or None (no such cgroup, or no limit)."""
        for p in paths:
            try:
                limit = _read(os.path.join(p, "pids.max")).strip()
                now = int(_read(os.path.join(p, "pids.current")))
            except (OSError, ValueError):
                continue
            if limit.isdigit():
                return now, int(limit)
        return None

    def pids_refusals(self, paths: list[str]) -> int | None:
        """The ``max`` count of ``pids.events`` of the cgroup among ``paths`` that has the
        pids controller (forks refused: see ``_pids_events_own`` for whose), or None. Read
        before a spawn, it is the base ``pids_at_own_limit`` compares with."""
        for p in paths:
            try:
                return _key_values(_read(os.path.join(p, "pids.events")))["max"]
            except (OSError, KeyError):
                continue
        return None

    def pids_at_own_limit(self, paths: list[str], base: int | None) -> int | None:
        """A fork in the sandbox of ``paths`` was refused (EAGAIN) during a spawn: its pids
        limit when the refusal is its own (its processes fill its limit), else None.

        The evidence is a rise of ``pids.events`` ``max`` since ``base`` (``pids_refusals``
        before the spawn): a count the kernel keeps, which processes that end after the
        refusal cannot undo. v2 counts it only at and above the cgroup whose limit refused,
        so a rise is the sandbox's own limit; v1 counts it in the forking process's cgroup
        whichever limit refused, so it is the sandbox's own unless a limited ancestor is at
        its limit too (then the host's: the count below decides). Without a rise: processes
        now within PIDS_SLACK of the limit (a fork bomb keeps it there; the slack covers a
        few that ended since). A rise is never needed: a kernel without pids.events, or the
        span's other refusals, only fall back on the count."""
        for p in paths:
            try:
                limit = _read(os.path.join(p, "pids.max")).strip()
            except OSError:
                continue
            if not limit.isdigit():
                return None
            now = self.pids_refusals([p])
            if base is not None and now is not None and now > base and (
                    self._pids_events_own or not self._pids_ancestor_full(p)):
                return int(limit)
            try:
                current = int(_read(os.path.join(p, "pids.current")))
            except (OSError, ValueError):
                return None
            return int(limit) if current + PIDS_SLACK >= int(limit) else None
        return None

    def _pids_ancestor_full(self, path: str) -> bool:
        """Whether an ancestor of the pids cgroup ``path`` (up to its hierarchy's root, which
        has no limit) is within PIDS_SLACK of its own limit: its refusal would count in
        ``path``'s pids.events too (v1)."""
        d = os.path.dirname(path)
        while True:
            try:
                limit = _read(os.path.join(d, "pids.max")).strip()
            except OSError:
                return False  # the root: no pids.max
            if limit.isdigit():
                try:
                    current = int(_read(os.path.join(d, "pids.current")))
                except (OSError, ValueError):
                    return True
                if current + PIDS_SLACK >= int(limit):
                    return True
            d = os.path.dirname(d)

    def kill_all(self, paths: list[str], timeout: float = 2.0, lift: bool = True) -> None:
        """SIGKILL every process in the cgroups until they are empty (or ``timeout``); with
        ``lift``, past 50 ms the cgroups' CPU quota is lifted (lift_cpu_quota)."""
        self._kill_first(paths)
        start = time.monotonic()
        deadline = start + timeout
        delay = 0.0005
        lifted = False
        while True:
            pids = self.pids(paths)
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self._after_kill_round(paths)
            now = time.monotonic()
            if lift and not lifted and now - start >= 0.05:  # slow to die: throttled? (rare:
                self.lift_cpu_quota(paths)  # a quota write walks every cpu cgroup)
                lifted = True
            if now >= deadline:
                return
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def remove(self, paths: list[str], timeout: float = 1.0) -> None:
        """rmdir each path (children first). A dying process may keep a cgroup busy for a few
        ms, so EBUSY is retried; past ``timeout``, for as long as a thread in them is in its
        exit (up to EXIT_WAIT_S: a sandbox's process with GiBs of page tables takes seconds
        to end, and a destroy failed on it, its cgroups and files left for good). Missing dirs
        are fine. Raises OSError if one stays busy."""
        start = time.monotonic()
        deadline = start + timeout
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
                    now = time.monotonic()
                    if now >= deadline and now < start + EXIT_WAIT_S and self._exiting(paths):
                        deadline = min(now + 0.5, start + EXIT_WAIT_S)  # look again then
                    if now >= deadline:
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
        return os.path.join(self._memcgs, DAEMON_CGROUP)

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
        self._protect_daemon(reserve_bytes)
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
        # A helper process still ending in it (a runsc or a zygote on its way out) is waited
        # out a moment; one that stays keeps it for the next stop.
        _rmdir_once_empty(self.daemon_cgroup())

    def remove_parents(self) -> None:
        """Remove our (empty) top-level directories; best effort, a busy one stays."""
        self.leave_daemon_cgroup(os.getpid())
        self.drop_spares()
        for base in self._bases:
            _rmdir_once_empty(base)

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
        for p in paths:
            try:
                return int(_read(os.path.join(p, self._usage_file)))
            except FileNotFoundError:
                continue
        return 0

    def oom_kills(self, sandbox_id: str) -> OomCount | None:
        """The OomCount of the sandbox's memory cgroup since the cgroup was made (v2
        ``memory.events``; v1 ``memory.oom_control`` and the fail counts). A recycled v1
        cgroup has no kill (recycle_memory discards those) and its fail counts reset; a
        cgroup kept across a restore in place has both, and callers keep a baseline. The
        daemon's thrash kills count as kills at the sandbox's own limit. None when the
        sandbox has no memory cgroup (yet) or the kernel does not count."""
        extra = self.thrash_kills.get(sandbox_id, 0)
        count = oom_count_at(os.path.join(self._memcgs, check_id(sandbox_id)), self.version)
        return OomCount(count.kills + extra, count.own + extra) if count is not None else None

    def record_thrash_kill(self, sandbox_id: str) -> None:
        self.thrash_kills[sandbox_id] += 1

    def forget_thrash_kills(self, sandbox_id: str) -> None:
        self.thrash_kills.pop(sandbox_id, None)

    def _oom_kills_at(self, path: str) -> int | None:
        try:
            text = _read(os.path.join(path, self._oom_file))
        except OSError:
            return None
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return None

    # ---- freezer ---------------------------------------------------------------------------
    def freeze(self, paths: list[str], timeout: float = 5.0) -> None:
        """Stop every process in the sandbox; returns once the kernel reports it frozen. Past
        ``timeout``, the wait goes on (up to EXIT_WAIT_S) while a thread of the sandbox is
        in its exit, uses CPU (a frozen thread uses none: one that does runs in the kernel)
        or the sandbox is throttled for its CPU quota: a process the sandbox killed, or a
        syscall it made that the freezer cannot interrupt (populating the page tables of a
        huge mapping) and the CPU debt it leaves, could otherwise fail any pause or snapshot
        of its own at will. A sandbox still busy so then raises PauseHeldOff (its own
        doing); TimeoutError otherwise. An uninterruptible wait (state D) does not extend it:
        on cgroup v1 a frozen thread reads D too. Only the kernel's word counts: a thread
        asleep in a syscall may still write the sandbox's files until it is frozen."""
        self._set_frozen(self._freezer_path(paths), True)
        self._wait_state(paths, True, timeout)

    def _exiting(self, paths: list[str]) -> bool:
        """A thread in one of ``paths`` is in its exit (or a zombie)."""
        return any(kernel.exiting(t) for t in self._tids(paths))

    def _cpu_ticks(self, paths: list[str]) -> dict[int, int]:
        """The CPU ticks of every thread in ``paths``."""
        out = {}
        for t in self._tids(paths):
            ticks = kernel.cpu_ticks(t)
            if ticks is not None:
                out[t] = ticks
        return out

    def _burning(self, paths: list[str], seen: dict[int, int]) -> int | None:
        """A thread in ``paths`` that used CPU since ``seen`` was taken (then updated), or
        None."""
        now = self._cpu_ticks(paths)
        busy = next((t for t, ticks in now.items() if ticks > seen.get(t, ticks)), None)
        seen.clear()
        seen.update(now)
        return busy

    def _tids(self, paths: list[str]) -> list[int]:
        out: list[int] = []
        for p in paths:
            try:
                out += [int(t) for t in _read(os.path.join(p, self._threads_file)).split()]
            except (OSError, ValueError):
                continue
        return out

    def thaw(self, paths: list[str], wait: bool = True, timeout: float = 5.0) -> None:
        try:
            p = self._freezer_path(paths)
        except OSError:
            if wait:
                raise
            return
        try:
            self._set_frozen(p, False)
        except FileNotFoundError:
            if wait:
                raise
            return
        if wait:
            self._wait_state(paths, False, timeout)

    def _wait_state(self, paths: list[str], frozen: bool, timeout: float) -> None:
        start = time.monotonic()
        deadline = start + timeout
        delay = 0.0005
        where = [self._freezer_path(paths)] if frozen else []
        seen = self._cpu_ticks(where)  # what each thread had used at the start
        throttled = self._throttled(paths) if frozen else 0
        while self.is_frozen(paths) != frozen:
            now = time.monotonic()
            if now >= deadline and frozen:
                burning = self._burning(where, seen)
                # Throttled for its CPU quota: CPU it used in a long syscall (the quota is
                # applied on return to user space) paid back before it can freeze.
                was, throttled = throttled, self._throttled(paths)
                own = burning is not None or throttled > was
                if now < start + EXIT_WAIT_S and (own or self._exiting(where)):
                    deadline = min(now + 0.5, start + EXIT_WAIT_S)  # look again then
                elif own:
                    raise PauseHeldOff(
                        f"the sandbox's threads kept running in the kernel, or paying back "
                        f"the CPU they used there, for {now - start:.0f} s: it could not be "
                        f"frozen", burning or 0)
            if now >= deadline:
                raise TimeoutError(f"cgroup did not become {'frozen' if frozen else 'thawed'}")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
