"""``corral.AsyncSandbox``: the asyncio facade, method for method the same as ``Sandbox``
(tests/test_sdk.py checks the signatures match); the Calls come from the same corral.sdk.api.

The constructor cannot await, so ``AsyncSandbox(...)`` only holds the spec; the sandbox is
created by ``await AsyncSandbox.create(...)``, ``async with AsyncSandbox(...)``,
``await AsyncSandbox(...)``, or else by its first method call.
"""

from __future__ import annotations

import asyncio
import builtins
import itertools
import os
from collections.abc import AsyncIterator, Callable, Generator, Iterable, Mapping, Sequence
from typing import Any, Literal, overload

from corral.errors import CorralError, SandboxNotFound
from corral.models import (
    DEFAULT_MAX_OUTPUT_BYTES,
    DEFAULT_TIMEOUT_S,
    FileEntry,
    FileTree,
    ImageInfo,
    LayerSpec,
    LogEntry,
    NetworkMode,
    NetworkPolicy,
    ProcessStatus,
    SandboxInfo,
    SandboxSpec,
)
from corral.sdk import api, placed, tarball
from corral.sdk import sandbox as _sync
from corral.sdk.call import Call, T, lost
from corral.sdk.endpoint import Endpoint
from corral.sdk.handle import (
    Group,
    ProcessBase,
    Retrier,
    SandboxHandle,
    batch_groups,
    batch_result,
    merge_groups,
)
from corral.sdk.results import ExecResult, OutputChunk
from corral.sdk.snapshot import AsyncSnapshot, SnapshotBase
from corral.sdk.twins import mirror_docs

Labels = Mapping[str, str | None] | builtins.list[str] | None


_transport: Any = None


def transport(endpoint: Endpoint) -> Any:
    """The loop's aiohttp transport. Imported on first use: aiohttp takes ~0.2 s to import,
    which sync-only programs and the CLI should not pay."""
    global _transport
    if _transport is None:
        from corral.sdk.async_transport import transport as real

        _transport = real
    return _transport(endpoint)


async def _send(endpoint: Endpoint, call: Call[T], handle: SandboxHandle | None = None) -> T:
    """See corral.sdk.sandbox._send: a keyed call is sent again, with the same key, when the
    connection was lost under it."""
    t = transport(endpoint)
    if call.key is None:
        return await t.call(call)
    r: Retrier | None = None
    while True:
        try:
            return await t.call(call)
        except BaseException as e:  # noqa: BLE001 - the Retrier re-raises what it won't retry
            r = r or Retrier(call, handle)
            delay = r.delay(e)
            if delay is None:
                raise r.give_up(e) from None
        await asyncio.sleep(delay)


async def _fan_out(items: builtins.list[AsyncSandbox | str], endpoint: str | Endpoint | None,
                   call: Callable[[builtins.list[str]], Call[builtins.list[Any]]]
                   ) -> builtins.list[Any]:
    """See corral.sdk.sandbox._fan_out: one request per daemon, all at once."""
    groups = batch_groups(items, endpoint)

    async def one(g: Group) -> builtins.list[Any] | BaseException:
        try:
            return await _send(g[0], call(g[2]))
        except CorralError as e:
            return e
    answers = await asyncio.gather(*(one(g) for g in groups))
    return merge_groups(len(items), groups, list(answers)) if groups else []


