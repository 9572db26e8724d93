"""The engine: registry of sandboxes, lifecycle, admission, TTL/idle reaper, exec, files,
persistence and re-adoption after a restart.

Policy lives here; mechanism (namespaces, mounts, resource limits, freezing, file syscalls)
in the substrate, reached only through the protocol of ``corral.daemon.substrates.base`` and
gated by each substrate's capability table (an operation it lacks: ``unsupported``, before any
side effect). Nothing here names a substrate.
Cheap substrate calls (create, spawn, small file operations: ~1 ms in the Rust core, GIL
released) run directly on the event loop: a thread hop would cost more than the call. Slow ones
(destroy, tar, big files, image import) go through ``asyncio.to_thread``.

Ending states, as reported to callers (``reason`` in the error details; the category a trainer
masks by in brackets, corral.errors):
  killed -> ``sandbox_not_running`` (409, task): the client's own DELETE. An exec in flight
      when that happens gets the same error, not a fake exit code.
  operator_killed -> ``sandbox_killed`` (409, infra): a DELETE of a sandbox made for a
      trajectory that did not carry one of the trajectory's keys (see by_operator).
  expired, idle_timeout -> ``sandbox_expired`` (409, limit): the TTL / idle timeout it chose.
  crashed -> ``sandbox_crashed`` (409; limit for an OOM kill, else task): the init died
      because of what ran in the sandbox: an OOM kill in its memory limit, or the init ending
      in a way nothing outside does (``details["cause"]``, see Substrate.end_cause).
  lost -> ``sandbox_lost`` (410, infra): the init died, the daemon did not kill it, and
      nothing in the sandbox explains it (the host killed it, the node or daemon failed).
  shutdown -> ``daemon_restarted`` (503, infra): the daemon stopped while the call was running.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import errno
import heapq
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, BinaryIO, TypeVar

from corral import __version__
from corral.config import Config
from corral.daemon import persist, procs, removal, snapshots, streams, users
from corral.daemon.substrates import registry
from corral.daemon.substrates.base import Capabilities, SandboxRuntime, Substrate
from corral.daemon.trajlog import TrajLog
from corral.errors import (
    CapacityExceeded,
    Conflict,
    CorralError,
    CwdNotFound,
    DaemonRestarted,
    DirectoryNotEmpty,
    FileExists,
    FileNotFound,
    ImageNotFound,
    InternalError,
    InvalidPath,
    InvalidRequest,
    IsADirectory,
    IsASymlink,
    NotADirectory,
    PermissionDenied,
    ProcessNotFound,
    ProcessStillRunning,
    SandboxCrashed,
    SandboxExpired,
    SandboxKilled,
    SandboxLost,
    SandboxNotFound,
    SandboxNotRunning,
    SnapshotExists,
    Unsupported,
)
from corral.models import ExecRequest, FileEntry, SandboxSpec

log = logging.getLogger("corral.engine")
T = TypeVar("T")
DEFAULT_CWD = SandboxSpec.model_fields["cwd"].default


def _effective_timeout(req: ExecRequest) -> float | None:
    """A background command (a server, a watcher) lives until killed or until its sandbox
    ends, unless the caller set a timeout; a foreground one gets the default."""
    if req.background and "timeout" not in req.model_fields_set:
        return None
    return req.timeout

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
TOMBSTONES = 50_000          # remembered ended ids, so late calls get a precise error
SHUTDOWN_ENDED = "ended-by-shutdown.json"  # in the state dir: ids a graceful stop destroyed
MAX_PROCS_KEPT = 256         # finished background processes remembered per sandbox
DIRECT_IO_BYTES = 1 << 20    # file reads/writes up to this size skip the thread hop
MAX_READ_BYTES = 1 << 30
PASSWD_MAX = 4 << 20
INIT_EXIT_GRACE_STEPS = 40   # x 5 ms: how long an unexplained SIGKILL waits for the init's exit

_CAUSE_TEXT = {
    "oom": "it ran out of memory (the kernel's OOM killer killed in it)",
    "init_exited": "its init process ended",
    "pids": "it reached its process limit (pids)",
}

_REASON_TEXT = {
    "killed": "it was killed",
    "operator_killed": "an operator killed it (a kill without its trajectory's key)",
    "expired": "its timeout (TTL) expired",
    "idle_timeout": "its idle timeout expired",
    "lost": "its init process died",
    "crashed": "it crashed",
    "shutdown": "the daemon shut down",
    "restoring": "it is being restored to a snapshot",
}


def _any_record(sandboxes_dir: str) -> bool:
    try:
        return any(not n.startswith(".") for n in os.listdir(sandboxes_dir))
    except FileNotFoundError:
        return False


class Sandbox:
    """One sandbox's bookkeeping; kept small, tens of thousands live at once."""

    __slots__ = ("id", "spec", "runtime", "state", "reason", "created_at", "expires_at",
                 "last_active", "sched", "busy", "threads", "procs", "stopping", "paused_at",
                 "capturing", "cause", "trajectory")

    def __init__(self, sid: str, spec: SandboxSpec, created_at: float, expires_at: float) -> None:
        self.id = sid
        self.spec = spec
        self.runtime: SandboxRuntime | None = None
        self.state = "starting"
        self.reason: str | None = None
        self.created_at = created_at
        self.expires_at = expires_at
        self.last_active = created_at
        self.sched = 0.0          # the reaper-heap entry that is current for this sandbox
        self.busy = 0             # foreground execs in flight: not idle while > 0
        self.threads = 0          # file operations running in worker threads
        self.procs: dict[int, procs.Process] | None = None
        self.stopping: asyncio.Future[None] | None = None
        self.paused_at: float | None = None
        # Set while a snapshot's capture holds the sandbox frozen (Engine.wait_capture).
        self.capturing: asyncio.Future[None] | None = None
        self.cause: dict[str, Any] | None = None  # reason "crashed": why (end_cause)
        # The trajectory it was made for (a create keyed "{T}:create", or child i of a fork
        # keyed for one): a kill without its keys is an operator's (Engine.by_operator).
        self.trajectory: str | None = None

    @property
    def rt(self) -> SandboxRuntime:
        """Its runtime, where the caller knows it is running (created, not yet destroyed)."""
        assert self.runtime is not None, f"{self.id} has no runtime"
        return self.runtime

    @property
    def hostname(self) -> str:
        # The spec object is shared by a batch; the substrate defaults the hostname to the id.
        return self.spec.hostname or self.id[:63]

    def deadline(self, now: float) -> float:
        idle = self.spec.idle_timeout
        if idle is None:
            return self.expires_at
        return min(self.expires_at, (now if self.busy else self.last_active) + idle)

    def info(self) -> dict[str, Any]:
        s = self.spec
        return {
            "id": self.id, "state": self.state, "image": s.image, "substrate": s.substrate,
            "cpu": s.cpu, "memory_mb": s.memory_mb, "pids": s.pids, "network": s.network,
            "hostname": self.hostname, "labels": s.labels, "metadata": s.metadata,
            "created_at": self.created_at, "expires_at": self.expires_at,
            "idle_timeout": s.idle_timeout, "last_active_at": self.last_active,
            "init_pid": self.runtime.init_pid if self.runtime else None,
            "snapshot": s.snapshot, "pause_ttl": s.pause_ttl, "paused_at": self.paused_at,
        }

    @property
    def layers(self) -> list[str]:
        """The snapshot layers this sandbox stands on (bottom first)."""
        return list(self.runtime.extra.get("layers", ())) if self.runtime else []

    def meta(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "spec": self.spec.model_dump(mode="json"),
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "runtime": self.runtime.to_json() if self.runtime else None,
            "paused_at": self.paused_at,
            "trajectory": self.trajectory,
        }


