"""Every API operation as a ``Call``: the one implementation behind Sandbox and AsyncSandbox.

Requests are validated here with the shared pydantic models, so bad input fails fast with
``InvalidRequest`` (the daemon validates again: it trusts no client). Responses are parsed into
the shared models. Nothing in this module does I/O.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, TypeVar
from urllib.parse import quote

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticSerializationError

from corral import nodeselector
from corral.errors import (
    Conflict,
    CorralError,
    DaemonRestarted,
    FileNotFound,
    InvalidNetwork,
    InvalidRequest,
    NotADirectory,
    error_from_payload,
)
from corral.models import (
    DEFAULT_EXEC_TIMEOUT_S,
    DEFAULT_MAX_OUTPUT_BYTES,
    NETWORK_MODES,
    AllowlistInfo,
    BatchExecRequest,
    CommitRequest,
    CreateManyRequest,
    DaemonStatus,
    ExecManyRequest,
    ExecRequest,
    ExposedPort,
    ExposeRequest,
    FileEntry,
    FileTree,
    ForkRequest,
    ForkResult,
    ImageInfo,
    ImportImageRequest,
    KillManyRequest,
    KillProcessRequest,
    LogEntry,
    MkdirRequest,
    NetworkUpdate,
    ProcessHandle,
    ProcessStatus,
    PruneResult,
    PullImageRequest,
    PushImageRequest,
    PushResult,
    RemoveRequest,
    RenameRequest,
    RestoreRequest,
    SandboxInfo,
    SandboxSpec,
    SetTimeoutRequest,
    SnapshotInfo,
    SnapshotRequest,
    StdinRequest,
    SubstrateInfo,
    TagImageRequest,
    WaitRequest,
)
from corral.sdk.call import DEFAULT_READ_TIMEOUT, WAIT_READ_TIMEOUT, Call, T, seg
from corral.sdk.results import ExecResult, OutputChunk

M = TypeVar("M", bound=BaseModel)

BATCH_CONCURRENCY = 64    # exec_many: commands the daemon runs at once
GRACE_S = 30.0            # wait this much beyond a command's own timeout before giving up
OCTET = "application/octet-stream"


# ---- request validation ------------------------------------------------------------------
def validated(model: type[M], **fields: Any) -> M:
    try:
        return model(**fields)
    except ValidationError as e:
        errs = e.errors(include_url=False)
        msgs = [f"{'.'.join(str(x) for x in d['loc']) or 'value'}: {d['msg']}"
                for d in errs[:5]]
        text = f"invalid {model.__name__}: {'; '.join(msgs)}"
        if any("network" in d["loc"] for d in errs):  # same code as the daemon
            raise InvalidNetwork(f"{text} (network modes: {', '.join(NETWORK_MODES)})",
                                 details={"modes": list(NETWORK_MODES)}) from None
        raise InvalidRequest(text) from None


def _body(model: BaseModel) -> bytes:
    # Only what the caller set: the daemon fills in the rest (and tells "unset" from "default").
    try:
        return model.model_dump_json(exclude_unset=True).encode()
    except PydanticSerializationError:
        # A path that is not UTF-8 (surrogate escapes, as a listing gave it): JSON's \udcxx
        # escapes carry it, and the daemon reads them back to the same bytes.
        return json.dumps(model.model_dump(mode="json", exclude_unset=True)).encode()


class _DefaultTimeout(float):
    """The exec timeout nobody chose: 60 s for a foreground command, none for a background one
    (a server lives until killed). Sent as "unset" so the daemon applies that rule."""


DEFAULT_TIMEOUT: float = _DefaultTimeout(DEFAULT_EXEC_TIMEOUT_S)


def _read_timeout(timeout: float | None) -> float | None:
    return None if timeout is None else timeout + GRACE_S


def spec(**fields: Any) -> SandboxSpec:
    """A SandboxSpec from keyword arguments (None means the default)."""
    if fields.get("snapshot") is not None:
        fields["snapshot"] = _snap_key(fields["snapshot"])
    return validated(SandboxSpec, **{k: v for k, v in fields.items() if v is not None})


# ---- response parsers -------------------------------------------------------------------
def _info(body: bytes) -> SandboxInfo:
    return SandboxInfo.model_validate_json(body)


def _ok(body: bytes) -> None:
    return None


def _raw(body: bytes) -> bytes:
    return body


def _keyed(call: Call[T]) -> Call[T]:
    """A logged call (mutating, or a read a replay must see as it was): the facades attach
    an idempotency key when the handle has a trajectory id or the caller gives one
    (docs/trajectory.md)."""
    call.keyed = True
    return call


# ---- sandboxes ----------------------------------------------------------------------------
def sb_path(sid: str) -> str:
    if not sid or not isinstance(sid, str):
        raise InvalidRequest(f"bad sandbox id {sid!r}")
    return "/v1/sandboxes/" + seg(sid)


def _placement(node_selector: Mapping[str, str] | None) -> dict[str, str] | None:
    """The header that asks a cluster gateway for nodes with these labels (one daemon
    ignores it)."""
    if not node_selector:
        return None
    return {nodeselector.HEADER: nodeselector.format_selector(node_selector)}


def create(s: SandboxSpec, *, node_selector: Mapping[str, str] | None = None
           ) -> Call[SandboxInfo]:
    return _keyed(Call("POST", "/v1/sandboxes", _info, body=_body(s),
                       headers=_placement(node_selector)))


# Long calls (batches, snapshot, fork, restore) are asked for as a stream of progress lines
# (docs/daemon.md, long calls): the daemon is never silent for more than a second, so the read
# timeout measures silence, not the call's length.
BATCH_STREAM = [("stream", "ndjson")]


def _streamed(parse: Callable[[bytes], T]) -> Callable[[bytes], T]:
    """The answer of a streamed call: its last line (the lines before are progress)."""
    def run(body: bytes) -> T:
        lines = [line for line in body.split(b"\n") if line.strip()]
        last = json.loads(lines[-1]) if lines else {}
        if not isinstance(last, dict) or set(last) <= {"progress"}:
            raise lost_answer()
        if "error" in last:
            raise error_from_payload(last)
        return parse(lines[-1])
    return run


def lost_answer() -> CorralError:
    # As a connection lost mid-call: the batch's outcome is unknown to the caller.
    return DaemonRestarted("the call's stream ended before its answer (the daemon stopped or "
                           "the connection dropped); its outcome is unknown")


def _infos_or_errors(body: bytes) -> list[SandboxInfo | CorralError]:
    return [error_from_payload(x) if "error" in x else SandboxInfo.model_validate(x)
            for x in json.loads(body)["sandboxes"]]


def create_many(count: int, s: SandboxSpec, *, partial: bool = False, spread: bool = False,
                node_selector: Mapping[str, str] | None = None
                ) -> Call[list[SandboxInfo | CorralError]]:
    """``partial``: a cluster gateway keeps the sandboxes its other nodes made when a node
    fails its share, and answers that share's error at its items' places. ``spread``: a
    cluster gateway spreads the sandboxes over its nodes as a group (a snapshot's layers
    move to the nodes that get some); ``node_selector``: only on nodes with these labels.
    One daemon ignores both."""
    req = validated(CreateManyRequest, count=count, spec=s)
    query = [*BATCH_STREAM, *([("partial", "true")] if partial else []),
             *([("spread", "true")] if spread else [])]
    return Call("POST", "/v1/sandboxes/batch", _streamed(_infos_or_errors), query=query,
                body=_body(req), headers=_placement(node_selector))


def _ids(sandboxes: Any) -> list[str]:
    ids = [x if isinstance(x, str) else x.id for x in sandboxes]
    if not ids:
        raise InvalidRequest("no sandboxes given")
    return ids


def _items(parse: Callable[[dict[str, Any]], T]) -> Callable[[bytes], list[T | CorralError]]:
    """A batch answer: each item parsed, or the CorralError it carries (not raised)."""
    def run(body: bytes) -> list[T | CorralError]:
        return [error_from_payload(x) if "error" in x else parse(x)
                for x in json.loads(body)["results"]]
    return run


def exec_many(ids: list[str], cmd: str | list[str], *,
              timeout: float | None = DEFAULT_TIMEOUT,
              env: Mapping[str, str] | None = None, cwd: str | None = None,
              user: str | int | None = None, stdin: str | bytes | None = None,
              max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
              concurrency: int = BATCH_CONCURRENCY) -> Call[list[ExecResult | CorralError]]:
    if isinstance(stdin, bytes):
        stdin = stdin.decode("utf-8")
    if isinstance(cmd, tuple):
        cmd = list(cmd)
    chosen = {} if isinstance(timeout, _DefaultTimeout) else {"timeout": timeout}
    ex = validated(BatchExecRequest, cmd=cmd, env=dict(env or {}), cwd=cwd, user=user,
                   stdin=stdin,
                   max_output_bytes=max_output_bytes, **chosen)
    req = validated(ExecManyRequest, ids=ids, exec=ex, concurrency=concurrency)
    return Call("POST", "/v1/sandboxes/batch/exec", _streamed(_items(ExecResult.model_validate)),
                query=BATCH_STREAM, body=_body(req))


def _killed(n: int) -> Callable[[bytes], list[bool | CorralError]]:
    """The daemon answers counts and the ids not killed; every other id was."""
    def run(body: bytes) -> list[bool | CorralError]:
        out: list[bool | CorralError] = [True] * n
        for x in json.loads(body)["not_killed"]:
            out[x["index"]] = error_from_payload(x) if x.get("error") else False
        return out
    return run


def kill_many(ids: list[str]) -> Call[list[bool | CorralError]]:
    req = validated(KillManyRequest, ids=ids)
    return Call("POST", "/v1/sandboxes/batch/destroy", _streamed(_killed(len(ids))),
                query=BATCH_STREAM, body=_body(req))


def get(sid: str) -> Call[SandboxInfo]:
    return Call("GET", sb_path(sid), _info, retry_safe=True)


def info(sid: str) -> Call[SandboxInfo]:
    """``sb.info()``: keyed, so that a replay returns what the first call saw."""
    return _keyed(get(sid))


def trajectory(tid: str) -> Call[dict[str, Any]]:
    """Where trajectory ``tid`` stands: ``{"sandbox_id", "step", "sandbox"}``."""
    if not isinstance(tid, str) or not tid or ":" in tid:
        raise InvalidRequest(f"bad trajectory_id {tid!r}: non-empty, no ':'")
    return Call("GET", "/v1/trajectories/" + seg(tid), json.loads, retry_safe=True)


def label_filters(labels: Mapping[str, str | None] | list[str] | None) -> list[tuple[str, str]]:
    """``{"k": "v"}`` (equal) or ``{"k": None}`` (present), or ``["k=v", "k"]``."""
    if not labels:
        return []
    if isinstance(labels, Mapping):
        return [("label", k if v is None else f"{k}={v}") for k, v in labels.items()]
    return [("label", str(x)) for x in labels]


Page = tuple[list[T], "str | None"]


def _page(key: str, parse: Callable[[Any], T]) -> Callable[[bytes], Page[T]]:
    """A list endpoint's answer: (items, cursor of the next page or None)."""
    def run(body: bytes) -> Page[T]:
        data = json.loads(body)
        return [parse(x) for x in data[key]], data.get("next")
    return run


