"""The host side of a benchmark: memory counters, kernel limits, and leak checks.

Every cgroup the bench (or its private daemon, or a peer runtime) makes lives under a name
that starts with ``corral-bench-<pid>``, so cleanup can find and sweep all of it by name.
"""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import time
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")

# /proc/meminfo fields a per-sandbox memory figure is built from (kB).
MEM_FIELDS = ("MemTotal", "MemFree", "MemAvailable", "Slab", "SReclaimable", "SUnreclaim",
              "KernelStack", "PageTables", "Shmem", "Percpu")


def meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, rest = line.split(":", 1)
            if name in MEM_FIELDS:
                out[name] = int(rest.split()[0])
    return out


def settle(seconds: float = 1.5) -> None:
    """Let RCU-deferred frees and per-cpu slab flushes land before reading counters."""
    time.sleep(seconds)


def memcg_usage_kib(name: str) -> int | None:
    """Memory charged to the top-level memory cgroup ``name`` and everything under it
    (hierarchical): the sandboxes' own pages and the kernel objects allocated on their
    behalf once they joined it. Untouched by other users of the machine, unlike meminfo."""
    for path in (CGROUP_ROOT / "memory" / name / "memory.usage_in_bytes",
                 CGROUP_ROOT / name / "memory.current"):
        try:
            return int(path.read_text()) // 1024
        except (OSError, ValueError):
            continue
    return None


def memcg_file_kib(name: str) -> int | None:
    """Page cache (file pages: reclaimable) in the memory cgroup ``name``, hierarchical."""
    for path, key in ((CGROUP_ROOT / "memory" / name / "memory.stat", "total_cache"),
                      (CGROUP_ROOT / name / "memory.stat", "file")):
        try:
            for line in path.read_text().splitlines():
                k, _, v = line.partition(" ")
                if k == key:
                    return int(v) // 1024
        except (OSError, ValueError):
            continue
    return None


def make_memcg(name: str) -> str | None:
    """Create the top-level memory cgroup ``name``; returns its cgroup.procs path."""
    for d in (CGROUP_ROOT / "memory" / name, CGROUP_ROOT / name):
        if d.parent.is_dir() and (d.parent / "cgroup.procs").exists():
            d.mkdir(exist_ok=True)
            return str(d / "cgroup.procs")
    return None


def join_cgroup(procs: str | None) -> None:
    """preexec_fn: move the new process into a cgroup before it allocates anything we want
    to count (writing 0 to cgroup.procs moves the writer)."""
    if procs:
        with open(procs, "w") as f:
            f.write("0")


def rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def proc_cpu_s(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process, all threads plus its reaped children."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        rest = f.read().rsplit(b")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    ut, st, cut, cst = (int(x) for x in rest[11:15])  # fields 14-17
    return (ut + cut) / tick, (st + cst) / tick


