"""The one interface every substrate implements (container today; gvisor, microvm, vm later).

The engine (``corral.daemon.engine``) owns policy: ids, admission, TTLs, bookkeeping, I/O pumping
of exec pipes, the HTTP mapping. A substrate owns mechanism: making, entering and tearing down one
sandbox, and resolving file operations inside its root. Substrate methods that do syscalls are
synchronous and cheap (the Rust core releases the GIL); the engine calls slow ones (destroy,
rmtree) through ``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from corral.daemon.initexec import Spawned
from corral.models import FileEntry, SandboxSpec

# What spawn gives: our child's pid, the init's child, or (with a loop) the init's answer to come.
Spawn = int | Spawned | Coroutine[Any, Any, Spawned]


@dataclass(slots=True)  # tens of thousands live at once
class SandboxRuntime:
    """What a substrate needs to find one live sandbox again; persisted as JSON by the engine.

    ``init_pid`` + ``init_starttime`` (field 22 of /proc/PID/stat) identify PID 1 of the sandbox
    without the pid-reuse race; ``pidfd`` is the live handle (not persisted).
    """

    sandbox_id: str
    init_pid: int
    init_starttime: int
    sandbox_dir: str
    cgroup_paths: list[str]
    pidfd: int = -1
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "sandbox_id": self.sandbox_id,
            "init_pid": self.init_pid,
            "init_starttime": self.init_starttime,
            "sandbox_dir": self.sandbox_dir,
            "cgroup_paths": self.cgroup_paths,
            "extra": self.extra,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SandboxRuntime:
        return cls(
            sandbox_id=d["sandbox_id"],
            init_pid=int(d["init_pid"]),
            init_starttime=int(d["init_starttime"]),
            sandbox_dir=d["sandbox_dir"],
            cgroup_paths=list(d["cgroup_paths"]),
            extra=dict(d.get("extra", {})),
        )


@dataclass
class ExecSpec:
    """A command to start inside a sandbox, fully resolved by the engine."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    uid: int = 0
    gid: int = 0
    groups: list[int] = field(default_factory=list)
    stdin_fd: int = -1   # child's end of the pipes; -1 means /dev/null
    stdout_fd: int = -1
    stderr_fd: int = -1


class Substrate(ABC):
    name: str

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
        """Kill every process of the sandbox and remove its cgroups and directories. Idempotent,
        works on half-made or already-dead sandboxes, never raises for 'already gone'."""

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

    @abstractmethod
    def cleanup_orphans(self, known_ids: set[str]) -> list[str]:
        """Remove every trace (processes, cgroups, dirs) of sandboxes not in ``known_ids``;
        return the ids removed."""

    @abstractmethod
    def spawn(self, runtime: SandboxRuntime, spec: ExecSpec,
              loop: asyncio.AbstractEventLoop | None = None) -> Spawn:
        """Start a process inside the sandbox in its own session/process group: a direct
        child of the daemon (its host pid is returned), or a child of the sandbox's init
        (``Spawned``: its pidfd, through which the daemon reads its exit status). Given the
        event loop, it may return a coroutine that gives the Spawned (await it at once: the
        request is already sent)."""

    @abstractmethod
    def is_alive(self, runtime: SandboxRuntime) -> bool: ...

    def end_cause(self, runtime: SandboxRuntime) -> dict[str, Any] | None:
        """Why a sandbox whose init died ended, when what ran in it is the cause (its own
        out-of-memory kill, its init crashing): ``{"cause": ...}``, reported as
        ``sandbox_crashed``. None: the cause is outside the sandbox (``sandbox_lost``).
        Called before destroy. Default: None."""
        return None

    def oom_kills(self, runtime: SandboxRuntime) -> int | None:
        """How many processes the OOM killer has killed in the sandbox so far (a counter the
        exec path reads before and after a command: ``ExecResult.oom_killed``). None: not
        counted here. Default: None."""
        return None

    def expect(self, count: int, spec: SandboxSpec) -> None:  # noqa: B027 (optional hook)
        """A batch of ``count`` creates of ``spec`` is starting (create_many, fork): a hint
        for whatever the substrate keeps ready. Default: nothing."""

    @abstractmethod
    def close(self, *, retire: bool = False) -> None:
        """Release what the substrate holds (never the sandboxes). ``retire``: every sandbox is
        gone (graceful stop), so host-level leftovers (parent cgroups ...) go too."""

    # ---- files: every path is absolute inside the sandbox and resolved inside its root -------
    @abstractmethod
    def read_file(self, runtime: SandboxRuntime, path: str, max_bytes: int) -> bytes: ...

    @abstractmethod
    def write_file(self, runtime: SandboxRuntime, path: str, data: bytes | BinaryIO,
                   mode: int = 0o644, make_parents: bool = True) -> None:
        """``data``: bytes, or a seekable binary file at its start (a spooled body)."""

    @abstractmethod
    def list_dir(self, runtime: SandboxRuntime, path: str) -> list[FileEntry]: ...

    @abstractmethod
    def stat(self, runtime: SandboxRuntime, path: str) -> FileEntry: ...

    @abstractmethod
    def mkdir(self, runtime: SandboxRuntime, path: str, parents: bool = True) -> None: ...

    @abstractmethod
    def remove(self, runtime: SandboxRuntime, path: str, recursive: bool = False) -> None: ...

    @abstractmethod
    def rename(self, runtime: SandboxRuntime, src: str, dst: str) -> None: ...

    @abstractmethod
    def upload_tar(self, runtime: SandboxRuntime, path: str,
                   tar_bytes: bytes | BinaryIO) -> None:
        """Extract a tar into directory ``path`` (created if missing), every member resolved
        inside the root."""

    @abstractmethod
    def download_tar(self, runtime: SandboxRuntime, path: str) -> bytes:
        """A tar of the directory (or file) at ``path``."""

    @abstractmethod
    def open_read(self, runtime: SandboxRuntime, path: str) -> tuple[int, int]:
        """(fd, size) of a regular file to stream from; the caller closes the fd."""

    @abstractmethod
    def tree_ops(self, runtime: SandboxRuntime, path: str) -> Any:
        """The primitives (corral.daemon.streams.TreeOps) a streamed tar download uses."""
