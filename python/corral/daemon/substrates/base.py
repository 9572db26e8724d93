"""The one interface every substrate implements: the boundary between the engine and a way of
running sandboxes (container today).

The engine (``corral.daemon.engine``) owns policy: ids, admission, TTLs, bookkeeping, I/O pumping
of exec pipes, the HTTP mapping. A substrate owns mechanism: making, entering and tearing down one
sandbox, freezing it, capturing and restoring its files, resolving file operations inside its
root. Every method has one return type. What a substrate can do beyond the core (create, exec,
destroy, recover) it declares in ``capabilities``; the engine checks that table before it acts,
and the defaults here of the optional methods raise ``unsupported`` (they are never probed).

Substrate methods that do syscalls are synchronous and cheap (the Rust core releases the GIL);
the engine calls slow ones (destroy, reset, capture, rmtree) through ``asyncio.to_thread``.
Substrates are made by the registry (``corral.daemon.substrates.registry``).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

from corral.daemon.params import page_of
from corral.daemon.substrates.types import (
    Capabilities,
    ExecSpec,
    NotCached,
    OomCount,
    PauseHeldOff,
    SandboxRuntime,
    Spawned,
    oom_verdict,
)
from corral.errors import Unsupported
from corral.models import FileEntry, SandboxSpec

if TYPE_CHECKING:
    from corral.daemon.snapshots import CaptureControl, SnapshotStore
    from corral.daemon.streams import TreeOps

__all__ = ["Capabilities", "ExecSpec", "NotCached", "OomCount", "PauseHeldOff",
           "SandboxRuntime", "Spawned", "Substrate", "oom_verdict"]


class NetworkControl(Protocol):
    """A substrate's network beyond ``none``/``disabled`` (modes internet and policies:
    corral.daemon.network): what the engine asks of it."""

    @property
    def allowlists(self) -> Mapping[str, Any]: ...

    def blocked(self) -> dict[str, list[str]]: ...
    def set_blocked(self, items: list[str]) -> dict[str, list[str]]: ...
    def check(self, network: Any) -> None: ...
    async def expose(self, sandbox_id: str, port: int, host_port: int = 0) -> int: ...
    def unexpose(self, sandbox_id: str, port: int) -> bool: ...
    def update(self, sandbox_id: str, network: Any) -> None: ...


class Substrate(ABC):
    name: str
    capabilities: Capabilities = Capabilities()

    def _lacks(self, what: str) -> Unsupported:
        return Unsupported(f"{what} is not supported on substrate {self.name!r}",
                           details={"substrate": self.name, "operation": what})

    # ---- lifecycle -----------------------------------------------------------------------
    @abstractmethod
    def create(self, sandbox_id: str, spec: SandboxSpec, image: Any) -> SandboxRuntime:
        """Make and start one sandbox (PID 1 running); raise a CorralError on failure and
        leave nothing behind."""

    @abstractmethod
    def adopt(self, runtime: SandboxRuntime) -> bool:
        """After a daemon restart: reattach to a sandbox if its init is still the same process
        (fills ``runtime.pidfd``). False if it is gone."""

    @abstractmethod
    def destroy(self, runtime: SandboxRuntime) -> None:
        """Kill every process of the sandbox and remove everything it holds on the host.
        Idempotent, works on half-made or already-dead sandboxes, never raises for 'already
        gone'. The sandbox's directory under the state dir goes too."""

    def destroy_many(self, runtimes: list[SandboxRuntime]) -> list[BaseException | None]:
        """``destroy`` each (one worker-thread hop for a batch); one outcome per runtime."""
        out: list[BaseException | None] = []
        for rt in runtimes:
            try:
                self.destroy(rt)
                out.append(None)
            except Exception as e:  # noqa: BLE001 - reported per sandbox by the caller
                out.append(e)
        return out

    def restore_networks(self, adopted: list[tuple[SandboxRuntime, SandboxSpec]]
                         ) -> dict[str, str]:
        """Recovery, once every sandbox is adopted: take over the networks of those adopted
        (all of them at once: one rule set). ``{sandbox id: why}`` for each whose network
        cannot be restored; the engine ends those. Default: nothing to restore."""
        return {}

    @abstractmethod
    def cleanup_orphans(self, known_ids: set[str]) -> list[str]:
        """Recovery: remove every trace (processes, host resources, dirs) of sandboxes not in
        ``known_ids``; return the ids removed."""

    @abstractmethod
    def is_alive(self, runtime: SandboxRuntime) -> bool: ...

    @abstractmethod
    def close(self, *, retire: bool = False) -> None:
        """Release what the substrate holds (never the sandboxes). ``retire``: every sandbox is
        gone (graceful stop), so host-level leftovers go too."""

    def expect(self, count: int, spec: SandboxSpec) -> None:  # noqa: B027 (a hint)
        """A batch of ``count`` creates of ``spec`` is starting (create_many, fork): a hint
        for whatever the substrate keeps ready. Default: nothing."""

    def warm(self, runtime: SandboxRuntime) -> None:  # noqa: B027 (a hint)
        """A sandbox made ahead of demand (warm pool): make now what its first exec would.
        Default: nothing."""

    def claim(self, runtime: SandboxRuntime, spec: SandboxSpec) -> None:  # noqa: B027
        """A pooled sandbox taken for ``spec``: apply what its pool's key left open (the
        pool made it with ``corral.daemon.pools.pool_spec(spec)``). Default: nothing is left
        open; a substrate whose pools hold networked sandboxes applies their policy here."""

    # ---- exits and why ---------------------------------------------------------------------
    def watch_exits(self, loop: asyncio.AbstractEventLoop,
                    on_lost: Callable[[list[str]], None]) -> bool:
        """Learn about dead inits without a pidfd per sandbox in the daemon's fd table:
        ``on_lost`` gets the ids of sandboxes whose init died. False: not done (the engine
        watches each ``runtime.pidfd``). Default: False."""
        return False

    def end_cause(self, runtime: SandboxRuntime) -> dict[str, Any] | None:
        """Why a sandbox whose init died ended, when what ran in it is the cause (its own
        out-of-memory kill, its init crashing): ``{"cause": ...}``, reported as
        ``sandbox_crashed``. None: the cause is outside the sandbox (``sandbox_lost``); so is
        ``{"cause": "host_oom"}`` (engine.base.LOST_CAUSES: an OOM kill from outside its own
        limit), reported as ``sandbox_lost`` with that cause. Called before destroy.
        Default: None."""
        return None

    def oom_kills(self, runtime: SandboxRuntime) -> OomCount | None:
        """The sandbox's OOM counts so far (OomCount: the kills, and the evidence of
        its own limit hit), read by the exec path before and after a command:
        ``ExecResult.oom_killed`` when its own limit was hit, an infra error (cause
        ``host_oom``) when a kill came from outside it (oom_verdict). None: not
        counted here. Default: None."""
        return None

    # ---- exec ----------------------------------------------------------------------------
    @abstractmethod
    def spawn(self, runtime: SandboxRuntime, spec: ExecSpec,
              loop: asyncio.AbstractEventLoop) -> Awaitable[Spawned]:
        """Start a process inside the sandbox in its own session/process group. The request
        is made before this returns (the caller closes its copies of the stdio fds then);
        await the result at once for the started process."""

    # ---- freeze, snapshots, restore (capabilities pause, snapshot, restore) ---------------
    def freeze(self, runtime: SandboxRuntime) -> None:
        """Stop every process of the sandbox from running (pause); OSError when this host
        cannot, TimeoutError when it did not settle (the caller thaws)."""
        raise self._lacks("pause")

    def thaw(self, runtime: SandboxRuntime, wait: bool = True) -> None:
        raise self._lacks("resume")

    def is_frozen(self, runtime: SandboxRuntime) -> bool:
        """Frozen or freezing: a process started in it now would not run. Default: False."""
        return False

    def networking(self) -> NetworkControl | None:
        """The network policy manager when the substrate gives networked sandboxes (modes
        internet and policies), else None."""
        return None

    def image_on(self, image: Any, layers: list[str], store: SnapshotStore) -> Any:
        """``image`` with the snapshot ``layers`` (bottom first) on top, to create on."""
        raise self._lacks("snapshot")

    def capture(self, runtime: SandboxRuntime, image: Any, store: SnapshotStore,
                paused: bool, control: CaptureControl | None = None) -> tuple[str, str, int]:
        """Copy the sandbox's own files (what it changed over ``image``) into a new layer of
        ``store``, frozen meanwhile unless ``paused`` (then it is frozen already): (temporary
        layer dir, digest, bytes) for ``store.commit``. Runs in a worker thread; ``control``
        (passed on to ``store.capture``) reports its bytes copied and cancels it."""
        raise self._lacks("snapshot")

    def capture_estimate(self, runtime: SandboxRuntime) -> int:
        """Bytes a capture of the sandbox is expected to write on the state dir's disk (its
        own files' disk use, where the substrate can tell cheaply). Default: 0 (unknown)."""
        return 0

    def reset(self, runtime: SandboxRuntime, spec: SandboxSpec, image: Any) -> SandboxRuntime:
        """Restart a sandbox in place on ``image`` (restore): every process killed, same id
        and limits; returns the new runtime (the old one is dead either way)."""
        raise self._lacks("restore")

    # ---- what the daemon reports -----------------------------------------------------------
    def metrics(self) -> dict[str, int]:
        """Counters for /metrics (``corral_{name}_total``). Default: none."""
        return {}

    def status(self) -> dict[str, Any]:
        """Facts about the host this substrate runs on, for /v1/status. Default: none."""
        return {}

    # ---- files (capability files): every path is absolute inside the sandbox and resolved
    # inside its root --------------------------------------------------------------------------
    def read_file(self, runtime: SandboxRuntime, path: str, max_bytes: int,
                  cached_only: bool = False) -> bytes:
        """At most ``max_bytes`` of the file. ``cached_only``: raise NotCached rather than
        wait for the disk (a substrate that cannot tell may read anyway)."""
        raise self._lacks("files")

    def write_file(self, runtime: SandboxRuntime, path: str, data: bytes | BinaryIO,
                   mode: int = 0o644, make_parents: bool = True) -> None:
        """``data``: bytes, or a seekable binary file at its start (a spooled body)."""
        raise self._lacks("files")

    def list_dir(self, runtime: SandboxRuntime, path: str) -> list[FileEntry]:
        raise self._lacks("files")

    def list_page(self, runtime: SandboxRuntime, path: str, after: str | None,
                  limit: int) -> tuple[list[FileEntry], str | None]:
        """The entries after ``after`` in name order (the names' bytes), at most ``limit``,
        and the next page's cursor (None: the last page). Here from the whole listing; a
        substrate that can stat just the page does (a page of a big directory then costs its
        names, not every stat)."""
        return page_of(self.list_dir(runtime, path), after, limit, lambda e: e.name)

    def stat(self, runtime: SandboxRuntime, path: str, cached_only: bool = False) -> FileEntry:
        """lstat semantics. ``cached_only``: as read_file's."""
        raise self._lacks("files")

    def mkdir(self, runtime: SandboxRuntime, path: str, parents: bool = True) -> None:
        raise self._lacks("files")

    def remove(self, runtime: SandboxRuntime, path: str, recursive: bool = False) -> None:
        raise self._lacks("files")

    def rename(self, runtime: SandboxRuntime, src: str, dst: str) -> None:
        raise self._lacks("files")

    def upload_tar(self, runtime: SandboxRuntime, path: str,
                   tar_bytes: bytes | BinaryIO) -> None:
        """Extract a tar into directory ``path`` (created if missing), every member resolved
        inside the root."""
        raise self._lacks("files")

    def download_tar(self, runtime: SandboxRuntime, path: str) -> bytes:
        """A tar of the directory (or file) at ``path``."""
        raise self._lacks("files")

    def open_read(self, runtime: SandboxRuntime, path: str) -> tuple[int, int]:
        """(fd, size) of a regular file to stream from; the caller closes the fd."""
        raise self._lacks("files")

    def tree_ops(self, runtime: SandboxRuntime, path: str) -> TreeOps:
        """The primitives (corral.daemon.streams.TreeOps) a streamed tar download uses."""
        raise self._lacks("files")