class AsyncSandbox(SandboxHandle):
    """The asyncio twin of ``corral.Sandbox``.

    >>> async with corral.AsyncSandbox(image="host") as sb:
    ...     (await sb.exec("echo hi")).stdout
    'hi\\n'
    """

    files: AsyncFiles
    _spec: SandboxSpec | None = None
    _create_call: Call[SandboxInfo] | None = None  # until it is made
    _creating: asyncio.Future[str] | None = None

    def __init__(self, image: str = "host", *, substrate: str = "container", cpu: float = 1.0,
                 memory_mb: int = 512, pids: int = 512, timeout: float = DEFAULT_TIMEOUT_S,
                 disk_mb: int | None = None,
                 idle_timeout: float | None = None, env: Mapping[str, str] | None = None,
                 labels: Mapping[str, str] | None = None,
                 metadata: Mapping[str, str] | None = None,
                 network: NetworkMode | str | NetworkPolicy = "none",
                 network_group: str | None = None, bandwidth_mbit: float | None = None,
                 expose: Sequence[int] | None = None,
                 hostname: str | None = None, cwd: str | None = None,
                 snapshot: str | SnapshotBase | None = None, pause_ttl: str = "count",
                 endpoint: str | Endpoint | None = None,
                 trajectory_id: str | None = None, user: str | int | None = None,
                 layers: Sequence[LayerSpec] | None = None,
                 node_selector: Mapping[str, str] | None = None) -> None:
        # Validated now, so bad input fails at the call site, not at the first await.
        self._spec = api.spec(image=image, substrate=substrate, cpu=cpu, memory_mb=memory_mb,
                              disk_mb=disk_mb,
                              pids=pids, timeout=timeout, idle_timeout=idle_timeout, env=env,
                              labels=labels, metadata=metadata, network=network,
                              network_group=network_group, bandwidth_mbit=bandwidth_mbit,
                              expose=list(expose) if expose is not None else None,
                              hostname=hostname, cwd=cwd, snapshot=snapshot,
                              pause_ttl=pause_ttl, user=user,
                              layers=list(layers) if layers else None)
        self._create_call = api.create(self._spec, node_selector=node_selector)
        self._init_handle(Endpoint.parse(endpoint), None)
        if trajectory_id is not None:
            self._set_trajectory(trajectory_id)

    def _init_files(self) -> None:
        self.files = AsyncFiles(self)
        self.network = AsyncNetworkControl(self)

    async def _sid_ready(self) -> str:
        """The id, creating the sandbox first if that has not happened yet (exactly once,
        even when several tasks call methods on a fresh handle at the same time)."""
        if self._sid is not None:
            return self._sid
        if self._creating is None:
            self._creating = asyncio.ensure_future(self._create())
        return await asyncio.shield(self._creating)

    async def _create(self) -> str:
        assert self._create_call is not None
        try:
            call = self._create_call
            if self._traj is not None:
                call.key = f"{self._traj}:create"
            # Through a cluster gateway: placed there, made on (and talked to at) the node.
            ep, info = await placed.drive_async(placed.create_steps(self._endpoint, call),
                                                _send)
        except BaseException:
            self._creating = None  # a later call may try again
            raise
        self._endpoint = ep
        self._sid = info.id
        self.last_info = info
        return info.id

    async def _call(self, make: Any, *args: Any, key: str | None = None, **kwargs: Any) -> Any:
        sid = await self._sid_ready()
        return await _send(self._endpoint, self._with_key(make(sid, *args, **kwargs), key), self)

    def __await__(self) -> Generator[Any, None, AsyncSandbox]:
        async def ready() -> AsyncSandbox:
            await self._sid_ready()
            return self
        return ready().__await__()

    # ---- class-level ----------------------------------------------------------------------
    @classmethod
    async def create(cls, image: str = "host", **kwargs: Any) -> AsyncSandbox:
        """Create a sandbox now (same parameters as the constructor)."""
        return await cls(image, **kwargs)

    @classmethod
    async def connect(cls, sandbox_id: str, *, endpoint: str | Endpoint | None = None,
                      trajectory_id: str | None = None, step: int = 0) -> AsyncSandbox:
        ep = Endpoint.parse(endpoint)
        info = await _send(ep, api.get(sandbox_id))
        sb = cls._bind(ep.placed(info), info.id, info)  # through a gateway: its node
        if trajectory_id is not None:
            sb._set_trajectory(trajectory_id, step)
        return sb

    @classmethod
    async def from_trajectory(cls, trajectory_id: str, *, step: int | None = None,
                              endpoint: str | Endpoint | None = None) -> AsyncSandbox:
        """See ``Sandbox.from_trajectory``."""
        ep = Endpoint.parse(endpoint)
        got = await _send(ep, api.trajectory(trajectory_id))
        info = SandboxInfo.model_validate(got["sandbox"])
        sb = cls._bind(ep.placed(info), got["sandbox_id"], info)  # through a gateway: its node
        sb._set_trajectory(trajectory_id, int(got["step"]) if step is None else step)
        return sb

    @classmethod
    def from_id(cls, sandbox_id: str, *, endpoint: str | Endpoint | None = None) -> AsyncSandbox:
        """A handle to sandbox ``sandbox_id`` without a round trip (as after unpickling):
        a wrong id shows up as SandboxNotFound on the first call."""
        return cls._bind(Endpoint.parse(endpoint), sandbox_id)

    @classmethod
    async def list(cls, labels: Labels = None, *,
                   endpoint: str | Endpoint | None = None) -> builtins.list[AsyncSandbox]:
        ep = Endpoint.parse(endpoint)
        infos = await api.all_pages_async(transport(ep).call,
                                          lambda after: api.list_(labels, after))
        return [cls._bind(ep.placed(i), i.id, i) for i in infos]  # a gateway names each node

    @overload
    @classmethod
    async def create_many(cls, n: int, image: str = ..., *,
                          endpoint: str | Endpoint | None = ...,
                          return_exceptions: Literal[False] = ..., spread: bool = ...,
                          node_selector: Mapping[str, str] | None = ...,
                          **spec: Any) -> builtins.list[AsyncSandbox]: ...

    @overload
    @classmethod
    async def create_many(cls, n: int, image: str = ..., *,
                          endpoint: str | Endpoint | None = ..., return_exceptions: bool,
                          spread: bool = ..., node_selector: Mapping[str, str] | None = ...,
                          **spec: Any) -> builtins.list[AsyncSandbox | CorralError]: ...

    @classmethod
    async def create_many(cls, n: int, image: str = "host", *,
                          endpoint: str | Endpoint | None = None,
                          return_exceptions: bool = False, spread: bool = False,
                          node_selector: Mapping[str, str] | None = None,
                          **spec: Any) -> builtins.list[AsyncSandbox] | builtins.list[
                              AsyncSandbox | CorralError]:
        """See ``Sandbox.create_many``."""
        ep = Endpoint.parse(endpoint)
        infos = await _send(ep, api.create_many(n, api.spec(image=image, **spec),
                                                partial=return_exceptions, spread=spread,
                                                node_selector=node_selector))
        return [i if isinstance(i, CorralError) else cls._bind(ep.placed(i), i.id, i)
                for i in infos]

    @classmethod
    async def exec_many(cls, sandboxes: Iterable[AsyncSandbox | str],
                        cmd: str | builtins.list[str], *,
                        timeout: float | None = api.DEFAULT_TIMEOUT,
                        env: Mapping[str, str] | None = None, cwd: str | None = None,
                        user: str | int | None = None, stdin: str | bytes | None = None,
                        max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
                        concurrency: int = api.BATCH_CONCURRENCY,
                        return_exceptions: bool = False,
                        endpoint: str | Endpoint | None = None,
                        ) -> builtins.list[ExecResult | CorralError]:
        """See ``Sandbox.exec_many``."""
        def call(ids: builtins.list[str]) -> Call[builtins.list[ExecResult | CorralError]]:
            return api.exec_many(ids, cmd, timeout=timeout, env=env, cwd=cwd, user=user,
                                 stdin=stdin, max_output_bytes=max_output_bytes,
                                 concurrency=concurrency)
        items = [x if isinstance(x, str) else await x._ready_handle() for x in sandboxes]
        return batch_result(await _fan_out(items, endpoint, call), return_exceptions)

    @classmethod
    async def kill_many(cls, sandboxes: Iterable[AsyncSandbox | str], *,
                        return_exceptions: bool = False,
                        endpoint: str | Endpoint | None = None,
                        ) -> builtins.list[bool | CorralError]:
        """See ``Sandbox.kill_many``."""
        items = [x if isinstance(x, str) else await x._ready_handle() for x in sandboxes]
        return batch_result(await _fan_out(items, endpoint, api.kill_many), return_exceptions)

    async def _ready_handle(self) -> AsyncSandbox:
        await self._sid_ready()
        return self

    # ---- the sandbox ----------------------------------------------------------------------
    @overload
    async def exec(self, cmd: str | builtins.list[str], *, timeout: float | None = ...,
                   env: Mapping[str, str] | None = ..., cwd: str | None = ...,
                   user: str | int | None = ..., stdin: str | bytes | None = ...,
                   background: Literal[False] = ..., max_output_bytes: int = ...,
                   key: str | None = ...) -> ExecResult: ...

    @overload
    async def exec(self, cmd: str | builtins.list[str], *, timeout: float | None = ...,
                   env: Mapping[str, str] | None = ..., cwd: str | None = ...,
                   user: str | int | None = ..., stdin: str | bytes | None = ...,
                   background: Literal[True], max_output_bytes: int = ...,
                   key: str | None = ...) -> AsyncProcess: ...

    async def exec(self, cmd: str | builtins.list[str], *,
                   timeout: float | None = api.DEFAULT_TIMEOUT,
                   env: Mapping[str, str] | None = None, cwd: str | None = None,
                   user: str | int | None = None, stdin: str | bytes | None = None,
                   background: bool = False,
                   max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
                   key: str | None = None) -> ExecResult | AsyncProcess:
        """See ``Sandbox.exec``; with ``background=True`` returns an AsyncProcess."""
        res = await self._call(api.exec_, cmd, timeout=timeout, env=env, cwd=cwd, user=user,
                               stdin=stdin, background=background,
                               max_output_bytes=max_output_bytes, key=key)
        if background:
            return AsyncProcess(self._endpoint, res)
        return res

    async def info(self, *, key: str | None = None) -> SandboxInfo:
        return self._remember(await self._call(api.info, key=key))

    async def is_running(self) -> bool:
        try:
            return (await self.info()).state == "running"
        except CorralError as e:
            if e.infra:
                raise
            return False

    async def set_timeout(self, seconds: float) -> SandboxInfo:
        return self._remember(await self._call(api.set_timeout, seconds))

    async def expose(self, port: int) -> str:
        return await self._call(api.expose, port)

    async def unexpose(self, port: int) -> bool:
        return await self._call(api.unexpose, port)

    async def kill(self, *, key: str | None = None) -> bool:
        if self._sid is None and self._creating is None:
            return False  # never created: nothing to kill
        return await self._call(api.kill, key=key)

    # ---- snapshots, fork, restore, pause (docs/snapshots.md) ------------------------------
    async def snapshot(self, name: str | None = None, *,
                       key: str | None = None) -> AsyncSnapshot:
        """See ``Sandbox.snapshot``."""
        return AsyncSnapshot(await self._call(api.snapshot, name, key=key), self._endpoint)

    async def commit(self, name: str, *, config: Mapping[str, Any] | None = None,
                     replace: bool = False) -> ImageInfo:
        return await self._call(api.commit, name, config, replace)

    async def fork(self, n: int, *, name: str | None = None, keep_snapshot: bool = False,
                   spread: bool = False, node_selector: Mapping[str, str] | None = None,
                   key: str | None = None) -> builtins.list[AsyncSandbox]:
        """See ``Sandbox.fork``."""
        call = self._with_key(api.fork(await self._sid_ready(), n, name, keep_snapshot,
                                       spread=spread, node_selector=node_selector), key)
        ep = self._endpoint.placing() if spread or node_selector else self._endpoint
        res = await _send(ep, call, self)
        return self._fork_children(call, res.sandboxes)

    async def restore(self, snapshot: str | SnapshotBase, *,
                      key: str | None = None) -> SandboxInfo:
        """See ``Sandbox.restore``."""
        return self._remember(await self._call(api.restore, snapshot, key=key))

    async def pause(self, *, key: str | None = None) -> SandboxInfo:
        return self._remember(await self._call(api.pause, key=key))

    async def resume(self, *, key: str | None = None) -> SandboxInfo:
        return self._remember(await self._call(api.resume, key=key))

    async def log(self) -> builtins.list[LogEntry]:
        """See ``Sandbox.log``."""
        return await self._call(api.log)

    async def __aenter__(self) -> AsyncSandbox:
        await self._sid_ready()
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            await self.kill()
        except SandboxNotFound:
            pass
        except CorralError:
            if exc is None:
                raise


