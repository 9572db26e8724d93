"""The cgroups of the run_code pools, on the daemon's side: made at a zygote's start, limits on
the zygote and each slot, removed at the stop.

Layout, in each hierarchy used (v1: memory, pids, freezer, and cpu for run_code; v2: the
unified one): ``<root>/<daemon cgroup name>.runcode/<language>-<n>/{zygote,s0,s1,...}``;
sessions (``Sandbox(substrate="process")``) under ``<daemon cgroup name>.process/<sandbox id>/
{zygote,s0}``. The zygote moves each child into its slot; the daemon sets the slot's memory
limit (per request, per session).

CPU (run_code): the slots weigh less than the zygote, the daemon and lxcfs, so requests that
spin every process they may have cannot starve what answers them. v1: the zygote stays in the
daemon's cpu cgroup and only the slots are in the cpu hierarchy, under a ``.runcode`` top of
RUNCODE_CPU_SHARES (a quarter of one nice-0 task of the daemon's); v2: the zygote's cgroup
weighs ZYGOTE_CPU_WEIGHT against its slots' RUNCODE_CPU_WEIGHT each, under a top of
RUNCODE_TOP_WEIGHT. No quota: an idle machine gives requests every CPU.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

from corral.daemon import kernel
from corral.daemon.cgroups.common import EXIT_WAIT_S, MEMSW_SLACK, _mounts, _read, _write
from corral.daemon.substrates.types import OomCount

ZYGOTE_MEMORY = 2 << 30     # the zygote and its launcher (numpy preloaded: ~60 MB)
ZYGOTE_PIDS = 16            # launcher, zygote, fork server, children not yet in their slot
RUNCODE_CPU_SHARES = 256    # v1: all of run_code's slots against a nice-0 task's 1024
RUNCODE_TOP_WEIGHT = 25     # v2: the same against the daemon's cgroup's default 100
ZYGOTE_CPU_WEIGHT = 10000   # v2: the zygote first within its pool
RUNCODE_CPU_WEIGHT = 1      # v2: each slot


class Layout:
    """Where the pools' cgroups go on this host."""

    def __init__(self, cgroup_name: str, suffix: str = ".runcode", cpu: bool = False) -> None:
        """``cpu``: weigh the slots below the zygote and the daemon (run_code's pools)."""
        v1, v2 = _mounts()
        ctrls: set[str] = set()
        if v2:
            with contextlib.suppress(OSError):
                ctrls = set(_read(os.path.join(v2, "cgroup.controllers")).split())
        if v2 and {"memory", "pids"} <= ctrls:
            self.v2 = True
            self.roots = {"unified": v2}
            self.cpu = cpu and "cpu" in ctrls
        else:
            if "memory" not in v1 or "pids" not in v1:
                raise RuntimeError("run_code needs the memory and pids cgroup controllers")
            self.v2 = False
            self.cpu = cpu and "cpu" in v1
            self.roots = {k: v1[k] for k in ("memory", "pids", "freezer", "cpu")
                          if k in v1 and (k != "cpu" or self.cpu)}
        self.top = cgroup_name + suffix

    def pools(self) -> list[str]:
        """The names of the pools that have cgroups now."""
        names: set[str] = set()
        for t in self.tops():
            with contextlib.suppress(OSError):
                names.update(n for n in os.listdir(t) if os.path.isdir(os.path.join(t, n)))
        return sorted(names)

    def tops(self) -> list[str]:
        return [os.path.join(r, self.top) for r in self.roots.values()]

    def pool_dirs(self, pool: str) -> dict[str, str]:
        return {k: os.path.join(r, self.top, pool) for k, r in self.roots.items()}

    def make_pool(self, pool: str, slots: int, pids_max: int) -> tuple[list[str], list[dict]]:
        """Make the pool's cgroups (fresh: anything left from before is killed and removed);
        returns the files the launcher joins through and each slot's directories."""
        self.remove_pool(pool)
        base = self.pool_dirs(pool)
        want = {"memory", "pids"} | ({"cpu"} if self.cpu else set())
        if self.v2:
            chain = [self.roots["unified"], os.path.join(self.roots["unified"], self.top),
                     base["unified"]]
            for d in chain[1:]:
                os.makedirs(d, exist_ok=True)
            for d in chain[:-1] + [base["unified"]]:
                ctl = os.path.join(d, "cgroup.subtree_control")
                if not want <= set(_read(ctl).split()):
                    _write(ctl, " ".join("+" + c for c in sorted(want)))
            if self.cpu:
                _write(chain[1] + "/cpu.weight", str(RUNCODE_TOP_WEIGHT))
        elif self.cpu:
            os.makedirs(os.path.join(self.roots["cpu"], self.top), exist_ok=True)
            _write(os.path.join(self.roots["cpu"], self.top, "cpu.shares"),
                   str(RUNCODE_CPU_SHARES))
        names = ["zygote"] + [f"s{i}" for i in range(slots)]
        for k, b in base.items():
            for n in names:
                if k != "cpu" or n != "zygote":  # v1: the zygote keeps the daemon's CPU
                    os.makedirs(os.path.join(b, n), exist_ok=True)
        zy = {k: os.path.join(b, "zygote") for k, b in base.items() if k != "cpu"}
        slot_dirs = [{k: os.path.join(b, f"s{i}") for k, b in base.items()}
                     for i in range(slots)]
        # Room for the helpers that wipe big scratch trees, one per slot at most.
        zygote_pids = ZYGOTE_PIDS + slots
        if self.v2:
            _write(zy["unified"] + "/memory.max", str(ZYGOTE_MEMORY))
            _write(zy["unified"] + "/pids.max", str(zygote_pids))
            if self.cpu:
                _write(zy["unified"] + "/cpu.weight", str(ZYGOTE_CPU_WEIGHT))
            for s in slot_dirs:
                _write(s["unified"] + "/pids.max", str(pids_max))
                if self.cpu:
                    _write(s["unified"] + "/cpu.weight", str(RUNCODE_CPU_WEIGHT))
            join = [zy["unified"] + "/cgroup.procs"]
        else:
            _write(zy["memory"] + "/memory.limit_in_bytes", str(ZYGOTE_MEMORY))
            _write(zy["pids"] + "/pids.max", str(zygote_pids))
            for s in slot_dirs:
                _write(s["pids"] + "/pids.max", str(pids_max))
            join = [os.path.join(d, "tasks") for d in zy.values()]
        return join, slot_dirs

    def remove_pool(self, pool: str, timeout: float = 5.0) -> None:
        for b in self.pool_dirs(pool).values():
            _remove_tree(b, timeout)

    def remove_all(self, timeout: float = 5.0) -> None:
        for t in self.tops():
            _remove_tree(t, timeout)