def all_pages(send: Callable[[Call[Page[T]]], Page[T]],
              call: Callable[[str | None], Call[Page[T]]]) -> list[T]:
    """Every item of a list endpoint: pages followed until ``next`` is null."""
    out: list[T] = []
    after: str | None = None
    while True:
        items, after = send(call(after))
        out.extend(items)
        if after is None:
            return out


async def all_pages_async(send: Callable[[Call[Page[T]]], Any],
                          call: Callable[[str | None], Call[Page[T]]]) -> list[T]:
    out: list[T] = []
    after: str | None = None
    while True:
        items, after = await send(call(after))
        out.extend(items)
        if after is None:
            return out


def _page_query(after: str | None) -> list[tuple[str, str]]:
    return [("after", after)] if after else []


def list_(labels: Mapping[str, str | None] | list[str] | None = None,
          after: str | None = None, limit: int | None = None) -> Call[Page[SandboxInfo]]:
    """One page of running sandboxes; callers follow ``next`` (all_pages)."""
    query = label_filters(labels) + _page_query(after)
    if limit is not None:
        query.append(("limit", str(limit)))
    return Call("GET", "/v1/sandboxes", _page("sandboxes", SandboxInfo.model_validate),
                query=query, retry_safe=True)


def kill(sid: str) -> Call[bool]:
    return _keyed(Call("DELETE", sb_path(sid), lambda b: bool(json.loads(b)["killed"]),
                       timeout=WAIT_READ_TIMEOUT))


