"""What Sandbox and AsyncSandbox share: identity, pickling, repr.

A handle is a sandbox id plus an endpoint and nothing else, so it pickles to a few bytes,
crosses process and Ray boundaries, and reconnects lazily on its first call over there.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable
from typing import Any, TypeVar

from corral.errors import CorralError, DaemonRestarted, DaemonUnavailable, InvalidRequest
from corral.models import ExecResult, ProcessHandle, ProcessStatus, SandboxInfo
from corral.sdk.call import Call
from corral.sdk.endpoint import Endpoint

H = TypeVar("H", bound="SandboxHandle")
E = TypeVar("E", bound=ExecResult)
T = TypeVar("T")

# Waits between the SDK's own retries of a keyed call whose connection was lost (the daemon
# died or restarted under it): ~11 s in all, a daemon's restart and re-adoption.
RETRY_DELAYS = (0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0)
MAX_KEY_LEN = 256


def retry_delay(err: CorralError, attempt: int, lost_before: bool) -> float | None:
    """How long to wait before sending a keyed call again after ``err``, or None (give up).
    Retried: a lost connection (the transport's ``daemon_restarted``: the outcome is unknown,
    the same key makes the retry return it instead of running twice, or raise
    ``step_interrupted`` if the daemon died under the call), and, once a connection
    was lost, ``daemon_unavailable`` (the daemon is on its way back). A daemon that was not
    there at the first attempt is reported at once."""
    if attempt >= len(RETRY_DELAYS):
        return None
    from_transport = "endpoint" in (err.details or {})
    if isinstance(err, DaemonRestarted) and from_transport:
        return RETRY_DELAYS[attempt]
    if isinstance(err, DaemonUnavailable) and lost_before:
        return RETRY_DELAYS[attempt]
    return None


class Retrier:
    """The SDK's retries of one keyed call (the sync and async facades drive it: one sleeps,
    the other awaits). ``delay(err)``: how long to wait before the next attempt, or None;
    then ``give_up(err)`` is what to raise."""

    def __init__(self, call: Call[Any], handle: SandboxHandle | None) -> None:
        self.call, self.handle = call, handle
        self.attempt = 0
        self.lost: DaemonRestarted | None = None

    def delay(self, err: BaseException) -> float | None:
        if not isinstance(err, CorralError):
            return None
        d = retry_delay(err, self.attempt, self.lost is not None)
        if isinstance(err, DaemonRestarted) and "endpoint" in (err.details or {}):
            self.lost = self.lost or err
        self.attempt += 1
        return d

    def give_up(self, err: BaseException) -> BaseException:
        reached = self.lost is not None or not isinstance(err, DaemonUnavailable)
        if self.handle is not None:
            self.handle._failed(self.call, err, reached)
        # Lost once, then no daemon: the outcome is unknown (not "never sent").
        return self.lost if self.lost is not None and isinstance(err, DaemonUnavailable) \
            else err


def check_key(key: str) -> str:
    """An explicit per-call idempotency key: 1-256 characters, no ':' (which the automatic
    keys ``{trajectory_id}:{step}`` use, so the two never collide)."""
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_LEN or ":" in key:
        raise InvalidRequest(f"bad key {key!r}: 1 to {MAX_KEY_LEN} characters, no ':'")
    return key


def _call_fp(call: Call[Any]) -> str:
    """What makes two calls "the same call" for a retry: method, target and body."""
    h = hashlib.sha256(f"{call.method} {call.target()}\n".encode())
    if call.body is not None:
        h.update(call.body)
    return h.hexdigest()


class SandboxHandle:
    _sid: str | None
    _endpoint: Endpoint
    #: The SandboxInfo from the latest create / connect / list / info / set_timeout call on
    #: this handle (not refreshed by itself; None after unpickling).
    last_info: SandboxInfo | None
    _traj: str | None = None
    _step = 0
    _step_lock: threading.Lock | None = None
    # (step, call fingerprint) of the last stepped call whose outcome is unknown (it failed
    # with an infra error): the next call that is the same call reuses its step.
    _retry: tuple[int, str] | None = None

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
            raise InvalidRequest(f"bad trajectory_id {trajectory_id!r}: non-empty, no ':'")
        self._traj = trajectory_id
        self._step = int(step)
        self._retry = None
        self._step_lock = threading.Lock()

    @property
    def trajectory_id(self) -> str | None:
        return self._traj

    @property
    def step(self) -> int:
        """The step number the next keyed call will carry (``{trajectory_id}:{step}``)."""
        return self._step

    def _with_key(self, call: Call[Any], key: str | None = None) -> Call[Any]:
        """Give a keyed call its idempotency key: ``key`` if given (it takes no step), else
        the next step of this handle's trajectory. A call that is the same call as the last
        one whose outcome is unknown (an infra failure) gets that call's step again, so a
        retry never runs twice (docs/trajectory.md, "Idempotency rules")."""
        if key is not None:
            call.key = check_key(key)
            return call
        if self._traj is not None and call.keyed and call.key is None:
            assert self._step_lock is not None
            with self._step_lock:
                # The same call as the last one left unknown: its step. (Hashed only then.)
                if self._retry is not None and self._retry[1] == _call_fp(call):
                    step = self._retry[0]
                else:
                    step = self._step
                    self._step += 1
                self._retry = None
            call.key = f"{self._traj}:{step}"
        return call

    def _stepped(self, call: Call[Any]) -> int | None:
        """The step of a call keyed by this handle's trajectory, else None."""
        if self._traj is None or call.key is None:
            return None
        head, _, step = call.key.rpartition(":")
        return int(step) if head == self._traj and step.isdigit() else None

    def _failed(self, call: Call[Any], err: BaseException, reached: bool) -> None:
        """A keyed call failed (after the SDK's own retries). An answer from the daemon that is
        not an infra error is logged under the key: the step is used. An infra error (or a
        call cancelled or interrupted in the client) leaves the outcome unknown: the same
        call, sent again, reuses the step. A call that never reached the daemon (``reached``
        False) leaves its step free for any next call, unless a later step was taken
        meanwhile (concurrent calls on one handle)."""
        step = self._stepped(call)
        if step is None or (isinstance(err, CorralError) and not err.infra):
            return
        assert self._step_lock is not None
        with self._step_lock:
            if not reached and self._step == step + 1:
                self._step = step
                self._retry = None
            else:
                self._retry = (step, _call_fp(call))

    def _fork_children(self: H, call: Call[Any], infos: list[SandboxInfo]) -> list[H]:
        """Handles for the children of a fork. With a trajectory, child ``i`` of the fork
        keyed ``T:S`` gets the trajectory ``T/forkS/i`` (from step 0): a restarted client that
        replays the fork gets the same children back and fast-forwards through their calls
        too."""
        # Placed by a gateway, a child names its node; else it is on the parent's.
        kids = [type(self)._bind(self._endpoint.placed(i), i.id, i) for i in infos]
        if call.key is not None and self._traj is not None:
            step = self._stepped(call)
            # an explicit key (no ':' in it) names the fork itself
            where = call.key if step is None else step
            for i, kid in enumerate(kids):
                kid._set_trajectory(f"{self._traj}/fork{where}/{i}")
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
        # the node rides along (a cluster sandbox's lost node answers sandbox_lost)
        return (_restore, (type(self), self.id, self._endpoint.url, self._traj, self._step,
                           self._endpoint.node))

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
        #: The signal that ended it (None: it exited), and whether that was an OOM kill at
        #: its sandbox's own memory limit.
        self.signal: int | None = None
        self.oom_killed = False
        #: Bytes of each stream that stream() did not deliver: output past the process's
        #: ``max_output_bytes`` the daemon dropped before stream() was opened. They came
        #: right after the kept output (the first chunks), before the live ones.
        self.skipped = {"stdout": 0, "stderr": 0}

    def _saw_status(self, st: ProcessStatus) -> ProcessStatus:
        if not st.running:
            self.exit_code, self.timed_out = st.exit_code, st.timed_out
            self.signal, self.oom_killed = st.signal, st.oom_killed
        return st

    def _saw_result(self, res: E) -> E:
        self.exit_code, self.timed_out = res.exit_code, res.timed_out
        self.signal, self.oom_killed = res.signal, res.oom_killed
        return res

    def __reduce__(self) -> tuple[Any, ...]:
        handle = ProcessHandle(sandbox_id=self.sandbox_id, pid=self.pid, cmd=self.cmd,
                               started_at=self.started_at)
        return (type(self), (self._endpoint, handle))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.pid} in {self.sandbox_id} cmd={self.cmd!r}>"


