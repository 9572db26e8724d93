"""``corral.Sandbox``: the blocking facade. Every method builds a Call (corral.sdk.api) and sends
it on the sync transport; ``corral.sdk.async_sandbox`` mirrors it method for method."""

from __future__ import annotations

import builtins
import itertools
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
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
)
from corral.sdk import api, placed, tarball
from corral.sdk.call import Call, T, lost
from corral.sdk.endpoint import Endpoint
from corral.sdk.handle import (
    MAX_FAN_OUT,
    Group,
    ProcessBase,
    Retrier,
    SandboxHandle,
    batch_groups,
    batch_result,
    merge_groups,
)
from corral.sdk.results import ExecResult, OutputChunk
from corral.sdk.snapshot import Snapshot, SnapshotBase
from corral.sdk.sync_transport import transport

Labels = Mapping[str, str | None] | builtins.list[str] | None


def _send(endpoint: Endpoint, call: Call[T], handle: SandboxHandle | None = None) -> T:
    """Send ``call``; a keyed one is sent again, with the same key, when the connection was
    lost under it (corral.sdk.handle.Retrier): the daemon answers a retry of a call it ran
    with the logged result, so nothing runs twice."""
    t = transport(endpoint)
    if call.key is None:
        return t.call(call)
    r: Retrier | None = None
    while True:
        try:
            return t.call(call)
        except BaseException as e:  # noqa: BLE001 - the Retrier re-raises what it won't retry
            r = r or Retrier(call, handle)
            delay = r.delay(e)
            if delay is None:
                raise r.give_up(e) from None
        time.sleep(delay)


def _fan_out(sandboxes: Iterable[Sandbox | str], endpoint: str | Endpoint | None,
             call: Callable[[builtins.list[str]], Call[builtins.list[Any]]]
             ) -> builtins.list[Any]:
    """One batch request per daemon the sandboxes live on (on a cluster: per node, at once),
    the answers in the order asked (corral.sdk.handle.merge_groups)."""
    items = list(sandboxes)
    groups = batch_groups(items, endpoint)
    if not groups:
        return []  # nothing to do: no request (the API takes one id at least)

    def one(g: Group) -> builtins.list[Any] | BaseException:
        try:
            return _send(g[0], call(g[2]))
        except CorralError as e:
            return e
    if len(groups) == 1:
        answers = [one(groups[0])]
    else:
        with ThreadPoolExecutor(min(len(groups), MAX_FAN_OUT)) as pool:
            answers = list(pool.map(one, groups))
    return merge_groups(len(items), groups, answers)


