"""How many sandboxes this node admits: derived from the machine, not a fixed number.

The admission limit (``CORRAL_MAX_SANDBOXES`` when set) defaults to the smallest of what the
machine can hold: its memory at ``IDLE_SANDBOX_KIB`` per idle sandbox (the design budget for
an idle sandbox, kernel and daemon included: docs/benchmarks.md, density), and the kernel's
own ceilings on the things every sandbox takes one of (namespaces of each kind, pids, tasks,
cgroup v1 memory cgroup ids), each less a reserve for the rest of the host. Separately, a
create is refused while the host's available memory is below its floor (whatever the count):
a node under memory pressure from elsewhere says so (``capacity_exceeded``, infra) instead of
OOM-killing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

IDLE_SANDBOX_KIB = 400          # memory budget per idle sandbox
MEMORY_SHARE = 0.85             # of MemTotal for sandboxes (the rest: host, daemon, caches)
TASK_RESERVE = 32768            # pids / tasks left to the rest of the host
NAMESPACE_RESERVE = 1024        # namespaces of each kind left to the rest of the host
NAMESPACE_KINDS = ("mnt", "pid", "uts", "ipc", "net", "cgroup")
V1_MEMCG_IDS = 65535            # cgroup v1: a memory cgroup id is 16 bits
LOW_MEMORY_FLOOR_KIB = 256 << 10  # refuse creates below this much MemAvailable...
LOW_MEMORY_SHARE = 0.02           # ...or below this share of MemTotal, whichever is larger
MEMINFO_TTL_S = 0.1             # how long one read of /proc/meminfo answers for


@dataclass(frozen=True)
class Limit:
    count: int
    bound_by: str  # what set it: "memory", "max_net_namespaces", "pid_max", ... or "config"


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def meminfo_kib(field: str, text: str | None = None) -> int | None:
    if text is None:
        try:
            with open("/proc/meminfo") as f:
                text = f.read()
        except OSError:
            return None
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return None


def bounds(proc: str = "/proc", sys_root: str = "/sys") -> dict[str, int]:
    """Each thing that bounds the count, with the count it allows."""
    out: dict[str, int] = {}
    try:
        with open(os.path.join(proc, "meminfo")) as f:
            total = meminfo_kib("MemTotal", f.read())
    except OSError:
        total = None
    if total:
        out["memory"] = int(total * MEMORY_SHARE / IDLE_SANDBOX_KIB)
    for kind in NAMESPACE_KINDS:
        v = _read_int(os.path.join(proc, "sys/user", f"max_{kind}_namespaces"))
        if v is not None:
            out[f"max_{kind}_namespaces"] = v - NAMESPACE_RESERVE
    if os.path.isfile(os.path.join(sys_root, "fs/cgroup/memory/memory.limit_in_bytes")):
        # cgroup v1: memory cgroup ids are 16 bits (offline ones holding page cache count)
        out["v1_memory_cgroup_ids"] = V1_MEMCG_IDS - NAMESPACE_RESERVE
    for name, path in (("pid_max", "sys/kernel/pid_max"),
                       ("threads-max", "sys/kernel/threads-max")):
        v = _read_int(os.path.join(proc, path))
        if v is not None:
            out[name] = v - TASK_RESERVE
    return out


def derive(proc: str = "/proc", sys_root: str = "/sys") -> Limit:
    """The machine's admission limit and what bounds it."""
    b = bounds(proc, sys_root)
    if not b:
        return Limit(1000, "default")  # nothing readable: a modest limit
    name = min(b, key=lambda k: b[k])
    return Limit(max(1, b[name]), name)


class MemoryGuard:
    """Is there memory for one more sandbox? One read of /proc/meminfo per ``MEMINFO_TTL_S``."""

    def __init__(self, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._monotonic = monotonic
        total = meminfo_kib("MemTotal") or 0
        self.floor_kib = max(LOW_MEMORY_FLOOR_KIB, int(total * LOW_MEMORY_SHARE))
        self._checked_at = -MEMINFO_TTL_S
        self._available: int | None = None

    def available_kib(self) -> int | None:
        now = self._monotonic()
        if now - self._checked_at >= MEMINFO_TTL_S:
            self._available = meminfo_kib("MemAvailable")
            self._checked_at = now
        return self._available

    def low(self) -> bool:
        avail = self.available_kib()
        return avail is not None and avail < self.floor_kib
