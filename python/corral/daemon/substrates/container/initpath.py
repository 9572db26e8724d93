"""The init exec path: commands started by each sandbox's init."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from corral import _core
from corral.daemon import initexec
from corral.errors import ExecStalled, InvalidRequest, SandboxNotRunning

from ..base import ExecSpec, SandboxRuntime, Spawned
from . import rootcache
from .daemonpath import _unix_only
from .threads import _dup, _within

if TYPE_CHECKING:  # pragma: no cover
    from .host import Host


# What one start of a command gives on the container's paths: our child's pid, the init's
# child, or (with a loop) the init's answer to come.
Launch = int | Spawned | Awaitable[Spawned]


class InitExec:
    """Commands started by the sandbox's own init over its channel (corral.daemon.initexec)."""

    def _channel(self: Host, runtime: SandboxRuntime) -> initexec.Channel | None:
        """The init's exec channel (destroy and reset close it with the root fd). At most
        ROOT_CACHE are held open, least recently used first out, as root fds are."""
        sid = runtime.sandbox_id
        with self._lock:
            if sid in self._closing:
                raise SandboxNotRunning("the sandbox is being destroyed")
            if sid in self._chans:
                self._chans.move_to_end(sid)
                return self._chans[sid]
        pidfd = runtime.pidfd if runtime.pidfd >= 0 else self._open_pidfd(runtime)
        if pidfd < 0:
            raise SandboxNotRunning("the sandbox's init is gone")
        try:
            chan: initexec.Channel | None = initexec.Channel(_core.init_channel(pidfd))
        except OSError:  # EBADF: an init without a channel (an older corral's)
            chan = None
        finally:
            if pidfd != runtime.pidfd:
                os.close(pidfd)
        evicted: list[initexec.Channel | None] = []
        with self._lock:
            if sid in self._closing:
                evicted.append(chan)
                chan = None
            elif sid in self._chans:  # another thread won the race
                evicted.append(chan)
                chan = self._chans[sid]
            else:
                self._chans[sid] = chan
                # Least recently used first; never one with answers still to come (closing
                # it would fail commands that are running): the bound may pass for a while.
                extra = len(self._chans) - rootcache.ROOT_CACHE
                for old_sid in list(self._chans)[:extra] if extra > 0 else []:
                    old = self._chans[old_sid]
                    if old_sid != sid and (old is None or not old.waiting):
                        evicted.append(self._chans.pop(old_sid))
            closing = sid in self._closing
        for old in evicted:
            if old is not None:
                with old.lock:  # not under a spawn waiting for its answer
                    old.close()
        if closing:
            raise SandboxNotRunning("the sandbox is being destroyed")
        return chan

    def _close_channel(self: Host, sandbox_id: str) -> None:
        with self._lock:
            chan = self._chans.pop(sandbox_id, None)
            self._fallback_gates.pop(sandbox_id, None)
        if chan is not None:
            with chan.lock:  # not under a spawn waiting for its answer
                chan.close()

    def _spawn_via_init(self: Host, runtime: SandboxRuntime, spec: ExecSpec,
                        loop: asyncio.AbstractEventLoop | None) -> Launch | None:
        """Start the command through the init (with a loop: a coroutine that gives the
        Spawned); None when it must take the daemon's own path (no channel, a command beyond
        the init's limits, 16 answers awaited)."""
        if not self.init_exec or spec.stdout_fd < 0 or spec.stderr_fd < 0:
            return None
        chan = self._channel(runtime)
        if chan is None:
            return None
        self._ensure_memcg(runtime)  # the init joins them: its children start there
        cands = initexec.candidates(spec.argv[0], spec.env, _core.DEFAULT_PATH) \
            if spec.argv else []
        args = (list(spec.argv), spec.env, spec.cwd or "/", spec.uid, spec.gid,
                list(spec.groups), cands, (spec.stdin_fd, spec.stdout_fd, spec.stderr_fd),
                _unix_only(runtime))
        base = self._pids_base(runtime)  # before the init forks: see _spawn_error
        try:
            if loop is None:
                return chan.spawn(*args)
            try:
                return self._answer(runtime, chan.submit(loop, *args), pids_base=base)
            except initexec.Full:  # wait for room: never the daemon's path because of load
                return self._submit_later(runtime, chan, loop, args, base)
        except initexec.Invalid as e:
            raise InvalidRequest(str(e)) from None
        except initexec.Busy:
            return None
        except (initexec.Gone, OSError) as e:
            raise self._spawn_error(runtime, e, base) from e

    def _submit_later(self: Host, runtime: SandboxRuntime, chan: initexec.Channel,
                      loop: asyncio.AbstractEventLoop, args: tuple[Any, ...],
                      pids_base: int | None) -> Awaitable[initexec.Spawned]:
        """Send once the init has room (copies of the stdio fds: the caller closes its own
        when we return), then await the answer; ExecStalled after WAIT_TIMEOUT_S."""
        stdio = tuple(_dup(fd) for fd in args[7])
        own = (*args[:7], stdio, *args[8:])

        # One deadline for the room and the answer: two waits of WAIT_TIMEOUT_S each would
        # let a sandbox that holds its init keep the answer past the client's deadline.
        deadline = loop.time() + initexec.WAIT_TIMEOUT_S

        async def later() -> initexec.Spawned:
            try:
                fut = await chan.submit_when_ready(loop, deadline, *own)
            except initexec.Stalled as e:
                raise ExecStalled(str(e)) from None
            except (initexec.Gone, OSError) as e:
                raise self._spawn_error(runtime, e, pids_base) from e
            finally:
                for fd in stdio:
                    if fd >= 0:
                        os.close(fd)
            return await self._answer(runtime, fut, deadline - loop.time(), pids_base)

        return later()

    async def _answer(self: Host, runtime: SandboxRuntime,
                      fut: asyncio.Future[initexec.Spawned],
                      wait: float = initexec.WAIT_TIMEOUT_S,
                      pids_base: int | None = None) -> initexec.Spawned:
        try:  # on timeout fut is cancelled: the command is killed when its answer comes
            return await _within(fut, max(0.0, wait), "the sandbox's init did not "
                                 f"answer within {initexec.WAIT_TIMEOUT_S:.0f}s")
        except (initexec.Gone, OSError) as e:
            raise self._spawn_error(runtime, e, pids_base) from e