class Sandbox(SandboxHandle):
    """An isolated Linux sandbox. ``Sandbox(...)`` creates one; ``with`` kills it on exit.

    >>> with corral.Sandbox(image="host", cpu=1, memory_mb=512) as sb:
    ...     sb.exec("echo hi").stdout
    'hi\\n'
    """

    files: Files
    network: NetworkControl

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
        s = api.spec(image=image, substrate=substrate, cpu=cpu, memory_mb=memory_mb,
                     disk_mb=disk_mb, pids=pids,
                     timeout=timeout, idle_timeout=idle_timeout, env=env, labels=labels,
                     metadata=metadata, network=network, network_group=network_group,
                     bandwidth_mbit=bandwidth_mbit,
                     expose=list(expose) if expose is not None else None,
                     hostname=hostname, cwd=cwd,
                     snapshot=snapshot, pause_ttl=pause_ttl, user=user,
                     layers=list(layers) if layers else None)
        ep = Endpoint.parse(endpoint)
        call = api.create(s, node_selector=node_selector)
        if trajectory_id is not None:
            self._set_trajectory(trajectory_id)
            call.key = f"{trajectory_id}:create"  # a restarted client gets the same sandbox
        # Through a cluster gateway: placed there, made on (and talked to at) the node.
        ep, info = placed.drive(placed.create_steps(ep, call), _send)
        self._init_handle(ep, info.id, info)

    def _init_files(self) -> None:
        self.files = Files(self)
        self.network = NetworkControl(self)

    def _call(self, call: Call[T], key: str | None = None) -> T:
        return _send(self._endpoint, self._with_key(call, key), self)

    # ---- class-level ----------------------------------------------------------------------
    @classmethod
    def create(cls, image: str = "host", **kwargs: Any) -> Sandbox:
        """Same as ``Sandbox(...)``."""
        return cls(image, **kwargs)

    @classmethod
    def connect(cls, sandbox_id: str, *, endpoint: str | Endpoint | None = None,
                trajectory_id: str | None = None, step: int = 0) -> Sandbox:
        """A handle to an existing sandbox (raises SandboxNotFound / SandboxNotRunning).
        With ``trajectory_id``, mutating calls carry the keys ``{trajectory_id}:{step}``
        from ``step`` on: replaying a trajectory's calls fast-forwards through the logged
        ones (docs/trajectory.md)."""
        ep = Endpoint.parse(endpoint)
        info = _send(ep, api.get(sandbox_id))
        sb = cls._bind(ep.placed(info), info.id, info)  # through a gateway: its node
        if trajectory_id is not None:
            sb._set_trajectory(trajectory_id, step)
        return sb

    @classmethod
    def from_trajectory(cls, trajectory_id: str, *, step: int | None = None,
                        endpoint: str | Endpoint | None = None) -> Sandbox:
        """The sandbox of trajectory ``trajectory_id`` (made by ``Sandbox(trajectory_id=...)``,
        or a fork child's ``{parent}/fork{step}/{i}``), positioned after the last step its log
        binds: the next call carries the first key the daemon has not logged. Also after the
        sandbox died (``last_info.state`` is then ``dead``). Raises NotFound if the log has no
        such trajectory. ``step=0`` positions it at the start instead (a client rebuilding its
        state by replaying every call). See docs/trajectory.md, "Resuming"."""
        ep = Endpoint.parse(endpoint)
        got = _send(ep, api.trajectory(trajectory_id))
        info = SandboxInfo.model_validate(got["sandbox"])
        sb = cls._bind(ep.placed(info), got["sandbox_id"], info)  # through a gateway: its node
        sb._set_trajectory(trajectory_id, int(got["step"]) if step is None else step)
        return sb

    @classmethod
    def from_id(cls, sandbox_id: str, *, endpoint: str | Endpoint | None = None) -> Sandbox:
        """A handle to sandbox ``sandbox_id`` without a round trip (as after unpickling):
        a wrong id shows up as SandboxNotFound on the first call."""
        return cls._bind(Endpoint.parse(endpoint), sandbox_id)

    @classmethod
    def list(cls, labels: Labels = None, *,
             endpoint: str | Endpoint | None = None) -> builtins.list[Sandbox]:
        """Running sandboxes, optionally those whose labels match (``{"k": "v"}``; a None
        value matches any value). Each handle's ``last_info`` holds what was listed."""
        ep = Endpoint.parse(endpoint)
        infos = api.all_pages(transport(ep).call, lambda after: api.list_(labels, after))
        return [cls._bind(ep.placed(i), i.id, i) for i in infos]  # a gateway names each node

    @overload
    @classmethod
    def create_many(cls, n: int, image: str = ..., *, endpoint: str | Endpoint | None = ...,
                    return_exceptions: Literal[False] = ..., spread: bool = ...,
                    node_selector: Mapping[str, str] | None = ..., **spec: Any
                    ) -> builtins.list[Sandbox]: ...

    @overload
    @classmethod
    def create_many(cls, n: int, image: str = ..., *, endpoint: str | Endpoint | None = ...,
                    return_exceptions: bool, spread: bool = ...,
                    node_selector: Mapping[str, str] | None = ..., **spec: Any
                    ) -> builtins.list[Sandbox | CorralError]: ...

    @classmethod
    def create_many(cls, n: int, image: str = "host", *,
                    endpoint: str | Endpoint | None = None, return_exceptions: bool = False,
                    spread: bool = False, node_selector: Mapping[str, str] | None = None,
                    **spec: Any
                    ) -> builtins.list[Sandbox] | builtins.list[Sandbox | CorralError]:
        """``n`` sandboxes with one spec, in one request: all or nothing. Through a cluster
        gateway they are spread over the nodes; with ``return_exceptions=True`` a node that
        failed its share (lost mid-batch) leaves its error at those places and the others
        are kept. ``spread=True`` asks the gateway to spread them as a group, as evenly over
        the nodes as room allows (a fork group: ``snapshot=`` moves the snapshot's layers to
        the nodes that get some), rather than filling the snapshot's holders first.
        ``node_selector``: only on nodes with these labels, as for ``Sandbox(...)``."""
        ep = Endpoint.parse(endpoint)
        infos = _send(ep, api.create_many(n, api.spec(image=image, **spec),
                                          partial=return_exceptions, spread=spread,
                                          node_selector=node_selector))
        return [i if isinstance(i, CorralError) else cls._bind(ep.placed(i), i.id, i)
                for i in infos]

    @classmethod
    def exec_many(cls, sandboxes: Iterable[Sandbox | str], cmd: str | builtins.list[str], *,
                  timeout: float | None = api.DEFAULT_TIMEOUT,
                  env: Mapping[str, str] | None = None, cwd: str | None = None,
                  user: str | int | None = None, stdin: str | bytes | None = None,
                  max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
                  concurrency: int = api.BATCH_CONCURRENCY, return_exceptions: bool = False,
                  endpoint: str | Endpoint | None = None,
                  ) -> builtins.list[ExecResult | CorralError]:
        """Run ``cmd`` in every sandbox (handles or ids) in one request; results in order.
        A sandbox where it could not run (gone, bad user ...) raises its error, or with
        ``return_exceptions=True`` has the error in its place. ``concurrency``: commands the
        daemon runs at once."""
        def call(ids: builtins.list[str]) -> Call[builtins.list[ExecResult | CorralError]]:
            return api.exec_many(ids, cmd, timeout=timeout, env=env, cwd=cwd, user=user,
                                 stdin=stdin, max_output_bytes=max_output_bytes,
                                 concurrency=concurrency)
        return batch_result(_fan_out(sandboxes, endpoint, call), return_exceptions)

    @classmethod
    def kill_many(cls, sandboxes: Iterable[Sandbox | str], *, return_exceptions: bool = False,
                  endpoint: str | Endpoint | None = None) -> builtins.list[bool | CorralError]:
        """Kill every sandbox (handles or ids) in one request; per sandbox True, or False if it
        had already ended. An unknown id raises SandboxNotFound (or, with
        ``return_exceptions=True``, has it in its place)."""
        return batch_result(_fan_out(sandboxes, endpoint, api.kill_many), return_exceptions)

    # ---- the sandbox ----------------------------------------------------------------------
    @overload
    def exec(self, cmd: str | builtins.list[str], *, timeout: float | None = ...,
             env: Mapping[str, str] | None = ..., cwd: str | None = ...,
             user: str | int | None = ..., stdin: str | bytes | None = ...,
             background: Literal[False] = ..., max_output_bytes: int = ...,
             key: str | None = ...) -> ExecResult: ...

    @overload
    def exec(self, cmd: str | builtins.list[str], *, timeout: float | None = ...,
             env: Mapping[str, str] | None = ..., cwd: str | None = ...,
             user: str | int | None = ..., stdin: str | bytes | None = ...,
             background: Literal[True], max_output_bytes: int = ...,
             key: str | None = ...) -> Process: ...

    def exec(self, cmd: str | builtins.list[str], *,
             timeout: float | None = api.DEFAULT_TIMEOUT,
             env: Mapping[str, str] | None = None, cwd: str | None = None,
             user: str | int | None = None, stdin: str | bytes | None = None,
             background: bool = False,
             max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
             key: str | None = None) -> ExecResult | Process:
        """Run ``cmd`` (a string runs under ``/bin/sh -c``, a list is the argv) and return its
        ExecResult; with ``background=True`` return its Process at once. A non-zero exit is not
        an exception (``result.check()`` makes it one); ``timeout=None`` waits forever.
        ``key``: this call's idempotency key (every logged call takes one; it takes no step
        of the trajectory): a call with a key already logged returns the logged result."""
        res = self._call(api.exec_(self.id, cmd, timeout=timeout, env=env, cwd=cwd, user=user,
                                   stdin=stdin, background=background,
                                   max_output_bytes=max_output_bytes), key)
        if background:
            return Process(self._endpoint, res)
        return res

    def info(self, *, key: str | None = None) -> SandboxInfo:
        """Its current state, spec, labels and times (keyed: a replay returns what was seen)."""
        return self._remember(self._call(api.info(self.id), key))

    def is_running(self) -> bool:
        """True while it runs (False once it has ended or is paused)."""
        try:
            return self.info().state == "running"
        except CorralError as e:
            if e.infra:
                raise
            return False

    def set_timeout(self, seconds: float) -> SandboxInfo:
        """Kill the sandbox ``seconds`` from now (extends or shortens its TTL)."""
        return self._remember(self._call(api.set_timeout(self.id, seconds)))

    def expose(self, port: int) -> str:
        """``host:port`` on the host's loopback that reaches TCP ``port`` in this networked
        sandbox, until ``unexpose`` or its end."""
        return self._call(api.expose(self.id, port))

    def unexpose(self, port: int) -> bool:
        """Stop exposing ``port``; False if it was not exposed."""
        return self._call(api.unexpose(self.id, port))

    def kill(self, *, key: str | None = None) -> bool:
        """Kill it; False if it had already ended (keyed: also if it is long gone)."""
        return self._call(api.kill(self.id), key)

    # ---- snapshots, fork, restore, pause (docs/snapshots.md) ------------------------------
    def snapshot(self, name: str | None = None, *, key: str | None = None) -> Snapshot:
        """Its files (not its processes) as a read-only snapshot that outlives it."""
        return Snapshot(self._call(api.snapshot(self.id, name), key), self._endpoint)

    def commit(self, name: str, *, config: Mapping[str, Any] | None = None,
               replace: bool = False) -> ImageInfo:
        """Its files as a new image ``name`` (a local name or a registry reference): its
        image's layers and one layer of what it changed; ``Sandbox(image=name)`` starts on
        it at once. ``config`` changes the image config (Env, WorkingDir, User, Cmd...)."""
        return self._call(api.commit(self.id, name, config, replace))

    def fork(self, n: int, *, name: str | None = None, keep_snapshot: bool = False,
             spread: bool = False, node_selector: Mapping[str, str] | None = None,
             key: str | None = None) -> builtins.list[Sandbox]:
        """Snapshot + ``n`` new sandboxes on it (same spec), in one call (all or nothing).
        The snapshot is deleted once they exist unless ``keep_snapshot`` (its layers live as
        long as the children). With a trajectory id, the children get trajectory ids of
        their own (``{trajectory_id}/fork{step}/{i}``) and a replayed fork returns the same
        children (those that ended since come back with state ``dead``). On a sandbox a
        cluster gateway placed, ``spread=True`` (or a ``node_selector``) has the gateway
        place the children: spread over the nodes as a group (the snapshot's layers move
        to them); one daemon ignores both (docs/cluster.md, "Snapshots and forks")."""
        call = self._with_key(api.fork(self.id, n, name, keep_snapshot, spread=spread,
                                       node_selector=node_selector), key)
        ep = self._endpoint.placing() if spread or node_selector else self._endpoint
        return self._fork_children(call, _send(ep, call, self).sandboxes)

    def restore(self, snapshot: str | SnapshotBase, *, key: str | None = None) -> SandboxInfo:
        """Roll this sandbox's files back to ``snapshot`` in place (same id). Every process
        in it is killed and its init restarted; background processes are forgotten."""
        return self._remember(self._call(api.restore(self.id, snapshot), key))

    def pause(self, *, key: str | None = None) -> SandboxInfo:
        """Freeze every process (no CPU) until ``resume()`` or any exec or file call."""
        return self._remember(self._call(api.pause(self.id), key))

    def resume(self, *, key: str | None = None) -> SandboxInfo:
        """Thaw a paused sandbox (an exec resumes it too)."""
        return self._remember(self._call(api.resume(self.id), key))

    def log(self) -> builtins.list[LogEntry]:
        """Its trajectory log: every exec and file operation with its result, in order (also
        after the sandbox ended, until the daemon prunes it)."""
        return self._call(api.log(self.id))

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self.kill()
        except SandboxNotFound:
            pass
        except CorralError:
            if exc is None:  # don't hide the body's own exception behind a cleanup failure
                raise