def self_cpu_s(children: bool = False) -> tuple[float, float]:
    """(user, system) CPU seconds of this process (or of its reaped children)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN if children else resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


class CpuMeter:
    """CPU milliseconds per operation spent by the parties of one measurement: a daemon (by
    pid), this process (the client) and/or its waited-for children (raw, peers)."""

    def __init__(self, daemon_pid: int | None = None, client: bool = False,
                 children: bool = False) -> None:
        self.daemon_pid, self.client, self.children = daemon_pid, client, children

    def __enter__(self) -> CpuMeter:
        self._d0 = proc_cpu_s(self.daemon_pid) if self.daemon_pid else None
        self._c0 = self_cpu_s()
        self._k0 = self_cpu_s(children=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self._d1 = proc_cpu_s(self.daemon_pid) if self.daemon_pid else None
        self._c1 = self_cpu_s()
        self._k1 = self_cpu_s(children=True)

    def per_op_ms(self, n: int) -> dict[str, float]:
        out: dict[str, float] = {}

        def put(name: str, a: tuple[float, float], b: tuple[float, float]) -> None:
            out[f"{name}_user"] = round((b[0] - a[0]) * 1000 / max(1, n), 3)
            out[f"{name}_sys"] = round((b[1] - a[1]) * 1000 / max(1, n), 3)

        if self._d0 and self._d1:
            put("daemon", self._d0, self._d1)
        if self.client:
            put("client", self._c0, self._c1)
        if self.children:
            put("proc", self._k0, self._k1)
        return out


def pss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def cgroup_mode() -> str:
    if (CGROUP_ROOT / "memory" / "cgroup.procs").exists():
        return "v1"
    return "v2" if (CGROUP_ROOT / "cgroup.controllers").exists() else "none"


def host_info() -> dict[str, object]:
    mem = meminfo()
    return {
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "mem_total_gib": round(mem.get("MemTotal", 0) / 2**20, 1),
        "cgroup": cgroup_mode(),
        "python": platform.python_version(),
        "loadavg_at_start": _read("/proc/loadavg").split()[:3],
        "pid_max": int(_read("/proc/sys/kernel/pid_max") or 0),
        "nofile": list(_nofile()),
        "cpu_pressure": cpu_pressure(),
    }


def _slab_objects(cache: str) -> int | None:
    for line in _read("/proc/slabinfo").splitlines():
        f = line.split()
        if f and f[0] == cache:
            return int(f[1])
    return None


def memcg_health(name: str, tries: int = 5) -> dict[str, object] | None:
    """What a memory cgroup costs on this host now, and how many the kernel still holds dead
    (v1). Both grow with the host's history, not with corral: a memcg's shrinker table is
    sized by the most superblocks (mounts) ever alive at once since boot (8 per sandbox: a
    50,000-sandbox run makes every later memcg ~7 MB of kmalloc-1k and ~1.5 ms to mkdir), and
    a removed memcg still charged with page cache stays *dying* until the pages are evicted.
    Quoted with every report so that runs on a degraded host can be told apart.
    ``name`` is a cgroup name of the bench's (swept by its cleanup)."""
    base = CGROUP_ROOT / "memory"
    if not (base / "cgroup.procs").exists():
        return None
    probe = base / name
    ms, objs = [], []
    try:
        for _ in range(tries):
            before = _slab_objects("kmalloc-1k")
            t = time.perf_counter()
            probe.mkdir()
            ms.append((time.perf_counter() - t) * 1000)
            after = _slab_objects("kmalloc-1k")
            probe.rmdir()
            if before is not None and after is not None:
                objs.append(after - before)
    except OSError:
        try:
            probe.rmdir()
        except OSError:
            pass
        return None
    with open("/proc/cgroups") as f:
        total = next((int(line.split()[2]) for line in f if line.split()[:1] == ["memory"]), 0)
    live = sum(1 for _ in os.walk(base))
    ms.sort()
    objs.sort()
    return {"mkdir_ms_p50": round(ms[len(ms) // 2], 3),
            "kmalloc_1k_per_memcg": objs[len(objs) // 2] if objs else None,
            "dying": max(0, total - live),
            "sunreclaim_mib": meminfo().get("SUnreclaim", 0) // 1024}


def cpu_pressure() -> dict[str, float] | None:
    """PSI "some" averages: the share of time runnable tasks waited for a CPU (other load on
    the machine while the bench ran)."""
    line = _read("/proc/pressure/cpu").splitlines()
    if not line:
        return None
    return {k: float(v) for k, v in (f.split("=") for f in line[0].split()[1:4])}


def _nofile() -> tuple[int, int]:
    import resource

    return resource.getrlimit(resource.RLIMIT_NOFILE)


def fs_type(path: str) -> str:
    """Filesystem type of the mount holding ``path`` (longest mountpoint prefix)."""
    best, kind = "", "?"
    real = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        for ln in f:
            parts = ln.split()
            mnt, fstype = parts[4], parts[parts.index("-") + 1]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, kind = mnt, fstype
    return kind


def git_rev(repo: Path) -> str | None:
    try:
        r = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
                           capture_output=True, text=True, timeout=5)
        return r.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


# ---- kernel limits ---------------------------------------------------------------------------
def raise_limits(live: int) -> list[str]:
    """Raise the limits that stand between us and ``live`` sandboxes alive at once; never lower
    one. Returns a note per change (the report says what was changed)."""
    notes = []
    # One host pid per idle sandbox (its init), plus headroom for everything else.
    want = {"/proc/sys/kernel/pid_max": min(4194304, max(32768, live * 2 + 10000)),
            "/proc/sys/kernel/threads-max": live * 2 + 20000}
    for ns in ("mnt", "pid", "net", "ipc", "uts", "cgroup"):
        want[f"/proc/sys/user/max_{ns}_namespaces"] = live * 2 + 10000
    for path, value in want.items():
        cur = _read(path)
        if not cur.isdigit() or int(cur) >= value:
            continue
        try:
            with open(path, "w") as f:
                f.write(str(value))
            notes.append(f"{path}: {cur} -> {value}")
        except OSError as e:
            notes.append(f"{path}: {cur}, could not raise to {value}: {e.strerror}")
    return notes


# ---- leaks -----------------------------------------------------------------------------------
def cgroup_tops(prefix: str, exact: bool = False) -> list[Path]:
    """Top-level cgroup dirs named ``prefix`` (exact) or starting with it, in every
    hierarchy."""
    out: list[Path] = []
    roots = [CGROUP_ROOT] + [p for p in CGROUP_ROOT.iterdir() if p.is_dir()]
    for root in roots:
        try:
            out.extend(p for p in root.iterdir() if p.is_dir() and (
                p.name == prefix if exact else p.name.startswith(prefix)))
        except OSError:
            continue
    return out


def cgroup_children(prefix: str, exact: bool = False) -> list[str]:
    return [str(d) for top in cgroup_tops(prefix, exact) for d in _walk_dirs(top)[1:]]


def _walk_dirs(top: Path) -> list[Path]:
    """Every dir under ``top`` (itself included); dirs vanishing meanwhile are skipped
    (os.walk ignores errors), which rglob does not survive."""
    return [Path(d) for d, _, _ in os.walk(top)]


def sandbox_controllers(name: str) -> list[str]:
    """v1 controllers in which most of the sandboxes under ``name`` have a cgroup (which
    cgroups a daemon's idle sandboxes actually have: some may be made only at first use)."""
    counts = {top.parent.name: sum(1 for d in top.iterdir()
                                   if d.is_dir() and not d.name.startswith("."))  # not spares
              for top in cgroup_tops(name, exact=True) if top.parent != CGROUP_ROOT}
    most = max(counts.values(), default=0)
    return sorted(c for c, k in counts.items() if most and k * 2 > most)


def cgroup_pids(prefix: str, exact: bool = False) -> set[int]:
    pids: set[int] = set()
    for top in cgroup_tops(prefix, exact):
        for d in _walk_dirs(top):
            try:
                pids.update(int(x) for x in (d / "cgroup.procs").read_text().split())
            except (OSError, ValueError):
                pass
    return pids


def host_mounts_under(path: str) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [ln.split()[4] for ln in f if ln.split()[4].startswith(path)]


def unmount_under(path: str) -> list[str]:
    """Detach every mount under ``path``, deepest first (a daemon killed before its own
    cleanup leaves its scratch disk and lxcfs views); returns what could not be."""
    from corral import _core

    left = []
    for m in sorted(host_mounts_under(path), key=len, reverse=True):
        try:
            _core.umount_detach(m)
        except OSError:
            left.append(m)
    return left


def mount_count() -> int:
    with open("/proc/self/mountinfo") as f:
        return sum(1 for _ in f)


def sweep_cgroups(prefix: str, timeout: float = 10.0) -> list[str]:
    """Kill every process in our cgroups and rmdir them, deepest first. Returns what stayed."""
    deadline = time.monotonic() + timeout
    left: list[str] = []
    while True:
        for pid in cgroup_pids(prefix):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for top in cgroup_tops(prefix):
            _thaw(top)
        left = []
        for top in cgroup_tops(prefix):
            for d in sorted(_walk_dirs(top), key=lambda p: -len(p.parts)):
                try:
                    d.rmdir()
                except FileNotFoundError:
                    pass
                except OSError:
                    left.append(str(d))
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def _thaw(top: Path) -> None:
    # v1 frozen tasks ignore SIGKILL until thawed.
    if top.parent.name != "freezer":
        return
    for d in _walk_dirs(top):
        try:
            (d / "freezer.state").write_text("THAWED")
        except OSError:
            pass
