"""Which CPUs each sandbox's cpuset holds: ceil(cpu) of the host's, the least assigned first.

A sandbox's CPU time is limited by its CFS quota (``cpu``); its cpuset makes the same limit
visible: ``nproc``, ``os.sched_getaffinity``, and (through lxcfs) /proc/cpuinfo, /proc/stat and
``os.cpu_count()`` show ceil(cpu) CPUs, so ``make -j$(nproc)`` starts as many jobs as the
sandbox can run. The trade-off: a sandbox runs only on its CPUs, so it cannot borrow an idle one
when its own are busy with other sandboxes; spreading by least-assigned count keeps the CPUs
evenly shared. A sandbox with ``cpu`` >= the host's count gets every CPU.
"""

from __future__ import annotations

import math
import threading


def cpulist(cpus: list[int]) -> str:
    return ",".join(str(c) for c in cpus)


class CpuPlacer:
    def __init__(self, cpus: list[int]) -> None:
        if not cpus:
            raise ValueError("no CPU to place sandboxes on")
        self.cpus = sorted(cpus)
        self.load = {c: 0 for c in self.cpus}
        self.held: dict[str, tuple[int, ...]] = {}
        self._lock = threading.Lock()

    def take(self, sandbox_id: str, cpu: float) -> str:
        """The cpulist for a sandbox of ``cpu`` cores (its earlier one if it holds one)."""
        want = min(len(self.cpus), max(1, math.ceil(cpu - 1e-9)))
        with self._lock:
            old = self.held.get(sandbox_id)
            if old is not None and len(old) == want:
                return cpulist(list(old))
            if old is not None:
                self._drop(old)
            chosen = tuple(sorted(sorted(self.cpus, key=lambda c: (self.load[c], c))[:want]))
            self._add(sandbox_id, chosen)
            return cpulist(list(chosen))

    def hold(self, sandbox_id: str, cpus: str | None) -> None:
        """Count a sandbox placed by an earlier daemon (re-adopted)."""
        if not cpus:
            return
        got = tuple(c for c in (int(x) for x in cpus.split(",") if x) if c in self.load)
        with self._lock:
            old = self.held.pop(sandbox_id, None)
            if old is not None:
                self._drop(old)
            self._add(sandbox_id, got)

    def release(self, sandbox_id: str) -> None:
        with self._lock:
            old = self.held.pop(sandbox_id, None)
            if old is not None:
                self._drop(old)

    def _add(self, sandbox_id: str, cpus: tuple[int, ...]) -> None:
        self.held[sandbox_id] = cpus
        for c in cpus:
            self.load[c] += 1

    def _drop(self, cpus: tuple[int, ...]) -> None:
        for c in cpus:
            self.load[c] -= 1