class NetworkControl:
    """``sandbox.network``: its network policy, changed live."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sb = sandbox

    def update(self, network: str | NetworkPolicy) -> SandboxInfo:
        """Replace the policy at once (``"internet"``, a named allowlist or a
        ``corral.Network``): new connections follow it, DNS pins of the old one are gone."""
        return self._sb._remember(self._sb._call(api.update_network(self._sb.id, network)))


class Files:
    """``sandbox.files``: file operations resolved inside the sandbox's root."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sb = sandbox

    def _call(self, call: Call[T], key: str | None = None) -> T:
        return self._sb._call(call, key)

    def read(self, path: str, *, key: str | None = None) -> str:
        """The file as text (UTF-8; undecodable bytes become U+FFFD: use read_bytes)."""
        return self._call(api.read(self._sb.id, path), key).decode("utf-8", "replace")

    def read_bytes(self, path: str, max_bytes: int | None = None, *,
                   key: str | None = None) -> bytes:
        """The file's bytes (only the first ``max_bytes`` of them if given)."""
        return self._call(api.read(self._sb.id, path, max_bytes), key)

    def write(self, path: str, data: str | bytes, mode: int = 0o644, *,
              key: str | None = None) -> None:
        """Create or replace a file (parent directories are created)."""
        self._call(api.write(self._sb.id, path, data, mode), key)

    def list(self, path: str = "/", *, key: str | None = None) -> builtins.list[FileEntry]:
        """The entries of directory ``path`` (every page of them)."""
        pages = itertools.count()
        return api.all_pages(lambda call: self._call(call, api.page_key(key, next(pages))),
                             lambda after: api.list_dir(self._sb.id, path, after))

    def tree(self, path: str = "/", depth: int | None = None,
             limit: int | None = None) -> FileTree:
        """The entries under directory ``path`` to ``depth`` levels (default 64), breadth
        first, at most ``limit`` (default 10,000; ``truncated`` says there were more), in one
        call. Not in the trajectory log: for watching a tree, not for an agent's steps."""
        return self._call(api.tree(self._sb.id, path, depth, limit))

    def stat(self, path: str, *, key: str | None = None) -> FileEntry:
        """Type, size, mode and mtime of ``path`` (symlinks are not followed)."""
        return self._call(api.stat(self._sb.id, path), key)

    def exists(self, path: str, *, key: str | None = None) -> bool:
        """Whether ``path`` exists."""
        return self._call(api.exists(self._sb.id, path), key)

    def mkdir(self, path: str, parents: bool = True, *, key: str | None = None) -> None:
        """Make directory ``path`` (and its missing parents unless ``parents=False``)."""
        self._call(api.mkdir(self._sb.id, path, parents), key)

    def remove(self, path: str, recursive: bool = False, *, key: str | None = None) -> None:
        """Remove a file, or a directory (its contents too only with ``recursive=True``)."""
        self._call(api.remove(self._sb.id, path, recursive), key)

    def rename(self, src: str, dst: str, *, key: str | None = None) -> None:
        """Move ``src`` to ``dst`` (replacing a file there)."""
        self._call(api.rename(self._sb.id, src, dst), key)

    def upload(self, local_dir: str | os.PathLike[str], remote_dir: str, *,
               key: str | None = None) -> None:
        """Copy a local directory's contents into ``remote_dir`` (one tar)."""
        self._call(api.put_tar(self._sb.id, remote_dir, tarball.pack(local_dir)), key)

    def download(self, remote_dir: str,
                 local_dir: str | os.PathLike[str]) -> builtins.list[str]:
        """Copy ``remote_dir`` into ``local_dir`` (one tar); returns the names extracted."""
        return tarball.unpack(self._call(api.get_tar(self._sb.id, remote_dir)), local_dir)


