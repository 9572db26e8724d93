"""Recycled v1 memory cgroups: spares kept for the next sandbox, and the drainer.

A memcg's mkdir + rmdir costs ~4 ms of CPU on a host that has ever mounted many superblocks
(its shrinker_info is sized by the most memcg-aware shrinkers, i.e. superblocks, ever alive at
once: ~7 MB of 1 KiB allocations per memcg after 50,000 sandboxes of 8 mounts each), against
~0.1 ms for the rename + limit writes of reuse. A removed memory cgroup with page cache stays
*dying* until the kernel evicts those pages; the drainer empties it first, off every caller's
path.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import itertools
import os
import threading
import time
from collections.abc import Callable

from .common import _read, _write, check_id

# Emptied v1 memory cgroups kept for the next sandbox (see MemcgRecycler.recycle).
MEMCG_SPARES = int(os.environ.get("CORRAL_MEMCG_SPARES", "16"))
_SPARE = ".spare-"  # never matches _ID_RE: list_ids and cleanup_orphans do not see spares
_COOLING = ".cooling-"
_DRAINING = ".drain-"  # removed memory cgroups with page cache, waiting for the drainer
COOL_S = 1.0
# At a stop, queued drains run for at most this long; the rest are removed undrained (they
# stay dying until the kernel evicts their pages).
DRAIN_AT_STOP_S = 10.0
# memory.stat fields (this cgroup's own) of charges that reclaim cannot drop while no task is
# left: tmpfs/shm pages (no swap here) and locked pages. A cgroup with any of these is never
# handed on; page cache and slab are (see settle).
_UNRECLAIMABLE = ("rss", "shmem", "unevictable", "swap")
# Usage counters that start again at 0 for the next tenant (limits are set at every reuse).
_MEM_RESETS = ("memory.max_usage_in_bytes", "memory.failcnt", "memory.memsw.max_usage_in_bytes",
               "memory.memsw.failcnt", "memory.kmem.max_usage_in_bytes", "memory.kmem.failcnt")


class MemcgRecycler:
    """The spares of one v1 memory hierarchy directory (``mem``: ours, <mount>/<name>)."""

    def __init__(self, mem: str, spares_max: int,
                 oom_kills_at: Callable[[str], int | None]) -> None:
        self.mem = mem
        self.spares_max = spares_max
        self._oom_kills_at = oom_kills_at
        # Whether memory+swap can be limited (swap accounting on) is fixed per host.
        memsw = os.path.exists(os.path.join(mem, "memory.memsw.limit_in_bytes"))
        self.usages = ["memory.usage_in_bytes"] + (
            ["memory.memsw.usage_in_bytes"] if memsw else [])
        self.resets = [f for f in _MEM_RESETS if os.path.exists(os.path.join(mem, f))]
        self.spares: list[str] = []
        self.cooling: list[tuple[float, str]] = []  # (since, path): not yet known uncharged
        self.lock = threading.Lock()
        self.seq = itertools.count()
        self.stats = {"reused": 0, "kept": 0, "kept_charged": 0, "discarded": 0,
                      "drained": 0}
        # Memory cgroups to drain and remove, off every caller's path (see remove).
        self.drain_q: collections.deque[str] = collections.deque()
        self.drain_cv = threading.Condition()
        self.drainer: threading.Thread | None = None
        self.closed = False  # at stop: nothing is kept any more

    def recycle(self, sandbox_id: str) -> bool:
        """Keep the sandbox's v1 memory cgroup for a later sandbox instead of removing it.
        Call once the sandbox's processes are gone and its files deleted. The cgroup is renamed
        out of the sandbox's name at once and becomes a spare as soon as what is still charged
        to it is only reclaimable (see settle): page cache of files its processes read first
        (host image, volumes), slab, per-cpu charge caches. Right after the exit, the tmpfs
        pages of its mounts may still be on their way out: it cools for up to COOL_S. Such a
        charge is not the tenant's data, and the next tenant's limit reclaims it. Removed, the
        cgroup would stay *dying* (the kernel keeps it, with its shrinker_info, until those
        pages are evicted: ~7 MB each on this host) for every sandbox that read a file no one
        had read before. A cgroup with unreclaimable charges (tmpfs pages of a host volume)
        is drained and removed. Usage peaks and fail counts are reset; limits are written at
        reuse. True if kept for now (or already gone, or removed here), False if the caller
        should remove it (a task is still in it)."""
        if not self.spares_max or self.closed:
            return False
        path = os.path.join(self.mem, check_id(sandbox_id))
        with self.lock:
            full = len(self.spares) + len(self.cooling) >= 2 * self.spares_max
        try:
            if _read(path + "/tasks").strip():
                self.stats["discarded"] += 1
                return False
            if full or self._oom_kills_at(path):
                # An OOM kill count cannot be reset: a cgroup that has one is not handed on,
                # so a sandbox's count is its own (see oom_kills), also after a restart.
                self.stats["discarded"] += 1
                return self.remove(path)
            dest = os.path.join(self.mem, f"{_COOLING}{next(self.seq)}")
            os.rename(path, dest)  # cgroup v1 renames within a parent
        except FileNotFoundError:
            return True  # never made (no exec) or already removed
        except OSError:
            self.stats["discarded"] += 1
            return False
        with self.lock:
            self.cooling.append((time.monotonic(), dest))
        self.settle()
        return True

    def _uncharged(self, path: str) -> bool:
        return all(_read(f"{path}/{f}").strip() == "0" for f in self.usages)

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

    def drain(self, path: str) -> None:
        """Reclaim the page cache charged to a task-less v1 memory cgroup
        (``memory.force_empty``), so that its rmdir frees it instead of leaving it dying
        until the kernel evicts those pages (slab charges do not keep it: they move to the
        parent). Best effort: force_empty walks the cgroup's shrinkers, ~50 ms of CPU on this
        host (see MEMCG_SPARES); tmpfs pages cannot be reclaimed without swap."""
        try:
            if self._page_cache(path) > 0:
                _write(path + "/memory.force_empty", "0")
                self.stats["drained"] += 1
        except (OSError, ValueError):
            pass

    def remove(self, path: str) -> bool:
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
            dest = os.path.join(self.mem, f"{_DRAINING}{next(self.seq)}")
            with self.drain_cv:
                if not self.closed:
                    try:
                        os.rename(path, dest)
                    except OSError:
                        pass
                    else:
                        self.drain_q.append(dest)
                        self._start_drainer()
                        self.drain_cv.notify()
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
        if self.drainer is None or not self.drainer.is_alive():
            self.drainer = threading.Thread(target=self._drain_loop, daemon=True,
                                             name="corral-memcg-drain")
            self.drainer.start()

    def _drain_loop(self) -> None:
        with contextlib.suppress(OSError):  # lowest CPU priority: work nobody waits for
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        while True:
            with self.drain_cv:
                while not self.drain_q and not self.closed:
                    self.drain_cv.wait()
                if not self.drain_q:
                    return
                path = self.drain_q.popleft()
            self.drain(path)
            with contextlib.suppress(OSError):
                os.rmdir(path)

    def finish_drains(self, deadline: float) -> None:
        """At a stop (``_closed`` set): the queued drains, until ``deadline``; then the rest
        are removed undrained."""
        with self.drain_cv:
            self.drain_cv.notify_all()
            drainer = self.drainer
        if drainer is not None:
            drainer.join(max(0.0, deadline - time.monotonic()))
        with self.drain_cv:
            rest, self.drain_q = list(self.drain_q), collections.deque()
        for path in rest:  # out of time: removed undrained
            with contextlib.suppress(OSError):
                os.rmdir(path)
        if drainer is not None:
            drainer.join(1.0)  # its last one (one drain): it then finds the queue empty

    def settle(self) -> None:
        """Cooling cgroups with nothing charged, or only reclaimable charges (page cache,
        slab), become spares; those with others (tmpfs pages) still after COOL_S are drained
        and removed."""
        now = time.monotonic()
        with self.lock:
            cooling, self.cooling = self.cooling, []
        keep: list[tuple[float, str]] = []
        for t, path in cooling:
            try:
                if _read(path + "/tasks").strip():
                    raise OSError(errno.EBUSY, "a task joined a cooling cgroup")
                clean = self._uncharged(path)
                if clean or self._reclaimable_only(path):
                    for f in self.resets:
                        _write(f"{path}/{f}", "0")
                    spare = os.path.join(self.mem, f"{_SPARE}{next(self.seq)}")
                    os.rename(path, spare)
                    with self.lock:
                        kept = not self.closed
                        if kept:
                            self.spares.append(spare)
                    if kept:
                        self.stats["kept"] += 1
                        if not clean:
                            self.stats["kept_charged"] += 1
                        continue
                    path = spare  # closed meanwhile: removed below
                elif now - t < COOL_S:  # tmpfs pages of the sandbox's mounts, still freeing
                    keep.append((t, path))
                    continue
            except OSError:
                pass
            self.stats["discarded"] += 1
            self.remove(path)
        with self.lock:
            if not self.closed:
                self.cooling[:0] = keep
                keep = []
        # drop_spares ran while this settle held some (a worker thread still running at
        # stop): they are removed here, or they would outlive the daemon.
        for _, path in keep:
            self.remove(path)

    def ready(self) -> bool:
        """Is a recycled memory cgroup ready (making one costs ~nothing then)?"""
        if self.spares_max and not self.spares and self.cooling:
            self.settle()
        return bool(self.spares)

    def take(self, path: str) -> bool:
        """Rename a spare memory cgroup to ``path`` (True), or False if there is none."""
        if self.spares_max and not self.spares and self.cooling:
            self.settle()
        while True:
            with self.lock:
                if not self.spares:
                    return False
                spare = self.spares.pop()
            try:
                os.rename(spare, path)
            except FileExistsError:
                with self.lock:
                    self.spares.append(spare)
                raise
            except OSError:
                continue  # removed behind our back: try the next one
            self.stats["reused"] += 1
            return True