def by_operator(sb: Sandbox, key: str | None) -> bool:
    """Is a kill of ``sb`` carrying idempotency key ``key`` an operator's (infra for its
    trajectory) rather than the trajectory's own? Only a sandbox made for a trajectory ``T``
    can tell: its own client keys its kill ``T:{step}`` or with an explicit key (no ``:``);
    a kill with no key (``corral rm``, a batch destroy) or another trajectory's key is an
    operator's. A sandbox made without a trajectory cannot tell: every kill is its own."""
    if sb.trajectory is None:
        return False
    if key is None:
        return True
    head, sep, _ = key.rpartition(":")
    return bool(sep) and head != sb.trajectory


CREATE_WORKERS = max(2, min(8, 2 * (os.cpu_count() or 2)))
# Worker threads a batch destroy (kill_many) is split over: one per core at most.
DESTROY_THREADS = max(1, min(4, os.cpu_count() or 1))


async def _settle(fut: asyncio.Future[Any]) -> bool:
    """Wait until ``fut`` is done even if this task is cancelled meanwhile (what it makes must
    be undone, not leaked); True if a cancel came in while waiting."""
    cancelled = False
    while not fut.done():
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            cancelled = True
        except BaseException:  # noqa: BLE001 - the caller reads fut.result()
            break
    return cancelled


def new_id() -> str:
    return "sb-" + os.urandom(8).hex()


def os_error(e: OSError, path: str = "") -> CorralError:
    """Map a file-operation OSError to the API's error."""
    where = f": {path}" if path else ""
    n = e.errno
    if n == errno.ENOENT:
        return FileNotFound(f"no such file or directory{where}")
    if n == errno.EEXIST:
        return FileExists(f"file exists{where}")
    if n == errno.ENOTDIR:
        return NotADirectory(f"not a directory{where}")
    if n == errno.EISDIR:
        return IsADirectory(f"is a directory{where}")
    if n == errno.ENOTEMPTY:
        return DirectoryNotEmpty(f"directory not empty{where}")
    if n == errno.ELOOP:
        return IsASymlink(f"{os.strerror(n)}{where}", details={"errno": n})
    if n in (errno.EXDEV, errno.ENAMETOOLONG, errno.EINVAL):
        return InvalidPath(f"{os.strerror(n)}{where}")
    if n in (errno.EACCES, errno.EPERM, errno.EROFS):
        return PermissionDenied(f"{os.strerror(n)}{where}", details={"errno": n})
    if n in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return InvalidRequest(f"{os.strerror(n)}{where}", details={"errno": n})
    if n in _INPUT_ERRNOS:  # the request named a file that cannot be used that way
        return InvalidRequest(f"{os.strerror(n)}{where}", details={"errno": n})
    return InternalError(f"{e.strerror or e}{where}", details={"errno": n})


# Errors a file operation gets from what the request named (a special file, a busy file), not
# from a fault of the daemon.
_INPUT_ERRNOS = frozenset({errno.EIO, errno.ENXIO, errno.ENODEV, errno.EOPNOTSUPP,
                           errno.ETXTBSY, errno.EBUSY, errno.ESPIPE, errno.EOVERFLOW,
                           errno.E2BIG, errno.ERANGE, errno.EMLINK, errno.EFAULT})