def set_timeout(sid: str, seconds: float) -> Call[SandboxInfo]:
    req = validated(SetTimeoutRequest, timeout=seconds)
    return Call("POST", sb_path(sid) + "/timeout", _info, body=_body(req))


def update_network(sid: str, network: Any) -> Call[SandboxInfo]:
    req = validated(NetworkUpdate, network=network)
    return Call("PUT", sb_path(sid) + "/network", _info, body=_body(req))


def expose(sid: str, port: int) -> Call[str]:
    req = validated(ExposeRequest, port=port)
    return Call("POST", sb_path(sid) + "/ports",
                lambda b: ExposedPort.model_validate_json(b).host, body=_body(req))


def unexpose(sid: str, port: int) -> Call[bool]:
    return Call("DELETE", sb_path(sid) + f"/ports/{int(port)}",
                lambda b: bool(json.loads(b)["removed"]))


# ---- snapshots, fork, restore, pause --------------------------------------------------------
def _snap_key(snapshot: Any) -> str:
    key = getattr(snapshot, "id", snapshot)
    if not isinstance(key, str) or not key:
        raise InvalidRequest(f"bad snapshot {snapshot!r}: give a Snapshot, an id or a name")
    return key


def snapshot(sid: str, name: str | None = None) -> Call[SnapshotInfo]:
    req = validated(SnapshotRequest, name=name)
    return _keyed(Call("POST", sb_path(sid) + "/snapshot",
                       _streamed(SnapshotInfo.model_validate_json), query=BATCH_STREAM,
                       body=_body(req)))


