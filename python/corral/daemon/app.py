"""The HTTP/JSON API: routes -> engine calls, errors -> JSON, bearer auth on TCP.

``ROUTES`` is the one table of the API: the app registers it and ``corral.daemon.openapi``
generates the spec from it, so the two cannot drift apart.

Responses are built as plain dicts and ``json.dumps``: no pydantic model on the way out (it
would cost more than the sandbox operation for small calls). Requests are validated with the
shared pydantic models; a validation failure is ``invalid_request`` with pydantic's message.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ValidationError

from corral.daemon import streams
from corral.daemon.engine import MAX_READ_BYTES, Engine
from corral.daemon.trajlog import (
    KEY_HEADER,
    TrajLog,
    body_request,
    data_result,
    listing_result,
    replayed_listing,
    replayed_read,
)
from corral.errors import (
    CorralError,
    InternalError,
    InvalidNetwork,
    InvalidPath,
    InvalidRequest,
    NotFound,
    ReplayDivergence,
    SandboxNotFound,
    Unauthorized,
)
from corral.models import (
    NETWORK_MODES,
    CreateManyRequest,
    DaemonStatus,
    ExecManyRequest,
    ExecManyResponse,
    ExecRequest,
    ExecResult,
    FileEntry,
    ForkRequest,
    ForkResult,
    ImageInfo,
    ImportImageRequest,
    KillManyRequest,
    KillManyResponse,
    KillProcessRequest,
    MkdirRequest,
    ProcessHandle,
    ProcessStatus,
    RemoveRequest,
    RenameRequest,
    RestoreRequest,
    SandboxInfo,
    SandboxSpec,
    SetTimeoutRequest,
    SnapshotInfo,
    SnapshotRequest,
    StdinRequest,
    WaitRequest,
)

log = logging.getLogger("corral.api")

ENGINE: web.AppKey[Engine] = web.AppKey("engine", Engine)
MAX_BODY = 1 << 30           # file and tar uploads come as request bodies
BIG_BODY = 1 << 20           # bigger writes go through a thread
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# ---- helpers ---------------------------------------------------------------------------
def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=json.dumps(obj, separators=(",", ":")).encode(), status=status,
                        content_type="application/json")


_OK = b'{"ok":true}'


def _ok() -> web.Response:
    return web.Response(body=_OK, content_type="application/json")


def _error(err: CorralError, status: int | None = None) -> web.Response:
    return _json(err.to_payload(), status or err.status)


def validation_message(e: ValidationError) -> tuple[str, list[dict[str, Any]]]:
    errs = [{"loc": [str(x) for x in d["loc"]], "msg": d["msg"], "type": d["type"]}
            for d in e.errors(include_url=False, include_input=False, include_context=False)]
    text = "; ".join(f"{'.'.join(d['loc']) or 'body'}: {d['msg']}" for d in errs[:5])
    return text, errs


async def _body(request: web.Request, model: type[BaseModel]) -> Any:
    return _parse(await request.read(), model)


def _parse(raw: bytes, model: type[BaseModel]) -> Any:
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as e:
        text, errs = validation_message(e)
        # A bad network mode gets its own code: clients branch on it (an older daemon may lack
        # a newer mode), and the message lists the modes this daemon knows.
        if any(d["loc"] and d["loc"][-1] == "network" for d in errs):
            raise InvalidNetwork(f"invalid {model.__name__}: {text} (network modes: "
                                 f"{', '.join(NETWORK_MODES)})",
                                 details={"errors": errs, "modes": list(NETWORK_MODES)}) from None
        raise InvalidRequest(f"invalid {model.__name__}: {text}",
                             details={"errors": errs}) from None


def _engine(request: web.Request) -> Engine:
    return request.app[ENGINE]


def check_path(path: str, what: str = "path") -> str:
    if not path.startswith("/") or "\0" in path or len(path) > 4096:
        raise InvalidPath(f"{what} must be an absolute path inside the sandbox: {path!r}")
    return path


def _query_path(request: web.Request) -> str:
    path = request.query.get("path")
    if path is None:
        raise InvalidRequest("missing query parameter 'path'")
    return check_path(path)


def _query_int(request: web.Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw, 8) if len(raw) > 1 and raw.startswith("0") and raw.isdigit() \
            else int(raw, 0)
    except ValueError:
        raise InvalidRequest(f"query parameter {name!r} must be an integer") from None
    if not lo <= value <= hi:
        raise InvalidRequest(f"query parameter {name!r} must be in [{lo}, {hi}]")
    return value


def _pid(request: web.Request) -> int:
    try:
        return int(request.match_info["pid"])
    except ValueError:
        raise InvalidRequest("process id must be an integer") from None


def _entry(e: Any) -> Any:
    return e.model_dump() if isinstance(e, BaseModel) else e


# ---- trajectory log hooks (corral.daemon.trajlog; docs/trajectory.md) ----------------------
def _tl(request: web.Request) -> TrajLog:
    return request.app[ENGINE].trajlog


def _key(request: web.Request) -> str | None:
    """The idempotency key of a call (header ``Idempotency-Key``)."""
    return request.headers.get(KEY_HEADER)


_EXEC_FIELDS = frozenset(ExecResult.model_fields)
_HANDLE_FIELDS = frozenset(ProcessHandle.model_fields)
_LOGGED_OK = {"ok": True}


def _exec_out(res: dict[str, Any]) -> dict[str, Any]:
    """The response of an exec, whether it ran now or was fast-forwarded from the log (whose
    copy carries hashes and may be cut to the log's output cap)."""
    if "exit_code" not in res and "pid" in res:
        return {k: v for k, v in res.items() if k in _HANDLE_FIELDS}
    out = {k: v for k, v in res.items() if k in _EXEC_FIELDS}
    if res.get("log_truncated"):
        out["truncated"] = True
    return out


def _logged_ok(_: Any) -> dict[str, Any]:
    return _LOGGED_OK


def _snap_of(info: Any) -> list[str]:
    """The snapshot a sandbox (its logged SandboxInfo) stands on, for ``snapshot_ids``."""
    snap = info.get("snapshot") if isinstance(info, dict) else None
    return [snap] if snap else []


def _as_now(engine: Engine, info: dict[str, Any]) -> dict[str, Any]:
    """A logged SandboxInfo, as the sandbox is now (a fast-forwarded create, restore, pause or
    resume returns the sandbox's current state, not the one it had then): ``dead`` once it
    is gone."""
    sb = engine.sandboxes.get(info.get("id", ""))
    if sb is not None:
        return sb.info()
    return dict(info, state="dead") if info.get("state") != "dead" else info


async def _file_op(request: web.Request, op: str, req: dict[str, Any], *args: Any,
                   big: bool = False) -> web.Response:
    """A mutating file operation: logged, once per idempotency key."""
    sid = request.match_info["id"]
    engine = _engine(request)
    await engine.trajlog.run(sid, op, req, _key(request),
                             lambda: engine.files(sid, op_method(op), *args, big=big),
                             to_log=_logged_ok)
    return _ok()


def op_method(op: str) -> str:
    return {"write": "write_file", "upload": "upload_tar"}.get(op, op)


# ---- handlers --------------------------------------------------------------------------
async def health(request: web.Request) -> web.Response:
    return web.Response(body=b'{"ok":true}', content_type="application/json")


async def status(request: web.Request) -> web.Response:
    return _json(_engine(request).status())


# Parsed specs by request body: a trainer sends the same spec again and again, and the
# sandboxes share one (immutable by convention) SandboxSpec instead of ~1 KiB each.
_SPECS: dict[bytes, SandboxSpec] = {}


async def create_sandbox(request: web.Request) -> web.Response:
    raw = await request.read()
    spec = _SPECS.get(raw)
    if spec is None:
        spec = _parse(raw, SandboxSpec)
        if len(_SPECS) >= 256:
            _SPECS.clear()
        _SPECS[raw] = spec
    engine = _engine(request)

    async def make() -> dict[str, Any]:
        return (await engine.create(spec)).info()

    info = await engine.trajlog.run("", "create", spec.model_dump(mode="json"), _key(request),
                                    make, snapshot_ids=_snap_of)
    return _json(_as_now(engine, info), 201)


async def create_batch(request: web.Request) -> web.Response:
    req = await _body(request, CreateManyRequest)
    engine = _engine(request)
    made = await engine.create_many(req.count, req.spec)
    infos = [sb.info() for sb in made]
    if engine.trajlog.enabled:
        spec, now = req.spec.model_dump(mode="json"), time.time()
        await asyncio.gather(*(engine.trajlog.record(i["id"], "create", spec, i, None, now, now,
                                                     snapshot_ids=_snap_of(i))
                               for i in infos))
    return _json({"sandboxes": infos}, 201)


async def exec_batch(request: web.Request) -> web.Response:
    req = await _body(request, ExecManyRequest)
    results = await _engine(request).exec_many(req.ids, req.exec, req.concurrency)
    return _json({"results": results})


async def kill_batch(request: web.Request) -> web.Response:
    req = await _body(request, KillManyRequest)
    return _json({"results": await _engine(request).kill_many(req.ids)})


async def list_sandboxes(request: web.Request) -> web.Response:
    labels: dict[str, str | None] = {}
    for item in request.query.getall("label", []):
        key, eq, value = item.partition("=")
        if not key:
            raise InvalidRequest(f"bad label filter {item!r}: use key=value or key")
        labels[key] = value if eq else None
    return _json({"sandboxes": [sb.info() for sb in _engine(request).list(labels)]})


async def get_sandbox(request: web.Request) -> web.Response:
    sid, key, engine = request.match_info["id"], _key(request), _engine(request)
    if key is None:  # a status poll: not logged
        return _json(engine.lookup(sid).info())

    async def info() -> dict[str, Any]:
        return engine.lookup(sid).info()

    # Keyed: logged, and fast-forwarded it returns what the first call saw.
    return _json(await engine.trajlog.run(sid, "info", {}, key, info))


async def kill_sandbox(request: web.Request) -> web.Response:
    sid, key, engine = request.match_info["id"], _key(request), _engine(request)

    async def kill() -> dict[str, Any]:
        try:
            killed = await engine.kill(sid)
        except SandboxNotFound:
            # Keyed (a trainer's cleanup): a sandbox gone so long the daemon forgot it, but
            # whose log it still has, is killed already.
            if key is None or not await engine.trajlog.knows(sid):
                raise
            killed = False
        return {"id": sid, "killed": killed}

    try:
        return _json(await engine.trajlog.run(sid, "kill", {}, key, kill))
    except ReplayDivergence:
        # A cleanup is never refused: a key bound to another call still kills (unkeyed).
        return _json(await engine.trajlog.run(sid, "kill", {}, None, kill))


async def set_timeout(request: web.Request) -> web.Response:
    req = await _body(request, SetTimeoutRequest)
    return _json(_engine(request).set_timeout(request.match_info["id"], req.timeout).info())


async def exec_cmd(request: web.Request) -> web.Response:
    req = await _body(request, ExecRequest)
    sid = request.match_info["id"]
    engine = _engine(request)
    # The model, not its dump: the log dumps it while the command runs (trajlog._plain).
    res = await engine.trajlog.run(sid, "exec", req, _key(request),
                                   lambda: engine.exec(sid, req),
                                   to_log=engine.trajlog.exec_result)
    return _json(_exec_out(res))


async def proc_status(request: web.Request) -> web.Response:
    _, p = _engine(request).proc(request.match_info["id"], _pid(request))
    return _json(p.status())


async def proc_wait(request: web.Request) -> web.Response:
    req = await _body(request, WaitRequest)
    sid, pid = request.match_info["id"], _pid(request)
    engine = _engine(request)
    res = await engine.trajlog.run(sid, "wait", {"pid": pid, "timeout": req.timeout}, None,
                                   lambda: engine.wait(sid, pid, req.timeout),
                                   to_log=engine.trajlog.exec_result)
    return _json(_exec_out(res))


async def proc_stream(request: web.Request) -> web.StreamResponse:
    """NDJSON: output chunks as they come (what was buffered first), then one final line:
    ``{"exit_code", "timed_out"}``, or ``{"error": {...}}`` if the sandbox ended under it."""
    engine = _engine(request)
    sid = request.match_info["id"]
    sb, p = engine.proc(sid, _pid(request))
    queue: asyncio.Queue[tuple[str, str] | None] = asyncio.Queue()

    def on_out(text: str) -> None:
        queue.put_nowait(("stdout", text))

    def on_err(text: str) -> None:
        queue.put_nowait(("stderr", text))

    if p.running:
        first = [("stdout", p.stdout.subscribe(on_out)), ("stderr", p.stderr.subscribe(on_err))]
        p.on_exit(lambda: queue.put_nowait(None))
    else:
        first = [("stdout", p.stdout.text()), ("stderr", p.stderr.text())]
        queue.put_nowait(None)
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await resp.prepare(request)
    try:
        for name, text in first:
            if text:
                await resp.write(_line({"stream": name, "data": text}))
        sb.busy += 1  # a client following the output is activity (no idle timeout)
        try:
            while (item := await queue.get()) is not None:
                await resp.write(_line({"stream": item[0], "data": item[1]}))
        finally:
            sb.busy -= 1
        final: dict[str, Any] = {"exit_code": p.exit_code, "timed_out": p.timed_out}
        try:
            await engine.after_exit(sb, p)
        except CorralError as e:
            final = e.to_payload()
        await resp.write(_line(final))
        await resp.write_eof()
    finally:
        p.stdout.unsubscribe(on_out)
        p.stderr.unsubscribe(on_err)
    return resp


def _line(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


async def proc_stdin(request: web.Request) -> web.Response:
    req = await _body(request, StdinRequest)
    _engine(request).stdin(request.match_info["id"], _pid(request), req.data, req.eof)
    return _ok()


async def proc_kill(request: web.Request) -> web.Response:
    req = await _body(request, KillProcessRequest)
    _engine(request).signal(request.match_info["id"], _pid(request), req.signal)
    return _ok()


async def file_read(request: web.Request) -> web.StreamResponse:
    """Small files in one response; bigger ones streamed in bounded chunks (streams.py)."""
    path = _query_path(request)
    max_bytes = _query_int(request, "max_bytes", MAX_READ_BYTES, 0, MAX_READ_BYTES)
    sid = request.match_info["id"]
    engine = _engine(request)
    key = _key(request)
    keep = engine.trajlog.body_cap if key is not None else -1  # keyed: its replay returns them
    streamed: list[web.StreamResponse] = []

    async def read() -> Any:
        data, truncated, fd = await engine.read_file(sid, path, max_bytes)
        if fd is None:
            return data, truncated
        return await _stream_file(request, streamed, fd, max_bytes, truncated,
                                  engine.trajlog.enabled)

    got = await engine.trajlog.run(
        sid, "read", {"path": path, "max_bytes": max_bytes}, key, read,
        to_log=lambda v: v if isinstance(v, dict) else data_result(v[0], keep, truncated=v[1]))
    if streamed:
        await streamed[0].write_eof()
        return streamed[0]
    if isinstance(got, tuple):
        data, truncated = got
    elif "data_b64" in got:  # a fast-forwarded keyed read: what the first one got
        data, truncated = await replayed_read(got, _never)
    else:  # ...of a file too big to log: the file now, if it is still what was read then
        data, truncated, fd = await engine.read_file(sid, path, max_bytes)
        if fd is not None:
            if await streams.fd_sha256(fd, max_bytes) != got.get("sha256"):
                os.close(fd)
                raise ReplayDivergence("the file read under this key was over the log's cap "
                                       "and has changed since: its logged content cannot be "
                                       "returned", details={"sha256": got.get("sha256")})
            await _stream_file(request, streamed, fd, max_bytes, truncated, False)
            await streamed[0].write_eof()
            return streamed[0]
        data, truncated = await replayed_read(got, lambda: _ready((data, truncated)))
    return web.Response(body=data, content_type="application/octet-stream",
                        headers=_truncated(truncated) or None)


async def _stream_file(request: web.Request, streamed: list[web.StreamResponse], fd: int,
                       max_bytes: int, truncated: bool, digest: bool) -> dict[str, Any]:
    """Send ``fd`` (closed here) as the body of a streamed response, appended to
    ``streamed``; what the log records of it."""
    try:
        resp = web.StreamResponse(headers=_truncated(truncated))
        resp.content_type = "application/octet-stream"
        await resp.prepare(request)
    except BaseException:
        os.close(fd)
        raise
    streamed.append(resp)
    try:
        sent = await streams.send_file(resp, fd, max_bytes, digest)
    except BaseException:
        _cut(request)  # headers are out: the client must see a broken transfer
        raise
    return {"size": sent.size, "sha256": sent.sha256, "truncated": truncated}


async def _ready(value: Any) -> Any:
    return value


async def _never() -> Any:
    raise AssertionError("a logged read with its bytes needs no read now")


def _cut(request: web.Request) -> None:
    log.warning("stream cut short", extra={"path": request.path,
                                           "error": repr(sys.exc_info()[1])})
    if request.transport is not None:
        request.transport.close()


def _truncated(truncated: bool) -> dict[str, str]:
    return {"X-Corral-Truncated": "true"} if truncated else {}


async def file_write(request: web.Request) -> web.Response:
    path = _query_path(request)
    mode = _query_int(request, "mode", 0o644, 0, 0o7777)
    data = await request.read()
    req = body_request(data, _tl(request).body_cap, path=path, mode=mode)
    return await _file_op(request, "write", req, path, data, mode, True,
                          big=len(data) > BIG_BODY)


async def file_list(request: web.Request) -> web.Response:
    sid, path = request.match_info["id"], _query_path(request)
    engine = _engine(request)

    async def ls() -> list[Any]:
        return [_entry(e) for e in await engine.files(sid, "list_dir", path)]

    key = _key(request)
    entries = await engine.trajlog.run(sid, "list", {"path": path}, key, ls,
                                       to_log=lambda v: listing_result(v, key is not None))
    if isinstance(entries, dict):  # fast-forwarded: what was listed then
        entries = await replayed_listing(entries, ls)
    return _json({"entries": entries})


async def file_stat(request: web.Request) -> web.Response:
    sid, path = request.match_info["id"], _query_path(request)
    engine = _engine(request)

    async def st() -> Any:
        return _entry(await engine.files(sid, "stat", path))

    return _json(await engine.trajlog.run(sid, "stat", {"path": path}, _key(request), st))


async def file_mkdir(request: web.Request) -> web.Response:
    req = await _body(request, MkdirRequest)
    return await _file_op(request, "mkdir", req.model_dump(), check_path(req.path), req.parents)


async def file_remove(request: web.Request) -> web.Response:
    req = await _body(request, RemoveRequest)
    return await _file_op(request, "remove", req.model_dump(), check_path(req.path),
                          req.recursive, big=req.recursive)


async def file_rename(request: web.Request) -> web.Response:
    req = await _body(request, RenameRequest)
    return await _file_op(request, "rename", req.model_dump(), check_path(req.src, "src"),
                          check_path(req.dst, "dst"))


async def tar_upload(request: web.Request) -> web.Response:
    path = _query_path(request)
    data = await request.read()
    req = body_request(data, _tl(request).body_cap, path=path)
    return await _file_op(request, "upload", req, path, data, big=True)


async def tar_download(request: web.Request) -> web.StreamResponse:
    """Planned first (caps checked, clear errors), then streamed in bounded chunks."""
    sid, path = request.match_info["id"], _query_path(request)
    engine = _engine(request)
    from corral.daemon.substrates.container import TAR_MAX_BYTES, TAR_MAX_MEMBERS

    async def download() -> dict[str, Any]:
        ops = await engine.plan_tar(sid, path, TAR_MAX_BYTES, TAR_MAX_MEMBERS)
        resp = web.StreamResponse()
        resp.content_type = "application/x-tar"
        await resp.prepare(request)
        try:
            sent = await streams.send_chunks(
                resp, streams.chunks(ops, path.rstrip("/") or "/", TAR_MAX_BYTES),
                engine.trajlog.enabled)
        except BaseException:
            _cut(request)  # headers are out: the client must see a broken transfer
            raise
        await resp.write_eof()
        return {"size": sent.size, "sha256": sent.sha256, "response": resp}

    res = await engine.trajlog.run(sid, "download", {"path": path}, None, download,
                                   to_log=lambda v: {"size": v["size"], "sha256": v["sha256"]})
    return res["response"]


# ---- snapshots, fork, restore, pause (docs/snapshots.md) ----------------------------------
def _snap(rec: dict[str, Any]) -> dict[str, Any]:
    from corral.daemon.snapshots import info

    return info(rec)


async def snapshot_sandbox(request: web.Request) -> web.Response:
    req = await _body(request, SnapshotRequest)
    sid, engine = request.match_info["id"], _engine(request)

    async def snap() -> dict[str, Any]:
        return _snap(await engine.snapshot(sid, req.name))

    # Fast-forwarded: the snapshot as logged (also if it was deleted since).
    return _json(await engine.trajlog.run(sid, "snapshot", req.model_dump(), _key(request),
                                          snap, snapshot_ids=lambda r: [r["id"]]), 201)


async def fork_sandbox(request: web.Request) -> web.Response:
    """Logged as one ``fork`` entry in the parent's log (the children's ids) and one ``create``
    entry in each child's log (``parent`` in its request). Fast-forwarded, it returns the
    same children: see _fork_child."""
    req = await _body(request, ForkRequest)
    sid, engine = request.match_info["id"], _engine(request)
    tl = engine.trajlog

    async def fork() -> dict[str, Any]:
        started = time.time()
        rec, kids = await engine.fork(sid, req.count, req.name, req.keep_snapshot)
        if kids and tl.enabled:
            spec = dict(kids[0].spec.model_dump(mode="json"), parent=sid)
            for kid in kids:  # committed with (before) the fork entry awaited below
                tl.logged(kid.id, "create", spec, kid.info(), started, [rec["id"]])
        return {"snapshot": _snap(rec), "sandboxes": [kid.id for kid in kids]}

    res = await tl.run(sid, "fork", req.model_dump(), _key(request), fork,
                       snapshot_ids=lambda r: [r["snapshot"]["id"]])
    return _json({"snapshot": res["snapshot"],
                  "sandboxes": [await _fork_child(engine, cid) for cid in res["sandboxes"]]},
                 201)


async def _fork_child(engine: Engine, cid: str) -> dict[str, Any]:
    """A child of a (maybe fast-forwarded) fork: as it is now, or, if it has ended since, as
    its create entry logged it with state ``dead``: a replayed fork never forks again, and the
    first call on a gone child that is not in its log fails with sandbox_not_running (or
    sandbox_lost)."""
    sb = engine.sandboxes.get(cid)
    if sb is not None:
        return sb.info()
    await engine.trajlog.flushed()  # its create entry may be journaled, not yet ingested
    info = engine.trajlog.logged_result(cid, "create")
    if info is None:
        raise SandboxNotFound(f"sandbox {cid}, a child of a logged fork, is gone and its log "
                              "was pruned", details={"id": cid})
    return dict(info, state="dead")


async def restore_sandbox(request: web.Request) -> web.Response:
    req = await _body(request, RestoreRequest)
    sid, engine = request.match_info["id"], _engine(request)

    async def restore() -> dict[str, Any]:
        return (await engine.restore(sid, req.snapshot)).info()

    info = await engine.trajlog.run(sid, "restore", req.model_dump(), _key(request), restore,
                                    snapshot_ids=_snap_of)
    return _json(_as_now(engine, info))


async def pause_sandbox(request: web.Request) -> web.Response:
    return await _state_op(request, "pause")


async def resume_sandbox(request: web.Request) -> web.Response:
    return await _state_op(request, "resume")


async def _state_op(request: web.Request, op: str) -> web.Response:
    sid, engine = request.match_info["id"], _engine(request)

    async def call() -> dict[str, Any]:
        await engine.wait_capture(sid)  # a snapshot's freeze is not a pause
        return getattr(engine, op)(sid).info()

    return _json(_as_now(engine, await engine.trajlog.run(sid, op, {}, _key(request), call)))


async def list_snapshots(request: web.Request) -> web.Response:
    return _json({"snapshots": [_snap(r) for r in _engine(request).snapshot_list()]})


async def get_snapshot(request: web.Request) -> web.Response:
    return _json(_snap(_engine(request).snapshot_get(request.match_info["snap"])))


async def delete_snapshot(request: web.Request) -> web.Response:
    rec = _engine(request).snapshot_delete(request.match_info["snap"])
    return _json({"id": rec["id"], "deleted": True})


async def sandbox_log(request: web.Request) -> web.Response:
    """The sandbox's trajectory log (also after the sandbox is gone, until pruned)."""
    engine = _engine(request)
    sid = request.match_info["id"]
    fmt = request.query.get("format", "json")
    if fmt not in ("json", "jsonl"):
        raise InvalidRequest("query parameter 'format' must be json or jsonl")
    data = await engine.trajlog.entries(sid, known=sid in engine.sandboxes)
    if fmt == "jsonl":
        return web.Response(body=b"".join(_line(e) for e in data["entries"]),
                            content_type="application/x-ndjson")
    return _json(data)


async def get_trajectory(request: web.Request) -> web.Response:
    """The sandbox of trajectory ``tid`` and the step after the last one its log binds (a
    resuming client's position): ``Sandbox.from_trajectory``."""
    tid, engine = request.match_info["tid"], _engine(request)
    found = await engine.trajlog.trajectory(tid)
    if found is None:
        raise NotFound(f"no trajectory {tid!r} in the log (no create keyed {tid}:create)",
                       details={"trajectory_id": tid})
    sid, step = found
    sb = engine.sandboxes.get(sid)
    if sb is not None:
        info = sb.info()
    else:
        await engine.trajlog.flushed()
        info = dict(engine.trajlog.logged_result(sid, "create") or {}, state="dead")
    return _json({"trajectory_id": tid, "sandbox_id": sid, "step": step, "sandbox": info})


async def list_images(request: web.Request) -> web.Response:
    images = _engine(request).images.list()
    return _json({"images": [_entry(i) for i in images]})


async def import_image(request: web.Request) -> web.Response:
    req = await _body(request, ImportImageRequest)
    info = await asyncio.to_thread(_engine(request).images.import_image, req.name, req.source)
    return _json(_entry(info), 201)


async def metrics(request: web.Request) -> web.Response:
    engine = _engine(request)
    lines = [
        "# TYPE corral_sandboxes gauge", f"corral_sandboxes {len(engine.sandboxes)}",
        "# TYPE corral_capacity gauge", f"corral_capacity {engine.config.max_sandboxes}",
    ]
    for name, value in engine.metrics().items():
        if name == "pool_ready":
            lines += ["# TYPE corral_pool_ready gauge", f"corral_pool_ready {value}"]
        else:
            lines += [f"# TYPE corral_{name}_total counter", f"corral_{name}_total {value}"]
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


# ---- the route table (the API contract; see docs/architecture.md) --------------------------
@dataclass(frozen=True)
class Param:
    name: str
    type: str = "string"        # JSON schema type
    required: bool = False
    description: str = ""
    repeated: bool = False
    where: str = "query"        # or "header"


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: Handler
    summary: str
    body: type[BaseModel] | str | None = None         # a model, "bytes" or None
    response: type[BaseModel] | str | dict | None = None  # a model, "bytes", "tar", "ndjson",
    status: int = 200                                   # "ok", "text" or a JSON schema
    query: tuple[Param, ...] = ()
    alt_response: type[BaseModel] | None = None         # exec: ProcessHandle if background


SCHEMA_REF = "#/components/schemas/"
SB = "/v1/sandboxes/{id}"
PROC = SB + "/procs/{pid}"
PATH_Q = Param("path", required=True, description="absolute path inside the sandbox")
KEY_H = Param(KEY_HEADER, where="header", description=(
    "idempotency key: a key already logged returns the logged result without running the "
    "call again; the same key with a different request is replay_divergence (409). Scope: "
    "the sandbox (create: global). See docs/trajectory.md"))
_LOG_RESPONSE = {"type": "object", "required": ["entries", "sandbox_id"], "properties": {
    "entries": {"type": "array", "items": {"$ref": SCHEMA_REF + "LogEntry"}},
    "sandbox_id": {"type": "string"},
    "sandbox": {"type": ["object", "null"], "description": "spec, created_at, ended_at, reason"},
}}

_TRAJ_RESPONSE = {"type": "object", "required": ["trajectory_id", "sandbox_id", "step",
                                                 "sandbox"], "properties": {
    "trajectory_id": {"type": "string"}, "sandbox_id": {"type": "string"},
    "step": {"type": "integer", "description": "the step the next call carries"},
    "sandbox": {"$ref": SCHEMA_REF + "SandboxInfo"},
}}


def _list_of(key: str, model: type[BaseModel]) -> dict:
    return {"type": "object", "required": [key],
            "properties": {key: {"type": "array", "items": {"$ref": SCHEMA_REF + model.__name__}}}}


ROUTES: tuple[Route, ...] = (
    Route("GET", "/v1/health", health, "Liveness", response={
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}),
    Route("GET", "/v1/status", status, "Daemon status", response=DaemonStatus),
    Route("POST", "/v1/sandboxes", create_sandbox, "Create a sandbox", body=SandboxSpec,
          response=SandboxInfo, status=201, query=(KEY_H,)),
    Route("POST", "/v1/sandboxes/batch", create_batch,
          "Create many sandboxes (all or nothing)", body=CreateManyRequest,
          response=_list_of("sandboxes", SandboxInfo), status=201),
    Route("POST", "/v1/sandboxes/batch/exec", exec_batch,
          "Run the same command in many sandboxes (one result or error per id, in order)",
          body=ExecManyRequest, response=ExecManyResponse),
    Route("POST", "/v1/sandboxes/batch/destroy", kill_batch,
          "Kill many sandboxes (one result or error per id, in order)",
          body=KillManyRequest, response=KillManyResponse),
    Route("GET", "/v1/sandboxes", list_sandboxes, "List running sandboxes", query=(
        Param("label", description="key=value (or key: present); repeat to AND them",
              repeated=True),), response=_list_of("sandboxes", SandboxInfo)),
    Route("GET", SB, get_sandbox, "Sandbox info (keyed: logged, and a repeated key returns "
          "the logged info)", response=SandboxInfo, query=(KEY_H,)),
    Route("DELETE", SB, kill_sandbox, "Kill a sandbox (killed=false: it had already ended)",
          query=(KEY_H,), response={"type": "object", "required": ["id", "killed"], "properties": {
              "id": {"type": "string"}, "killed": {"type": "boolean"}}}),
    Route("POST", SB + "/timeout", set_timeout, "Set the TTL, in seconds from now",
          body=SetTimeoutRequest, response=SandboxInfo),
    Route("POST", SB + "/exec", exec_cmd, "Run a command", body=ExecRequest,
          response=ExecResult, alt_response=ProcessHandle, query=(KEY_H,)),
    Route("GET", SB + "/log", sandbox_log, "The sandbox's trajectory log (kept after it ends, "
          "until pruned)", response=_LOG_RESPONSE, query=(
              Param("format", description="json (default) or jsonl (one LogEntry a line)"),)),
    Route("GET", PROC, proc_status, "Background process status", response=ProcessStatus),
    Route("POST", PROC + "/wait", proc_wait, "Wait for a background process",
          body=WaitRequest, response=ExecResult),
    Route("GET", PROC + "/stream", proc_stream, "Stream a background process's output",
          response="ndjson"),
    Route("POST", PROC + "/stdin", proc_stdin, "Write to a background process's stdin",
          body=StdinRequest, response="ok"),
    Route("POST", PROC + "/kill", proc_kill, "Signal a background process's group",
          body=KillProcessRequest, response="ok"),
    Route("GET", SB + "/files", file_read, "Read a file (header X-Corral-Truncated: true when "
          "it is longer than max_bytes)", response="bytes", query=(
              PATH_Q, Param("max_bytes", "integer",
                            description="read at most this many bytes (default 1 GiB)"),
              KEY_H)),
    Route("PUT", SB + "/files", file_write, "Write a file (parents are created)", body="bytes",
          response="ok", query=(PATH_Q, Param("mode", "integer",
                                               description="permission bits (default 420)"),
                                KEY_H)),
    Route("GET", SB + "/files/list", file_list, "List a directory", query=(PATH_Q, KEY_H),
          response=_list_of("entries", FileEntry)),
    Route("GET", SB + "/files/stat", file_stat, "Stat a path (lstat)", query=(PATH_Q, KEY_H),
          response=FileEntry),
    Route("POST", SB + "/files/mkdir", file_mkdir, "Make a directory", body=MkdirRequest,
          response="ok", query=(KEY_H,)),
    Route("POST", SB + "/files/remove", file_remove, "Remove a file or directory",
          body=RemoveRequest, response="ok", query=(KEY_H,)),
    Route("POST", SB + "/files/rename", file_rename, "Rename", body=RenameRequest,
          response="ok", query=(KEY_H,)),
    Route("PUT", SB + "/files/tar", tar_upload, "Extract a tar into a directory", body="tar",
          response="ok", query=(PATH_Q, KEY_H)),
    Route("GET", SB + "/files/tar", tar_download, "A tar of a directory or file",
          response="tar", query=(PATH_Q,)),
    Route("POST", SB + "/snapshot", snapshot_sandbox, "Snapshot the sandbox's files as a "
          "layer", body=SnapshotRequest, response=SnapshotInfo, status=201, query=(KEY_H,)),
    Route("POST", SB + "/fork", fork_sandbox, "Snapshot + count sandboxes on it (all or "
          "nothing)", body=ForkRequest, response=ForkResult, status=201, query=(KEY_H,)),
    Route("POST", SB + "/restore", restore_sandbox, "Roll the sandbox back to a snapshot in "
          "place (its processes are restarted)", body=RestoreRequest, response=SandboxInfo,
          query=(KEY_H,)),
    Route("POST", SB + "/pause", pause_sandbox, "Freeze every process of the sandbox",
          response=SandboxInfo, query=(KEY_H,)),
    Route("POST", SB + "/resume", resume_sandbox, "Thaw a paused sandbox",
          response=SandboxInfo, query=(KEY_H,)),
    Route("GET", "/v1/trajectories/{tid}", get_trajectory, "Where a trajectory stands: its "
          "sandbox and the step after the last one its log binds", response=_TRAJ_RESPONSE),
    Route("GET", "/v1/snapshots", list_snapshots, "List snapshots",
          response=_list_of("snapshots", SnapshotInfo)),
    Route("GET", "/v1/snapshots/{snap}", get_snapshot, "Snapshot info (by id or name)",
          response=SnapshotInfo),
    Route("DELETE", "/v1/snapshots/{snap}", delete_snapshot, "Delete a snapshot (its layers "
          "stay while a sandbox or a child snapshot uses them)", response={
              "type": "object", "required": ["id", "deleted"], "properties": {
                  "id": {"type": "string"}, "deleted": {"type": "boolean"}}}),
    Route("GET", "/v1/images", list_images, "List images",
          response=_list_of("images", ImageInfo)),
    Route("POST", "/v1/images", import_image, "Import a rootfs directory or tarball",
          body=ImportImageRequest, response=ImageInfo, status=201),
    Route("GET", "/metrics", metrics, "Prometheus metrics", response="text"),
)


# ---- errors and auth -------------------------------------------------------------------
def _is_unix(request: web.Request) -> bool:
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    return sock is not None and sock.family == socket.AF_UNIX


def _middleware(token: str | None) -> Any:
    expected = f"Bearer {token}".encode() if token else None

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            # The unix socket is root-only (0600); TCP clients must present the token.
            if request.path != "/v1/health" and not _is_unix(request):
                got = request.headers.get("Authorization", "").encode()
                if expected is None or not hmac.compare_digest(got, expected):
                    raise Unauthorized("missing or wrong bearer token")
            return await handler(request)
        except CorralError as e:
            return _error(e)
        except web.HTTPException as e:
            if e.status == 404:
                return _error(NotFound(f"no route {request.method} {request.path}"))
            if e.status == 405:
                return _error(InvalidRequest(f"method {request.method} not allowed on "
                                             f"{request.path}"), 405)
            if e.status == 413:
                return _error(InvalidRequest(f"request body too large (max {MAX_BODY} bytes)"),
                              413)
            return _error(CorralError(e.reason or str(e), code="http_error"), e.status)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as e:  # noqa: BLE001 - one bad request must not hurt the others
            log.exception("unhandled error", extra={"method": request.method,
                                                    "path": request.path})
            return _error(InternalError(f"internal error: {type(e).__name__}: {e}"))

    return middleware


def create_app(engine: Engine | None, token: str | None = None) -> web.Application:
    app = web.Application(middlewares=[_middleware(token)], client_max_size=MAX_BODY)
    if engine is not None:
        app[ENGINE] = engine
    for r in ROUTES:
        app.router.add_route(r.method, r.path, r.handler)
    return app
