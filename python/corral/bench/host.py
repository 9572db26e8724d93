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


def rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


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
def cgroup_tops(prefix: str) -> list[Path]:
    """Top-level cgroup dirs whose name starts with ``prefix``, in every hierarchy."""
    out = []
    roots = [CGROUP_ROOT] + [p for p in CGROUP_ROOT.iterdir() if p.is_dir()]
    for root in roots:
        try:
            out.extend(p for p in root.iterdir() if p.is_dir() and p.name.startswith(prefix))
        except OSError:
            continue
    return out


def cgroup_children(prefix: str) -> list[str]:
    return [str(d) for top in cgroup_tops(prefix) for d in _walk_dirs(top)[1:]]


def _walk_dirs(top: Path) -> list[Path]:
    """Every dir under ``top`` (itself included); dirs vanishing meanwhile are skipped
    (os.walk ignores errors), which rglob does not survive."""
    return [Path(d) for d, _, _ in os.walk(top)]


def cgroup_pids(prefix: str) -> set[int]:
    pids: set[int] = set()
    for top in cgroup_tops(prefix):
        for d in _walk_dirs(top):
            try:
                pids.update(int(x) for x in (d / "cgroup.procs").read_text().split())
            except (OSError, ValueError):
                pass
    return pids


def host_mounts_under(path: str) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [ln.split()[4] for ln in f if ln.split()[4].startswith(path)]


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