class AsyncNetworkControl:
    """``sandbox.network`` of an AsyncSandbox."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sb = sandbox

    async def update(self, network: str | NetworkPolicy) -> SandboxInfo:
        return self._sb._remember(await self._sb._call(api.update_network, network))


class AsyncFiles:
    """``sandbox.files`` of an AsyncSandbox."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sb = sandbox

    async def read(self, path: str, *, key: str | None = None) -> str:
        return (await self._sb._call(api.read, path, key=key)).decode("utf-8", "replace")

    async def read_bytes(self, path: str, max_bytes: int | None = None, *,
                         key: str | None = None) -> bytes:
        return await self._sb._call(api.read, path, max_bytes, key=key)

    async def write(self, path: str, data: str | bytes, mode: int = 0o644, *,
                    key: str | None = None) -> None:
        await self._sb._call(api.write, path, data, mode, key=key)

    async def list(self, path: str = "/", *,
                   key: str | None = None) -> builtins.list[FileEntry]:
        sid = await self._sb._sid_ready()
        pages = itertools.count()

        async def send(call: Call[Any]) -> Any:
            return await self._sb._call(lambda _sid: call, key=api.page_key(key, next(pages)))

        return await api.all_pages_async(send, lambda after: api.list_dir(sid, path, after))

    async def tree(self, path: str = "/", depth: int | None = None,
                   limit: int | None = None) -> FileTree:
        return await self._sb._call(api.tree, path, depth, limit)

    async def stat(self, path: str, *, key: str | None = None) -> FileEntry:
        return await self._sb._call(api.stat, path, key=key)

    async def exists(self, path: str, *, key: str | None = None) -> bool:
        return await self._sb._call(api.exists, path, key=key)

    async def mkdir(self, path: str, parents: bool = True, *, key: str | None = None) -> None:
        await self._sb._call(api.mkdir, path, parents, key=key)

    async def remove(self, path: str, recursive: bool = False, *,
                     key: str | None = None) -> None:
        await self._sb._call(api.remove, path, recursive, key=key)

    async def rename(self, src: str, dst: str, *, key: str | None = None) -> None:
        await self._sb._call(api.rename, src, dst, key=key)

    async def upload(self, local_dir: str | os.PathLike[str], remote_dir: str, *,
                     key: str | None = None) -> None:
        data = await asyncio.to_thread(tarball.pack, local_dir)  # disk I/O off the loop
        await self._sb._call(api.put_tar, remote_dir, data, key=key)

    async def download(self, remote_dir: str,
                       local_dir: str | os.PathLike[str]) -> builtins.list[str]:
        data = await self._sb._call(api.get_tar, remote_dir)
        return await asyncio.to_thread(tarball.unpack, data, local_dir)


