"""The engine: the sandboxes' registry and lifecycle (create, liveness, reaper, destroy,
pause), with exec, files, snapshots and recovery mixed in from their modules."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import heapq
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from corral import __version__
from corral.config import Config
from corral.daemon import (
    capacity,
    filethreads,
    listing,
    oserrors,
    outputmem,
    persist,
    removal,
    snapshots,
)
from corral.daemon.clock import REAL, Clock
from corral.daemon.oci.ref import looks_like_ref
from corral.daemon.outputmem import OutputMemory
from corral.daemon.substrates import registry
from corral.daemon.substrates.base import (
    Capabilities,
    NetworkControl,
    PauseHeldOff,
    SandboxRuntime,
    Substrate,
)
from corral.daemon.tenants import TENANT_LABEL
from corral.daemon.trajlog import TrajLog
from corral.errors import (
    CapacityExceeded,
    CorralError,
    DaemonRestarted,
    ImageNotFound,
    InternalError,
    InvalidNetwork,
    InvalidRequest,
    SandboxAtLimit,
    SandboxCrashed,
    SandboxExpired,
    SandboxKilled,
    SandboxLost,
    SandboxNotFound,
    SandboxNotRunning,
    Unsupported,
)
from corral.models import SandboxSpec, network_kind

from .base import (
    _CAUSE_TEXT,
    _REASON_TEXT,
    CREATE_WORKERS,
    DESTROY_THREADS,
    LOST_CAUSES,
    TOMBSTONES,
    Sandbox,
    _any_record,
    _settle,
    by_operator,
    log,
    new_id,
)
from .committing import CommitOps
from .execs import ExecOps
from .files import FileOps
from .quota import LabelQuota
from .recovery import Recovery
from .snapshotting import SnapshotOps


class Engine(ExecOps, FileOps, SnapshotOps, CommitOps, Recovery):
    def __init__(self, config: Config, *, substrates: Sequence[str] | None = None,
                 images: Any = None, clock: Clock = REAL) -> None:
        """``substrates``: the registered substrates to serve (default: the registry's
        defaults); made at start (corral.daemon.substrates.registry). ``clock``: what every
        TTL, idle timeout, reaper pass and log time is read from (corral.daemon.clock)."""
        if config.max_sandboxes <= 0:  # not configured: what this machine holds
            limit = capacity.derive()
            config = dataclasses.replace(config, max_sandboxes=limit.count,
                                         capacity_bound_by=limit.bound_by)
        self.config = config
        self.clock = clock
        Sandbox.node = config.node_id or None
        self.sandboxes: dict[str, Sandbox] = {}
        # Live sandboxes per tenant, each at most its quota (set_tenant_quota; none by default).
        self.quota = LabelQuota(TENANT_LABEL, lambda tenant: None)
        self.listing = listing.ListOrder()
        # Memory for commands' output past each stream's first 64 KiB; past it, spill files.
        self.output_memory = OutputMemory(
            config.output_memory_mb << 20 if config.output_memory_mb > 0
            else outputmem.default_limit(),
            config.state_dir,
            config.output_disk_mb << 20 if config.output_disk_mb > 0
            else outputmem.default_disk_limit(config.state_dir))
        # refuses creates while the host is short of memory
        self.memory = capacity.MemoryGuard(clock.monotonic)
        self.tombstones: OrderedDict[str, str] = OrderedDict()
        # The tenant of an ended sandbox with a tombstone (corral.daemon.tenants).
        self.ended_tenants: dict[str, str] = {}
        self.causes: dict[str, dict[str, Any]] = {}  # tombstoned "crashed" ids: the cause
        self.substrate_names = list(substrates) if substrates is not None \
            else registry.defaults()
        self.substrates: dict[str, Substrate] = {}
        self.images = images
        # Substrates asked for that this host cannot run, with why (registry.Unavailable).
        self.unavailable: dict[str, str] = {}
        # Host-wide resources the substrates made (registry.Context.shared).
        self.shared: dict[str, Any] = {}
        self.sandboxes_dir = os.path.join(config.state_dir, "sandboxes")
        self.started_at = self.clock.time()
        self.shutting_down = False
        self._shutdown_ended: list[str] = []  # see _save_shutdown_tombstones
        self.counters: dict[str, int] = {
            "created": 0, "create_failed": 0, "execs": 0, "exec_timeouts": 0, "lost": 0,
            "crashed": 0,
            "expired": 0, "idle_timeout": 0, "killed": 0, "operator_killed": 0, "adopted": 0,
            "orphans_removed": 0,
            "snapshots": 0, "snapshots_exported": 0, "snapshots_imported": 0,
        }
        self._heap: list[tuple[float, str]] = []
        # Background work kept referenced: batch destroys, spare layer dirs.
        self._batch_tasks: set[asyncio.Future[None]] = set()
        self.pools: Any = None  # corral.daemon.pools.WarmPools, made at start
        self._reaper: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.snaps: snapshots.SnapshotStore | None = None
        self.trajlog = TrajLog(config.state_dir, enabled=config.trajlog,
                               retention_s=config.log_retention_s,
                               output_cap=config.trajlog_output_cap, sync=config.trajlog_sync,
                               flush_ms=config.trajlog_flush_ms,
                               start_ms=config.trajlog_start_ms, clock=clock)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        os.makedirs(self.sandboxes_dir, mode=0o700, exist_ok=True)
        await self._make_substrates()
        self.snaps = snapshots.SnapshotStore(self.config.state_dir,
                                             self.config.snapshot_max_bytes,
                                             self.config.snapshot_max_entries)
        await asyncio.to_thread(self.snaps.load)
        # Image layers that are snapshot parts hold them too (one store for what they share).
        self.snaps.acquire(await asyncio.to_thread(self.images.shared_snapshot_parts))
        self.trajlog.open(self._loop)
        self._load_shutdown_tombstones()
        self._recover()
        await self._restore_exposed()
        self.snaps.collect()
        self._catch_init_exits()
        self._reaper = asyncio.create_task(self._reap_loop())
        from corral.daemon.pools import PoolConfig, WarmPools

        self.pools = WarmPools(PoolConfig.from_env(), self.substrates, self.images,
                               self.sandboxes_dir, new_id=new_id,
                               room=lambda: self.config.max_sandboxes - len(self.sandboxes))
        self.pools.start()

    def _catch_init_exits(self) -> None:
        """Substrates that can learn about dead inits without an fd per sandbox do so (the
        daemon's fd table then does not grow with the sandboxes; Substrate.watch_exits);
        sandboxes made before (re-adopted) keep their pidfd."""
        assert self._loop is not None
        for sub in self.substrates.values():
            sub.watch_exits(self._loop, self._inits_died)

    def _inits_died(self, ids: list[str]) -> None:
        for sid in ids:
            sb = self.sandboxes.get(sid)
            if sb is not None and sb.state in ("running", "paused"):
                self._lose(sb)

    async def _make_substrates(self) -> None:
        if self.images is None:
            from corral.daemon.images import ImageStore

            c = self.config
            self.images = ImageStore(c.state_dir, c.image_max_bytes, c.image_max_files,
                                     frozenset(c.insecure_registries),
                                     frozenset(c.registries), erofs=c.image_layers != "dir")
        if self.disk is not None:  # pulls and imports stop short of the disk's reserve
            self.images.disk_check = self.disk.check
        await asyncio.to_thread(self.images.ensure_host)
        ctx = registry.Context(self.config, self.images, self.shared)
        self.substrates = registry.build(self.substrate_names, ctx, self.unavailable)
        # A pull reaches no address a sandbox may never reach (the live list included).
        self.images.egress.blocked_source = self._blocked_addresses

    def _blocked_addresses(self) -> list[str]:
        net = self._networking()
        if net is None:  # no networked substrate: the settings' list still holds for pulls
            return os.environ.get("CORRAL_NET_BLOCKED", "").replace(",", " ").split()
        b = net.blocked()
        return [*b["configured"], *b["live"]]

    def close(self) -> None:
        """Stop the reaper and watchers, leave every sandbox running (re-adopted next start)."""
        if self._reaper:
            self._reaper.cancel()
        if self.pools is not None:
            self.pools.close_now()
        for sb in self.sandboxes.values():
            if sb.state in ("running", "paused"):
                self._unwatch(sb)
        # A start that failed with no sandbox to keep (none re-adopted, no record on disk not
        # yet looked at) leaves nothing of the substrates on the host (Substrate.close retire).
        # With sandboxes to keep, everything stays for the next start.
        retire = not self.sandboxes and not _any_record(self.sandboxes_dir)
        for substrate in self.substrates.values():
            try:
                substrate.close(retire=retire)
            except Exception:  # noqa: BLE001
                log.exception("substrate close failed", extra={"substrate": substrate.name})
        self.trajlog.close()
        if self.snaps is not None:
            self.snaps.close()

    async def shutdown(self) -> None:
        """Destroy every sandbox (graceful stop)."""
        self.shutting_down = True
        if self._reaper:
            self._reaper.cancel()
        if self.pools is not None:
            await self.pools.close()
        self._save_shutdown_tombstones()
        stops = [self._begin_stop(sb, "shutdown") for sb in list(self.sandboxes.values())]
        if stops:
            log.info("destroying sandboxes", extra={"count": len(stops)})
            await asyncio.gather(*stops, return_exceptions=True)
        for substrate in self.substrates.values():
            substrate.close(retire=not self.sandboxes)

    def _gone(self, sid: str, sb: Sandbox | None = None) -> CorralError:
        reason = sb.reason if sb is not None else self.tombstones.get(sid)
        if reason is None:
            if sb is not None:  # still starting (only visible during a batch create)
                return SandboxNotRunning(f"sandbox {sid} is still starting",
                                         details={"reason": "starting"})
            return SandboxNotFound(f"no sandbox {sid}", details={"id": sid})
        text = f"sandbox {sid} is not running: {_REASON_TEXT.get(reason, reason)}"
        details: dict[str, Any] = {"id": sid, "reason": reason}
        if reason == "crashed":
            cause = (sb.cause if sb is not None else None) or self.causes.get(sid) or {}
            details.update(cause)
            what = _CAUSE_TEXT.get(str(cause.get("cause")), "it crashed")
            status = f" ({cause['status']})" if cause.get("status") else ""
            text = f"sandbox {sid} is not running: {what}{status}"
            return SandboxCrashed(text, details=details)
        if reason == "operator_killed":
            return SandboxKilled(text, details=details)
        if reason in ("expired", "idle_timeout"):
            return SandboxExpired(text, details=details)
        if reason in ("lost", "network_lost"):
            lost = (sb.cause if sb is not None else None) or self.causes.get(sid)
            if lost:  # an infra cause (LOST_CAUSES): a host-wide OOM, say
                details.update(lost)
                text = f"sandbox {sid} is not running: {_CAUSE_TEXT[str(lost['cause'])]}"
            return SandboxLost(text, details=details)
        if reason == "shutdown":
            if self.config.node_id:  # a cluster node stops only when it leaves the cluster
                return SandboxLost(text, details=dict(details, node=self.config.node_id))
            return DaemonRestarted(text, details=details)
        return SandboxNotRunning(text, details=details)

    def get(self, sid: str) -> Sandbox:
        """A running sandbox (a paused one is resumed); refreshes its idle clock."""
        sb = self.sandboxes.get(sid)
        if sb is not None and sb.state == "paused":
            self._resume(sb)
        if sb is None or sb.state != "running":
            raise self._gone(sid, sb)
        sb.last_active = self.clock.time()
        return sb

    def sandbox_count(self) -> int:
        """Sandboxes held, in any state (each counts against capacity)."""
        return len(self.sandboxes)

    def info_now(self, sid: str) -> dict[str, Any] | None:
        """The SandboxInfo of a sandbox the engine holds (any state), else None."""
        sb = self.sandboxes.get(sid)
        return sb.info() if sb is not None else None

    def lookup(self, sid: str) -> Sandbox:
        """A running or paused sandbox, not resumed (info calls); refreshes its idle clock."""
        sb = self.sandboxes.get(sid)
        if sb is None or sb.state not in ("running", "paused"):
            raise self._gone(sid, sb)
        sb.last_active = self.clock.time()
        return sb

    def precheck_sandbox(self, sid: str, key: str | None) -> None:
        """What a long call on ``sid`` (snapshot, fork, restore) would refuse at once for an
        id this daemon does not hold, raised before a streamed answer starts; a keyed call
        that replays a logged result is let through (its sandbox may be gone)."""
        if sid in self.sandboxes or (key is not None and self.trajlog.binds(sid, key)):
            return
        raise self._gone(sid, None)

    def _substrate(self, name: str) -> Substrate:
        sub = self.substrates.get(name)
        if sub is None:
            raise registry.unknown(name, list(self.substrates), self.unavailable)
        return sub

    def _for_create(self, spec: SandboxSpec) -> Substrate:
        """The substrate a create names, checked against its capabilities."""
        sub = self._substrate(spec.substrate)
        caps = sub.capabilities
        kind = network_kind(spec.network)
        if kind not in caps.networks:
            raise Unsupported(f"network {kind!r} is not supported on substrate "
                              f"{sub.name!r} (it has: {', '.join(caps.networks)})",
                              details={"substrate": sub.name, "network": kind})
        if spec.expose and kind not in ("internet", "policy"):
            raise InvalidNetwork("expose needs a networked sandbox (network internet or a "
                                 "policy)", details={"network": kind})
        if kind in ("internet", "policy"):
            net = sub.networking()
            if net is not None:
                net.check(spec.network)  # invalid_network before anything is made
        if spec.snapshot is not None and not caps.snapshot:
            raise Unsupported(f"snapshots are not supported on substrate {sub.name!r}",
                              details={"substrate": sub.name, "operation": "snapshot"})
        return sub

    @staticmethod
    def _lacks(sub: Substrate, what: str) -> Unsupported:
        return Unsupported(f"{what} is not supported on substrate {sub.name!r}",
                           details={"substrate": sub.name, "operation": what})

    def allowlists(self) -> dict[str, list[str]]:
        """The daemon's named allowlists (GET /v1/networks), from the substrate that networks
        sandboxes."""
        net = self._networking()
        return dict(net.allowlists) if net is not None else {}

    def _networking(self) -> NetworkControl | None:
        for sub in self.substrates.values():
            net = sub.networking()
            if net is not None:
                return net
        return None

    def blocked_networks(self, items: list[str] | None = None) -> dict[str, list[str]]:
        """Addresses no sandbox may reach beyond the fixed ones (GET and PUT
        /v1/network/blocked); ``items`` replaces the live ones."""
        net = self._networking()
        if net is None:
            raise Unsupported("no substrate of this daemon networks sandboxes")
        return net.blocked() if items is None else net.set_blocked(items)

    def substrate_table(self) -> list[dict[str, Any]]:
        """Each served substrate and its capabilities, then each one asked for that this host
        cannot run, with why (GET /v1/substrates)."""
        served = [{"name": name, "available": True, "reason": None,
                   "capabilities": sub.capabilities.to_json(),
                   "operations": sub.capabilities.operations()}
                  for name, sub in sorted(self.substrates.items())]
        return served + [{"name": name, "available": False, "reason": why,
                          "capabilities": Capabilities().to_json(), "operations": []}
                         for name, why in sorted(self.unavailable.items())]

    def _image(self, name: str) -> Any:
        image = self.images.get(name)
        if image is None:
            raise ImageNotFound(f"no image {name!r}", details={"image": name})
        return image

    def set_tenant_quota(self, limit_of: Callable[[str], int | None]) -> None:
        """Each tenant's quota of live sandboxes: ``limit_of(tenant)``, None for no limit."""
        self.quota.limit_of = limit_of

    def _register(self, sb: Sandbox) -> None:
        self.sandboxes[sb.id] = sb
        self.quota.add(sb.spec.labels)
        self.listing.add(sb.id, sb.created_at, sb.spec.labels.get(TENANT_LABEL))

    def _unregister(self, sid: str) -> None:
        sb = self.sandboxes.pop(sid, None)
        if sb is not None:
            self.quota.remove(sb.spec.labels)
            self.listing.remove(sid)

    def _admit(self, n: int, labels: dict[str, Any] | None = None) -> None:
        """Room for ``n`` more sandboxes (with ``labels``: within their tenant's quota)."""
        if self.shutting_down:
            raise DaemonRestarted("the daemon is shutting down")
        self.quota.admit(labels, n)
        cap = self.config.max_sandboxes
        if len(self.sandboxes) + n > cap:
            raise CapacityExceeded(
                f"capacity exceeded: {len(self.sandboxes)} of {cap} sandboxes in use, "
                f"{n} requested", details={"in_use": len(self.sandboxes), "capacity": cap})
        if self.memory.low():
            avail = self.memory.available_kib() or 0
            raise CapacityExceeded(
                f"host memory low: {avail >> 10} MiB available, creates wait for "
                f"{self.memory.floor_kib >> 10} MiB", details={
                    "available_kib": avail, "floor_kib": self.memory.floor_kib})

    async def _create_one(self, substrate: Substrate, spec: SandboxSpec, image: Any,
                          demand: int = 1, trajectory: str | None = None) -> Sandbox:
        # A warm one if a pool has it (corral.daemon.pools): its id was drawn when it was made.
        pooled = self.pools.take(spec, demand) if self.pools is not None else None
        sid = pooled.sandbox_id if pooled is not None else new_id()
        now = self.clock.time()
        sb = Sandbox(sid, spec, now, now + spec.timeout)
        sb.trajectory = trajectory
        sdir = os.path.join(self.sandboxes_dir, sid)
        meta_path = os.path.join(sdir, persist.META)
        # The directory is the record until meta.json exists: a crash mid-create leaves a
        # dir without a runtime, which recovery hands to cleanup_orphans with everything else.
        if pooled is None:
            os.mkdir(sdir, 0o700)
        self._register(sb)  # counts against capacity (and its tenant's quota) while made
        try:
            if pooled is not None:
                sb.runtime = pooled
                await asyncio.to_thread(substrate.claim, pooled, spec)  # e.g. its policy
            else:
                # In a worker thread (the Rust core releases the GIL): creates of concurrent
                # clients, and of a batch, use every core; the loop stays free meanwhile. A
                # stop meanwhile (shutdown) waits for the runtime, then kills it.
                sb.enter_thread()
                try:
                    fut = asyncio.ensure_future(asyncio.to_thread(substrate.create, sid, spec,
                                                                  image))
                    cancelled = await _settle(fut)
                    sb.runtime = fut.result()
                finally:
                    sb.leave_thread()
                if cancelled:
                    raise asyncio.CancelledError
                if sb.stopping is not None:  # the daemon is stopping: it destroys this one
                    raise self._gone(sid, sb)
            layers = self._image_layers(image)
            if layers:
                sb.runtime.extra["layers"] = layers
                if self.snaps is not None:
                    self.snaps.acquire(layers)
            sb.state = "running"
            for port in spec.expose:
                await self.expose(sid, port)
            persist.write_json_atomic(meta_path, sb.meta())
        except BaseException as e:
            self.counters["create_failed"] += 1
            if sb.stopping is not None:
                raise  # being destroyed by the stop that caught it half-made
            self._unregister(sid)
            if sb.state == "running" and sb.layers and self.snaps is not None:
                self.snaps.release(sb.layers)
            await self._undo_create(substrate, sb.runtime, sdir)
            if isinstance(e, CorralError) or not isinstance(e, Exception):
                raise
            if isinstance(e, OSError) and e.errno in oserrors.HOST_OUT_OF_RESOURCES:
                raise CapacityExceeded(f"host out of resources: {e}") from e
            log.exception("create failed", extra={"sandbox": sid})
            raise InternalError(f"could not create the sandbox: {e}") from e
        self.counters["created"] += 1
        self.trajlog.sandbox_created(sid, sb.meta()["spec"], now)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("sandbox created", extra={"sandbox": sid, "init_pid": sb.runtime.init_pid})
        self._watch(sb)
        self._schedule(sb, now)
        return sb

    async def _image_name(self, name: str, tenant: str | None = None) -> str:
        """``name`` as the store knows it; a registry reference the node lacks is pulled
        first (once, however many creates ask at the same time: oci.flight), a pull
        ``tenant``'s create starts counting in its pull quota (images.PULLS_PER_TENANT)."""
        if name == "host" or not looks_like_ref(name):
            return name  # a local name: never looked up in a registry
        try:
            if self.images.has(name):
                return str(self.images.canonical(name))
            return str((await self.images.pull(name, missing_only=True,
                                               tenant=tenant)).name)
        except InvalidRequest as e:
            if e.code != "invalid_request":
                raise  # invalid_image, too_large: about a real image
            raise ImageNotFound(f"no image {name!r}: {e.message}",
                                details={"image": name}) from None

    async def _pull_missing(self, spec: SandboxSpec) -> SandboxSpec:
        """The spec with every image it names present on the node (by its full reference)
        and every dir layer resolved to its content-addressed layer (``digest``)."""
        update: dict[str, Any] = {}
        tenant = spec.labels.get(TENANT_LABEL)  # set by the daemon on a tenant's create
        if spec.snapshot is None:
            name = await self._image_name(spec.image, tenant)
            if name != spec.image:
                update["image"] = name
        if spec.layers:
            layers = []
            for lay in spec.layers:
                if lay.image is not None:
                    lay = lay.model_copy(update={"image": await self._image_name(lay.image,
                                                                                 tenant)})
                elif lay.dir is not None:
                    hexd = await asyncio.to_thread(self.images.layers.from_dir, lay.dir,
                                                   self.images.max_bytes,
                                                   self.images.max_files)
                    lay = lay.model_copy(update={"digest": "dir:" + hexd})
                layers.append(lay)
            update["layers"] = layers
        return spec.model_copy(update=update) if update else spec

    @staticmethod
    def _with_image_config(spec: SandboxSpec, image: Any) -> SandboxSpec:
        """An OCI image's Env, WorkingDir and User, where the spec does not say otherwise."""
        cfg = image.meta.get("config") if image.kind == "oci" else None
        if not cfg:
            return spec
        update: dict[str, Any] = {}
        env = {}
        for item in cfg.get("Env", ()):
            k, sep, v = item.partition("=")
            if sep and k and "\0" not in item:
                env[k] = v
        if env:
            update["env"] = {**env, **spec.env}
        if "cwd" not in spec.model_fields_set and cfg.get("WorkingDir", "").startswith("/"):
            update["cwd"] = cfg["WorkingDir"]
        if spec.user is None and cfg.get("User"):
            user = cfg["User"].split(":", 1)[0]  # "user:group": the user's own groups
            update["user"] = int(user) if user.isdigit() else user
        return spec.model_copy(update=update) if update else spec

    async def _undo_create(self, substrate: Substrate, runtime: SandboxRuntime | None,
                           sdir: str) -> None:
        """What a failed create made, destroyed in a worker thread: a substrate's destroy
        waits for the sandbox's processes to end (seconds, for some), which must not hold
        the loop. It finishes even if the create's caller is cancelled."""
        sid = os.path.basename(sdir)

        def undo() -> None:
            if runtime is not None:
                try:
                    substrate.destroy(runtime)
                except Exception:  # noqa: BLE001
                    log.exception("destroy after a failed create", extra={"sandbox": sid})
            removal.remove_or_quarantine(sdir)

        task = asyncio.ensure_future(asyncio.to_thread(undo))
        self._batch_tasks.add(task)
        task.add_done_callback(self._batch_tasks.discard)
        with contextlib.suppress(asyncio.CancelledError):  # cancelled again: it goes on
            await asyncio.shield(task)

    async def create(self, spec: SandboxSpec, trajectory: str | None = None) -> Sandbox:
        substrate = self._for_create(spec)
        self._admit(1, spec.labels)
        spec = await self._pull_missing(spec)
        spec, image = self._resolve(substrate, spec)
        return await self._create_one(substrate, spec, image, trajectory=trajectory)

    def _resolve(self, substrate: Substrate, spec: SandboxSpec) -> tuple[SandboxSpec, Any]:
        """The image to start on: the spec's, or a snapshot's image with its layers on top
        (the spec then names the snapshot by id and its image)."""
        if spec.snapshot is None:
            image = self._image(spec.image)
            return self._with_image_config(spec, image), self.images.compose(image, spec.layers)
        store = self._snaps()
        rec = store.get(spec.snapshot)
        base = self._image(rec["image"])
        spec = spec.model_copy(update={"snapshot": rec["id"], "image": rec["image"]})
        return self._with_image_config(spec, base), substrate.image_on(
            self.images.compose(base, spec.layers), rec["layers"], store)

    def precheck_create(self, count: int, spec: SandboxSpec) -> None:
        """What a create batch would refuse at once (substrate, network, admission, a local
        image that does not exist), raised before the batch starts: a streamed batch then
        answers it as an error status, not as the last line of a stream already begun."""
        self._for_create(spec)
        self._admit(count, spec.labels)
        if spec.snapshot is None and not spec.layers and (
                spec.image == "host" or not looks_like_ref(spec.image)):
            self._image(spec.image)

    async def create_many(self, count: int, spec: SandboxSpec,
                          trajectories: list[str] | None = None,
                          on_made: Callable[[], None] | None = None) -> list[Sandbox]:
        """All or nothing: on the first failure (or a cancel: the client left) the ones
        already made are destroyed. ``on_made`` is called once per sandbox made."""
        substrate = self._for_create(spec)
        self._admit(count, spec.labels)
        spec = await self._pull_missing(spec)
        spec, image = self._resolve(substrate, spec)
        if count > 1:
            substrate.expect(count, spec)
        layers = self._image_layers(image)
        if self.snaps is not None:
            self.snaps.acquire(layers)  # held for the batch: an rm meanwhile cannot collect
        try:
            return await self._create_many(substrate, count, spec, image, trajectories,
                                           on_made)
        finally:
            if self.snaps is not None:
                self.snaps.release(layers)

    @staticmethod
    def _image_layers(image: Any) -> list[str]:
        return list(image.meta.get("layers") or ())

    async def _create_many(self, substrate: Substrate, count: int, spec: SandboxSpec,
                           image: Any, trajectories: list[str] | None = None,
                           on_made: Callable[[], None] | None = None) -> list[Sandbox]:
        made: list[Sandbox | None] = [None] * count
        gate = asyncio.Semaphore(CREATE_WORKERS)  # creates of one batch in flight at once
        failed: list[BaseException] = []

        async def one(i: int) -> None:
            async with gate:
                if failed:
                    return
                try:
                    self._admit(1, spec.labels)
                    # The batch counts as demand once, with its size.
                    made[i] = await self._create_one(substrate, spec, image,
                                                     count if i == 0 else 0,
                                                     trajectories[i] if trajectories else None)
                    if on_made is not None:
                        on_made()
                except BaseException as e:  # noqa: BLE001 - raised below, after the undo
                    failed.append(e)

        try:
            await asyncio.gather(*(one(i) for i in range(count)))
        except BaseException as e:  # noqa: BLE001 - cancelled: the creates finish, then undo
            failed.append(e)
        if failed:
            await asyncio.gather(*(self._begin_stop(sb, "killed") for sb in made if sb),
                                 return_exceptions=True)
            raise failed[0]
        return [sb for sb in made if sb is not None]

    def _watch(self, sb: Sandbox) -> None:
        """Learn about a dead init as soon as it happens: its pidfd turns readable."""
        fd = sb.runtime.pidfd if sb.runtime else -1
        if fd >= 0 and self._loop is not None:
            self._loop.add_reader(fd, self._on_init_exit, sb)

    def _unwatch(self, sb: Sandbox) -> None:
        fd = sb.runtime.pidfd if sb.runtime else -1
        if fd >= 0 and self._loop is not None:
            self._loop.remove_reader(fd)

    def _on_init_exit(self, sb: Sandbox) -> None:
        self._unwatch(sb)
        if sb.state in ("running", "paused"):
            self._lose(sb)

    def _lose(self, sb: Sandbox) -> None:
        """Its init died and the daemon did not kill it: crashed if the sandbox explains it
        (read now, before destroy removes what it held and reaps the init), else lost."""
        cause = None
        substrate = self.substrates.get(sb.spec.substrate)
        if substrate is not None and sb.runtime is not None:
            try:
                cause = substrate.end_cause(sb.runtime)
            except Exception:  # noqa: BLE001 - no cause found: lost
                log.exception("end_cause failed", extra={"sandbox": sb.id})
        if cause is not None and cause.get("cause") in LOST_CAUSES:
            log.warning("sandbox lost", extra={"sandbox": sb.id, "cause": cause})
            sb.cause = cause
            self._begin_stop(sb, "lost")
            return
        if cause is not None:
            log.info("sandbox crashed", extra={"sandbox": sb.id, "cause": cause})
            sb.cause = cause
            self._begin_stop(sb, "crashed")  # counted there (corral_crashed_total)
            return
        log.warning("sandbox lost: its init died", extra={"sandbox": sb.id})
        self._begin_stop(sb, "lost")  # counted there, once

    def _alive(self, sb: Sandbox) -> bool:
        try:
            return self.substrates[sb.spec.substrate].is_alive(sb.rt)
        except Exception:  # noqa: BLE001
            return False

    def _check_alive(self, sb: Sandbox) -> None:
        """After a failed call: if the init is gone, that was the cause -> sandbox_lost."""
        if sb.state != "running":
            raise self._gone(sb.id, sb)
        if not self._alive(sb):
            self._lose(sb)
            raise self._gone(sb.id, sb)

    def _schedule(self, sb: Sandbox, now: float) -> None:
        d = sb.deadline(now)
        if not sb.sched or d < sb.sched:
            sb.sched = d
            heapq.heappush(self._heap, (d, sb.id))

    async def _reap_loop(self) -> None:
        while True:
            await self.clock.sleep(self.config.reaper_interval_s)
            try:
                now = self.clock.time()
                self.reap(now)
                self.trajlog.maybe_prune(now)
            except Exception:  # noqa: BLE001 - the reaper must survive anything
                log.exception("reaper failed")

    def reap(self, now: float) -> None:
        if len(self._heap) > 2 * len(self.sandboxes) + 1024:
            self._compact_heap()
        heap = self._heap
        while heap and heap[0][0] <= now:
            when, sid = heapq.heappop(heap)
            sb = self.sandboxes.get(sid)
            if sb is None or sb.state not in ("running", "paused") or when != sb.sched:
                continue  # gone, or a stale entry
            if sb.state == "paused" and sb.spec.pause_ttl == "stop":
                sb.sched = 0.0  # clocks stopped: rescheduled on resume
                continue
            idle = sb.spec.idle_timeout
            if now >= sb.expires_at:
                self._begin_stop(sb, "expired")
            elif idle is not None and not sb.busy and now >= sb.last_active + idle:
                self._begin_stop(sb, "idle_timeout")
            else:
                sb.sched = 0.0
                self._schedule(sb, now)

    def _compact_heap(self) -> None:
        """Entries of killed sandboxes stay until their deadline (up to a week away): with
        heavy churn, rebuild the heap from the live entries only."""
        self._heap = [(sb.sched, sid) for sid, sb in self.sandboxes.items()
                      if sb.state in ("running", "paused") and sb.sched]
        heapq.heapify(self._heap)

    def _begin_stop(self, sb: Sandbox, reason: str) -> asyncio.Future[None]:
        if sb.stopping is None:
            if sb.state in ("running", "paused"):
                self._unwatch(sb)
            sb.state = "stopping"
            sb.reason = reason
            if reason in self.counters:
                self.counters[reason] += 1
            if reason in ("expired", "idle_timeout"):
                log.info("sandbox reaped", extra={"sandbox": sb.id, "reason": reason})
            sb.stopping = asyncio.ensure_future(self._destroy(sb))
        return sb.stopping

    async def _destroy(self, sb: Sandbox) -> None:
        substrate = self.substrates.get(sb.spec.substrate)
        sdir = os.path.join(self.sandboxes_dir, sb.id)

        def work() -> None:
            if sb.runtime is not None and substrate is not None:
                substrate.destroy(sb.runtime)
            if os.path.lexists(sdir):  # the substrate's destroy removes it; a failed one may not
                removal.remove_or_quarantine(sdir)

        try:
            # destroy closes the root fd that file operations in worker threads use.
            await sb.no_threads()
            await asyncio.to_thread(work)
        except Exception:  # noqa: BLE001
            log.exception("destroy failed", extra={"sandbox": sb.id})
        finally:
            self._destroyed(sb)

    def _begin_stop_many(self, sbs: list[Sandbox], reason: str) -> list[asyncio.Future[None]]:
        """``_begin_stop`` for a batch: the ones not already stopping are destroyed together,
        a few worker-thread hops per batch (DESTROY_THREADS) instead of one per sandbox, each
        hop destroying its share in one go (substrate.destroy_many)."""
        fresh = [sb for sb in sbs if sb.stopping is None]
        if len(fresh) < 2:
            return [self._begin_stop(sb, reason) for sb in sbs]
        loop = asyncio.get_running_loop()
        for sb in fresh:
            if sb.state in ("running", "paused"):
                self._unwatch(sb)
            sb.state = "stopping"
            sb.reason = reason
            sb.stopping = loop.create_future()
        if reason in self.counters:
            self.counters[reason] += len(fresh)
        task = asyncio.ensure_future(self._destroy_batch(fresh))
        self._batch_tasks.add(task)
        task.add_done_callback(self._batch_tasks.discard)
        return [sb.stopping for sb in sbs if sb.stopping is not None]

    async def _destroy_batch(self, sbs: list[Sandbox]) -> None:
        by_sub: dict[str, list[Sandbox]] = {}
        for sb in sbs:
            by_sub.setdefault(sb.spec.substrate, []).append(sb)

        def work(part: list[Sandbox]) -> None:
            substrate = self.substrates.get(part[0].spec.substrate)
            have = [sb for sb in part if sb.runtime is not None]
            outcomes = substrate.destroy_many([sb.rt for sb in have]) if substrate else []
            for sb, err in zip(have, outcomes, strict=False):
                if err is not None:
                    log.error("destroy failed: %s", err, extra={"sandbox": sb.id})
            for sb in part:  # the substrate's destroy removes it; a failed one may not have
                d = os.path.join(self.sandboxes_dir, sb.id)
                if os.path.lexists(d):
                    removal.remove_or_quarantine(d)

        try:
            while busy := [sb for sb in sbs if sb.threads]:  # see _destroy
                await busy[0].no_threads()
            parts = [group[i::DESTROY_THREADS] for group in by_sub.values()
                     for i in range(min(DESTROY_THREADS, len(group)))]
            await asyncio.gather(*(asyncio.to_thread(work, part) for part in parts))
        except Exception:  # noqa: BLE001
            log.exception("batch destroy failed", extra={"count": len(sbs)})
        finally:
            for sb in sbs:
                self._destroyed(sb)
                fut = sb.stopping
                if fut is not None and not fut.done():
                    fut.set_result(None)

    def _destroyed(self, sb: Sandbox) -> None:
        """The bookkeeping once a sandbox's destroy has run (or failed)."""
        sb.state = "dead"
        if sb.procs:
            for p in sb.procs.values():
                p.release()
            sb.procs = None
        self._unregister(sb.id)
        if self.pools is not None:
            self.pools.settled(sb.id)
        if sb.layers and self.snaps is not None:
            self.snaps.release(sb.layers)
        self._tombstone(sb.id, sb.reason or "killed", sb.cause)
        if (tenant := sb.spec.labels.get(TENANT_LABEL)) is not None:
            self.ended_tenants[sb.id] = tenant
        self.trajlog.sandbox_ended(sb.id, sb.reason or "killed", sb.final_net())
        log.debug("sandbox destroyed", extra={"sandbox": sb.id, "reason": sb.reason})

    def _tombstone(self, sid: str, reason: str, cause: dict[str, Any] | None = None) -> None:
        self.tombstones[sid] = reason
        if reason in ("crashed", "lost") and cause:
            self.causes[sid] = cause
        else:
            self.causes.pop(sid, None)
        while len(self.tombstones) > TOMBSTONES:
            old, _ = self.tombstones.popitem(last=False)
            self.ended_tenants.pop(old, None)
            self.causes.pop(old, None)

    async def kill(self, sid: str, key: str | None = None) -> bool:
        """True if this call (or one in flight) destroyed it; False if it had already ended.
        ``key``: the call's idempotency key, which tells the trajectory's own kill from an
        operator's (by_operator)."""
        sb = self.sandboxes.get(sid)
        if sb is None:
            if sid in self.tombstones:
                return False
            raise SandboxNotFound(f"no sandbox {sid}", details={"id": sid})
        reason = "operator_killed" if by_operator(sb, key) else "killed"
        await asyncio.shield(self._begin_stop(sb, reason))
        return True

    async def kill_many(self, ids: list[str],
                        on_done: Callable[[], None] | None = None) -> list[dict[str, Any]]:
        """Kill each; one result per id, in order: ``{"id", "killed"}`` or ``{"error"}``.
        Every destroy is started before the first is awaited, so they overlap; ``on_done``
        is called once per id settled. A kill, once started, finishes even if the caller
        is cancelled."""
        out: list[dict[str, Any]] = []
        found: list[Sandbox] = []
        for sid in ids:
            sb = self.sandboxes.get(sid)
            if sb is not None:
                found.append(sb)
                out.append({"id": sid, "killed": True})
            elif sid in self.tombstones:
                out.append({"id": sid, "killed": False})
            else:
                out.append(SandboxNotFound(f"no sandbox {sid}", details={"id": sid})
                           .to_payload())
        if found:  # unkeyed: an operator's kill for a trajectory's sandbox (by_operator)
            found = list(dict.fromkeys(found))
            stops = self._begin_stop_many([sb for sb in found if not sb.trajectory], "killed")
            stops += self._begin_stop_many([sb for sb in found if sb.trajectory],
                                           "operator_killed")
            if on_done is not None:
                tick = on_done
                for st in stops:
                    st.add_done_callback(lambda _f: tick())
            await asyncio.shield(asyncio.gather(*stops, return_exceptions=True))
        return out

    def _network_of(self, sb: Sandbox, operation: str) -> NetworkControl:
        sub = self.substrates.get(sb.spec.substrate)
        mgr = sub.networking() if sub is not None else None
        kind = network_kind(sb.spec.network)
        if mgr is None or kind not in ("internet", "policy"):
            raise Unsupported(f"{operation} needs a networked sandbox (network internet or a "
                              f"policy); this one has network {kind!r}",
                              details={"operation": operation, "network": kind})
        return mgr

    async def expose(self, sid: str, port: int) -> dict[str, Any]:
        """127.0.0.1:<host port> reaches ``port`` in the sandbox until unexposed or it ends."""
        sb = self.get(sid)
        host_port = await self._network_of(sb, "expose").expose(sid, port)
        self._record_exposed(sb, port, host_port)
        return {"port": port, "host": f"127.0.0.1:{host_port}"}

    def unexpose(self, sid: str, port: int) -> bool:
        sb = self.get(sid)
        done = bool(self._network_of(sb, "unexpose").unexpose(sid, port))
        if done:
            self._record_exposed(sb, port, None)
        return done

    def _record_exposed(self, sb: Sandbox, port: int, host_port: int | None) -> None:
        """Exposed ports in the sandbox's record: a daemon after a restart listens on the
        same host ports again."""
        if sb.runtime is None:
            return
        exposed = dict(sb.runtime.extra.get("exposed") or {})
        if exposed.get(str(port)) == host_port:
            return
        if host_port is None:
            exposed.pop(str(port), None)
        else:
            exposed[str(port)] = host_port
        sb.runtime.extra["exposed"] = exposed
        if sb.state in ("running", "paused"):  # a create writes its record itself
            persist.write_json_atomic(os.path.join(self.sandboxes_dir, sb.id, persist.META),
                                      sb.meta())

    async def _restore_exposed(self) -> None:
        """After recovery: each re-adopted sandbox's exposed ports, on their host ports
        again when those are free (else on new ones, recorded)."""
        for sb in list(self.sandboxes.values()):
            want = (sb.runtime.extra.get("exposed") or {}) if sb.runtime else {}
            if not want:
                continue
            sub = self.substrates.get(sb.spec.substrate)
            mgr = sub.networking() if sub is not None else None
            if mgr is None:
                continue
            for port, host_port in sorted(want.items()):
                try:
                    got = await mgr.expose(sb.id, int(port), int(host_port))
                except Exception:  # noqa: BLE001 - the sandbox runs on without this port
                    log.exception("cannot expose a re-adopted sandbox's port again",
                                  extra={"sandbox": sb.id, "port": port})
                    self._record_exposed(sb, int(port), None)
                    continue
                self._record_exposed(sb, int(port), got)

    def update_network(self, sid: str, network: Any) -> Sandbox:
        """A networked sandbox's policy (or mode internet) replaced at once; its spec too, so
        forks and a daemon restart see the new one."""
        sb = self.get(sid)
        if network_kind(network) not in ("internet", "policy"):
            raise InvalidNetwork("a live sandbox changes between internet and policies only "
                                 "(none and disabled have no network to change)",
                                 details={"network": network_kind(network)})
        self._network_of(sb, "network update").update(sid, network)
        sb.spec = sb.spec.model_copy(update={"network": network})
        persist.write_json_atomic(os.path.join(self.sandboxes_dir, sid, persist.META), sb.meta())
        return sb

    def set_timeout(self, sid: str, timeout: float) -> Sandbox:
        sb = self.get(sid)
        now = self.clock.time()
        sb.expires_at = now + timeout
        persist.write_json_atomic(os.path.join(self.sandboxes_dir, sid, persist.META), sb.meta())
        self._schedule(sb, now)
        return sb

    def sandbox_page(self, labels: dict[str, str | None], after: str | None,
                     limit: int) -> tuple[list[Sandbox], str | None]:
        """One page of ``list(labels)`` in listing order (oldest first), after cursor
        ``after``, and the next page's cursor. With a tenant's label, only that tenant's
        sandboxes are walked; a page stops at its ``limit``."""
        tenant = labels.get(TENANT_LABEL)

        def keep(sid: str) -> bool:
            sb = self.sandboxes.get(sid)
            if sb is None or sb.state not in ("running", "paused"):
                return False
            have = sb.spec.labels
            return all(k in have and (v is None or have[k] == v) for k, v in labels.items())

        ids, nxt = listing.page(self.listing, after, limit, tenant, tenant is not None, keep)
        return [self.sandboxes[sid] for sid in ids], nxt

    def list(self, labels: dict[str, str | None]) -> list[Sandbox]:
        """Every live sandbox with ``labels``, in listing order (a tenant's: its own only
        walked)."""
        return self.sandbox_page(labels, None, len(self.sandboxes) + 1)[0]

    def _capturing(self, sid: str) -> bool:
        """A snapshot's capture holds the sandbox frozen, or a pause or resume of it runs, or
        it is paused (cheap: the exec path asks first; Engine.ready)."""
        sb = self.sandboxes.get(sid)
        return sb is not None and (sb.capturing is not None or sb.switching is not None
                                   or sb.state == "paused")

    async def wait_capture(self, sid: str) -> None:
        """Return once no snapshot capture holds the sandbox frozen. Anything that starts a
        process in it waits here first: a process joining a frozen sandbox freezes at once,
        and the daemon's spawn (a vfork) would wait for it with the event loop blocked until
        the capture thaws. Pause and resume wait too (a resume would thaw the capture's
        freeze mid-copy; a capture's thaw would undo a pause made during it), and so do file
        operations (so a snapshot never holds half of a write made during it)."""
        await self.ready(sid, capture=True, wake=False)

    async def ready(self, sid: str, capture: bool = True, wake: bool = True) -> None:
        """Wait out a pause or resume in progress and (``capture``) a snapshot's capture;
        then (``wake``) resume the sandbox if it is paused, in a worker thread (_switch):
        a call that resumes a paused sandbox resumes it here, before the engine's sync
        lookup (get) sees it, so no freeze or thaw runs on the event loop (a substrate's
        may start a process: tens of ms, every tenant's calls held meanwhile)."""
        while (sb := self.sandboxes.get(sid)) is not None:
            paused = wake and sb.state == "paused"
            fut = sb.switching or (sb.capturing if capture or paused else None)
            if fut is not None:
                await asyncio.shield(fut)
                continue
            if not paused:
                return
            await self._switch(sb, False)

    @staticmethod
    def _frozen(substrate: Substrate, runtime: SandboxRuntime) -> bool:
        """Frozen or freezing: a process started in it would not run."""
        try:
            return substrate.is_frozen(runtime)
        except OSError:
            return False

    def _switch(self, sb: Sandbox, pause: bool) -> asyncio.Future[None]:
        """Pause (or resume) ``sb`` in a file thread (corral.daemon.filethreads: a tenant's
        pauses and resumes hold at most its share of them), with ``sb.switching`` set until
        it has ended. The state changes when the freeze (thaw) has ended, in a task of its
        own: a caller that leaves does not leave the sandbox frozen but marked running."""
        substrate = self.substrates[sb.spec.substrate]
        runtime = sb.rt
        want = "running" if pause else "paused"
        done = sb.switching = asyncio.get_running_loop().create_future()

        def start() -> None:  # ended while queued for a thread: its error, nothing run
            if sb.state != want:
                raise self._gone(sb.id, sb)
            sb.enter_thread()  # its destroy waits for the freeze (thaw) to end

        def work() -> None:
            if not pause:
                substrate.thaw(runtime)
                return
            try:
                substrate.freeze(runtime)
            except TimeoutError:  # an OSError too: first, or it would stay half frozen
                substrate.thaw(runtime, wait=False)
                raise

        async def go() -> None:
            try:
                await filethreads.run(sb.spec.labels.get(TENANT_LABEL), work, start,
                                      sb.leave_thread)
                if sb.state != want:  # ended (destroyed) meanwhile
                    raise self._gone(sb.id, sb)
                if pause:
                    sb.state, sb.paused_at = "paused", self.clock.time()
                    self._persist(sb)
                else:
                    self._resumed(sb)
            finally:
                sb.switching = None
                done.set_result(None)

        task = asyncio.ensure_future(go())
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # a caller left
        return asyncio.shield(task)

    async def pause(self, sid: str) -> Sandbox:
        """Freeze every process of the sandbox (Substrate.freeze): no CPU until resumed."""
        await self.ready(sid, wake=False)
        sb = self.lookup(sid)
        substrate = self.substrates[sb.spec.substrate]
        if not substrate.capabilities.pause:
            raise self._lacks(substrate, "pause")
        if sb.state == "paused":
            return sb
        try:
            await self._switch(sb, True)
        except PauseHeldOff as e:  # its own thread kept it from stopping: never masked
            raise SandboxAtLimit(
                "cannot pause: a thread of the sandbox stayed running in the kernel (a "
                "syscall that cannot be interrupted, or the CPU debt it left) past the "
                "daemon's wait", details={"limit": "freeze"}) from e
        except TimeoutError as e:
            raise InternalError(f"cannot pause: {e}") from e
        except OSError as e:
            raise Unsupported(f"cannot pause: {e.strerror or e}") from e
        return sb

    async def resume(self, sid: str) -> Sandbox:
        await self.ready(sid, wake=False)
        sb = self.lookup(sid)
        substrate = self.substrates[sb.spec.substrate]
        if not substrate.capabilities.pause:
            raise self._lacks(substrate, "resume")
        if sb.state == "paused":
            await self._switch(sb, False)
        return sb

    def _resume(self, sb: Sandbox) -> None:
        """Resume on the calling thread: a call that did not go through ``ready`` first (a
        pause that raced a call between its steps)."""
        assert sb.runtime is not None
        self.substrates[sb.spec.substrate].thaw(sb.runtime)
        self._resumed(sb)

    def _resumed(self, sb: Sandbox) -> None:
        now = self.clock.time()
        if sb.spec.pause_ttl == "stop" and sb.paused_at is not None:
            sb.expires_at += now - sb.paused_at  # the TTL clock stood still while paused
            sb.last_active = now
        sb.state, sb.paused_at = "running", None
        self._persist(sb)
        sb.sched = 0.0
        self._schedule(sb, now)

    def _persist(self, sb: Sandbox) -> None:
        try:
            persist.write_json_atomic(os.path.join(self.sandboxes_dir, sb.id, persist.META),
                                      sb.meta())
        except OSError:
            log.exception("cannot write the sandbox record", extra={"sandbox": sb.id})

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "version": __version__, "pid": os.getpid(), "started_at": self.started_at,
            "sandboxes": len(self.sandboxes), "created": self.counters["created"],
            "capacity": self.config.max_sandboxes,
            "capacity_bound_by": self.config.capacity_bound_by,
            "state_dir": self.config.state_dir,
        }
        for sub in self.substrates.values():  # facts of the host they run on
            out.update(sub.status())
        out["substrates"] = sorted(self.substrates)
        return out

    def census(self) -> dict[str, Any]:
        """Gauges for /metrics: live sandboxes by (state, substrate); warm pools, and their
        sandboxes by (substrate, image) as (ready, being made)."""
        by_state: dict[tuple[str, str], int] = {}
        for sb in self.sandboxes.values():
            k = (sb.state, sb.spec.substrate)
            by_state[k] = by_state.get(k, 0) + 1
        pools = self.pools
        return {"by_state": by_state, "pools": {} if pools is None else pools.by_image(),
                "pool_count": 0 if pools is None else len(pools.pools)}

    def metrics(self) -> dict[str, int]:
        """Counters and gauges for /metrics (besides the sandbox count)."""
        out = dict(self.counters)
        out["quarantined_trees"] = len(removal.quarantined)  # see corral.daemon.removal
        if self.pools is not None:
            out.update(self.pools.stats())
        if self.trajlog.enabled:  # trajlog_{records,commits,inline,...}_total
            out.update({f"trajlog_{k}": v for k, v in self.trajlog.stats.items()})
        for sub in self.substrates.values():  # summed over substrates
            for k, v in sub.metrics().items():
                out[k] = out.get(k, 0) + v
        return out
