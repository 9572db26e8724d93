"""The sandbox record and what every part of the engine uses."""

from __future__ import annotations

import asyncio
import collections
import logging
import os
from typing import Any, TypeVar

from corral.daemon import procs
from corral.daemon.substrates.base import SandboxRuntime
from corral.models import ExecRequest, SandboxSpec, network_kind

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
# ...and the output they keep, in all: finished ones go, oldest first, past either bound
MAX_KEPT_OUTPUT = 64 << 20
# Returned commands whose output pipes a process they left still holds, drained per sandbox
# (so that it never gets SIGPIPE); past this, the oldest's pipes are closed: each costs the
# daemon two fds for as long as the sandbox lives.
MAX_LINGERING = 64
DIRECT_IO_BYTES = 1 << 20    # file reads/writes up to this size skip the thread hop
MAX_READ_BYTES = 1 << 30
PASSWD_MAX = 256 << 10  # bytes of /etc/passwd or /etc/group an exec's user is looked up in
INIT_EXIT_GRACE_STEPS = 40   # x 5 ms: how long an unexplained SIGKILL waits for the init's exit

_CAUSE_TEXT = {
    "oom": "it ran out of memory (the kernel's OOM killer killed in it)",
    "init_exited": "its init process ended",
    "pids": "it reached its process limit (pids)",
    "host_oom": "an out-of-memory kill from outside its own memory limit (the host's or an "
                "enclosing limit's) ended it",
}
# Causes (Substrate.end_cause) that are the host's doing: the sandbox ends as "lost"
# (sandbox_lost, infra) with the cause in its details, not as "crashed".
LOST_CAUSES = frozenset({"host_oom"})

_REASON_TEXT = {
    "killed": "it was killed",
    "operator_killed": "an operator killed it (a kill without its trajectory's key)",
    "expired": "its timeout (TTL) expired",
    "idle_timeout": "its idle timeout expired",
    "lost": "its init process died",
    "network_lost": "its network could not be restored after a daemon restart",
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
                 "last_active", "sched", "busy", "threads", "threads_done", "procs", "stopping",
                 "paused_at", "capturing", "switching", "cause", "trajectory", "lingering")
    # The cluster node this daemon serves (Config.node_id), one per process: set by the Engine.
    node: str | None = None

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
        # Operations on it running in worker threads (file operations, a create, a capture,
        # a reset): a destroy, a capture or a restore waits until there are none.
        self.threads = 0
        self.threads_done: asyncio.Event | None = None  # made by a waiter, set at 0
        self.procs: dict[int, procs.Process] | None = None
        self.stopping: asyncio.Future[None] | None = None
        self.paused_at: float | None = None
        # Set while a snapshot's capture holds the sandbox frozen (Engine.wait_capture).
        self.capturing: asyncio.Future[None] | None = None
        # Set while a pause or a resume runs in a worker thread (Engine._switch): its state
        # is the one before until it has ended.
        self.switching: asyncio.Future[None] | None = None
        self.cause: dict[str, Any] | None = None  # reason "crashed" (or "lost"): why (end_cause)
        # The trajectory it was made for (a create keyed "{T}:create", or child i of a fork
        # keyed for one): a kill without its keys is an operator's (Engine.by_operator).
        self.trajectory: str | None = None
        # Foreground commands that returned while processes they left still hold their
        # output pipes open (Engine._linger).
        self.lingering: collections.deque[procs.Process] | None = None

    def enter_thread(self) -> None:
        self.threads += 1

    def leave_thread(self) -> None:
        self.threads -= 1
        if not self.threads and self.threads_done is not None:
            self.threads_done.set()  # its waiters hold it; the next one makes another
            self.threads_done = None

    async def no_threads(self) -> None:
        """Until none of its operations runs in a worker thread (at once if none does)."""
        while self.threads:
            if self.threads_done is None:
                self.threads_done = asyncio.Event()
            await self.threads_done.wait()

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
            "cpu": s.cpu, "memory_mb": s.memory_mb, "pids": s.pids,
            "network": (s.network if isinstance(s.network, str)
                        else s.network.model_dump(mode="json")),
            "network_group": s.network_group, "bandwidth_mbit": s.bandwidth_mbit,
            "net": self._net(),
            "hostname": self.hostname, "labels": s.labels, "metadata": s.metadata,
            "created_at": self.created_at, "expires_at": self.expires_at,
            "idle_timeout": s.idle_timeout, "last_active_at": self.last_active,
            "init_pid": self.runtime.init_pid if self.runtime else None,
            "snapshot": s.snapshot, "pause_ttl": s.pause_ttl, "paused_at": self.paused_at,
            "trajectory_id": self.trajectory, "node": self.node,
        }

    def _net(self) -> dict[str, Any] | None:
        if network_kind(self.spec.network) not in ("internet", "policy") or \
                self.state not in ("running", "paused"):
            return None
        from corral.daemon.network.manager import network_state

        return network_state(self.id)

    def final_net(self) -> dict[str, Any] | None:
        """A networked sandbox's counters as its network was removed (taken once)."""
        if network_kind(self.spec.network) not in ("internet", "policy"):
            return None
        from corral.daemon.network.manager import network_final_state

        return network_final_state(self.id)

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