class Process(ProcessBase):
    """A background command (``exec(..., background=True)``)."""

    def _call(self, call: Call[T]) -> T:
        return transport(self._endpoint).call(call)

    def status(self) -> ProcessStatus:
        """Whether it still runs, and its exit code once it has exited."""
        return self._saw_status(self._call(api.proc_status(self.sandbox_id, self.pid)))

    def wait(self, timeout: float | None = None) -> ExecResult:
        """Its result once it exits (raises corral.ProcessStillRunning if still running after
        ``timeout`` seconds; the process keeps running)."""
        return self._saw_result(self._call(api.proc_wait(self.sandbox_id, self.pid, timeout)))

    def stream(self) -> Iterator[OutputChunk]:
        """Output as it comes, from the start, as ``(stream, data)`` pairs (``stream`` is
        "stdout" or "stderr"), until the process exits. Opened after a stream passed its
        ``max_output_bytes``: what was kept of it, then the live output; the bytes dropped
        between them are counted in ``self.skipped``."""
        call = api.proc_stream(self.sandbox_id, self.pid)
        self.skipped = {"stdout": 0, "stderr": 0}
        for line in transport(self._endpoint).lines(call):
            ev = api.stream_event(line)
            if isinstance(ev, OutputChunk):
                yield ev
            elif isinstance(ev, api.Skipped):
                self.skipped[ev.stream] = self.skipped.get(ev.stream, 0) + ev.bytes
            else:
                self._saw_status(ev)
                return
        raise lost(self._endpoint, call, EOFError("the stream ended without an exit status"))

    def send_stdin(self, data: str | bytes, eof: bool = False) -> None:
        """Write ``data`` to its stdin (``eof=True`` closes it after)."""
        self._call(api.proc_stdin(self.sandbox_id, self.pid, data, eof))

    def close_stdin(self) -> None:
        """Close its stdin (the process reads end of file)."""
        self._call(api.proc_close_stdin(self.sandbox_id, self.pid))

    def kill(self, signal: int = 9) -> None:
        """Signal its whole process group (SIGKILL by default)."""
        self._call(api.proc_kill(self.sandbox_id, self.pid, signal))
