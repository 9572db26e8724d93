"""Warm pools: sandboxes made ahead of demand, so a create that matches takes a ready one.

A pool is keyed by what is fixed when a sandbox is made: (substrate, image, cpu, memory_mb,
pids, network, disk_mb). Everything else in a spec is applied when a sandbox is taken, so a pooled
sandbox is indistinguishable from a fresh one:

* its id is drawn at random when it is made and nobody sees it before the take; the hostname
  defaults to the id, as for a fresh one (specs with an explicit ``hostname``, and sandboxes
  started from a snapshot, are not pooled);
* ``created_at``, the TTL and the idle clock start at the take; labels, metadata, env and cwd
  live in the engine's record, written at the take;
* nothing has ever run in it (only its init), its upper dir is empty;
* a networked one (``internet`` or a policy, any group) comes from one pool per limits: it
  is made with its link and a policy that allows nothing, and the take gives it the
  create's policy and group (``Substrate.claim``) before anything runs in it.

Sizing: every create that could use a pool counts as demand for its key; each tick the pool's
target is about ``CORRAL_POOL_LEAD_S`` seconds of the recent create rate (EWMA), at least the
static size configured for its image, at most ``CORRAL_POOL_MAX_PER_KEY``; all pools together
hold at most ``CORRAL_POOL_MAX`` and never take the daemon past its capacity. A pool nobody
asked for in ``CORRAL_POOL_IDLE_S`` shrinks to its static size. Refills run in worker threads
(the Rust core releases the GIL), off the event loop.

Refills wait for the first command: a sandbox just taken from a pool is about to run its
first exec, the call a user waits on most. A refill is seconds of nothing to the pool but
milliseconds of kernel work (namespaces, mounts, cgroups) that this kernel does not preempt
(PREEMPT_NONE: a woken task waits for a busy core's syscall to end), so a refill started by
the take runs over that exec and slows it (measured at the daemon: 2.46 ms, against 1.25
with no refill running). New refills therefore start once every sandbox taken in the last
``CORRAL_POOL_DEFER_MS`` has finished its first exec (or been killed, or the time has
passed), unless the pool is low (at most a quarter of its target ready): then at once, so a
burst never finds it empty. Takes are newest first: the sandbox made last is the one whose
kernel state is still in the caches.

Never leaked: pooled sandboxes have a directory and cgroups but no ``meta.json``, so after a
crash recovery treats them as half-made and ``cleanup_orphans`` removes them; a graceful stop
destroys them; a pooled sandbox whose init died is destroyed when found, never handed out.

Configuration (environment; see docs/daemon.md "Warm pools"):
  CORRAL_POOL            "auto" (default: demand-sized pools for every key asked for),
                         "off" (no pools), or "static" (only the sizes below)
  CORRAL_POOL_SIZES      static sizes for the default limits of an image: "host:8,myimg:4"
  CORRAL_POOL_MAX        all pooled sandboxes together (default 256)
  CORRAL_POOL_MAX_PER_KEY  one pool (default 128)
  CORRAL_POOL_LEAD_S     seconds of demand kept ready (default 0.5)
  CORRAL_POOL_IDLE_S     an unused auto pool empties after this (default 60)
  CORRAL_POOL_WORKERS    refills in flight (default: CPU count, at most 4)
  CORRAL_POOL_DEFER_MS   how long a take holds back new refills waiting for the sandbox's
                         first exec (default 10; 0: refill at once)
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from corral.daemon import removal
from corral.daemon.substrates.base import SandboxRuntime, Substrate
from corral.errors import CorralError
from corral.models import NetworkPolicy, SandboxSpec, network_kind

log = logging.getLogger("corral.pools")

Key = tuple[str, str, float, int, int, str, int]
TICK_S = 0.25
EWMA = 0.3


NETWORKED = "networked"  # the network part of a key shared by every networked spec


def pool_spec(spec: SandboxSpec) -> SandboxSpec:
    """What a pool for ``spec`` makes: its key's fields; a networked one with a policy that
    allows nothing (the take applies the create's policy and group)."""
    networked = network_kind(spec.network) in ("internet", "policy")
    return SandboxSpec(image=spec.image, substrate=spec.substrate, cpu=spec.cpu,
                       memory_mb=spec.memory_mb, pids=spec.pids,
                       network=NetworkPolicy() if networked else spec.network,
                       disk_mb=spec.disk_mb)


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


@dataclass
class PoolConfig:
    mode: str = "auto"                       # auto | static | off
    sizes: dict[str, int] = field(default_factory=dict)
    max_total: int = 256
    max_per_key: int = 128
    lead_s: float = 0.5
    idle_s: float = 60.0
    workers: int = 2
    defer_s: float = 0.01

    @classmethod
    def from_env(cls) -> PoolConfig:
        mode = os.environ.get("CORRAL_POOL", "auto").strip().lower() or "auto"
        if mode in ("0", "false", "no", "none", "disabled"):
            mode = "off"
        if mode not in ("auto", "static", "off"):
            log.warning("unknown CORRAL_POOL, using auto", extra={"value": mode})
            mode = "auto"
        sizes: dict[str, int] = {}
        for item in os.environ.get("CORRAL_POOL_SIZES", "").replace(" ", "").split(","):
            if not item:
                continue
            name, _, n = item.rpartition(":")
            try:
                sizes[name or item] = max(0, int(n)) if name else 1
            except ValueError:
                log.warning("bad CORRAL_POOL_SIZES item", extra={"item": item})
        return cls(mode=mode, sizes=sizes,
                   max_total=max(0, _env_int("CORRAL_POOL_MAX", 256)),
                   max_per_key=max(0, _env_int("CORRAL_POOL_MAX_PER_KEY", 128)),
                   lead_s=max(0.0, _env_float("CORRAL_POOL_LEAD_S", 0.5)),
                   idle_s=max(0.0, _env_float("CORRAL_POOL_IDLE_S", 60.0)),
                   workers=max(1, _env_int("CORRAL_POOL_WORKERS",
                                           min(4, os.cpu_count() or 2))),
                   defer_s=max(0.0, _env_float("CORRAL_POOL_DEFER_MS", 10.0)) / 1000.0)


def _same_content(a: Any, b: Any) -> bool:
    """Whether two records of an image make the same sandboxes: its layers and its config. An
    OCI image's layers are named by their content (a pull of the same content again is the
    same image, whenever it was recorded); a rootfs image's tree keeps its path when it is
    replaced, so for it the record's time tells."""
    same = bool(a.overlays == b.overlays and a.config == b.config)
    if getattr(a, "kind", None) != "oci" or getattr(b, "kind", None) != "oci":
        same = same and a.created_at == b.created_at
    return same


class _Pool:
    __slots__ = ("key", "spec", "image", "ready", "making", "static", "demand", "requests",
                 "last_use")

    def __init__(self, key: Key, spec: SandboxSpec, image: Any, static: int) -> None:
        self.key = key
        self.spec = spec
        self.image = image
        self.ready: collections.deque[SandboxRuntime] = collections.deque()
        self.making = 0
        self.static = static
        self.demand = 0.0          # creates per second (EWMA)
        self.requests = 0          # creates since the last tick
        self.last_use = time.monotonic()


class WarmPools:
    def __init__(self, config: PoolConfig, substrates: dict[str, Substrate], images: Any,
                 sandboxes_dir: str, room: Callable[[], int],
                 new_id: Callable[[], str]) -> None:
        self.config = config
        self.substrates = substrates
        self.images = images
        self.sandboxes_dir = sandboxes_dir
        self.room = room                 # how many more sandboxes the daemon may hold
        self.new_id = new_id
        self.pools: dict[Key, _Pool] = {}
        self.hits = 0
        self.misses = 0
        self.failures = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._inflight: set[asyncio.Task[Any]] = set()
        # Sandboxes taken and not yet through their first exec: id -> monotonic deadline.
        self._fresh: dict[str, float] = {}
        self._closed = False
        if config.mode != "off":
            for name, n in config.sizes.items():
                if n > 0:
                    self._pool_for(SandboxSpec(image=name), static=n)

    # ---- keys -------------------------------------------------------------------------------
    def key(self, spec: SandboxSpec) -> Key | None:
        if self.config.mode == "off" or spec.hostname is not None:
            return None
        if getattr(spec, "snapshot", None) is not None or spec.layers:
            return None  # made of a snapshot's or of its own layers; a pool's, of the image
        networked = network_kind(spec.network) in ("internet", "policy")
        if spec.bandwidth_mbit is not None or (spec.network_group and not networked):
            return None  # a shaped link is made with the sandbox
        sub = self.substrates.get(spec.substrate)
        if sub is None or not sub.capabilities.warm_pool:
            return None
        # Networked sandboxes share one pool whatever their policy or group: it makes them
        # with no egress at all, and the take applies the create's (Substrate.claim).
        return (spec.substrate, spec.image, float(spec.cpu), int(spec.memory_mb),
                int(spec.pids), NETWORKED if networked else str(spec.network),
                int(spec.disk_mb))

    def _pool_for(self, spec: SandboxSpec, static: int = 0) -> _Pool | None:
        key = self.key(spec)
        if key is None:
            return None
        pool = self.pools.get(key)
        if pool is None:
            image = self.images.get(spec.image) if self.images is not None else None
            if image is None:
                return None
            pool = self.pools[key] = _Pool(key, pool_spec(spec), image, static)
        return pool

    @property
    def ready_total(self) -> int:
        return sum(len(p.ready) for p in self.pools.values())

    def by_image(self) -> dict[tuple[str, str], tuple[int, int]]:
        """(substrate, image) -> (ready, being made), summed over the limits: /metrics."""
        out: dict[tuple[str, str], tuple[int, int]] = {}
        for p in self.pools.values():
            k = (str(p.key[0]), str(p.key[1]))
            ready, making = out.get(k, (0, 0))
            out[k] = (ready + len(p.ready), making + p.making)
        return out

    @property
    def held_total(self) -> int:
        return sum(len(p.ready) + p.making for p in self.pools.values())

    # ---- take -------------------------------------------------------------------------------
    def take(self, spec: SandboxSpec, count: int = 1) -> SandboxRuntime | None:
        """A ready sandbox for ``spec`` (its id is ``runtime.sandbox_id``), or None. ``count``:
        how many creates this stands for (demand accounting of a batch, counted once)."""
        if self._closed or self.config.mode == "off":
            return None
        key = self.key(spec)
        if key is None:
            return None
        pool = self.pools.get(key)
        if pool is None:
            if self.config.mode != "auto":
                return None
            pool = self._pool_for(spec)
            if pool is None:
                return None
        pool.requests += count
        pool.last_use = time.monotonic()
        substrate = self.substrates[key[0]]
        if not self._current(key, pool):
            self.misses += 1
            return None
        while pool.ready:
            rt = pool.ready.pop()  # newest first: its kernel state is the warmest
            if substrate.is_alive(rt):
                self.hits += 1
                if self.config.defer_s:
                    self._fresh[rt.sandbox_id] = time.monotonic() + self.config.defer_s
                self._wake.set()
                return rt
            log.warning("pooled sandbox died; discarded", extra={"sandbox": rt.sandbox_id})
            self._spawn(self._discard(substrate, rt))
        self.misses += 1
        self._wake.set()
        return None

    def settled(self, sandbox_id: str) -> None:
        """A taken sandbox's first exec ended (or it is gone): refills need not wait for it."""
        if self._fresh.pop(sandbox_id, None) is not None and not self._fresh:
            self._wake.set()

    def _deferred_until(self, now: float) -> float | None:
        """The latest deadline of the takes still waiting for their first exec, or None."""
        if not self._fresh:
            return None
        for sid in [s for s, d in self._fresh.items() if d <= now]:
            del self._fresh[sid]
        return max(self._fresh.values(), default=None)

    # ---- refill -----------------------------------------------------------------------------
    def start(self) -> None:
        if self.config.mode != "off" and self._task is None:
            self._task = asyncio.create_task(self._run())

    def _target(self, pool: _Pool, now: float) -> int:
        if self.config.mode == "auto" and now - pool.last_use <= self.config.idle_s:
            want = math.ceil(pool.demand * self.config.lead_s)
            if pool.demand > 0 or pool.requests:  # requests: asked since the last tick
                want = max(want, 2)
        else:
            want = 0
        return min(self.config.max_per_key, max(pool.static, want))

    async def _run(self) -> None:
        last = time.monotonic()
        wait = TICK_S
        while not self._closed:
            try:
                await asyncio.wait_for(self._wake.wait(), wait)
            except asyncio.TimeoutError:
                pass
            if self._closed:  # a close() racing a wake-up: wait_for may not raise the cancel
                return
            self._wake.clear()
            now = time.monotonic()
            if now - last >= TICK_S:
                dt, last = now - last, now
                for pool in self.pools.values():
                    pool.demand = (1 - EWMA) * pool.demand + EWMA * pool.requests / dt
                    pool.requests = 0
            wait = TICK_S
            try:
                until = self._plan(now)
                if until is not None:  # refills held back: look again when the hold ends
                    wait = min(TICK_S, max(0.0005, until - now))
            except Exception:  # noqa: BLE001 - the pool must survive anything
                log.exception("warm pool planning failed")

    def _plan(self, now: float) -> float | None:
        """Start the refills and shrinks due; the time refills held back (see the module
        doc: first execs) may start, if any were."""
        budget = min(self.config.max_total - self.held_total, self.room() - self.held_total)
        until = self._deferred_until(now)
        held = None
        for key, pool in list(self.pools.items()):
            target = self._target(pool, now)
            have = len(pool.ready) + pool.making
            if until is not None and have < target and len(pool.ready) > target // 4:
                held = until  # not low: wait for the first execs
                have = target
            while have < target and budget > 0 and len(self._inflight) < self.config.workers:
                self._spawn(self._make(pool))
                have += 1
                budget -= 1
            # Shrink slowly (a few per tick): demand often comes back. Oldest first (takes
            # are newest first).
            extra = len(pool.ready) - target
            for _ in range(min(extra, 4)):
                rt = pool.ready.popleft()
                self._spawn(self._discard(self.substrates[key[0]], rt))
            if target == 0 and not pool.ready and not pool.making and pool.static == 0:
                del self.pools[key]
        return held

    def _current(self, key: Key, pool: _Pool) -> bool:
        """Whether ``pool`` still makes what its image's name stands for. A name can be given
        to other content (a pull of a moved tag, a commit or build that replaces it): the
        pool's ready sandboxes of the old content are discarded and it refills with the new
        (28 creates in 30 s after a replace all got the old files); a name that is gone
        takes its pool with it."""
        if self.images is None:
            return True
        try:
            current = self.images.get(pool.spec.image)
        except CorralError:
            current = None
        if current is not None and _same_content(current, pool.image):
            return True
        for rt in list(pool.ready):
            self._spawn(self._discard(self.substrates[key[0]], rt))
        pool.ready.clear()
        if current is None:
            if pool.static == 0:  # a static pool stays, empty, for its name to come back
                del self.pools[key]
        else:
            pool.image = current
        self._wake.set()
        return False

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    async def _make(self, pool: _Pool) -> None:
        substrate = self.substrates[pool.key[0]]
        sid = self.new_id()
        sdir = os.path.join(self.sandboxes_dir, sid)
        pool.making += 1
        image = pool.image

        def work() -> SandboxRuntime:
            os.mkdir(sdir, 0o700)
            try:
                rt = substrate.create(sid, pool.spec, image)
            except BaseException:
                removal.remove_or_quarantine(sdir)
                raise
            try:
                substrate.warm(rt)  # e.g. cgroups a cold sandbox makes at its first exec
            except BaseException:
                substrate.destroy(rt)
                removal.remove_or_quarantine(sdir)
                raise
            return rt

        try:
            rt = await asyncio.to_thread(work)
        except Exception as e:  # noqa: BLE001 - out of resources, image gone ...: back off
            self.failures += 1
            log.warning("warm pool refill failed", extra={"image": pool.spec.image,
                                                          "error": str(e)[:300]})
            await asyncio.sleep(1.0)
            return
        finally:
            pool.making -= 1
            self._wake.set()
        if self._closed or self.pools.get(pool.key) is not pool or pool.image is not image:
            await self._discard(substrate, rt)  # the pool is gone, or its image's content
            return
        pool.ready.append(rt)

    async def _discard(self, substrate: Substrate, rt: SandboxRuntime) -> None:
        sdir = os.path.join(self.sandboxes_dir, rt.sandbox_id)

        def work() -> None:
            try:
                substrate.destroy(rt)
            finally:
                removal.remove_or_quarantine(sdir)

        try:
            await asyncio.to_thread(work)
        except Exception:  # noqa: BLE001
            log.exception("destroy of a pooled sandbox failed", extra={"sandbox": rt.sandbox_id})

    # ---- stop -------------------------------------------------------------------------------
    async def close(self) -> None:
        """Stop refilling and destroy every pooled sandbox (graceful stop)."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            self._task = None
        while self._inflight:  # refills and discards under way (each is tracked there)
            await asyncio.gather(*list(self._inflight), return_exceptions=True)
        rts = [(p.key[0], rt) for p in self.pools.values() for rt in p.ready]
        for p in self.pools.values():
            p.ready.clear()
        if rts:
            await asyncio.gather(*(self._discard(self.substrates[s], rt) for s, rt in rts),
                                 return_exceptions=True)

    def close_now(self) -> None:
        """Synchronous close (the daemon stops without destroying its sandboxes): pooled ones
        have no record, so the next start would clean them anyway; destroy them now so
        nothing lingers if there is no next start."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            self._task = None
        for p in self.pools.values():
            while p.ready:
                rt = p.ready.popleft()
                try:
                    self.substrates[p.key[0]].destroy(rt)
                except Exception:  # noqa: BLE001
                    log.exception("destroy of a pooled sandbox failed")
                removal.remove_or_quarantine(os.path.join(self.sandboxes_dir, rt.sandbox_id))

    def stats(self) -> dict[str, int]:
        return {"pool_ready": self.ready_total, "pool_hits": self.hits,
                "pool_misses": self.misses, "pool_failures": self.failures}