def _procs(d: str) -> list[int]:
    try:
        return [int(x) for x in _read(os.path.join(d, "cgroup.procs")).split()]
    except OSError:
        return []


def _exiting(d: str) -> bool:
    """A process in cgroup ``d`` is in its exit (seconds, for one with GiBs of page tables)."""
    return any(kernel.exiting(pid) for pid in _procs(d))


def _remove_tree(top: str, timeout: float) -> None:
    """Kill every process under ``top`` and remove its cgroups, leaves first; past
    ``timeout``, for as long as a process in them is in its exit (up to EXIT_WAIT_S)."""
    if not os.path.isdir(top):
        return
    start = time.monotonic()
    deadline = start + timeout
    dirs = [dp for dp, _, _ in os.walk(top)]
    for d in reversed(dirs):
        with contextlib.suppress(OSError):
            if _read(os.path.join(d, "freezer.state")).strip() != "THAWED":
                _write(os.path.join(d, "freezer.state"), "THAWED")
        delay = 0.0005
        lifted = False
        while True:
            for pid in _procs(d):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            try:
                os.rmdir(d)
                break
            except FileNotFoundError:
                break
            except OSError:
                if not lifted:  # throttled for CPU used in a syscall, they would act on the
                    lifted = True  # SIGKILL only once the debt is paid: no quota now
                    for name, unlimited in (("cpu.cfs_quota_us", "-1"), ("cpu.max", "max")):
                        with contextlib.suppress(OSError):
                            _write(os.path.join(d, name), unlimited)
                now = time.monotonic()
                if now > deadline and now < start + EXIT_WAIT_S and _exiting(d):
                    deadline = min(now + 0.5, start + EXIT_WAIT_S)  # look again then
                if now > deadline:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 0.05)