def fork(sid: str, count: int, name: str | None = None, keep_snapshot: bool = False, *,
         spread: bool = False, node_selector: Mapping[str, str] | None = None
         ) -> Call[ForkResult]:
    """``spread`` and ``node_selector``: for a cluster gateway, which places the children
    (corral.cluster.forks); one daemon ignores both."""
    req = validated(ForkRequest, count=count, name=name, keep_snapshot=keep_snapshot)
    query = [*BATCH_STREAM, *([("spread", "true")] if spread else [])]
    return _keyed(Call("POST", sb_path(sid) + "/fork", _streamed(ForkResult.model_validate_json),
                       query=query, body=_body(req), headers=_placement(node_selector)))


def restore(sid: str, snapshot: Any) -> Call[SandboxInfo]:
    req = validated(RestoreRequest, snapshot=_snap_key(snapshot))
    return _keyed(Call("POST", sb_path(sid) + "/restore", _streamed(_info), query=BATCH_STREAM,
                       body=_body(req)))


def pause(sid: str) -> Call[SandboxInfo]:
    return _keyed(Call("POST", sb_path(sid) + "/pause", _info, timeout=WAIT_READ_TIMEOUT))


def resume(sid: str) -> Call[SandboxInfo]:
    return _keyed(Call("POST", sb_path(sid) + "/resume", _info))


def snapshots(after: str | None = None) -> Call[Page[SnapshotInfo]]:
    return Call("GET", "/v1/snapshots", _page("snapshots", SnapshotInfo.model_validate),
                query=_page_query(after), retry_safe=True)


def snapshot_get(key: Any) -> Call[SnapshotInfo]:
    return Call("GET", "/v1/snapshots/" + seg(_snap_key(key)),
                SnapshotInfo.model_validate_json, retry_safe=True)


def snapshot_delete(key: Any) -> Call[bool]:
    return Call("DELETE", "/v1/snapshots/" + seg(_snap_key(key)),
                lambda b: bool(json.loads(b)["deleted"]))