class AsyncProcess(ProcessBase):
    """A background command of an AsyncSandbox."""

    async def _call(self, call: Call[T]) -> T:
        return await transport(self._endpoint).call(call)

    async def status(self) -> ProcessStatus:
        return self._saw_status(await self._call(api.proc_status(self.sandbox_id, self.pid)))

    async def wait(self, timeout: float | None = None) -> ExecResult:
        return self._saw_result(
            await self._call(api.proc_wait(self.sandbox_id, self.pid, timeout)))

    async def stream(self) -> AsyncIterator[OutputChunk]:
        """``async for stream, data in proc.stream()`` (as Process.stream: ``skipped``)."""
        call = api.proc_stream(self.sandbox_id, self.pid)
        self.skipped = {"stdout": 0, "stderr": 0}
        async for line in transport(self._endpoint).lines(call):
            ev = api.stream_event(line)
            if isinstance(ev, OutputChunk):
                yield ev
            elif isinstance(ev, api.Skipped):
                self.skipped[ev.stream] = self.skipped.get(ev.stream, 0) + ev.bytes
            else:
                self._saw_status(ev)
                return
        raise lost(self._endpoint, call, EOFError("the stream ended without an exit status"))

    async def send_stdin(self, data: str | bytes, eof: bool = False) -> None:
        await self._call(api.proc_stdin(self.sandbox_id, self.pid, data, eof))

    async def close_stdin(self) -> None:
        await self._call(api.proc_close_stdin(self.sandbox_id, self.pid))

    async def kill(self, signal: int = 9) -> None:
        await self._call(api.proc_kill(self.sandbox_id, self.pid, signal))


# Docstrings: written once, on the sync classes.
mirror_docs(AsyncSandbox, _sync.Sandbox)
mirror_docs(AsyncFiles, _sync.Files)
mirror_docs(AsyncProcess, _sync.Process)