CPU_PERIOD_US = 100_000


def set_cpu_quota(dirs: dict[str, str], cpus: float) -> None:
    """A CFS quota of ``cpus`` CPUs on a slot made with a cpu cgroup (else nothing)."""
    quota = max(1000, int(cpus * CPU_PERIOD_US))
    if "unified" in dirs:
        if os.path.exists(os.path.join(dirs["unified"], "cpu.max")):
            _write(os.path.join(dirs["unified"], "cpu.max"), f"{quota} {CPU_PERIOD_US}")
    elif "cpu" in dirs:
        _write(os.path.join(dirs["cpu"], "cpu.cfs_period_us"), str(CPU_PERIOD_US))
        _write(os.path.join(dirs["cpu"], "cpu.cfs_quota_us"), str(quota))


class SlotMemory:
    """A slot's memory cgroup, from the daemon's side: the limit, set per request (only when
    it changes), and its OOM counts (cgroups.OomCount: the kills in it, and the evidence that
    its own limit was hit: v2 ``memory.events`` ``oom``, v1 the fail counts). With
    ``keep_open`` (run_code's slots, read twice a request) the counts' files stay open and
    are re-read by pread; ``close`` them."""

    def __init__(self, dirs: dict[str, str], keep_open: bool = False) -> None:
        self.v2 = "unified" in dirs
        self.dir = dirs["unified" if self.v2 else "memory"]
        self.memsw = not self.v2 and os.path.exists(
            os.path.join(self.dir, "memory.memsw.limit_in_bytes"))
        self.limit = 1 << 62  # unlimited, as made
        self.events = os.path.join(self.dir, "memory.events" if self.v2 else "memory.oom_control")
        # v1: the charges refused at this cgroup's own limit (memory, and memory+swap)
        self.failcnts = [] if self.v2 else [os.path.join(self.dir, f) for f in (
            ["memory.failcnt"] + (["memory.memsw.failcnt"] if self.memsw else []))]
        self.fds = ([os.open(f, os.O_RDONLY | os.O_CLOEXEC) for f in [self.events, *self.failcnts]]
                    if keep_open else [])

    def set(self, nbytes: int) -> None:
        if nbytes == self.limit:
            return
        if self.v2:
            _write(self.dir + "/memory.max", str(nbytes))
            with contextlib.suppress(OSError):
                _write(self.dir + "/memory.swap.max", "0")
        else:
            order = ["memory.limit_in_bytes"]
            if self.memsw:  # memsw >= limit at every step
                order = (["memory.memsw.limit_in_bytes"] + order if nbytes > self.limit
                         else order + ["memory.memsw.limit_in_bytes"])
                if self.limit == 1 << 62:  # the first limit: see MEMSW_SLACK
                    _write(os.path.join(self.dir, "memory.swappiness"), "0")
            for name in order:
                slack = MEMSW_SLACK if name == "memory.memsw.limit_in_bytes" else 0
                _write(os.path.join(self.dir, name), str(nbytes + slack))
        self.limit = nbytes

    def _texts(self) -> list[str]:
        if self.fds:
            return [os.pread(fd, 4096, 0).decode() for fd in self.fds]
        return [_read(f) for f in [self.events, *self.failcnts]]

    def oom_kills(self) -> OomCount:
        events, *failcnts = self._texts()
        counts: dict[str, int] = {}
        for line in events.splitlines():
            key, _, value = line.partition(" ")
            if key in ("oom_kill", "oom"):
                counts[key] = int(value)
        own = counts.get("oom", 0) if self.v2 else sum(int(t) for t in failcnts)
        return OomCount(counts.get("oom_kill", 0), own)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []
