"""Sandboxes that thrash at their memory limit are OOM-killed, as a real kernel would have.

The kernel's memory-cgroup OOM killer runs only when reclaim makes no progress. Pages of files a
sandbox was the first to read (an image's programs and libraries) are charged to its memory
cgroup, and they can always be reclaimed: at its limit with only those left to give, a sandbox
evicts its own programs' text, faults it back in, evicts it again, and the kernel never calls
that "out of memory". Measured here: 20 Python hogs in a 32 MiB sandbox, the interpreter read
first by that sandbox, four OOM kills in 2.5 s and then nothing: two minutes of thrashing, until
the command's timeout.

v1 has no per-cgroup pressure stall information, so the watcher reads what v1 counts: every
``TICK_S`` the parent's hierarchical major-fault count (one read); when it moved, each sandbox
memory cgroup's own ``memory.stat``. A sandbox is thrashing when, over the last ``WINDOW_S``, it
stayed at its limit, refaulted pages it had evicted recently (``workingset_refault``) at least
``REFAULT_FRACTION`` of its limit per second (at most ``REFAULT_CAP``), and took at least
``MAJFAULTS_PER_S`` major faults a second: it keeps losing and re-reading mapped pages. Reading
a file larger than the limit over and over (``read``, no faults) or starting a large program
once (faults, no refaults) is not thrashing. The watcher then kills the processes the kernel
would have chosen (the highest ``oom_score``; never the sandbox's init) and counts each as an
OOM kill of that sandbox, so the command's result says ``oom_killed`` and an ended sandbox's
cause is ``oom`` (category ``limit``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable

log = logging.getLogger("corral.thrash")

TICK_S = 0.25
WINDOW_S = 1.0
REFAULT_FRACTION = 0.5   # of the limit, per second,
REFAULT_CAP = 64 << 20   # or this many bytes a second (a large sandbox re-reads no faster)
MAJFAULTS_PER_S = 50
FREE_FRACTION = 0.25     # of the limit, in anonymous memory of the processes killed
AT_LIMIT_SLACK = 1 << 20  # usage within this of the limit counts as at the limit
# Sandboxes sampled per tick besides those already at their limit, round robin: a sandbox that
# keeps faulting cannot make the watcher read every memory cgroup of the host four times a
# second (at 5,000 sandboxes one is first looked at within 5 s, then every tick).
SCAN_PER_TICK = 256
_STAT_KEYS = ("workingset_refault_anon", "workingset_refault_file", "pgmajfault")


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _stat(path: str) -> dict[str, int]:
    out = {}
    for line in _read(os.path.join(path, "memory.stat")).splitlines():
        k, _, v = line.partition(" ")
        if k in _STAT_KEYS or k == "total_pgmajfault":
            out[k] = int(v)
    return out


class _Track:
    __slots__ = ("samples", "quiet_until")

    def __init__(self) -> None:
        self.samples: deque[tuple[float, int, int, bool]] = deque()  # t, refaults, majf, full
        self.quiet_until = 0.0


class ThrashWatcher:
    """One thread per daemon over the v1 memory cgroups below ``mem_base``; ``on_kill(id)``
    is called for each process it kills (the sandbox's OOM kill count)."""

    def __init__(self, mem_base: str, is_sandbox: Callable[[str], bool],
                 on_kill: Callable[[str], None]) -> None:
        self.base = mem_base
        self._is_sandbox = is_sandbox  # name -> bool
        self._on_kill = on_kill
        self._tracks: dict[str, _Track] = {}
        self._last_total: int | None = None
        self._cursor = 0
        self._hot_until = 0.0
        self._stop = threading.Event()
        self.kills = 0
        self._thread = threading.Thread(target=self._run, name="corral-thrash", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2.0)

    def _run(self) -> None:
        while not self._stop.wait(TICK_S):
            try:
                self.tick(time.monotonic())
            except Exception:  # noqa: BLE001 - never let the watcher die
                log.exception("thrash watcher tick failed")

    def tick(self, now: float) -> None:
        try:
            total = _stat(self.base).get("total_pgmajfault", 0)
        except OSError:
            return
        moved = self._last_total is not None and total > self._last_total
        self._last_total = total
        if moved:
            self._hot_until = now + 2 * WINDOW_S
        if now > self._hot_until:
            self._tracks.clear()  # nothing faulting anywhere: nothing to watch
            return
        with os.scandir(self.base) as it:
            names = sorted(e.name for e in it
                           if e.is_dir(follow_symlinks=False) and self._is_sandbox(e.name))
        present = set(names)
        for name in list(self._tracks):
            if name not in present:
                del self._tracks[name]
        hot = [n for n, tr in self._tracks.items() if tr.samples and tr.samples[-1][3]]
        rest = [n for n in names if n not in set(hot)]
        if len(rest) > SCAN_PER_TICK:
            start = self._cursor % len(rest)
            self._cursor = start + SCAN_PER_TICK
            rest = (rest + rest)[start:start + SCAN_PER_TICK]
        for name in hot + rest:
            self._sample(name, now)

    def _sample(self, name: str, now: float) -> None:
        path = os.path.join(self.base, name)
        try:
            st = _stat(path)
            limit = int(_read(os.path.join(path, "memory.limit_in_bytes")))
            usage = int(_read(os.path.join(path, "memory.usage_in_bytes")))
        except (OSError, ValueError):
            return
        tr = self._tracks.setdefault(name, _Track())
        refaults = st.get("workingset_refault_anon", 0) + st.get("workingset_refault_file", 0)
        tr.samples.append((now, refaults, st.get("pgmajfault", 0),
                           usage + AT_LIMIT_SLACK >= limit))
        while tr.samples and now - tr.samples[0][0] > WINDOW_S + TICK_S / 2:
            tr.samples.popleft()
        t0, r0, m0, _ = tr.samples[0]
        span = now - t0
        if span < WINDOW_S - TICK_S / 2 or now < tr.quiet_until:
            return
        if not all(full for *_, full in tr.samples):
            return
        pages = min(REFAULT_FRACTION * limit, REFAULT_CAP) / 4096
        if (refaults - r0) / span >= pages and \
                (st.get("pgmajfault", 0) - m0) / span >= MAJFAULTS_PER_S:
            if self._kill_one(path, name, limit):
                # The next decision on fresh evidence: half a window after the kill.
                tr.quiet_until = now + WINDOW_S / 2
                while tr.samples and tr.samples[0][0] < now:
                    tr.samples.popleft()

    def _kill_one(self, path: str, name: str, limit: int) -> bool:
        """SIGKILL the sandbox's processes with the highest oom_score (never its init), as
        many as hold ``FREE_FRACTION`` of the limit in anonymous memory (at least one): one
        kill at a time, each after a new window, would leave the rest thrashing meanwhile."""
        try:
            pids = [int(x) for x in _read(os.path.join(path, "cgroup.procs")).split()]
        except (OSError, ValueError):
            return False
        ranked = []
        for pid in pids:
            try:
                status = _read(f"/proc/{pid}/status")
                score = int(_read(f"/proc/{pid}/oom_score"))
            except (OSError, ValueError):
                continue
            fields = dict(ln.split(":", 1) for ln in status.splitlines() if ":" in ln)
            if fields.get("NSpid", "").split()[-1:] == ["1"]:
                continue  # the sandbox's init: its end is the sandbox's
            anon = int((fields.get("RssAnon", "0 kB").split() or ["0"])[0]) * 1024
            ranked.append((score, anon, pid))
        ranked.sort(reverse=True)
        freed, killed = 0, 0
        for _, anon, pid in ranked:
            if killed and freed >= FREE_FRACTION * limit:
                break
            if self._kill(path, pid, name):
                freed += anon
                killed += 1
                self.kills += 1
        if killed:
            log.warning("thrashing at its memory limit: processes killed",
                        extra={"sandbox": name, "killed": killed})
        return killed > 0

    def _kill(self, path: str, pid: int, name: str) -> bool:
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return False
        try:
            # The pid was read before the pidfd pinned it: still in this sandbox's cgroup?
            if str(pid) not in _read(os.path.join(path, "cgroup.procs")).split():
                return False
            # Counted before the kill: whoever sees the process end must see the count.
            with contextlib.suppress(Exception):
                self._on_kill(name)
            signal.pidfd_send_signal(fd, signal.SIGKILL)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)