# ---- exec and background processes ----------------------------------------------------------
def exec_(sid: str, cmd: str | list[str], *, timeout: float | None = DEFAULT_TIMEOUT,
          env: Mapping[str, str] | None = None, cwd: str | None = None,
          user: str | int | None = None, stdin: str | bytes | None = None,
          background: bool = False,
          max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES) -> Call[Any]:
    if isinstance(stdin, bytes):
        stdin = stdin.decode("utf-8")
    if isinstance(cmd, tuple):
        cmd = list(cmd)
    chosen = {} if isinstance(timeout, _DefaultTimeout) else {"timeout": timeout}
    req = validated(ExecRequest, cmd=cmd, env=dict(env or {}), cwd=cwd, user=user, stdin=stdin,
                    background=background, max_output_bytes=max_output_bytes, **chosen)
    if background:
        return _keyed(Call("POST", sb_path(sid) + "/exec", ProcessHandle.model_validate_json,
                           body=_body(req)))
    return _keyed(Call("POST", sb_path(sid) + "/exec", ExecResult.model_validate_json,
                       body=_body(req), timeout=_read_timeout(timeout)))


def _proc(sid: str, pid: int) -> str:
    return f"{sb_path(sid)}/procs/{int(pid)}"


def proc_status(sid: str, pid: int) -> Call[ProcessStatus]:
    return Call("GET", _proc(sid, pid), ProcessStatus.model_validate_json, retry_safe=True)


def proc_wait(sid: str, pid: int, timeout: float | None = None) -> Call[ExecResult]:
    req = validated(WaitRequest, timeout=timeout)
    return Call("POST", _proc(sid, pid) + "/wait", ExecResult.model_validate_json,
                body=_body(req), timeout=_read_timeout(timeout))


def proc_stdin(sid: str, pid: int, data: str | bytes, eof: bool = False) -> Call[None]:
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidRequest(f"stdin must be UTF-8 text: {e}") from None
    req = validated(StdinRequest, data=data, eof=eof)
    return Call("POST", _proc(sid, pid) + "/stdin", _ok, body=_body(req))


def _ignore_conflict(err: CorralError) -> None:
    if not isinstance(err, Conflict):
        raise err


def proc_close_stdin(sid: str, pid: int) -> Call[None]:
    """EOF on stdin; a no-op if the process already exited or its stdin is closed."""
    c = proc_stdin(sid, pid, "", True)
    c.recover = _ignore_conflict
    return c


def proc_kill(sid: str, pid: int, signal: int = 9) -> Call[None]:
    req = validated(KillProcessRequest, signal=signal)
    return Call("POST", _proc(sid, pid) + "/kill", _ok, body=_body(req))


def proc_stream(sid: str, pid: int) -> Call[None]:
    return Call("GET", _proc(sid, pid) + "/stream", _ok, timeout=None)


class Skipped(NamedTuple):
    """A stream line marking bytes of ``stream`` the daemon dropped (past the process's cap
    before the stream was opened) between the chunks before it and after it."""

    stream: str
    bytes: int


def stream_event(line: bytes) -> OutputChunk | Skipped | ProcessStatus:
    """One NDJSON line of a stream: an output chunk, a gap, or the final status (raises if
    the sandbox ended under the process)."""
    obj = json.loads(line)
    if "stream" in obj:
        if obj.get("skipped"):
            return Skipped(obj["stream"], int(obj["skipped"]))
        return OutputChunk(obj["stream"], obj.get("data", ""))
    if "error" in obj:
        raise error_from_payload(obj)
    signal = obj.get("signal")
    return ProcessStatus(pid=int(obj.get("pid") or 0), running=False,
                         exit_code=obj.get("exit_code"),
                         timed_out=bool(obj.get("timed_out", False)),
                         signal=signal if isinstance(signal, int) else None,
                         oom_killed=bool(obj.get("oom_killed", False)))


# ---- files --------------------------------------------------------------------------------
def _path(path: str) -> str:
    if not isinstance(path, str) or not path:
        raise InvalidRequest(f"bad path {path!r}")
    return path


def read(sid: str, path: str, max_bytes: int | None = None) -> Call[bytes]:
    q = [("path", _path(path))]
    if max_bytes is not None:
        q.append(("max_bytes", str(int(max_bytes))))
    return _keyed(Call("GET", sb_path(sid) + "/files", _raw, query=q, retry_safe=True))


def write(sid: str, path: str, data: str | bytes, mode: int = 0o644) -> Call[None]:
    if isinstance(data, str):
        data = data.encode("utf-8")
    elif not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidRequest(f"file data must be str or bytes, not {type(data).__name__}")
    return _keyed(Call("PUT", sb_path(sid) + "/files", _ok,
                       query=[("path", _path(path)), ("mode", str(int(mode)))],
                       body=bytes(data), content_type=OCTET))


def list_dir(sid: str, path: str, after: str | None = None) -> Call[Page[FileEntry]]:
    """One page of a directory, by name; callers follow ``next`` (all_pages)."""
    return _keyed(Call("GET", sb_path(sid) + "/files/list",
                       _page("entries", FileEntry.model_validate),
                       query=[("path", _path(path))] + _page_query(after), retry_safe=True))


def tree(sid: str, path: str, depth: int | None = None,
         limit: int | None = None) -> Call[FileTree]:
    """The entries under a directory in one answer (not logged: an observation)."""
    query = [("path", _path(path))]
    query += [("depth", str(depth))] if depth is not None else []
    query += [("limit", str(limit))] if limit is not None else []
    return Call("GET", sb_path(sid) + "/files/tree", _file_tree,
                query=query, retry_safe=True)


def page_key(key: str | None, index: int) -> str | None:
    """The explicit key of page ``index`` of a keyed listing: each page is a call of its own
    in the log (the first keeps the caller's key)."""
    return key if key is None or index == 0 else f"{key}/page{index}"


def _file_tree(body: bytes) -> FileTree:
    return FileTree.model_validate(json.loads(body))  # json.loads: as _file_entry


def _file_entry(body: bytes) -> FileEntry:
    # json.loads, not model_validate_json: a name that is not UTF-8 comes as surrogate
    # escapes (as os.fsdecode gives it), which pydantic's JSON parser refuses.
    return FileEntry.model_validate(json.loads(body))


def stat(sid: str, path: str) -> Call[FileEntry]:
    return _keyed(Call("GET", sb_path(sid) + "/files/stat", _file_entry,
                       query=[("path", _path(path))], retry_safe=True))


def _missing(err: CorralError) -> bool:
    if isinstance(err, (FileNotFound, NotADirectory)):
        return False
    raise err


def exists(sid: str, path: str) -> Call[bool]:
    c = stat(sid, path)
    return _keyed(Call(c.method, c.path, lambda b: True, query=c.query, recover=_missing,
                       retry_safe=True))


def mkdir(sid: str, path: str, parents: bool = True) -> Call[None]:
    req = validated(MkdirRequest, path=path, parents=parents)
    return _keyed(Call("POST", sb_path(sid) + "/files/mkdir", _ok, body=_body(req)))


def remove(sid: str, path: str, recursive: bool = False) -> Call[None]:
    req = validated(RemoveRequest, path=path, recursive=recursive)
    return _keyed(Call("POST", sb_path(sid) + "/files/remove", _ok, body=_body(req)))


def rename(sid: str, src: str, dst: str) -> Call[None]:
    req = validated(RenameRequest, src=src, dst=dst)
    return _keyed(Call("POST", sb_path(sid) + "/files/rename", _ok, body=_body(req)))


def put_tar(sid: str, remote_dir: str, tar_bytes: bytes) -> Call[None]:
    return _keyed(Call("PUT", sb_path(sid) + "/files/tar", _ok,
                       query=[("path", _path(remote_dir))], body=tar_bytes,
                       content_type="application/x-tar", timeout=DEFAULT_READ_TIMEOUT * 5))


def get_tar(sid: str, remote_path: str) -> Call[bytes]:
    return Call("GET", sb_path(sid) + "/files/tar", _raw, query=[("path", _path(remote_path))],
                timeout=DEFAULT_READ_TIMEOUT * 5, retry_safe=True)


