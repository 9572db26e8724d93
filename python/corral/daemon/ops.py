"""Operations as data: every call on a sandbox, parsed from its request into one of a closed
set of typed operations, and one dispatcher that runs any of them.

What every operation shares lives in ``dispatch``: waiting out a snapshot capture where the
operation starts or changes processes, the trajectory log (logged once per idempotency key, a
repeated key fast-forwarded: corral.daemon.trajlog), and the engine call. Lookup and liveness
are the engine's, inside the call: a fast-forwarded call must answer from the log even when
the sandbox is gone. A handler (corral.daemon.app) parses the request into an operation,
dispatches it and serializes what comes back; it does not touch the engine's state.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO, ClassVar

from pydantic import BaseModel

from corral.daemon.params import DEFAULT_PAGE
from corral.errors import SandboxNotFound
from corral.models import ExecRequest, SandboxSpec

if TYPE_CHECKING:
    from corral.daemon.engine import Engine

ToLog = Callable[[Any], dict[str, Any]] | None
SnapIds = list[str] | Callable[[Any], list[str]] | None
_LOGGED_OK = {"ok": True}


def entry(e: Any) -> Any:
    """A model as the plain dict a response carries."""
    return e.model_dump() if isinstance(e, BaseModel) else e


def logged_ok(_: Any) -> dict[str, Any]:
    return _LOGGED_OK


def snap_of(info: Any) -> list[str]:
    """The snapshot a sandbox (its logged SandboxInfo) stands on, for ``snapshot_ids``."""
    snap = info.get("snapshot") if isinstance(info, dict) else None
    return [snap] if snap else []


def snap_info(rec: dict[str, Any]) -> dict[str, Any]:
    from corral.daemon.snapshots import info

    return info(rec)


@dataclass(frozen=True, slots=True)
class Op(abc.ABC):
    """One call on one sandbox (``sid``; "" for a create) under idempotency key ``key``."""

    sid: str
    key: str | None

    name: ClassVar[str]
    logged: ClassVar[bool] = True          # goes through the trajectory log
    waits_capture: ClassVar[bool] = False  # starts or changes processes: not during a capture
    # Resumes a paused sandbox (its engine call's lookup is Engine.get): resumed first, in a
    # worker thread (Engine.ready), never by that lookup on the event loop.
    wakes: ClassVar[bool] = False

    def request(self) -> Any:
        """What the log records as the request (a dict or a model)."""
        return {}

    @abc.abstractmethod
    async def run(self, engine: Engine) -> Any:
        """Do it (the engine's call): what the handler serializes."""

    def to_log(self, engine: Engine) -> ToLog:
        """The result as logged (None: the value itself)."""
        return None

    def snapshot_ids(self) -> SnapIds:
        return None


# ---- lifecycle -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Create(Op):
    spec: SandboxSpec
    trajectory: str | None = None  # a create keyed "{T}:create" makes trajectory T's sandbox
    name: ClassVar[str] = "create"

    def request(self) -> Any:
        return self.spec.model_dump(mode="json")

    async def run(self, engine: Engine) -> Any:
        return (await engine.create(self.spec, self.trajectory)).info()

    def snapshot_ids(self) -> SnapIds:
        return snap_of


@dataclass(frozen=True, slots=True)
class Info(Op):
    name: ClassVar[str] = "info"

    async def run(self, engine: Engine) -> Any:
        return engine.lookup(self.sid).info()


@dataclass(frozen=True, slots=True)
class Kill(Op):
    # The key that tells whose kill it is (Engine.kill) when the call is not logged under
    # one: a cleanup whose key is bound to another call kills unkeyed, and is still the
    # trajectory's own.
    whose: str | None = None

    name: ClassVar[str] = "kill"

    async def run(self, engine: Engine) -> Any:
        try:
            killed = await engine.kill(self.sid, self.whose or self.key)
        except SandboxNotFound:
            # Keyed (a trainer's cleanup): a sandbox gone so long the daemon forgot it, but
            # whose log it still has, is killed already.
            if self.key is None or not await engine.trajlog.knows(self.sid):
                raise
            killed = False
        return {"id": self.sid, "killed": killed}


@dataclass(frozen=True, slots=True)
class SetTimeout(Op):
    timeout: float
    wakes: ClassVar[bool] = True
    name: ClassVar[str] = "timeout"
    logged: ClassVar[bool] = False

    async def run(self, engine: Engine) -> Any:
        return engine.set_timeout(self.sid, self.timeout).info()


@dataclass(frozen=True, slots=True)
class Pause(Op):
    name: ClassVar[str] = "pause"
    waits_capture: ClassVar[bool] = True  # a snapshot's freeze is not a pause

    async def run(self, engine: Engine) -> Any:
        return (await engine.pause(self.sid)).info()


@dataclass(frozen=True, slots=True)
class Resume(Op):
    name: ClassVar[str] = "resume"
    waits_capture: ClassVar[bool] = True  # a resume would thaw a capture's freeze mid-copy

    async def run(self, engine: Engine) -> Any:
        return (await engine.resume(self.sid)).info()


# ---- processes -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Exec(Op):
    req: ExecRequest
    name: ClassVar[str] = "exec"

    def request(self) -> Any:
        return self.req  # the model: the log dumps it while the command runs

    async def run(self, engine: Engine) -> Any:
        return await engine.exec(self.sid, self.req)

    def to_log(self, engine: Engine) -> ToLog:
        return engine.trajlog.exec_result


@dataclass(frozen=True, slots=True)
class Wait(Op):
    pid: int
    timeout: float | None
    wakes: ClassVar[bool] = True
    name: ClassVar[str] = "wait"

    def request(self) -> Any:
        return {"pid": self.pid, "timeout": self.timeout}

    async def run(self, engine: Engine) -> Any:
        return await engine.wait(self.sid, self.pid, self.timeout)

    def to_log(self, engine: Engine) -> ToLog:
        return engine.trajlog.exec_result


@dataclass(frozen=True, slots=True)
class Stdin(Op):
    pid: int
    data: str
    eof: bool
    wakes: ClassVar[bool] = True
    name: ClassVar[str] = "stdin"
    logged: ClassVar[bool] = False

    async def run(self, engine: Engine) -> Any:
        engine.stdin(self.sid, self.pid, self.data, self.eof)


@dataclass(frozen=True, slots=True)
class Signal(Op):
    pid: int
    signal: int
    wakes: ClassVar[bool] = True
    name: ClassVar[str] = "signal"
    logged: ClassVar[bool] = False

    async def run(self, engine: Engine) -> Any:
        engine.signal(self.sid, self.pid, self.signal)


# ---- files -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Stat(Op):
    path: str
    name: ClassVar[str] = "stat"

    def request(self) -> Any:
        return {"path": self.path}

    async def run(self, engine: Engine) -> Any:
        return entry(await engine.stat(self.sid, self.path))


@dataclass(frozen=True, slots=True)
class ListDir(Op):
    """One page of a directory's entries: those after ``after``, at most ``limit``. The
    logged request is the path (and a limit not the default): a keyed page is told by its key
    (the SDK keys each page), and a daemon that logged whole listings logged just the path.
    The cursor is in the logged result."""

    path: str
    after: str | None = None
    limit: int = DEFAULT_PAGE
    name: ClassVar[str] = "list"

    def request(self) -> Any:
        req: dict[str, Any] = {"path": self.path}
        if self.limit != DEFAULT_PAGE:
            req["limit"] = self.limit
        return req

    async def run(self, engine: Engine) -> Listing:
        found, cursor = await engine.list_page(self.sid, self.path, self.after, self.limit)
        return Listing([entry(e) for e in found], cursor)

    def to_log(self, engine: Engine) -> ToLog:
        from corral.daemon.trajlog import listing_result

        keyed = self.key is not None
        return lambda v: listing_result(v.entries, keyed, v.next, self.after)


@dataclass(frozen=True, slots=True)
class Tree(Op):
    """The entries under a directory to ``depth`` levels, at most ``limit``, in one answer.
    An observation, not a step: not in the trajectory log (a client watching a directory
    polls it several times a second; logged, each poll would add the whole tree to the log)."""

    path: str
    depth: int
    limit: int
    name: ClassVar[str] = "tree"
    logged: ClassVar[bool] = False

    async def run(self, engine: Engine) -> Any:
        found, truncated = await engine.tree(self.sid, self.path, self.depth, self.limit)
        return {"entries": [entry(e) for e in found], "truncated": truncated}


@dataclass(frozen=True, slots=True)
class Listing:
    """A page of a listing, as ListDir gives it: its entries and the next page's cursor."""

    entries: list[dict[str, Any]]
    next: str | None


@dataclass(frozen=True, slots=True)
class Mkdir(Op):
    path: str
    parents: bool
    logged_request: dict[str, Any] = field(default_factory=dict)
    name: ClassVar[str] = "mkdir"

    def request(self) -> Any:
        return self.logged_request

    async def run(self, engine: Engine) -> Any:
        await engine.mkdir(self.sid, self.path, self.parents)

    def to_log(self, engine: Engine) -> ToLog:
        return logged_ok


@dataclass(frozen=True, slots=True)
class Remove(Op):
    path: str
    recursive: bool
    logged_request: dict[str, Any] = field(default_factory=dict)
    name: ClassVar[str] = "remove"

    def request(self) -> Any:
        return self.logged_request

    async def run(self, engine: Engine) -> Any:
        await engine.remove(self.sid, self.path, self.recursive)

    def to_log(self, engine: Engine) -> ToLog:
        return logged_ok


@dataclass(frozen=True, slots=True)
class Rename(Op):
    src: str
    dst: str
    logged_request: dict[str, Any] = field(default_factory=dict)
    name: ClassVar[str] = "rename"

    def request(self) -> Any:
        return self.logged_request

    async def run(self, engine: Engine) -> Any:
        await engine.rename(self.sid, self.src, self.dst)

    def to_log(self, engine: Engine) -> ToLog:
        return logged_ok


@dataclass(frozen=True, slots=True)
class Write(Op):
    """A file write (``mode`` given) or a tar upload into directory ``path``: the body is
    bytes, or a spooled file (``big``). Both run in a file thread (engine.files)."""

    path: str
    data: bytes | BinaryIO
    mode: int | None
    big: bool
    logged_request: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:  # type: ignore[override]
        return "write" if self.mode is not None else "upload"

    def request(self) -> Any:
        return self.logged_request

    async def run(self, engine: Engine) -> Any:
        if self.mode is not None:
            await engine.write_file(self.sid, self.path, self.data, self.mode)
        else:
            await engine.upload_tar(self.sid, self.path, self.data, self.big)

    def to_log(self, engine: Engine) -> ToLog:
        return logged_ok


@dataclass(frozen=True, slots=True)
class Transfer(Op):
    """A read or a tar download, whose result is streamed by the handler as it is made:
    ``send`` runs it (the engine's part included) and gives what the log records."""
    wakes: ClassVar[bool] = True

    op: str  # "read" or "download"
    logged_request: dict[str, Any]
    send: Callable[[], Awaitable[Any]]
    log: ToLog = None

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.op

    def request(self) -> Any:
        return self.logged_request

    async def run(self, engine: Engine) -> Any:
        return await self.send()

    def to_log(self, engine: Engine) -> ToLog:
        return self.log


# ---- snapshots -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Snapshot(Op):
    snap_name: str | None
    # How far the copy is, and its cancel (corral.daemon.snapshots.CaptureControl).
    control: Any = field(default=None, compare=False, repr=False)
    name: ClassVar[str] = "snapshot"

    def request(self) -> Any:
        return {"name": self.snap_name}

    async def run(self, engine: Engine) -> Any:
        return snap_info(await engine.snapshot(self.sid, self.snap_name, self.control))

    def snapshot_ids(self) -> SnapIds:
        return lambda r: [r["id"]]


@dataclass(frozen=True, slots=True)
class Fork(Op):
    """Logged as one ``fork`` entry in the parent's log (the children's ids) and one
    ``create`` entry in each child's log (``parent`` in its request)."""

    count: int
    snap_name: str | None
    keep_snapshot: bool
    logged_request: dict[str, Any] = field(default_factory=dict)
    # Progress: the capture's control, and a call per child made.
    control: Any = field(default=None, compare=False, repr=False)
    on_made: Callable[[], None] | None = field(default=None, compare=False, repr=False)
    name: ClassVar[str] = "fork"

    def request(self) -> Any:
        return self.logged_request

    async def run(self, engine: Engine) -> Any:
        started = engine.clock.time()
        rec, kids = await engine.fork(self.sid, self.count, self.snap_name,
                                      self.keep_snapshot, self.key, self.control,
                                      self.on_made)
        tl = engine.trajlog
        if kids and tl.enabled:
            spec = dict(kids[0].spec.model_dump(mode="json"), parent=self.sid)
            for kid in kids:  # committed with (before) the fork entry
                tl.logged(kid.id, "create", spec, kid.info(), started, [rec["id"]])
        return {"snapshot": snap_info(rec), "sandboxes": [kid.id for kid in kids]}

    def snapshot_ids(self) -> SnapIds:
        return lambda r: [r["snapshot"]["id"]]


@dataclass(frozen=True, slots=True)
class Restore(Op):
    snapshot: str
    name: ClassVar[str] = "restore"

    def request(self) -> Any:
        return {"snapshot": self.snapshot}

    async def run(self, engine: Engine) -> Any:
        return (await engine.restore(self.sid, self.snapshot)).info()

    def snapshot_ids(self) -> SnapIds:
        return snap_of


OPS: tuple[type[Op], ...] = (Create, Info, Kill, SetTimeout, Pause, Resume, Exec, Wait, Stdin,
                             Signal, Stat, ListDir, Tree, Mkdir, Remove, Rename, Write, Transfer,
                             Snapshot, Fork, Restore)


async def dispatch(engine: Engine, op: Op) -> Any:
    """Run ``op``: after any snapshot capture holding its sandbox (if it starts or changes
    processes), through the trajectory log (if it is logged). Returns the call's value, or
    the logged result dict when the log fast-forwards a repeated key."""
    call: Callable[[], Awaitable[Any]]
    if op.waits_capture or op.wakes:
        async def after_capture() -> Any:
            await engine.ready(op.sid, capture=op.waits_capture, wake=op.wakes)
            return await op.run(engine)
        call = after_capture
    else:  # the coroutine itself: no frame of our own
        call = functools.partial(op.run, engine)
    if not op.logged:
        return await call()
    return await engine.trajlog.run(op.sid, op.name, op.request(), op.key, call,
                                    to_log=op.to_log(engine), snapshot_ids=op.snapshot_ids())