class Engine:
    def __init__(self, config: Config, *, substrates: Sequence[str] | None = None,
                 images: Any = None) -> None:
        """``substrates``: the registered substrates to serve (default: the registry's
        defaults); made at start (corral.daemon.substrates.registry)."""
        self.config = config
        self.sandboxes: dict[str, Sandbox] = {}
        self.tombstones: OrderedDict[str, str] = OrderedDict()
        self.causes: dict[str, dict[str, Any]] = {}  # tombstoned "crashed" ids: the cause
        self.substrate_names = list(substrates) if substrates is not None \
            else registry.defaults()
        self.substrates: dict[str, Substrate] = {}
        # Substrates asked for that this host cannot run, with why (registry.Unavailable).
        self.unavailable: dict[str, str] = {}
        self.images = images
        # Host-wide resources the substrates made (registry.Context.shared).
        self.shared: dict[str, Any] = {}
        self.sandboxes_dir = os.path.join(config.state_dir, "sandboxes")
        self.started_at = time.time()
        self.shutting_down = False
        self._shutdown_ended: list[str] = []  # see _save_shutdown_tombstones
        self.counters: dict[str, int] = {
            "created": 0, "create_failed": 0, "execs": 0, "exec_timeouts": 0, "lost": 0,
            "crashed": 0,
            "expired": 0, "idle_timeout": 0, "killed": 0, "operator_killed": 0, "adopted": 0,
            "orphans_removed": 0,
            "snapshots": 0,
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
                               start_ms=config.trajlog_start_ms)

    # ---- start / stop --------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        os.makedirs(self.sandboxes_dir, mode=0o700, exist_ok=True)
        await self._make_substrates()
        self.snaps = snapshots.SnapshotStore(self.config.state_dir,
                                             self.config.snapshot_max_bytes,
                                             self.config.snapshot_max_entries)
        await asyncio.to_thread(self.snaps.load)
        self.trajlog.open(self._loop)
        self._load_shutdown_tombstones()
        self._recover()
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

            self.images = ImageStore(self.config.state_dir)
        await asyncio.to_thread(self.images.ensure_host)
        ctx = registry.Context(self.config, self.images, self.shared)
        self.substrates = registry.build(self.substrate_names, ctx, self.unavailable)

    def _recover(self) -> None:
        """Re-adopt every sandbox a previous daemon left running; clean up everything else."""
        known: set[str] = set()
        lost = 0
        for sid, meta in persist.iter_records(self.sandboxes_dir):
            if not meta or not meta.get("runtime"):
                continue  # half-made (crash mid-create): cleanup_orphans removes it
            try:
                spec = SandboxSpec.model_validate(meta["spec"])
                runtime = SandboxRuntime.from_json(meta["runtime"])
                substrate = self.substrates[spec.substrate]
            except Exception:  # noqa: BLE001 - an unreadable record is an orphan
                log.warning("unreadable sandbox record", extra={"sandbox": sid})
                continue
            try:
                alive = substrate.adopt(runtime)
            except Exception:  # noqa: BLE001
                log.exception("adopt failed", extra={"sandbox": sid})
                alive = False
            if not alive:
                lost += 1
                try:
                    cause = substrate.end_cause(runtime)
                except Exception:  # noqa: BLE001 - no cause found: lost
                    log.exception("end_cause failed", extra={"sandbox": sid})
                    cause = None
                try:
                    substrate.destroy(runtime)
                except Exception:  # noqa: BLE001
                    log.exception("destroy of a dead sandbox failed", extra={"sandbox": sid})
                removal.remove_or_quarantine(os.path.join(self.sandboxes_dir, sid))
                self._tombstone(sid, "crashed" if cause else "lost", cause)
                continue
            sb = Sandbox(sid, spec, float(meta["created_at"]), float(meta["expires_at"]))
            sb.runtime = runtime
            sb.state = "running"
            sb.trajectory = meta.get("trajectory")
            if self._frozen(substrate, runtime):
                if meta.get("paused_at"):
                    sb.state, sb.paused_at = "paused", float(meta["paused_at"])
                else:
                    # Frozen but not paused: the last daemon died in a snapshot's capture (or
                    # between a pause's freeze and its record, or a resume's thaw and its
                    # record). Left so, its next exec would freeze with the loop waiting.
                    self._thaw_adopted(substrate, sb)
            if self.snaps is not None:
                self.snaps.acquire(sb.layers)
            sb.last_active = time.time()  # the idle clock restarts with the daemon
            self.sandboxes[sid] = sb
            known.add(sid)
            self._watch(sb)
            self._schedule(sb, time.time())
        removed: list[str] = []
        for substrate in self.substrates.values():
            try:
                removed += substrate.cleanup_orphans(known)
            except Exception:  # noqa: BLE001
                log.exception("cleanup_orphans failed", extra={"substrate": substrate.name})
        for sid, _ in persist.iter_records(self.sandboxes_dir):
            if sid not in known:  # belt and braces: records the substrate did not know
                removal.remove_or_quarantine(os.path.join(self.sandboxes_dir, sid))
        trash = os.path.join(self.sandboxes_dir, ".trash")  # restores a crash interrupted
        with contextlib.suppress(OSError):
            for name in os.listdir(trash):
                removal.remove_or_quarantine(os.path.join(trash, name), self.sandboxes_dir)
        qdir = os.path.join(self.sandboxes_dir, removal.QUARANTINE)
        with contextlib.suppress(OSError):  # left by an earlier run: one more try each
            for name in os.listdir(qdir):
                try:
                    removal.remove_tree(os.path.join(qdir, name))
                except OSError:
                    removal.quarantined.append(os.path.join(qdir, name))
        self.trajlog.readopted([(sid, sb.spec.model_dump(mode="json"), sb.created_at, sb.info())
                                for sid, sb in self.sandboxes.items() if sid in known])
        self.trajlog.recovered(known)
        self.counters["adopted"] = len(known)
        self.counters["orphans_removed"] = len(removed)
        log.info("recovered state", extra={"adopted": len(known), "lost": lost,
                                           "orphans_removed": len(removed)})

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

    # Ids of sandboxes that a graceful stop destroyed, kept across restarts: a client coming
    # back after `corral down; corral up` (or a restart by its supervisor) gets
    # daemon_restarted, an infra error a trainer masks, not sandbox_not_found.
    def _save_shutdown_tombstones(self) -> None:
        ids = [*self._shutdown_ended, *self.sandboxes][-TOMBSTONES:]
        try:
            persist.write_json_atomic(os.path.join(self.config.state_dir, SHUTDOWN_ENDED),
                                      {"ids": ids})
        except OSError as e:
            log.warning("cannot record the sandboxes this stop ends", extra={"error": str(e)})

    def _load_shutdown_tombstones(self) -> None:
        path = os.path.join(self.config.state_dir, SHUTDOWN_ENDED)
        try:
            ids = persist.read_json(path)["ids"]
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("unreadable record of the last stop's sandboxes",
                        extra={"error": str(e)})
            return
        self._shutdown_ended = [str(i) for i in ids][-TOMBSTONES:]
        for sid in self._shutdown_ended:
            self._tombstone(sid, "shutdown")

    # ---- lookup --------------------------------------------------------------------------
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
        if reason == "lost":
            return SandboxLost(text, details=details)
        if reason == "shutdown":
            return DaemonRestarted(text, details=details)
        return SandboxNotRunning(text, details=details)

    def get(self, sid: str) -> Sandbox:
        """A running sandbox (a paused one is resumed); refreshes its idle clock."""
        sb = self.sandboxes.get(sid)
        if sb is not None and sb.state == "paused":
            self._resume(sb)
        if sb is None or sb.state != "running":
            raise self._gone(sid, sb)
        sb.last_active = time.time()
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
        sb.last_active = time.time()
        return sb

    def _substrate(self, name: str) -> Substrate:
        sub = self.substrates.get(name)
        if sub is None:
            raise registry.unknown(name, list(self.substrates), self.unavailable)
        return sub

    def _for_create(self, spec: SandboxSpec) -> Substrate:
        """The substrate a create names, checked against its capabilities."""
        sub = self._substrate(spec.substrate)
        caps = sub.capabilities
        if spec.network not in caps.networks:
            raise Unsupported(f"network {spec.network!r} is not supported on substrate "
                              f"{sub.name!r} (it has: {', '.join(caps.networks)})",
                              details={"substrate": sub.name, "network": spec.network})
        if spec.snapshot is not None and not caps.snapshot:
            raise Unsupported(f"snapshots are not supported on substrate {sub.name!r}",
                              details={"substrate": sub.name, "operation": "snapshot"})
        return sub

    @staticmethod
    def _lacks(sub: Substrate, what: str) -> Unsupported:
        return Unsupported(f"{what} is not supported on substrate {sub.name!r}",
                           details={"substrate": sub.name, "operation": what})

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

    def _admit(self, n: int) -> None:
        if self.shutting_down:
            raise DaemonRestarted("the daemon is shutting down")
        cap = self.config.max_sandboxes
        if len(self.sandboxes) + n > cap:
            raise CapacityExceeded(
                f"capacity exceeded: {len(self.sandboxes)} of {cap} sandboxes in use, "
                f"{n} requested", details={"in_use": len(self.sandboxes), "capacity": cap})

    # ---- create --------------------------------------------------------------------------
    async def _create_one(self, substrate: Substrate, spec: SandboxSpec, image: Any,
                          demand: int = 1, trajectory: str | None = None) -> Sandbox:
        # A warm one if a pool has it (corral.daemon.pools): its id was drawn when it was made.
        pooled = self.pools.take(spec, demand) if self.pools is not None else None
        sid = pooled.sandbox_id if pooled is not None else new_id()
        now = time.time()
        sb = Sandbox(sid, spec, now, now + spec.timeout)
        sb.trajectory = trajectory
        sdir = os.path.join(self.sandboxes_dir, sid)
        meta_path = os.path.join(sdir, persist.META)
        # The directory is the record until meta.json exists: a crash mid-create leaves a
        # dir without a runtime, which recovery hands to cleanup_orphans with everything else.
        if pooled is None:
            os.mkdir(sdir, 0o700)
        self.sandboxes[sid] = sb  # counts against capacity while being made
        try:
            if pooled is not None:
                sb.runtime = pooled
            else:
                # In a worker thread (the Rust core releases the GIL): creates of concurrent
                # clients, and of a batch, use every core; the loop stays free meanwhile.
                sb.threads += 1  # a stop meanwhile (shutdown) waits for the runtime, then kills it
                try:
                    fut = asyncio.ensure_future(asyncio.to_thread(substrate.create, sid, spec,
                                                                  image))
                    cancelled = await _settle(fut)
                    sb.runtime = fut.result()
                finally:
                    sb.threads -= 1
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
            persist.write_json_atomic(meta_path, sb.meta())
        except BaseException as e:
            self.counters["create_failed"] += 1
            if sb.stopping is not None:
                raise  # being destroyed by the stop that caught it half-made
            del self.sandboxes[sid]
            if sb.state == "running" and sb.layers and self.snaps is not None:
                self.snaps.release(sb.layers)
            if sb.runtime is not None:
                try:
                    substrate.destroy(sb.runtime)
                except Exception:  # noqa: BLE001
                    log.exception("destroy after a failed create", extra={"sandbox": sid})
            removal.remove_or_quarantine(sdir)
            if isinstance(e, CorralError) or not isinstance(e, Exception):
                raise
            if isinstance(e, OSError) and e.errno in (errno.EAGAIN, errno.ENOMEM,
                                                      errno.ENOSPC):
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

    async def create(self, spec: SandboxSpec, trajectory: str | None = None) -> Sandbox:
        substrate = self._for_create(spec)
        self._admit(1)
        spec, image = self._resolve(substrate, spec)
        return await self._create_one(substrate, spec, image, trajectory=trajectory)

    def _resolve(self, substrate: Substrate, spec: SandboxSpec) -> tuple[SandboxSpec, Any]:
        """The image to start on: the spec's, or a snapshot's image with its layers on top
        (the spec then names the snapshot by id and its image)."""
        if spec.snapshot is None:
            return spec, self._image(spec.image)
        store = self._snaps()
        rec = store.get(spec.snapshot)
        base = self._image(rec["image"])
        spec = spec.model_copy(update={"snapshot": rec["id"], "image": rec["image"]})
        return spec, substrate.image_on(base, rec["layers"], store)

    async def create_many(self, count: int, spec: SandboxSpec,
                          trajectories: list[str] | None = None) -> list[Sandbox]:
        """All or nothing: on the first failure the ones already made are destroyed."""
        substrate = self._for_create(spec)
        self._admit(count)
        spec, image = self._resolve(substrate, spec)
        if count > 1:
            substrate.expect(count, spec)
        layers = self._image_layers(image)
        if self.snaps is not None:
            self.snaps.acquire(layers)  # held for the batch: an rm meanwhile cannot collect
        try:
            return await self._create_many(substrate, count, spec, image, trajectories)
        finally:
            if self.snaps is not None:
                self.snaps.release(layers)

    @staticmethod
    def _image_layers(image: Any) -> list[str]:
        return list(image.meta.get("layers") or ())

    async def _create_many(self, substrate: Substrate, count: int, spec: SandboxSpec,
                           image: Any, trajectories: list[str] | None = None) -> list[Sandbox]:
        made: list[Sandbox | None] = [None] * count
        gate = asyncio.Semaphore(CREATE_WORKERS)  # creates of one batch in flight at once
        failed: list[BaseException] = []

        async def one(i: int) -> None:
            async with gate:
                if failed:
                    return
                try:
                    self._admit(1)
                    # The batch counts as demand once, with its size.
                    made[i] = await self._create_one(substrate, spec, image,
                                                     count if i == 0 else 0,
                                                     trajectories[i] if trajectories else None)
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

    # ---- liveness, reaper, destroy --------------------------------------------------------
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
            await asyncio.sleep(self.config.reaper_interval_s)
            try:
                self.reap(time.time())
                self.trajlog.maybe_prune(time.time())
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
            while sb.threads:
                await asyncio.sleep(0.005)
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
            while any(sb.threads for sb in sbs):  # see _destroy
                await asyncio.sleep(0.005)
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
        self.sandboxes.pop(sb.id, None)
        if self.pools is not None:
            self.pools.settled(sb.id)
        if sb.layers and self.snaps is not None:
            self.snaps.release(sb.layers)
        self._tombstone(sb.id, sb.reason or "killed", sb.cause)
        self.trajlog.sandbox_ended(sb.id, sb.reason or "killed")
        log.debug("sandbox destroyed", extra={"sandbox": sb.id, "reason": sb.reason})

    def _tombstone(self, sid: str, reason: str, cause: dict[str, Any] | None = None) -> None:
        self.tombstones[sid] = reason
        if reason == "crashed" and cause:
            self.causes[sid] = cause
        else:
            self.causes.pop(sid, None)
        while len(self.tombstones) > TOMBSTONES:
            old, _ = self.tombstones.popitem(last=False)
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

    async def kill_many(self, ids: list[str]) -> list[dict[str, Any]]:
        """Kill each; one result per id, in order: ``{"id", "killed"}`` or ``{"error"}``.
        Every destroy is started before the first is awaited, so they overlap."""
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
            await asyncio.shield(asyncio.gather(*stops, return_exceptions=True))
        return out

    def set_timeout(self, sid: str, timeout: float) -> Sandbox:
        sb = self.get(sid)
        now = time.time()
        sb.expires_at = now + timeout
        persist.write_json_atomic(os.path.join(self.sandboxes_dir, sid, persist.META), sb.meta())
        self._schedule(sb, now)
        return sb

    def list(self, labels: dict[str, str | None]) -> list[Sandbox]:
        out = []
        for sb in self.sandboxes.values():
            if sb.state not in ("running", "paused"):
                continue
            have = sb.spec.labels
            if all(k in have and (v is None or have[k] == v) for k, v in labels.items()):
                out.append(sb)
        return out

    # ---- exec ----------------------------------------------------------------------------
    def _identity(self, sb: Sandbox, user: str | int | None) -> users.Identity:
        if user is None or user == 0 or user in ("root", "0"):
            return users.ROOT
        sub = self.substrates[sb.spec.substrate]

        def read(path: str) -> str:
            try:
                return sub.read_file(sb.rt, path, PASSWD_MAX).decode("utf-8", "replace")
            except (FileNotFound, FileNotFoundError):
                return ""

        return users.resolve(user, read("/etc/passwd"), read("/etc/group"))

    async def exec(self, sid: str, req: ExecRequest) -> dict[str, Any]:
        if self._capturing(sid):
            await self.wait_capture(sid)
        sb = self.get(sid)
        for k, v in req.env.items():
            if not k or "=" in k or "\0" in k or "\0" in v:
                raise InvalidRequest(f"bad environment variable name or value: {k!r}")
        cwd = req.cwd or sb.spec.cwd
        if not cwd.startswith("/") or "\0" in cwd:
            raise InvalidPath(f"cwd must be an absolute path: {cwd!r}")
        if req.cwd is not None or cwd != DEFAULT_CWD:
            await self._check_cwd(sid, cwd)
        ident = self._identity(sb, req.user)
        env = {"PATH": DEFAULT_PATH, "HOME": ident.home, "LANG": "C.UTF-8", "TERM": "xterm",
               "HOSTNAME": sb.hostname}
        env.update(sb.spec.env)
        env.update(req.env)
        argv = ["/bin/sh", "-c", req.cmd] if isinstance(req.cmd, str) else req.cmd
        stdin = req.stdin.encode() if req.stdin is not None else None
        substrate = self.substrates[sb.spec.substrate]
        assert self._loop is not None and sb.runtime is not None
        oom_before = substrate.oom_kills(sb.runtime)  # ExecResult.oom_killed: see _oom_after
        try:
            proc = await procs.start(self._loop, substrate, sb.runtime, argv, env, cwd,
                                     ident.uid, ident.gid, ident.groups, cmd=req.cmd,
                                     stdin=stdin, keep_stdin=req.background,
                                     cap=req.max_output_bytes,
                                     timeout=_effective_timeout(req))
        except CorralError:
            self._check_alive(sb)  # e.g. sandbox_not_running from a dead init -> lost
            raise
        except OSError as e:
            self._check_alive(sb)
            log.exception("spawn failed", extra={"sandbox": sid})
            raise InternalError(f"could not start the command: {e}") from e
        self.counters["execs"] += 1
        if oom_before is not None:
            runtime = sb.runtime
            proc.on_exit(lambda: self._oom_after(substrate, runtime, proc, oom_before))
        if req.background:
            if not proc.init_child:  # the init told us the pid it sees
                proc.ns_pid = procs.ns_pid(proc.pid)
            self._keep_proc(sb, proc)
            if self.pools is not None:
                self.pools.settled(sid)
            return {"sandbox_id": sid, "pid": proc.ns_pid, "cmd": req.cmd,
                    "started_at": proc.started_at}
        sb.busy += 1
        try:
            await proc.done
        except asyncio.CancelledError:
            proc.killpg(9)  # the daemon is stopping: don't leave the command behind
            raise
        finally:
            sb.busy -= 1
            sb.last_active = time.time()
            if self.pools is not None:  # its first exec is over: refills may start
                self.pools.settled(sid)
        await self.after_exit(sb, proc)
        return self._result(proc)

    async def _check_cwd(self, sid: str, cwd: str) -> None:
        """A cwd named by the client must be a directory inside the sandbox (resolved in its
        root, like a file operation): the command would otherwise start in / unnoticed. The
        default cwd may be missing from an image: then the command starts in /."""
        try:
            entry = await self.stat(sid, cwd)
        except (FileNotFound, NotADirectory):
            raise CwdNotFound(f"cwd {cwd!r} does not exist in the sandbox",
                              details={"cwd": cwd}) from None
        if entry.type not in ("dir", "symlink"):  # a symlink is resolved by chdir itself
            raise NotADirectory(f"cwd {cwd!r} is not a directory", details={"cwd": cwd})

    def _result(self, proc: procs.Process) -> dict[str, Any]:
        res = proc.result()
        if self.trajlog.enabled:  # hashes of the full outputs, for the log (popped there)
            res["_sha"] = (proc.stdout.sha256(), proc.stderr.sha256())
        return res

    async def exec_many(self, ids: builtins.list[str], req: ExecRequest,
                        concurrency: int = 64) -> builtins.list[dict[str, Any]]:
        """The same foreground command in each sandbox, ``concurrency`` at a time; one result
        per id, in order: an ExecResult dict, or ``{"error"}`` for a sandbox where it could not
        run (the others are unaffected)."""
        gate = asyncio.Semaphore(concurrency)
        logged = req.model_dump(mode="json") if self.trajlog.enabled else {}

        async def one(sid: str) -> dict[str, Any]:
            async with gate:
                try:  # each one logged in its sandbox's trajectory log, like a single exec
                    return await self.trajlog.run(sid, "exec", logged, None,
                                                  lambda: self.exec(sid, req),
                                                  to_log=self.trajlog.exec_result)
                except CorralError as e:
                    return e.to_payload()

        return list(await asyncio.gather(*(one(sid) for sid in ids)))

    async def after_exit(self, sb: Sandbox, proc: procs.Process) -> None:
        """If the sandbox ended while the command ran, report that, not an exit code that
        the ending caused. A SIGKILL we did not send (timeout) may be the init dying: the
        kernel kills the namespace's processes *before* the init turns into a zombie, so the
        command's exit can arrive first; give the init's pidfd watcher a moment to fire."""
        if proc.timed_out:
            self.counters["exec_timeouts"] += 1
        elif proc.exit_code == 128 + 9 and sb.state == "running":
            for _ in range(INIT_EXIT_GRACE_STEPS):
                if sb.state != "running" or not self._alive(sb):
                    break
                await asyncio.sleep(0.005)
        if sb.state != "running":
            raise self._gone(sb.id, sb)
        if not self._alive(sb):
            self._lose(sb)
            raise self._gone(sb.id, sb)

    @staticmethod
    def _oom_after(substrate: Substrate, runtime: Any, proc: procs.Process,
                   before: int) -> None:
        """At the command's exit: did the OOM killer kill in the sandbox while it ran? Read
        as the exit is seen, so a background command's answer does not depend on when it is
        waited for. The counter is the sandbox's: an OOM kill of a concurrent command's
        process counts too."""
        try:
            after = substrate.oom_kills(runtime)
        except (OSError, ValueError):
            return
        proc.oom_killed = after is not None and after > before

    def _keep_proc(self, sb: Sandbox, proc: procs.Process) -> None:
        if sb.procs is None:
            sb.procs = {}
        table = sb.procs
        if len(table) >= MAX_PROCS_KEPT:
            for pid in [pid for pid, p in table.items() if not p.running]:
                del table[pid]
                if len(table) < MAX_PROCS_KEPT // 2:
                    break
        old = table.pop(proc.ns_pid, None)
        if old is not None:
            old.release()
        table[proc.ns_pid] = proc

    def proc(self, sid: str, pid: int) -> tuple[Sandbox, procs.Process]:
        sb = self.get(sid)
        p = sb.procs.get(pid) if sb.procs else None
        if p is None:
            raise ProcessNotFound(f"no background process {pid} in sandbox {sid}",
                                  details={"id": sid, "pid": pid})
        return sb, p

    def proc_status(self, sid: str, pid: int) -> dict[str, Any]:
        return self.proc(sid, pid)[1].status()

    @contextlib.contextmanager
    def following(self, sb: Sandbox) -> Iterator[None]:
        """A client follows a process's output: activity, as a foreground exec is (the
        sandbox does not idle out meanwhile)."""
        sb.busy += 1
        try:
            yield
        finally:
            sb.busy -= 1

    async def wait(self, sid: str, pid: int, timeout: float | None) -> dict[str, Any]:
        sb, p = self.proc(sid, pid)
        if p.running:
            await self.until_exit(sb, p, timeout)
            await self.after_exit(sb, p)
        return self._result(p)

    async def until_exit(self, sb: Sandbox, p: procs.Process, timeout: float | None) -> None:
        """Wait for a background process; a client waiting on it keeps the sandbox from
        idling out, like a foreground exec."""
        sb.busy += 1
        try:
            await asyncio.wait_for(asyncio.shield(p.done), timeout)
        except asyncio.TimeoutError:
            raise ProcessStillRunning(f"process {p.ns_pid} still running after {timeout} s",
                          details={"pid": p.ns_pid}) from None
        finally:
            sb.busy -= 1
            sb.last_active = time.time()

    def stdin(self, sid: str, pid: int, data: str, eof: bool) -> None:
        _, p = self.proc(sid, pid)
        if not p.running:
            raise Conflict(f"process {pid} has exited", details={"pid": pid})
        if p.stdin is None:
            raise Conflict(f"process {pid} has no stdin pipe", details={"pid": pid})
        p.stdin.write(data.encode(), eof)

    def signal(self, sid: str, pid: int, sig: int) -> None:
        _, p = self.proc(sid, pid)
        p.killpg(sig)

    # ---- files ---------------------------------------------------------------------------
    async def _files(self, sid: str, path: str,
                     call: Callable[[Substrate, SandboxRuntime], T], big: bool = False) -> T:
        """Run a substrate file operation on ``path`` (errors name it); ``big`` ones in a
        thread."""
        if self._capturing(sid):
            await self.wait_capture(sid)
        sb = self.get(sid)
        sub = self.substrates[sb.spec.substrate]
        if not sub.capabilities.files:
            raise self._lacks(sub, "files")
        runtime = sb.runtime
        assert runtime is not None
        try:
            if big:
                sb.threads += 1
                try:
                    return await asyncio.to_thread(call, sub, runtime)
                finally:
                    sb.threads -= 1
            return call(sub, runtime)
        except CorralError as e:
            if sb.state == "running":
                self._check_alive(sb)
            elif sb.reason is not None:  # it ended (or is ending) meanwhile: say why, as exec
                raise self._gone(sb.id, sb) from e  # does (a shutdown: daemon_restarted)
            raise
        except OSError as e:
            self._check_alive(sb)
            raise os_error(e, path) from e

    async def stat(self, sid: str, path: str) -> FileEntry:
        return await self._files(sid, path, lambda s, rt: s.stat(rt, path))

    async def list_dir(self, sid: str, path: str) -> builtins.list[FileEntry]:
        return await self._files(sid, path, lambda s, rt: s.list_dir(rt, path))

    async def mkdir(self, sid: str, path: str, parents: bool) -> None:
        await self._files(sid, path, lambda s, rt: s.mkdir(rt, path, parents))

    async def remove(self, sid: str, path: str, recursive: bool) -> None:
        await self._files(sid, path, lambda s, rt: s.remove(rt, path, recursive),
                          big=recursive)

    async def rename(self, sid: str, src: str, dst: str) -> None:
        await self._files(sid, src, lambda s, rt: s.rename(rt, src, dst))

    async def write_file(self, sid: str, path: str, data: bytes | BinaryIO, mode: int,
                         big: bool = False) -> None:
        await self._files(sid, path, lambda s, rt: s.write_file(rt, path, data, mode, True),
                          big=big)

    async def upload_tar(self, sid: str, path: str, data: bytes | BinaryIO,
                         big: bool = True) -> None:
        await self._files(sid, path, lambda s, rt: s.upload_tar(rt, path, data), big=big)

    async def read_file(self, sid: str, path: str,
                        max_bytes: int) -> tuple[bytes, bool, int | None]:
        """(data, truncated, fd): at most ``max_bytes``. Most reads are small: tried on the
        loop and returned whole. A bigger file is not read here: ``fd`` is an open, checked fd
        of it (data empty) for the caller to stream in bounded chunks and close
        (corral.daemon.streams), so the daemon's memory does not grow with the file."""
        first = min(max_bytes, DIRECT_IO_BYTES)
        data = await self._files(sid, path, lambda s, rt: s.read_file(rt, path, first + 1))
        if len(data) > first and first < max_bytes:
            fd, size = await self._files(sid, path, lambda s, rt: s.open_read(rt, path),
                                         big=True)
            return b"", size > max_bytes, fd
        if len(data) > max_bytes:
            return data[:max_bytes], True, None
        return data, False, None

    async def plan_tar(self, sid: str, path: str, max_bytes: int,
                       max_members: int) -> streams.TreeOps:
        """Check that a tar of ``path`` stays within the caps (a walk that only stats, in a
        thread); returns the primitives to stream it with (streams.chunks)."""
        ops = await self._files(sid, path, lambda s, rt: s.tree_ops(rt, path))
        await self.stat(sid, path)  # a missing path fails here, with its error
        sb = self.get(sid)
        sb.threads += 1
        try:
            await asyncio.to_thread(streams.plan, ops, path.rstrip("/") or "/", max_bytes,
                                    max_members)
        finally:
            sb.threads -= 1
        return ops

    # ---- snapshots, fork, restore (corral.daemon.snapshots) ---------------------------------
    def _snaps(self) -> snapshots.SnapshotStore:
        if self.snaps is None:
            raise Unsupported("snapshots are not available")
        return self.snaps

    async def snapshot(self, sid: str, name: str | None) -> dict[str, Any]:
        """The sandbox's files (what it changed over its image) as a new layer on its own
        chain (Substrate.capture)."""
        store = self._snaps()
        sb = self.lookup(sid)
        substrate = self.substrates[sb.spec.substrate]
        if not substrate.capabilities.snapshot:
            raise self._lacks(substrate, "snapshot")
        if name is not None and name in store.by_name:  # checked again in commit
            raise SnapshotExists(f"a snapshot named {name!r} exists", details={"name": name})
        while True:  # one capture at a time (a freeze is shared), after file ops in flight
            await self.wait_capture(sid)
            sb = self.lookup(sid)
            if not sb.threads:
                break
            await asyncio.sleep(0.001)
        base = sb.layers
        image = self._image(sb.spec.image)
        runtime = sb.runtime
        assert runtime is not None
        paused = sb.state == "paused"
        layers = list(base)
        store.acquire(layers)  # the sandbox may die meanwhile: keep its chain
        sb.threads += 1
        sb.capturing = asyncio.get_running_loop().create_future()
        try:
            tmp, digest, size = await asyncio.to_thread(substrate.capture, runtime,
                                                        substrate.image_on(image, base, store),
                                                        store, paused)
        finally:
            sb.threads -= 1
            store.release(layers)
            done, sb.capturing = sb.capturing, None
            done.set_result(None)
        rec = store.commit(tmp, digest, size, name=name, parent=sb.spec.snapshot,
                           image=sb.spec.image, base=base, sandbox_id=sid)
        if store.wants_spares():  # the next capture's dir, made while this one answers
            task = asyncio.ensure_future(asyncio.to_thread(store.refill_spares))
            self._batch_tasks.add(task)
            task.add_done_callback(self._batch_tasks.discard)
        self.counters["snapshots"] = self.counters.get("snapshots", 0) + 1
        return rec

    async def fork(self, sid: str, count: int, name: str | None, keep: bool,
                   key: str | None = None) -> tuple[dict[str, Any], builtins.list[Sandbox]]:
        """Snapshot + ``count`` sandboxes on it with the parent's spec (one call). A parent
        made for trajectory ``T`` forked under key ``T:S`` (or explicit key ``S``) gives child
        ``i`` the trajectory ``T/forkS/i``, the SDK's name for it."""
        sb = self.lookup(sid)
        substrate = self.substrates[sb.spec.substrate]
        if not substrate.capabilities.snapshot:
            raise self._lacks(substrate, "fork")
        self._admit(count)
        kids_of: list[str] | None = None
        if sb.trajectory is not None and key is not None:
            head, sep, step = key.rpartition(":")
            if not sep or head == sb.trajectory:
                kids_of = [f"{sb.trajectory}/fork{step}/{i}" for i in range(count)]
        rec = await self.snapshot(sid, name)
        spec = sb.spec.model_copy(update={"snapshot": rec["id"]})
        try:
            kids = await self.create_many(count, spec, kids_of)
        finally:
            if not keep:
                self._snaps().delete(rec["id"])  # the children hold its layers
        return rec, kids

    async def restore(self, sid: str, key: str) -> Sandbox:
        """Roll a sandbox back to a snapshot in place: same id, spec and limits; its
        processes are killed and a new init starts on the snapshot (Substrate.reset)."""
        store = self._snaps()
        sb = self.lookup(sid)
        substrate = self.substrates[sb.spec.substrate]
        if not substrate.capabilities.restore:
            raise self._lacks(substrate, "restore")
        rec = store.get(key)
        image = substrate.image_on(self._image(rec["image"]), rec["layers"], store)
        old_layers = sb.layers
        store.acquire(rec["layers"])
        spec = sb.spec.model_copy(update={"snapshot": rec["id"], "image": rec["image"]})
        self._unwatch(sb)
        sb.state, sb.reason, sb.paused_at = "restoring", "restoring", None
        try:
            while sb.threads:
                await asyncio.sleep(0.001)
            # Counted as a thread: a kill or a shutdown that comes meanwhile waits for the
            # reset, then destroys what it made (not the runtime being replaced under it).
            sb.threads += 1
            try:
                runtime = await asyncio.to_thread(substrate.reset, sb.rt, spec, image)
            finally:
                sb.threads -= 1
        except BaseException:
            store.release(rec["layers"])
            if sb.stopping is None:
                sb.reason = None
                self._lose(sb)  # the old init is gone or in an unknown state
            raise
        if sb.procs:
            for p in sb.procs.values():
                p.release()
            sb.procs = None
        runtime.extra["layers"] = list(rec["layers"])
        sb.runtime, sb.spec = runtime, spec
        if sb.stopping is not None:  # killed or shut down while restoring: it stays so
            store.release(old_layers)  # (the destroy in flight releases the new ones)
            raise self._gone(sid, sb)
        sb.state, sb.reason = "running", None
        sb.last_active = time.time()
        persist.write_json_atomic(os.path.join(self.sandboxes_dir, sid, persist.META), sb.meta())
        store.release(old_layers)
        self._watch(sb)
        self._schedule(sb, time.time())
        return sb

    def snapshot_list(self) -> builtins.list[dict[str, Any]]:
        return self._snaps().list()

    def snapshot_get(self, key: str) -> dict[str, Any]:
        return self._snaps().get(key)

    def snapshot_delete(self, key: str) -> dict[str, Any]:
        return self._snaps().delete(key)

    # ---- pause / resume --------------------------------------------------------------------
    def _capturing(self, sid: str) -> bool:
        """A snapshot's capture holds the sandbox frozen (cheap: the exec path asks first)."""
        sb = self.sandboxes.get(sid)
        return sb is not None and sb.capturing is not None

    async def wait_capture(self, sid: str) -> None:
        """Return once no snapshot capture holds the sandbox frozen. Anything that starts a
        process in it waits here first: a process joining a frozen sandbox freezes at once,
        and the daemon's spawn (a vfork) would wait for it with the event loop blocked until
        the capture thaws. Pause and resume wait too (a resume would thaw the capture's
        freeze mid-copy; a capture's thaw would undo a pause made during it), and so do file
        operations (so a snapshot never holds half of a write made during it)."""
        sb = self.sandboxes.get(sid)
        while sb is not None and sb.capturing is not None:
            await asyncio.shield(sb.capturing)
            sb = self.sandboxes.get(sid)

    @staticmethod
    def _frozen(substrate: Substrate, runtime: SandboxRuntime) -> bool:
        """Frozen or freezing: a process started in it would not run."""
        try:
            return substrate.is_frozen(runtime)
        except OSError:
            return False

    def pause(self, sid: str) -> Sandbox:
        """Freeze every process of the sandbox (Substrate.freeze): no CPU until resumed."""
        sb = self.lookup(sid)
        substrate = self.substrates[sb.spec.substrate]
        if not substrate.capabilities.pause:
            raise self._lacks(substrate, "pause")
        if sb.state == "paused":
            return sb
        assert sb.runtime is not None
        try:
            substrate.freeze(sb.runtime)
        except OSError as e:
            raise Unsupported(f"cannot pause: {e.strerror or e}") from e
        except TimeoutError as e:
            substrate.thaw(sb.runtime, wait=False)
            raise InternalError(f"cannot pause: {e}") from e
        sb.state, sb.paused_at = "paused", time.time()
        self._persist(sb)
        return sb

    def resume(self, sid: str) -> Sandbox:
        sb = self.lookup(sid)
        substrate = self.substrates[sb.spec.substrate]
        if not substrate.capabilities.pause:
            raise self._lacks(substrate, "resume")
        if sb.state == "paused":
            self._resume(sb)
        return sb

    def _resume(self, sb: Sandbox) -> None:
        assert sb.runtime is not None
        self.substrates[sb.spec.substrate].thaw(sb.runtime)
        now = time.time()
        if sb.spec.pause_ttl == "stop" and sb.paused_at is not None:
            sb.expires_at += now - sb.paused_at  # the TTL clock stood still while paused
            sb.last_active = now
        sb.state, sb.paused_at = "running", None
        self._persist(sb)
        sb.sched = 0.0
        self._schedule(sb, now)

    def _thaw_adopted(self, substrate: Substrate, sb: Sandbox) -> None:
        assert sb.runtime is not None
        log.warning("re-adopted sandbox was frozen but not paused: thawed",
                    extra={"sandbox": sb.id})
        try:
            substrate.thaw(sb.runtime)
        except (OSError, TimeoutError, CorralError):
            log.exception("thaw of a re-adopted sandbox failed", extra={"sandbox": sb.id})

    def _persist(self, sb: Sandbox) -> None:
        try:
            persist.write_json_atomic(os.path.join(self.sandboxes_dir, sb.id, persist.META),
                                      sb.meta())
        except OSError:
            log.exception("cannot write the sandbox record", extra={"sandbox": sb.id})

    # ---- status --------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "version": __version__, "pid": os.getpid(), "started_at": self.started_at,
            "sandboxes": len(self.sandboxes), "capacity": self.config.max_sandboxes,
            "state_dir": self.config.state_dir,
        }
        for sub in self.substrates.values():  # facts of the host they run on
            out.update(sub.status())
        out["substrates"] = sorted(self.substrates)
        return out

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