MAX_FAN_OUT = 32  # nodes a batch call talks to at once
Group = tuple[Endpoint, list[int], list[str]]  # an endpoint, the items' places, their ids


def batch_groups(sandboxes: Iterable[SandboxHandle | str],
                 endpoint: str | Endpoint | None) -> list[Group]:
    """A batch call's sandboxes by daemon: all to ``endpoint`` if given, else each handle to
    its own (on a cluster, its node: the batch goes to each node directly, never through the
    gateway), plain ids to the handles' daemon if they have one, else the default endpoint."""
    items = list(sandboxes)
    eps = {x.endpoint for x in items if isinstance(x, SandboxHandle)}
    # Plain ids go with the handles when those are all on one daemon (else the default one).
    default = (Endpoint.parse(endpoint) if endpoint is not None or len(eps) != 1
               else next(iter(eps)))
    groups: dict[Endpoint, Group] = {}
    for i, x in enumerate(items):
        ep = x.endpoint if isinstance(x, SandboxHandle) and endpoint is None else default
        g = groups.setdefault(ep, (ep, [], []))
        g[1].append(i)
        g[2].append(x if isinstance(x, str) else x.id)
    return list(groups.values())


def merge_groups(n: int, groups: list[Group],
                 answers: list[list[T] | BaseException]) -> list[T | CorralError]:
    """The answers of a batch sent to several daemons, back in the order asked; a daemon's
    failed request (a lost node: ``sandbox_lost``) stands at the place of each of its items."""
    if len(groups) == 1 and isinstance(answers[0], BaseException):
        raise answers[0]  # one daemon: its error is the call's, as without a cluster
    out: list[T | CorralError] = [None] * n  # type: ignore[list-item]
    for (_, places, _), got in zip(groups, answers, strict=True):
        if isinstance(got, BaseException) and not isinstance(got, CorralError):
            raise got
        for j, i in enumerate(places):
            out[i] = got if isinstance(got, CorralError) else got[j]
    return out


def batch_result(results: list[T], return_exceptions: bool) -> list[T]:
    """Like asyncio.gather: the first item that is an error is raised, unless
    ``return_exceptions`` (then errors stand in the list at their sandbox's place)."""
    if not return_exceptions:
        for r in results:
            if isinstance(r, CorralError):
                raise r
    return results


def _restore(cls: type[H], sid: str, url: str, traj: str | None = None, step: int = 0,
             node: str | None = None) -> H:
    obj = cls._bind(Endpoint(url, node), sid)
    if traj is not None:
        obj._set_trajectory(traj, step)
    return obj