# ---- trajectory log ------------------------------------------------------------------------
def log(sid: str) -> Call[list[LogEntry]]:
    return Call("GET", sb_path(sid) + "/log",
                lambda b: [LogEntry.model_validate(x) for x in json.loads(b)["entries"]],
                retry_safe=True)


def log_raw(sid: str) -> Call[dict[str, Any]]:
    """The whole answer: ``{"sandbox_id", "sandbox": {spec, ...} | None, "entries"}``."""
    return Call("GET", sb_path(sid) + "/log", json.loads, retry_safe=True)


# ---- daemon and images ----------------------------------------------------------------------
def status() -> Call[DaemonStatus]:
    return Call("GET", "/v1/status", DaemonStatus.model_validate_json, retry_safe=True)


def substrates() -> Call[list[SubstrateInfo]]:
    return Call("GET", "/v1/substrates",
                lambda b: [SubstrateInfo.model_validate(x) for x in json.loads(b)["substrates"]],
                retry_safe=True)


def networks() -> Call[list[AllowlistInfo]]:
    return Call("GET", "/v1/networks",
                lambda b: [AllowlistInfo.model_validate(x) for x in json.loads(b)["networks"]],
                retry_safe=True)


def network(name: str) -> Call[AllowlistInfo]:
    return Call("GET", f"/v1/networks/{quote(name, safe='')}", AllowlistInfo.model_validate_json,
                retry_safe=True)


def images(after: str | None = None) -> Call[Page[ImageInfo]]:
    return Call("GET", "/v1/images", _page("images", ImageInfo.model_validate),
                query=_page_query(after), retry_safe=True)


def pull_image(reference: str, progress: bool = False,
               node_selector: Mapping[str, str] | None = None) -> Call[ImageInfo]:
    """``progress``: the answer is NDJSON (read it with a transport's ``lines``).
    ``node_selector``: through a cluster gateway, pull on the nodes with these labels only
    (without it, on every node)."""
    req = validated(PullImageRequest, reference=reference, progress=progress)
    return Call("POST", "/v1/images/pull", ImageInfo.model_validate_json, body=_body(req),
                timeout=None, headers=_placement(node_selector))


def pull_event(line: bytes) -> dict[str, Any]:
    """One NDJSON line of a pull with progress; the final ``{"error"}`` line raises."""
    ev = json.loads(line)
    if "error" in ev:
        raise error_from_payload(ev)
    return dict(ev)


def image(name: str) -> Call[ImageInfo]:
    return Call("GET", "/v1/images/" + seg(name), ImageInfo.model_validate_json,
                retry_safe=True)


def remove_image(name: str) -> Call[dict[str, Any]]:
    return Call("DELETE", "/v1/images/" + seg(name), json.loads)


def prune_images() -> Call[PruneResult]:
    return Call("POST", "/v1/images/prune", PruneResult.model_validate_json, timeout=None)


def import_image(name: str, source: str) -> Call[ImageInfo]:
    req = validated(ImportImageRequest, name=name, source=source)
    return Call("POST", "/v1/images", ImageInfo.model_validate_json, body=_body(req),
                timeout=None)


def commit(sid: str, name: str, config: Mapping[str, Any] | None = None,
           replace: bool = False) -> Call[ImageInfo]:
    req = validated(CommitRequest, name=name, config=dict(config) if config else None,
                    replace=replace)
    return Call("POST", sb_path(sid) + "/commit", ImageInfo.model_validate_json,
                body=_body(req), timeout=None)


def tag_image(source: str, name: str, config: Mapping[str, Any] | None = None,
              replace: bool = False) -> Call[ImageInfo]:
    req = validated(TagImageRequest, source=source, name=name,
                    config=dict(config) if config else None, replace=replace)
    return Call("POST", "/v1/images/tag", ImageInfo.model_validate_json, body=_body(req),
                timeout=None)


def push_image(name: str, reference: str | None = None) -> Call[PushResult]:
    req = validated(PushImageRequest, name=name, reference=reference)
    return Call("POST", "/v1/images/push", PushResult.model_validate_json, body=_body(req),
                timeout=None)
