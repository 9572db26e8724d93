"""The daemon exec path: commands forked from the daemon into a sandbox's namespaces."""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING

from corral import _core
from corral.errors import ExecStalled, InvalidRequest, SandboxNotRunning

from ..base import ExecSpec, SandboxRuntime, Spawned
from .threads import _in_thread, _kill_abandoned, _within

if TYPE_CHECKING:  # pragma: no cover
    from .host import Host


# The daemon's own exec path takes well under a millisecond; a command not started after this
# fails with ExecStalled (and is killed if it appears later).
SPAWN_TIMEOUT_S = 30.0


def _unix_only(runtime: SandboxRuntime) -> bool:
    return runtime.extra.get("network") == "disabled"


class DaemonExec:
    """Commands forked by the daemon into the sandbox's namespaces (_core.exec_in)."""

    async def _spawn_off_loop(self: Host, runtime: SandboxRuntime, spec: ExecSpec,
                              loop: asyncio.AbstractEventLoop) -> Spawned:
        """The daemon's own path, in a thread of its own, one command at a time per sandbox.
        Nothing a sandbox does can hold the thread (exec_in's helper is outside its pid
        namespace and returns once the command is forked); should the kernel hold it anyway,
        the caller gets ExecStalled after SPAWN_TIMEOUT_S, only this sandbox's next command
        waits for the thread, and the command is killed once it appears."""
        sid = runtime.sandbox_id
        with self._lock:
            gate = self._fallback_gates.get(sid)
            if gate is None:
                gate = self._fallback_gates[sid] = asyncio.Lock()
        fds = [fd for fd in (spec.stdin_fd, spec.stdout_fd, spec.stderr_fd) if fd >= 0]
        abandoned = False

        def done(job: asyncio.Future[int]) -> None:
            gate.release()
            for fd in fds:  # our copies: only once the thread is done with them
                os.close(fd)
            if abandoned:
                _kill_abandoned(job)

        try:
            await _within(loop.create_task(gate.acquire()), SPAWN_TIMEOUT_S,
                          "this sandbox's previous command has not started yet")
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        job = _in_thread(loop, self._spawn_here, runtime, spec)
        job.add_done_callback(done)
        try:
            pid = await _within(asyncio.shield(job), SPAWN_TIMEOUT_S,
                                f"the command did not start within {SPAWN_TIMEOUT_S:.0f}s")
        except (ExecStalled, asyncio.CancelledError):  # no unobserved command
            abandoned = True
            raise
        return Spawned(pidfd=-1, pid=pid, ns_pid=0, own_child=True)

    def _spawn_here(self: Host, runtime: SandboxRuntime, spec: ExecSpec) -> int:
        with self._rooted(runtime) as root:
            if runtime.pidfd >= 0:
                return self._spawn(runtime, spec, root, runtime.pidfd)
            pidfd = self._open_pidfd(runtime)
            if pidfd < 0:
                raise SandboxNotRunning("the sandbox's init is gone")
            try:
                return self._spawn(runtime, spec, root, pidfd)
            finally:
                os.close(pidfd)

    def _spawn(self: Host, runtime: SandboxRuntime, spec: ExecSpec, root: int,
               pidfd: int) -> int:
        self._ensure_memcg(runtime)
        try:
            cfg = _core.ExecConfig(
                init_pid=runtime.init_pid,
                pidfd=pidfd,
                root_fd=root,
                argv=list(spec.argv),
                env=[f"{k}={v}" for k, v in spec.env.items()],
                cwd=spec.cwd or "/",
                uid=spec.uid,
                gid=spec.gid,
                groups=list(spec.groups),
                stdin=spec.stdin_fd,
                stdout=spec.stdout_fd,
                stderr=spec.stderr_fd,
                cgroup_procs=self.cgroups.procs_files(runtime.cgroup_paths),
                rlimits=self.rlimits,
                unix_only=_unix_only(runtime),
            )
        except (ValueError, TypeError, OverflowError) as e:  # an id out of range, say
            raise InvalidRequest(str(e)) from None
        base = self._pids_base(runtime)  # before the fork: see _spawn_error
        try:
            return _core.exec_in(cfg)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        except OSError as e:
            raise self._spawn_error(runtime, e, base) from e
