"""What Sandbox and AsyncSandbox share: identity, pickling, repr.

A handle is a sandbox id plus an endpoint and nothing else, so it pickles to a few bytes,
crosses process and Ray boundaries, and reconnects lazily on its first call over there.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any, TypeVar

from corral.errors import CorralError, InvalidRequest
from corral.models import ExecResult, ProcessHandle, ProcessStatus, SandboxInfo
from corral.sdk.call import Call
from corral.sdk.endpoint import Endpoint

H = TypeVar("H", bound="SandboxHandle")
E = TypeVar("E", bound=ExecResult)
T = TypeVar("T")


class SandboxHandle:
    _sid: str | None
    _endpoint: Endpoint
    #: The SandboxInfo from the latest create / connect / list / info / set_timeout call on
    #: this handle (not refreshed by itself; None after unpickling).
    last_info: SandboxInfo | None
    _traj: str | None = None
    _step = 0
    _step_lock: threading.Lock | None = None

    @classmethod
    def _bind(cls: type[H], endpoint: Endpoint, sid: str, info: SandboxInfo | None = None) -> H:
        """A handle for an existing sandbox, without any request."""
        obj = cls.__new__(cls)
        obj._init_handle(endpoint, sid, info)
        return obj

    def _init_handle(self, endpoint: Endpoint, sid: str | None,
                     info: SandboxInfo | None = None) -> None:
        self._endpoint = endpoint
        self._sid = sid
        self.last_info = info
        self._init_files()

    def _init_files(self) -> None:  # overridden: attaches .files
        pass

    # ---- trajectory: automatic idempotency keys (docs/trajectory.md) -----------------------
    def _set_trajectory(self, trajectory_id: str | None, step: int = 0) -> None:
        if trajectory_id is not None and (not trajectory_id or ":" in trajectory_id):
            from corral.errors import InvalidRequest

            raise InvalidRequest(f"bad trajectory_id {trajectory_id!r}: non-empty, no ':'")
        self._traj = trajectory_id
        self._step = int(step)
        self._step_lock = threading.Lock()

    @property
    def trajectory_id(self) -> str | None:
        return self._traj

    @property
    def step(self) -> int:
        """The step number the next mutating call will carry (``{trajectory_id}:{step}``)."""
        return self._step

    def _with_key(self, call: Call[Any]) -> Call[Any]:
        """Give a mutating call the next key of this handle's trajectory: replaying the same
        calls in the same order after a restart fast-forwards through the logged ones."""
        if self._traj is not None and call.keyed and call.key is None:
            assert self._step_lock is not None
            with self._step_lock:
                step = self._step
                self._step += 1
            call.key = f"{self._traj}:{step}"
        return call

    def _fork_children(self: H, call: Call[Any], infos: list[SandboxInfo]) -> list[H]:
        """Handles for the children of a fork. With a trajectory, child ``i`` of the fork
        keyed ``T:S`` gets the trajectory ``T/forkS/i`` (from step 0): a restarted client that
        replays the fork gets the same children back and fast-forwards through their calls
        too."""
        kids = [type(self)._bind(self._endpoint, i.id, i) for i in infos]
        if call.key is not None and self._traj is not None:
            step = call.key.rpartition(":")[2]
            for i, kid in enumerate(kids):
                kid._set_trajectory(f"{self._traj}/fork{step}/{i}")
        return kids

    @property
    def id(self) -> str:
        if self._sid is None:
            raise RuntimeError(f"{type(self).__name__} not created yet: `await` it, use "
                               f"`async with`, or call one of its methods first")
        return self._sid

    @property
    def endpoint(self) -> Endpoint:
        return self._endpoint

    def _remember(self, info: SandboxInfo) -> SandboxInfo:
        self.last_info = info
        return info

    def __reduce__(self) -> tuple[Any, ...]:
        return (_restore, (type(self), self.id, self._endpoint.url, self._traj, self._step))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, SandboxHandle) and other._sid is not None
                and (other._sid, other._endpoint) == (self._sid, self._endpoint))

    def __hash__(self) -> int:
        return hash((self._sid, self._endpoint))

    def __repr__(self) -> str:
        state = f" {self.last_info.state}" if self.last_info else ""
        return f"<{type(self).__name__} {self._sid or '(not created)'}{state}>"


class ProcessBase:
    """What Process and AsyncProcess share: a (sandbox id, pid) pair plus the endpoint."""

    def __init__(self, endpoint: Endpoint, handle: ProcessHandle) -> None:
        self._endpoint = endpoint
        self.sandbox_id = handle.sandbox_id
        self.pid = handle.pid
        self.cmd = handle.cmd
        self.started_at = handle.started_at
        #: Set once the exit is known (from wait(), stream() or status()).
        self.exit_code: int | None = None
        self.timed_out = False

    def _saw_status(self, st: ProcessStatus) -> ProcessStatus:
        if not st.running:
            self.exit_code, self.timed_out = st.exit_code, st.timed_out
        return st

    def _saw_result(self, res: E) -> E:
        self.exit_code, self.timed_out = res.exit_code, res.timed_out
        return res

    def __reduce__(self) -> tuple[Any, ...]:
        handle = ProcessHandle(sandbox_id=self.sandbox_id, pid=self.pid, cmd=self.cmd,
                               started_at=self.started_at)
        return (type(self), (self._endpoint, handle))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.pid} in {self.sandbox_id} cmd={self.cmd!r}>"


def batch_target(sandboxes: Iterable[SandboxHandle | str],
                 endpoint: str | Endpoint | None) -> tuple[Endpoint, list[str]]:
    """(endpoint, ids) of a batch call: handles must all live on one daemon (``endpoint`` if
    given, else theirs); plain ids go to ``endpoint`` (or the default one)."""
    items = list(sandboxes)
    eps = {x.endpoint for x in items if isinstance(x, SandboxHandle)}
    ep = Endpoint.parse(endpoint) if endpoint is not None or not eps else eps.pop()
    if eps - {ep}:
        raise InvalidRequest("a batch call takes sandboxes of one daemon only")
    return ep, [x if isinstance(x, str) else x.id for x in items]


def batch_result(results: list[T], return_exceptions: bool) -> list[T]:
    """Like asyncio.gather: the first item that is an error is raised, unless
    ``return_exceptions`` (then errors stand in the list at their sandbox's place)."""
    if not return_exceptions:
        for r in results:
            if isinstance(r, CorralError):
                raise r
    return results


def _restore(cls: type[H], sid: str, url: str, traj: str | None = None, step: int = 0) -> H:
    obj = cls._bind(Endpoint(url), sid)
    if traj is not None:
        obj._set_trajectory(traj, step)
    return obj
