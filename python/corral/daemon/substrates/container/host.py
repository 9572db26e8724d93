"""What the container substrate's parts (files, tar, root cache, the two exec paths) need of
the substrate they are mixed into: its state and the methods they call across parts."""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Awaitable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

from ..base import ExecSpec, SandboxRuntime

if TYPE_CHECKING:  # pragma: no cover
    from corral.daemon import initexec, scratch, uploads
    from corral.daemon.cgroups import CgroupManager
    from corral.errors import CorralError

    from ..rootfiles import RootFiles
    from .rootcache import _RootRef


class Host(Protocol):
    cgroups: CgroupManager
    scratch: scratch.Scratch
    disk: uploads.DiskBudget
    upload_max_bytes: int
    _live: dict[str, tuple[int, int]]
    rlimits: dict[str, int | tuple[int, int]]
    init_exec: bool
    _lock: threading.Lock
    _closing: set[str]
    _roots: collections.OrderedDict[str, _RootRef]
    _chans: collections.OrderedDict[str, initexec.Channel | None]
    _fallback_gates: dict[str, asyncio.Lock]

    # the substrate's own
    def is_alive(self, runtime: SandboxRuntime) -> bool: ...
    def _open_pidfd(self, runtime: SandboxRuntime) -> int: ...
    def _pids_base(self, runtime: SandboxRuntime) -> int | None: ...
    def _spawn_error(self, runtime: SandboxRuntime, e: BaseException,
                     pids_base: int | None = None) -> CorralError: ...
    def _ensure_memcg(self, runtime: SandboxRuntime) -> None: ...

    # rootcache
    def _rooted(self, runtime: SandboxRuntime) -> AbstractContextManager[int]: ...
    def _acquire_root(self, runtime: SandboxRuntime) -> _RootRef: ...
    def _evict_roots(self) -> list[int]: ...

    # initpath
    def _channel(self, runtime: SandboxRuntime) -> initexec.Channel | None: ...
    def _close_channel(self, sandbox_id: str) -> None: ...
    def _submit_later(self, runtime: SandboxRuntime, chan: initexec.Channel,
                      loop: asyncio.AbstractEventLoop, args: tuple[Any, ...],
                      pids_base: int | None) -> Awaitable[initexec.Spawned]: ...
    async def _answer(self, runtime: SandboxRuntime, fut: asyncio.Future[initexec.Spawned],
                      wait: float = ..., pids_base: int | None = ...) -> initexec.Spawned: ...

    # daemonpath
    def _spawn_here(self, runtime: SandboxRuntime, spec: ExecSpec) -> int: ...
    def _spawn(self, runtime: SandboxRuntime, spec: ExecSpec, root: int, pidfd: int) -> int: ...

    # files
    def _files(self, runtime: SandboxRuntime) -> RootFiles: ...
    def _charge(self, runtime: SandboxRuntime, delta: int) -> None: ...
