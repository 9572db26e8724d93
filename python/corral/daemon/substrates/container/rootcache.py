"""The root-fd cache: an O_PATH fd of each recently used sandbox's root."""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING

from corral import _core
from corral.errors import SandboxNotRunning

from ..base import SandboxRuntime

if TYPE_CHECKING:  # pragma: no cover
    from .host import Host


# Open root fds kept for sandboxes used recently (exec and file operations reuse them); the rest
# are opened on demand: the daemon's fd table must not grow with the number of sandboxes (its
# RLIMIT_NOFILE may be as low as 20,000 where it cannot raise its hard limit).
ROOT_CACHE = int(os.environ.get("CORRAL_ROOT_FD_CACHE", "1024"))


class _RootRef:
    __slots__ = ("fd", "users", "closing")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.users = 0
        self.closing = False


class RootCache:
    """O_PATH fds of sandbox roots, reference-counted, at most ROOT_CACHE open."""

    @contextlib.contextmanager
    def _rooted(self: Host, runtime: SandboxRuntime):
        """The sandbox's root fd, held open for the duration of the block."""
        ref = self._acquire_root(runtime)
        try:
            yield ref.fd
        finally:
            with self._lock:
                ref.users -= 1
                close = ref.closing and ref.users == 0
            if close:
                os.close(ref.fd)

    def _acquire_root(self: Host, runtime: SandboxRuntime) -> _RootRef:
        sid = runtime.sandbox_id
        with self._lock:
            ref = self._roots.get(sid)
            if ref is not None:
                ref.users += 1
                self._roots.move_to_end(sid)
                return ref
        if sid in self._closing or (runtime.pidfd < 0 and runtime.init_pid <= 0):
            raise SandboxNotRunning("the sandbox is not running")
        try:
            fd = _core.root_fd(runtime.init_pid)
        except OSError as e:
            raise SandboxNotRunning(f"the sandbox's root is gone: {e.strerror}") from e
        # Same pid-reuse argument as in exec_in: the init still runs after the open, so the
        # pid was its pid then (an unreaped child's pid is never reused: see keep_pidfds).
        if not self.is_alive(runtime):
            os.close(fd)
            raise SandboxNotRunning("the sandbox's init is gone")
        evict: list[int] = []
        with self._lock:
            if sid in self._closing:
                os.close(fd)
                raise SandboxNotRunning("the sandbox is being destroyed")
            ref = self._roots.get(sid)
            if ref is not None:  # another thread won the race
                os.close(fd)
            else:
                ref = self._roots[sid] = _RootRef(fd)
                if len(self._roots) > ROOT_CACHE:
                    evict = self._evict_roots()
            ref.users += 1
        for old in evict:
            os.close(old)
        return ref

    def _evict_roots(self: Host) -> list[int]:
        """Drop the least recently used root fds beyond ROOT_CACHE (under _lock); fds in use
        close when their last user is done. Returns the fds to close now."""
        out = []
        for sid in list(self._roots)[:len(self._roots) - ROOT_CACHE]:
            ref = self._roots.pop(sid)
            ref.closing = True
            if ref.users == 0:
                out.append(ref.fd)
        return out

    def _close_root(self: Host, sandbox_id: str) -> None:
        """Close the sandbox's root fd (once no file operation uses it) and its exec channel."""
        self._close_channel(sandbox_id)
        with self._lock:
            ref = self._roots.pop(sandbox_id, None)
            if ref is None:
                return
            ref.closing = True
            close = ref.users == 0
        if close:
            os.close(ref.fd)
