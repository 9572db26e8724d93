"""The HTTP/JSON API: routes -> engine calls, errors -> JSON, bearer auth on TCP.

``ROUTES`` is the one table of the API: the app registers it and ``corral.daemon.openapi``
generates the spec from it, so the two cannot drift apart.

Responses are built as plain dicts and ``json.dumps``: no pydantic model on the way out (it
would cost more than the sandbox operation for small calls). Requests are validated with the
shared pydantic models; a validation failure is ``invalid_request`` with pydantic's message.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import re
import shutil
import sqlite3
import sys
import tempfile
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel

from corral.daemon import (
    batches,
    dashboard,
    image_api,
    jsonbody,
    ops,
    snapxfer,
    spool,
    streams,
    tenancy,
)
from corral.daemon.app_errors import JSON_MAX, MAX_BODY, TENANT, is_unix, middleware
from corral.daemon.bodies import parse
from corral.daemon.bodymem import BodyMemory
from corral.daemon.clientgone import WAITING, unless_gone
from corral.daemon.engine import MAX_READ_BYTES, Engine
from corral.daemon.images import resolve_source
from corral.daemon.metrics import CONTENT_TYPE, TIMED, Metrics
from corral.daemon.params import (
    MAX_PAGE,
    MAX_TREE_DEPTH,
    check_path,
    decimal,
    label_filters,
    not_root,
    page,
    page_args,
    page_of,
    path_int,
    query_int,
    query_mode,
    query_path,
)
from corral.daemon.procs import Follower
from corral.daemon.routes import (
    DEPTH_Q,
    FORMAT_Q,
    KEY_H,
    KEY_PATTERN,
    LABEL_Q,
    LOG_OUTPUT_Q,
    LOG_TAIL_Q,
    MAX_LOG_OUTPUT,
    MAX_LOG_TAIL,
    MODE_Q,
    PAGE_Q,
    PATH_Q,
    PROC,
    SB,
    SCHEMA_REF,
    STREAM_Q,
    Param,
    Route,
    int_param,
    link,
    list_of,
)
from corral.daemon.snapshots import CaptureControl
from corral.daemon.substrates.process import api as run_code_api
from corral.daemon.tenancy import tenant_of
from corral.daemon.tenants import TENANT_LABEL, Tenants
from corral.daemon.trajlog import (
    KEY_HEADER,
    MAX_KEY_LEN,
    body_request,
    data_result,
    replayed_listing,
    replayed_read,
)
from corral.errors import (
    Conflict,
    CorralError,
    InvalidPath,
    InvalidRequest,
    NetworkNotFound,
    NotFound,
    ReplayDivergence,
    SandboxNotFound,
    SnapshotNotFound,
)
from corral.models import (
    AllowlistInfo,
    BlockedInfo,
    BlockedUpdate,
    CreateManyRequest,
    DaemonStatus,
    ExecManyRequest,
    ExecManyResponse,
    ExecRequest,
    ExecResult,
    ExposedPort,
    ExposeRequest,
    FileEntry,
    FileTree,
    ForkRequest,
    ForkResult,
    ImageInfo,
    ImportImageRequest,
    KillManyRequest,
    KillManyResponse,
    KillProcessRequest,
    MkdirRequest,
    NetworkUpdate,
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
    SubstrateInfo,
    WaitRequest,
)

log = logging.getLogger("corral.api")

ENGINE: web.AppKey[Engine] = web.AppKey("engine", Engine)
METRICS: web.AppKey[Metrics] = web.AppKey("metrics", Metrics)
T = TypeVar("T")
KEY_RE = re.compile(KEY_PATTERN)
BIG_BODY = 1 << 20           # bigger writes are copied from the spooled body


# ---- helpers ---------------------------------------------------------------------------
def _json(obj: Any, status: int = 200) -> web.Response:
    return jsonbody.response(obj, status)


_OK = b'{"ok":true}'


def _ok() -> web.Response:
    return web.Response(body=_OK, content_type="application/json")


async def _body(request: web.Request, model: type[BaseModel]) -> Any:
    return parse(await request.read(), model)


def _engine(request: web.Request) -> Engine:
    return request.app[ENGINE]


def _dispatch(request: web.Request, op: ops.Op) -> Awaitable[Any]:
    if op.name in TIMED:  # create / exec / snapshot latency: /metrics
        return _timed(request, op)
    return ops.dispatch(request.app[ENGINE], op)


async def _timed(request: web.Request, op: ops.Op) -> Any:
    with request.app[METRICS].timed(op.name):
        return await ops.dispatch(request.app[ENGINE], op)


# ---- trajectory log hooks (corral.daemon.trajlog; docs/trajectory.md) ----------------------
def _key(request: web.Request) -> str | None:
    """The idempotency key of a mutating call (header ``Idempotency-Key``): 1 to 256
    visible ASCII characters."""
    key = request.headers.get(KEY_HEADER)
    if key is not None and not KEY_RE.match(key):
        raise InvalidRequest(f"{KEY_HEADER} must be 1 to {MAX_KEY_LEN} visible ASCII "
                             "characters (no spaces)")
    return key


_EXEC_FIELDS = frozenset(ExecResult.model_fields)
_HANDLE_FIELDS = frozenset(ProcessHandle.model_fields)


def _exec_out(res: dict[str, Any]) -> dict[str, Any]:
    """The response of an exec, whether it ran now or was fast-forwarded from the log (whose
    copy carries hashes and may be cut to the log's output cap)."""
    if "exit_code" not in res and "pid" in res:
        return {k: v for k, v in res.items() if k in _HANDLE_FIELDS}
    out = {k: v for k, v in res.items() if k in _EXEC_FIELDS}
    if res.get("log_truncated"):
        out["truncated"] = True
    return out


def _as_now(engine: Engine, info: dict[str, Any], key: str | None) -> dict[str, Any]:
    """A logged SandboxInfo, as the sandbox is now (a fast-forwarded create, restore, pause or
    resume returns the sandbox's current state, not the one it had then): ``dead`` once it
    is gone. Without an idempotency ``key`` nothing was fast-forwarded: ``info`` was made
    just now, and is not made again (for a networked sandbox that reads its link's
    counters)."""
    if key is None:
        return info
    now = engine.info_now(info.get("id", ""))
    if now is not None:
        return now
    return dict(info, state="dead") if info.get("state") != "dead" else info


# ---- handlers --------------------------------------------------------------------------
async def health(request: web.Request) -> web.Response:
    return web.Response(body=b'{"ok":true}', content_type="application/json")


async def status(request: web.Request) -> web.Response:
    return _json(_engine(request).status())


async def list_substrates(request: web.Request) -> web.Response:
    return _json({"substrates": _engine(request).substrate_table()})


async def update_network(request: web.Request) -> web.Response:
    req = await _body(request, NetworkUpdate)
    await _engine(request).ready(request.match_info["id"], capture=False)  # resumed off the loop
    return _json(_engine(request).update_network(request.match_info["id"], req.network).info())


async def expose_port(request: web.Request) -> web.Response:
    req = await _body(request, ExposeRequest)
    await _engine(request).ready(request.match_info["id"], capture=False)  # resumed off the loop
    return _json(await _engine(request).expose(request.match_info["id"], req.port))


async def unexpose_port(request: web.Request) -> web.Response:
    port = decimal(request.match_info["port"], "port", 1, 65535)
    await _engine(request).ready(request.match_info["id"], capture=False)  # resumed off the loop
    return _json({"removed": _engine(request).unexpose(request.match_info["id"], port)})


async def list_networks(request: web.Request) -> web.Response:
    lists = _engine(request).allowlists()
    return _json({"networks": [{"name": n, "rules": r} for n, r in sorted(lists.items())]})


async def get_blocked(request: web.Request) -> web.Response:
    return _json(_engine(request).blocked_networks())


async def put_blocked(request: web.Request) -> web.Response:
    """The cluster's supervisor keeps its node's list of the other nodes here."""
    req = await _body(request, BlockedUpdate)
    return _json(await asyncio.to_thread(_engine(request).blocked_networks, req.blocked))


async def get_network(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    lists = _engine(request).allowlists()
    if name not in lists:
        known = sorted(lists)
        raise NetworkNotFound(f"no allowlist {name!r} (known: {', '.join(known) or 'none'})",
                              details={"network": name, "known": known})
    return _json({"name": name, "rules": lists[name]})


# Parsed specs by request body: a trainer sends the same spec again and again, and the
# sandboxes share one (immutable by convention) SandboxSpec instead of ~1 KiB each.
_SPECS: dict[bytes, SandboxSpec] = {}
SPEC_CACHE_BODY = 64 << 10  # a bigger spec (a huge env) is not kept: 256 of them would be GiBs


async def create_sandbox(request: web.Request) -> web.Response:
    raw = await request.read()
    spec = _SPECS.get(raw)
    if spec is None:
        spec = parse(raw, SandboxSpec)
        if len(_SPECS) >= 256:
            _SPECS.clear()
        if len(raw) <= SPEC_CACHE_BODY:
            _SPECS[raw] = spec
    spec = tenancy.own_spec(request, _engine(request), _layer_dirs_allowed(request, spec))
    key = _key(request)
    # A create keyed "{T}:create" makes trajectory T's sandbox (engine.by_operator).
    tid = key[:-len(":create")] if key and key.endswith(":create") else None
    try:
        info = await _dispatch(request, ops.Create("", key, spec, tid or None))
    except ReplayDivergence as e:
        if tenant_of(request) is None:
            raise
        # Create keys are one namespace: a key another tenant used names no sandbox here.
        raise ReplayDivergence(f"idempotency key {key!r} was used for a different request",
                               details={"key": key}) from e
    return _json(_as_now(_engine(request), info, key), 201)


def _layer_dirs_allowed(request: web.Request, spec: SandboxSpec) -> SandboxSpec:
    """A dir layer is a host path: the admin socket's, or under the import directory (the
    rule of image imports: images.resolve_source); named by its real path."""
    if not spec.layers or all(lay.dir is None and lay.digest is None for lay in spec.layers):
        return spec
    engine = _engine(request)
    layers = []
    for lay in spec.layers:
        lay = lay.model_copy(update={"digest": None})  # the daemon's to set, from the dir
        if lay.dir is not None:
            lay = lay.model_copy(update={"dir": resolve_source(
                lay.dir, admin=is_unix(request), import_dir=engine.config.import_dir)})
        layers.append(lay)
    return spec.model_copy(update={"layers": layers})


async def create_batch(request: web.Request) -> web.StreamResponse:
    req = await _body(request, CreateManyRequest)
    engine = _engine(request)
    req.spec = tenancy.own_spec(request, engine, _layer_dirs_allowed(request, req.spec))
    engine.precheck_create(req.count, req.spec)

    async def answer(made: list[Any]) -> dict[str, Any]:
        infos = [sb.info() for sb in made]
        if engine.trajlog.enabled:
            spec, now = req.spec.model_dump(mode="json"), time.time()
            await asyncio.gather(*(engine.trajlog.record(i["id"], "create", spec, i, None, now,
                                                         now, snapshot_ids=ops.snap_of(i))
                                   for i in infos))
        return {"sandboxes": infos}

    async def undo(made: list[Any]) -> None:
        await engine.kill_many([sb.id for sb in made])

    return await batches.run(
        request, batches.Progress(req.count),
        lambda p: engine.create_many(req.count, req.spec, on_made=p.tick), answer, 201,
        cancel_when_gone=True, undo=undo)


async def _own_ids(request: web.Request, ids: list[str], run: Any) -> list[dict[str, Any]]:
    """A batch over ``ids`` by a tenant: ``run`` on its own ids only; another tenant's id
    gets the result of an unknown one, in its place."""
    tenant, engine = tenant_of(request), _engine(request)
    if tenant is None:
        return await run(ids)
    mask = [tenancy.owns(engine, i, tenant) for i in ids]
    got = iter(await run([i for i, m in zip(ids, mask, strict=True) if m]))
    return [next(got) if m else tenancy.unknown_sandbox(i).to_payload()
            for i, m in zip(ids, mask, strict=True)]


async def exec_batch(request: web.Request) -> web.StreamResponse:
    req = await _body(request, ExecManyRequest)
    engine = _engine(request)
    return await batches.run(
        request, batches.Progress(len(req.ids)),
        lambda p: _own_ids(request, req.ids, lambda ids: engine.exec_many(
            ids, req.exec, req.concurrency, on_done=p.tick, tenant=tenant_of(request))),
        lambda results: {"results": results})


async def kill_batch(request: web.Request) -> web.StreamResponse:
    req = await _body(request, KillManyRequest)

    def answer(results: list[dict[str, Any]]) -> dict[str, Any]:
        not_killed = [dict(r, index=i) for i, r in enumerate(results)
                      if r.get("killed") is not True]
        for r in not_killed:
            if "error" in r:
                r["id"] = req.ids[r["index"]]
                r["killed"] = False
        failed = sum(1 for r in not_killed if "error" in r)
        return {"killed": len(results) - len(not_killed),
                "already_ended": len(not_killed) - failed, "failed": failed,
                "not_killed": not_killed}

    return await batches.run(
        request, batches.Progress(len(req.ids)),
        lambda p: _own_ids(request, req.ids, lambda ids: _engine(request).kill_many(
            ids, on_done=p.tick)), answer)


async def list_sandboxes(request: web.Request) -> web.Response:
    labels = label_filters(request.query.getall("label", []))
    if (tenant := tenant_of(request)) is not None:
        labels[TENANT_LABEL] = tenant
    after, limit = page_args(request)
    items, nxt = _engine(request).sandbox_page(labels, after, limit)
    return _json({"sandboxes": [sb.info() for sb in items], "next": nxt})


async def get_sandbox(request: web.Request) -> web.Response:
    sid, key = request.match_info["id"], _key(request)
    if key is None:  # a status poll: not logged
        return _json(_engine(request).lookup(sid).info())
    # Keyed: logged, and fast-forwarded it returns what the first call saw.
    return _json(await _dispatch(request, ops.Info(sid, key)))


async def sandbox_spec(request: web.Request) -> web.Response:
    """What the sandbox was made with: a create with it makes one like it (a cluster
    gateway's fork over several nodes makes the children on other nodes with it)."""
    spec = _engine(request).lookup(request.match_info["id"]).spec
    return _json(tenancy.as_given(request, spec).model_dump(mode="json", exclude_none=True))


async def kill_sandbox(request: web.Request) -> web.Response:
    sid, key = request.match_info["id"], _key(request)
    try:
        return _json(await _dispatch(request, ops.Kill(sid, key)))
    except ReplayDivergence:
        # A cleanup is never refused: a key bound to another call still kills (logged
        # unkeyed); the key still says whose kill it is (an operator's is infra).
        return _json(await _dispatch(request, ops.Kill(sid, None, whose=key)))


async def set_timeout(request: web.Request) -> web.Response:
    req = await _body(request, SetTimeoutRequest)
    return _json(await _dispatch(request, ops.SetTimeout(request.match_info["id"], None,
                                                         req.timeout)))


async def exec_cmd(request: web.Request) -> web.Response:
    req = await _body(request, ExecRequest)
    res = await _dispatch(request, ops.Exec(request.match_info["id"], _key(request), req))
    return _json(_exec_out(res))


async def proc_status(request: web.Request) -> web.Response:
    await _engine(request).ready(request.match_info["id"], capture=False)  # resumed off the loop
    return _json(_engine(request).proc_status(request.match_info["id"],
                                              path_int(request, "pid")))


async def proc_wait(request: web.Request) -> web.Response:
    req = await _body(request, WaitRequest)
    op = ops.Wait(request.match_info["id"], None, path_int(request, "pid"), req.timeout)
    return _json(_exec_out(await unless_gone(request, _dispatch(request, op))))


async def proc_stream(request: web.Request) -> web.StreamResponse:
    """NDJSON: output chunks as they come (what was buffered first), then one final line:
    the process's status (``{"pid", "running": false, "exit_code", "timed_out", "signal",
    "oom_killed"}``), or ``{"error": {...}}`` if the sandbox ended under it (a host OOM
    included: the same answer as its wait).
    A stream that passed its cap before this follower came has bytes nobody kept between
    what was buffered and what comes now: a line ``{"stream", "data": "", "skipped": n}``
    says so where they were, so the chunks are never read as one contiguous output."""
    engine = _engine(request)
    sid = request.match_info["id"]
    await engine.ready(sid, capture=False)  # resumed off the loop
    sb, p = engine.proc(sid, path_int(request, "pid"))
    follower = Follower(p)
    try:
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        for name, text, skipped in follower.first:
            if text:
                await jsonbody.write_line(resp, {"stream": name, "data": text})
            if skipped:
                await jsonbody.write_line(resp, {"stream": name, "data": "",
                                                 "skipped": skipped})
        with engine.following(sb):  # a client following the output is activity (no idle)
            while (item := await unless_gone(request, follower.next())) is not None:
                await jsonbody.write_line(resp, {"stream": item[0], "data": item[1]})
        final: dict[str, Any] = p.status()
        try:
            await engine.after_exit(sb, p)
        except CorralError as e:
            final = e.to_payload()
        await jsonbody.write_line(resp, final)
        await resp.write_eof()
    finally:
        follower.close()
    return resp


async def proc_stdin(request: web.Request) -> web.Response:
    req = await _body(request, StdinRequest)
    await _dispatch(request, ops.Stdin(request.match_info["id"], None,
                                       path_int(request, "pid"), req.data, req.eof))
    return _ok()


async def proc_kill(request: web.Request) -> web.Response:
    req = await _body(request, KillProcessRequest)
    await _dispatch(request, ops.Signal(request.match_info["id"], None,
                                        path_int(request, "pid"), req.signal))
    return _ok()


async def file_read(request: web.Request) -> web.StreamResponse:
    """Small files in one response; bigger ones streamed in bounded chunks (streams.py)."""
    path = query_path(request)
    max_bytes = query_int(request, "max_bytes", MAX_READ_BYTES, 0, MAX_READ_BYTES)
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

    got = await _dispatch(request, ops.Transfer(
        sid, key, "read", {"path": path, "max_bytes": max_bytes}, read,
        lambda v: v if isinstance(v, dict) else data_result(v[0], keep, truncated=v[1])))
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


async def _spooled_op(request: web.Request, path: str, mode: int | None = None,
                      ) -> web.Response:
    """A write (``mode`` given) or an upload: its body streamed to an unnamed file on disk
    (corral.daemon.spool), hashed on the way, then handed to the substrate as a file object
    to copy in chunks."""
    engine, sid = _engine(request), request.match_info["id"]
    f = spool.tmp_file(os.path.join(engine.config.state_dir, "tmp"))
    handed_off = False

    key = _key(request)

    async def put(data: bytes | Any, big: bool, req: dict[str, Any]) -> web.Response:
        await _dispatch(request, ops.Write(sid, key, path, data, mode, big, req))
        return _ok()

    try:
        got = await spool.spool(request, f, MAX_BODY, engine.trajlog.body_cap, engine.disk,
                                request.get(TENANT))
        fields: dict[str, Any] = {"path": path} if mode is None else {"path": path, "mode": mode}
        req = body_request(got.size, got.sha256, got.head, **fields)
        if mode is not None and got.head is not None and got.size <= BIG_BODY:  # in hand
            return await put(got.head, False, req)
        # A thread reads f: cancelled here (the daemon stopping), f is closed when the thread
        # is done with it, never under it.
        task = asyncio.ensure_future(put(f, True, req))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(lambda _: f.close())
            handed_off = True
            raise
    finally:
        if not handed_off:
            f.close()


async def file_write(request: web.Request) -> web.Response:
    path = query_path(request)
    mode = query_mode(request)
    return await _spooled_op(request, path, mode)


async def file_list(request: web.Request) -> web.Response:
    after, limit = page_args(request, names=True)
    op = ops.ListDir(request.match_info["id"], _key(request), query_path(request), after, limit)
    res = await _dispatch(request, op)
    if not isinstance(res, dict):
        return _json({"entries": res.entries, "next": res.next})
    engine = _engine(request)
    if "next" in res:  # fast-forwarded: the page listed then

        async def page_now() -> tuple[list[Any], str | None]:
            listed = await ops.ListDir(op.sid, None, op.path, res.get("after"),
                                       op.limit).run(engine)
            return listed.entries, listed.next

        entries, nxt = await replayed_listing(res, page_now)
        return _json({"entries": entries, "next": nxt})

    # A whole listing, as a daemon that logged whole listings logged each page: this page of it.
    async def whole_now() -> tuple[list[Any], str | None]:
        return [ops.entry(e) for e in await engine.list_dir(op.sid, op.path)], None

    entries, _ = await replayed_listing(res, whole_now)
    entries, nxt = page_of(entries, after, limit, lambda e: e["name"])
    return _json({"entries": entries, "next": nxt})


async def file_tree(request: web.Request) -> web.Response:
    op = ops.Tree(request.match_info["id"], None, query_path(request),
                  query_int(request, "depth", MAX_TREE_DEPTH, 1, MAX_TREE_DEPTH),
                  query_int(request, "limit", MAX_PAGE, 1, MAX_PAGE))
    return _json(await _dispatch(request, op))


async def file_stat(request: web.Request) -> web.Response:
    op = ops.Stat(request.match_info["id"], _key(request), query_path(request))
    return _json(await _dispatch(request, op))


async def file_mkdir(request: web.Request) -> web.Response:
    req = await _body(request, MkdirRequest)
    await _dispatch(request, ops.Mkdir(request.match_info["id"], _key(request),
                                       check_path(req.path), req.parents, req.model_dump()))
    return _ok()


async def file_remove(request: web.Request) -> web.Response:
    req = await _body(request, RemoveRequest)
    not_root(req.path, "removed")
    await _dispatch(request, ops.Remove(request.match_info["id"], _key(request),
                                        check_path(req.path), req.recursive, req.model_dump()))
    return _ok()


async def file_rename(request: web.Request) -> web.Response:
    req = await _body(request, RenameRequest)
    not_root(req.src, "renamed")
    not_root(req.dst, "replaced")
    try:
        await _dispatch(request, ops.Rename(request.match_info["id"], _key(request),
                                            check_path(req.src, "src"),
                                            check_path(req.dst, "dst"), req.model_dump()))
        return _ok()
    except InvalidPath as e:
        if e.details.get("errno") != errno.EXDEV:
            raise
        # src and dst are on different mounts of the sandbox (its /tmp, its root): the
        # sandbox's layout, not the request, is in the way.
        raise Conflict(f"cannot rename across the sandbox's mounts: {req.src} -> {req.dst}",
                       details={"src": req.src, "dst": req.dst, "errno": e.details["errno"]},
                       ) from None


async def tar_upload(request: web.Request) -> web.Response:
    return await _spooled_op(request, query_path(request))


async def tar_download(request: web.Request) -> web.StreamResponse:
    """Planned first (caps checked, clear errors), then streamed in bounded chunks."""
    sid, path = request.match_info["id"], query_path(request)
    engine = _engine(request)

    async def download() -> dict[str, Any]:
        tree = await engine.plan_tar(sid, path, streams.TAR_MAX_BYTES, streams.TAR_MAX_MEMBERS)
        resp = web.StreamResponse()
        resp.content_type = "application/x-tar"
        await resp.prepare(request)
        try:
            sent = await streams.send_chunks(
                resp, streams.chunks(tree, path.rstrip("/") or "/", streams.TAR_MAX_BYTES),
                engine.trajlog.enabled)
        except BaseException:
            _cut(request)  # headers are out: the client must see a broken transfer
            raise
        await resp.write_eof()
        return {"size": sent.size, "sha256": sent.sha256, "response": resp}

    res = await _dispatch(request, ops.Transfer(
        sid, None, "download", {"path": path}, download,
        lambda v: {"size": v["size"], "sha256": v["sha256"]}))
    return res["response"]


# ---- snapshots, fork, restore, pause (docs/snapshots.md) ----------------------------------
_snap = ops.snap_info


# Long calls (corral.daemon.batches): streamed on ?stream=ndjson; a client that leaves a
# snapshot or a fork cancels it (nothing made is kept, unless keyed and already done: its
# retry fetches it), a restore runs to its end.
async def snapshot_sandbox(request: web.Request) -> web.StreamResponse:
    req = await _body(request, SnapshotRequest)
    engine, key = _engine(request), _key(request)
    engine.precheck_sandbox(request.match_info["id"], key)
    control = CaptureControl()
    # Fast-forwarded: the snapshot as logged (also if it was deleted since).
    op = ops.Snapshot(request.match_info["id"], key, req.name, control)

    async def undo(snap: dict[str, Any]) -> None:
        _forget_snapshot(engine, snap["id"])

    return await batches.run(request, batches.Progress(copied=control.charged),
                             lambda _: _dispatch(request, op), _same, 201,
                             cancel_when_gone=True, undo=None if key else undo)


async def fork_sandbox(request: web.Request) -> web.StreamResponse:
    """Fast-forwarded, a fork returns the same children: see _fork_child."""
    req = await _body(request, ForkRequest)
    engine, key = _engine(request), _key(request)
    engine.precheck_sandbox(request.match_info["id"], key)
    control = CaptureControl()
    progress = batches.Progress(req.count, copied=control.charged)
    op = ops.Fork(request.match_info["id"], key, req.count, req.name,
                  req.keep_snapshot, req.model_dump(), control, progress.tick)

    async def undo(res: dict[str, Any]) -> None:
        await engine.kill_many(res["sandboxes"])
        _forget_snapshot(engine, res["snapshot"]["id"])

    async def answer(res: dict[str, Any]) -> dict[str, Any]:
        return {"snapshot": res["snapshot"],
                "sandboxes": [await _fork_child(engine, cid) for cid in res["sandboxes"]]}

    return await batches.run(request, progress, lambda _: _dispatch(request, op), answer, 201,
                             cancel_when_gone=True, undo=None if key else undo)


def _same(value: T) -> T:
    return value


def _forget_snapshot(engine: Engine, snap_id: str) -> None:
    with contextlib.suppress(SnapshotNotFound):  # not kept, or deleted meanwhile
        engine.snapshot_delete(snap_id)


async def _fork_child(engine: Engine, cid: str) -> dict[str, Any]:
    """A child of a (maybe fast-forwarded) fork: as it is now, or, if it has ended since, as
    its create entry logged it with state ``dead``: a replayed fork never forks again, and the
    first call on a gone child that is not in its log fails with sandbox_not_running (or
    sandbox_lost)."""
    now = engine.info_now(cid)
    if now is not None:
        return now
    await engine.trajlog.flushed()  # its create entry may be journaled, not yet ingested
    info = engine.trajlog.logged_result(cid, "create")
    if info is None:
        raise SandboxNotFound(f"sandbox {cid}, a child of a logged fork, is gone and its log "
                              "was pruned", details={"id": cid})
    return dict(info, state="dead")


async def restore_sandbox(request: web.Request) -> web.StreamResponse:
    req = await _body(request, RestoreRequest)
    engine = _engine(request)
    engine.precheck_sandbox(request.match_info["id"], _key(request))
    if (tenant := tenant_of(request)) is not None:
        tenancy.snapshot(engine, req.snapshot, tenant)
    key = _key(request)
    op = ops.Restore(request.match_info["id"], key, req.snapshot)
    return await batches.run(request, batches.Progress(), lambda _: _dispatch(request, op),
                             lambda info: _as_now(engine, info, key))


async def pause_sandbox(request: web.Request) -> web.Response:
    key = _key(request)
    info = await _dispatch(request, ops.Pause(request.match_info["id"], key))
    return _json(_as_now(_engine(request), info, key))


async def resume_sandbox(request: web.Request) -> web.Response:
    key = _key(request)
    info = await _dispatch(request, ops.Resume(request.match_info["id"], key))
    return _json(_as_now(_engine(request), info, key))


async def list_snapshots(request: web.Request) -> web.Response:
    recs = _engine(request).snapshot_list()
    if (tenant := tenant_of(request)) is not None:
        recs = [r for r in recs if r.get("tenant") == tenant]
    items, nxt = page(request, recs, lambda r: f"{r['created_at']:020.6f}/{r['id']}")
    return _json({"snapshots": [_snap(r) for r in items], "next": nxt})


async def get_snapshot(request: web.Request) -> web.Response:
    return _json(_snap(tenancy.snapshot(_engine(request), request.match_info["snap"],
                                        tenant_of(request))))


async def delete_snapshot(request: web.Request) -> web.Response:
    engine, key = _engine(request), request.match_info["snap"]
    rec = engine.snapshot_delete(tenancy.snapshot(engine, key, tenant_of(request))["id"])
    return _json({"id": rec["id"], "deleted": True})


async def export_snapshot(request: web.Request) -> web.StreamResponse:
    """The snapshot's chain as a stream (corral.daemon.snapxfer), for another node's import;
    the layers named in ``have`` are left out."""
    engine = _engine(request)
    have = set(request.query.getall("have", []))
    if len(have) > snapxfer.MAX_CHAIN or not all(snapxfer.DIGEST.match(d) for d in have):
        raise InvalidRequest("query parameter 'have' takes layer digests (64 hex digits)")
    man, release = engine.snapshot_export(request.match_info["snap"], have)
    try:
        resp = web.StreamResponse(headers={"X-Corral-Snapshot": man["snapshot"]["id"]})
        resp.content_type = "application/x-tar"
        await resp.prepare(request)
        try:
            await engine.snapshot_export_stream(man, resp.write)
        except BaseException:
            _cut(request)  # headers are out: the importer must see a broken stream
            raise
        await resp.write_eof()
        return resp
    finally:
        release()


async def import_snapshot(request: web.Request) -> web.Response:
    """A snapshot from another node's export stream (the body), stored under the same id:
    201, or 200 if this node has that id already. ``?tenant=``: its owner here (the admin's
    call: a tenant's token cannot import), never what the stream says."""
    tenant = request.query.get("tenant") or None
    engine = _engine(request)
    if engine.disk is not None:  # its layers land on the state dir's disk
        engine.disk.check("a snapshot import", request.content_length or 0)
    rec, made = await engine.snapshot_import(request.content.read, tenant)
    return _json(_snap(rec), 201 if made else 200)


async def sandbox_log(request: web.Request) -> web.StreamResponse:
    """The sandbox's trajectory log (also after the sandbox is gone, until pruned)."""
    engine = _engine(request)
    sid = request.match_info["id"]
    fmt = request.query.get("format", "json")
    if fmt not in ("json", "jsonl"):
        raise InvalidRequest("query parameter 'format' must be json or jsonl")
    tail = query_int(request, "tail", 0, 1, MAX_LOG_TAIL) or None
    max_output = query_int(request, "max_output", -1, 0, MAX_LOG_OUTPUT)
    pages = await engine.trajlog.pages(sid, known=engine.info_now(sid) is not None,
                                       tail=tail, max_output=None if max_output < 0
                                       else max_output, jsonl=fmt == "jsonl")
    def cut(e: BaseException) -> None:
        if isinstance(e, sqlite3.Error):  # a client gone is no error of ours
            log.error("reading the trajectory log failed mid-stream", exc_info=e)

    # Streamed a page of rows at a time (the log's size is the sandbox's doing): the daemon
    # holds one page, and the event loop only writes.
    try:
        return await streams.stream_out(
            request, streams.pages_of(pages),
            content_type="application/x-ndjson" if fmt == "jsonl" else "application/json",
            cut_by=(sqlite3.Error, OSError), on_cut=cut)
    finally:
        close = getattr(pages, "close", None)
        if close is not None:
            close()


async def get_trajectory(request: web.Request) -> web.Response:
    """The sandbox of trajectory ``tid`` and the step after the last one its log binds (a
    resuming client's position): ``Sandbox.from_trajectory``."""
    tid, engine = request.match_info["tid"], _engine(request)
    found = await engine.trajlog.trajectory(tid)
    if found is None:
        raise NotFound(f"no trajectory {tid!r} in the log (no create keyed {tid}:create)",
                       details={"trajectory_id": tid})
    sid, step = found
    tenant = tenant_of(request)
    if tenant is not None and await tenancy.owner(engine, sid) != tenant:
        raise NotFound(f"no trajectory {tid!r} in the log (no create keyed {tid}:create)",
                       details={"trajectory_id": tid})
    now = engine.info_now(sid)
    if now is not None:
        info = now
    else:
        await engine.trajlog.flushed()
        info = dict(engine.trajlog.logged_result(sid, "create") or {}, state="dead")
    return _json({"trajectory_id": tid, "sandbox_id": sid, "step": step, "sandbox": info})


async def list_images(request: web.Request) -> web.Response:
    items, nxt = page(request, _engine(request).images.list(), lambda i: i.name)
    return _json({"images": [ops.entry(i) for i in items], "next": nxt})


async def import_image(request: web.Request) -> web.Response:
    """From a host path: the admin socket's, or under the import directory (images.py)."""
    req = await _body(request, ImportImageRequest)
    engine = _engine(request)
    src = resolve_source(req.source, admin=is_unix(request), import_dir=engine.config.import_dir)
    info = await asyncio.to_thread(engine.images.import_image, req.name, src)
    return _json(ops.entry(info), 201)


async def upload_image(request: web.Request) -> web.Response:
    """From the request body (a rootfs tarball, maybe compressed): what remote clients use.
    Streamed to a private temp dir, never held in memory."""
    name, store = request.match_info["name"], _engine(request).images
    store.check_new(name)
    tmp = tempfile.mkdtemp(prefix=f".tmp-upload-{name}-", dir=store.dir)
    try:
        path = os.path.join(tmp, "rootfs.tar")
        with open(path, "wb") as f:
            await spool.spool(request, f, MAX_BODY, disk=_engine(request).disk,
                              tenant=request.get(TENANT))
        info = await asyncio.to_thread(store.import_image, name, path, "upload")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _json(ops.entry(info), 201)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[METRICS].render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def dashboard_summary(request: web.Request) -> web.Response:
    engine, m = _engine(request), request.app[METRICS]
    tenant = tenant_of(request)
    return _json(dashboard.summary(engine.list({} if tenant is None else {TENANT_LABEL: tenant}),
                                   engine.config.max_sandboxes,
                                   engine.metrics(), m.error_counts(), m.infra_total(),
                                   m.histograms()))


def _scrape(app: web.Application) -> dict[str, Any]:
    """What /metrics reads from the engine at each scrape (corral.daemon.metrics)."""
    engine = app[ENGINE]
    return {"sandboxes": engine.sandbox_count(), "capacity": engine.config.max_sandboxes,
            "api_waiting": app[WAITING]["waiting"], **engine.census(),
            "engine": engine.metrics()}


# ---- the route table (the API contract; see docs/architecture.md) --------------------------
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

_DASH_RESPONSE = {"type": "object", "required": ["now", "capacity", "count", "sandboxes",
                                                 "totals", "errors_by_code", "latency"],
                  "properties": {
    "now": {"type": "number"}, "capacity": {"type": "integer"},
    "count": {"type": "integer", "description": "live sandboxes (all, not only those listed)"},
    "sandboxes": {"type": "array", "items": {"type": "object"}},
    "totals": {"type": "object", "description": "counters since the daemon started"},
    "errors_by_code": {"type": "object"},
    "latency": {"type": "object", "description": "create, exec, snapshot: cumulative "
                                                 "buckets [le, count], sum, count"},
}}

_ID = "$response.body#/id"
# Everything a new sandbox can be used for (the stateful fuzzer follows these).
_SB_LINKS = {name: link(name, id=_ID) for name in (
    "get_sandbox", "exec_cmd", "file_write", "file_read", "file_list", "file_stat",
    "file_mkdir", "tar_download", "tar_upload", "snapshot_sandbox", "fork_sandbox",
    "pause_sandbox", "resume_sandbox", "sandbox_log", "sandbox_spec", "set_timeout",
    "kill_sandbox")}
_PROC_LINKS = {name: link(name, id="$request.path.id", pid="$response.body#/pid")
               for name in ("proc_status", "proc_wait", "proc_stream", "proc_stdin",
                            "proc_kill")}
_FILE_LINKS = {name: link(name, id="$request.path.id", path="$request.query.path")
               for name in ("file_read", "file_stat", "tar_download")}
_SNAP_LINKS = {"get_snapshot": link("get_snapshot", snap=_ID),
               "delete_snapshot": link("delete_snapshot", snap=_ID),
               "restore_sandbox": link("restore_sandbox", id="$request.path.id",
                                       body={"snapshot": _ID}),
               "create_on_snapshot": link("create_sandbox", body={"snapshot": _ID})}
SB_ERR = (404, 409, 410, 503)  # unknown sandbox; ended; lost; daemon stopping


ROUTES: tuple[Route, ...] = (
    Route("GET", "/v1/health", health, "Liveness (no token needed)", response={
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}),
    Route("GET", "/v1/status", status, "Daemon status", response=DaemonStatus),
    Route("GET", "/v1/substrates", list_substrates, "The substrates this daemon serves, each "
          "with its capabilities (an operation a substrate lacks answers 501 unsupported)",
          response=list_of("substrates", SubstrateInfo, paged=False)),
    Route("PUT", "/v1/sandboxes/{id}/network", update_network, "Replace a networked sandbox's "
          "policy at once (internet, a named allowlist or rules)", body=NetworkUpdate,
          response=SandboxInfo, errors=(*SB_ERR, 501)),
    Route("POST", "/v1/sandboxes/{id}/ports", expose_port, "Expose a TCP port of a networked "
          "sandbox on the host's loopback", body=ExposeRequest, response=ExposedPort,
          errors=(*SB_ERR, 501)),
    Route("DELETE", "/v1/sandboxes/{id}/ports/{port}", unexpose_port,
          "Stop exposing a port", response={"type": "object", "required": ["removed"],
                                            "properties": {"removed": {"type": "boolean"}}},
          errors=(*SB_ERR, 501)),
    Route("GET", "/v1/networks", list_networks, "The daemon's named allowlists (usable as a "
          "sandbox's network, or @name in a policy's allow)",
          response=list_of("networks", AllowlistInfo, paged=False)),
    Route("GET", "/v1/networks/{name}", get_network, "One named allowlist",
          response=AllowlistInfo, errors=(404,)),
    Route("GET", "/v1/network/blocked", get_blocked, "Addresses no sandbox may reach whatever "
          "its policy, beyond the fixed ones (the admin's)", response=BlockedInfo,
          errors=(403, 501)),
    Route("PUT", "/v1/network/blocked", put_blocked, "Replace the live addresses no sandbox "
          "may reach (the admin's: a cluster's supervisor keeps its other nodes here)",
          body=BlockedUpdate, response=BlockedInfo, errors=(400, 403, 501)),
    Route("POST", "/v1/sandboxes", create_sandbox, "Create a sandbox", body=SandboxSpec,
          response=SandboxInfo, status=201, query=(KEY_H,),
          errors=(403, 404, 409, 413, 429, 501, 502, 503), links=_SB_LINKS),
    Route("POST", "/v1/sandboxes/batch", create_batch,
          "Create many sandboxes (all or nothing)", body=CreateManyRequest,
          response=list_of("sandboxes", SandboxInfo, paged=False), status=201,
          query=(STREAM_Q,), also=("ndjson",),
          errors=(403, 404, 409, 413, 429, 501, 502, 503), links={
              "exec_first": link("exec_cmd", id="$response.body#/sandboxes/0/id"),
              "kill_first": link("kill_sandbox", id="$response.body#/sandboxes/0/id")}),
    Route("POST", "/v1/sandboxes/batch/exec", exec_batch,
          "Run the same command in many sandboxes (one result or error per id, in order)",
          body=ExecManyRequest, response=ExecManyResponse, query=(STREAM_Q,),
          also=("ndjson",)),
    Route("POST", "/v1/sandboxes/batch/destroy", kill_batch,
          "Kill many sandboxes: counts, and the ids not killed (already ended, or an error)",
          body=KillManyRequest, response=KillManyResponse, query=(STREAM_Q,),
          also=("ndjson",)),
    Route("GET", "/v1/sandboxes", list_sandboxes, "List running sandboxes, oldest first, a "
          "page at a time", query=(LABEL_Q, *PAGE_Q), response=list_of("sandboxes", SandboxInfo)),
    Route("GET", SB, get_sandbox, "Sandbox info (keyed: logged, and a repeated key returns "
          "the logged info)", response=SandboxInfo, query=(KEY_H,), errors=SB_ERR),
    Route("GET", SB + "/spec", sandbox_spec, "The spec the sandbox was made with (the "
          "snapshot it started on included): a create with it makes one like it",
          response=SandboxSpec, errors=SB_ERR),
    Route("DELETE", SB, kill_sandbox, "Kill a sandbox (killed=false: it had already ended)",
          query=(KEY_H,), errors=SB_ERR,
          response={"type": "object", "required": ["id", "killed"], "properties": {
              "id": {"type": "string"}, "killed": {"type": "boolean"}}}),
    Route("POST", SB + "/timeout", set_timeout, "Set the TTL, in seconds from now",
          body=SetTimeoutRequest, response=SandboxInfo, errors=SB_ERR),
    Route("POST", SB + "/exec", exec_cmd, "Run a command", body=ExecRequest,
          response=ExecResult, alt_response=ProcessHandle, query=(KEY_H,), errors=SB_ERR,
          links=_PROC_LINKS),
    Route("GET", SB + "/log", sandbox_log, "The sandbox's trajectory log (kept after it ends, "
          "until pruned)", response=_LOG_RESPONSE, query=(FORMAT_Q, LOG_TAIL_Q, LOG_OUTPUT_Q),
          errors=(404, 501),
          also=("ndjson",)),
    Route("GET", PROC, proc_status, "Background process status", response=ProcessStatus,
          errors=SB_ERR),
    Route("POST", PROC + "/wait", proc_wait, "Wait for a background process (409 "
          "process_running if not done in time)", body=WaitRequest, response=ExecResult,
          errors=SB_ERR),
    Route("GET", PROC + "/stream", proc_stream, "Stream a background process's output",
          response="ndjson", errors=SB_ERR),
    Route("POST", PROC + "/stdin", proc_stdin, "Write to a background process's stdin",
          body=StdinRequest, response="ok", errors=SB_ERR),
    Route("POST", PROC + "/kill", proc_kill, "Signal a background process's group",
          body=KillProcessRequest, response="ok", errors=SB_ERR),
    Route("GET", SB + "/files", file_read, "Read a file (header X-Corral-Truncated: true when "
          "it is longer than max_bytes)", response="bytes", errors=SB_ERR, query=(
              PATH_Q, int_param("max_bytes", 0, MAX_READ_BYTES,
                                "read at most this many bytes (default 1 GiB)"), KEY_H)),
    Route("PUT", SB + "/files", file_write, "Write a file (parents are created)", body="bytes",
          response="ok", query=(PATH_Q, MODE_Q, KEY_H), errors=(*SB_ERR, 413),
          links=_FILE_LINKS),
    Route("GET", SB + "/files/list", file_list, "List a directory, by name, a page at a "
          "time", query=(PATH_Q, *PAGE_Q, KEY_H), response=list_of("entries", FileEntry),
          errors=SB_ERR),
    Route("GET", SB + "/files/tree", file_tree, "The entries under a directory, breadth first, "
          "in one answer (an observation: not in the trajectory log)",
          query=(PATH_Q, DEPTH_Q, Param("limit", description=f"at most this many entries "
                 f"(default and most {MAX_PAGE}); more: `truncated`",
                 schema={"type": "integer", "minimum": 1, "maximum": MAX_PAGE})),
          response=FileTree, errors=SB_ERR),
    Route("GET", SB + "/files/stat", file_stat, "Stat a path (lstat)", query=(PATH_Q, KEY_H),
          response=FileEntry, errors=SB_ERR),
    Route("POST", SB + "/files/mkdir", file_mkdir, "Make a directory", body=MkdirRequest,
          response="ok", query=(KEY_H,), errors=SB_ERR),
    Route("POST", SB + "/files/remove", file_remove, "Remove a file or directory",
          body=RemoveRequest, response="ok", query=(KEY_H,), errors=SB_ERR),
    Route("POST", SB + "/files/rename", file_rename, "Rename", body=RenameRequest,
          response="ok", query=(KEY_H,), errors=SB_ERR),
    Route("PUT", SB + "/files/tar", tar_upload, "Extract a tar into a directory", body="tar",
          response="ok", query=(PATH_Q, KEY_H), errors=(*SB_ERR, 413)),
    Route("GET", SB + "/files/tar", tar_download, "A tar of a directory or file",
          response="tar", query=(PATH_Q,), errors=SB_ERR),
    Route("POST", SB + "/snapshot", snapshot_sandbox, "Snapshot the sandbox's files as a "
          "layer", body=SnapshotRequest, response=SnapshotInfo, status=201,
          query=(KEY_H, STREAM_Q), also=("ndjson",), errors=(*SB_ERR, 501), links=_SNAP_LINKS),
    Route("POST", SB + "/fork", fork_sandbox, "Snapshot + count sandboxes on it (all or "
          "nothing)", body=ForkRequest, response=ForkResult, status=201,
          query=(KEY_H, STREAM_Q), also=("ndjson",), errors=(*SB_ERR, 429, 501), links={
              "exec_child": link("exec_cmd", id="$response.body#/sandboxes/0/id"),
              "get_snapshot": link("get_snapshot", snap="$response.body#/snapshot/id")}),
    Route("POST", SB + "/restore", restore_sandbox, "Roll the sandbox back to a snapshot in "
          "place (its processes are restarted)", body=RestoreRequest, response=SandboxInfo,
          query=(KEY_H, STREAM_Q), also=("ndjson",), errors=(*SB_ERR, 501)),
    Route("POST", SB + "/pause", pause_sandbox, "Freeze every process of the sandbox",
          response=SandboxInfo, query=(KEY_H,), errors=(*SB_ERR, 501)),
    Route("POST", SB + "/resume", resume_sandbox, "Thaw a paused sandbox",
          response=SandboxInfo, query=(KEY_H,), errors=(*SB_ERR, 501)),
    Route("GET", "/v1/trajectories/{tid}", get_trajectory, "Where a trajectory stands: its "
          "sandbox and the step after the last one its log binds", response=_TRAJ_RESPONSE,
          errors=(404,)),
    Route("GET", "/v1/snapshots", list_snapshots, "List snapshots, oldest first, a page at a "
          "time", query=PAGE_Q, response=list_of("snapshots", SnapshotInfo), errors=(501,)),
    Route("GET", "/v1/snapshots/{snap}", get_snapshot, "Snapshot info (by id or name)",
          response=SnapshotInfo, errors=(404, 501)),
    Route("GET", "/v1/snapshots/{snap}/export", export_snapshot, "The snapshot's whole chain "
          "as a tar stream (its record, then each layer's parts in OCI layer form) for "
          "another node's import (docs/snapshots.md, moving a snapshot)",
          response="tar", errors=(404, 501), query=(Param(
              "have", repeated=True, description="a layer digest the importer has: left out",
              schema={"type": "string", "pattern": "^[0-9a-f]{64}$"}),)),
    Route("POST", "/v1/snapshots", import_snapshot, "Store a snapshot from another "
          "node's export stream under its own id: unpacked as untrusted input, each layer's "
          "digest checked; 200 if the id is here already", body="tar",
          response=SnapshotInfo, status=201, errors=(404, 409, 501)),
    Route("DELETE", "/v1/snapshots/{snap}", delete_snapshot, "Delete a snapshot (its layers "
          "stay while a sandbox or a child snapshot uses them)", errors=(404, 501), response={
              "type": "object", "required": ["id", "deleted"], "properties": {
                  "id": {"type": "string"}, "deleted": {"type": "boolean"}}}),
    Route("GET", "/v1/images", list_images, "List images, by name, a page at a time",
          query=PAGE_Q, response=list_of("images", ImageInfo)),
    Route("POST", "/v1/images", import_image, "Import a rootfs directory or tarball from a "
          "host path (the local socket, or under the import directory: docs/daemon.md)",
          body=ImportImageRequest, response=ImageInfo, status=201, errors=(403, 409, 501)),
    Route("PUT", "/v1/images/{name}", upload_image, "Import a rootfs tarball sent as the body "
          "(.tar, gzip, xz or bzip2)", body="tar", response=ImageInfo, status=201,
          errors=(409, 413), links={"create_on_image": link(
              "create_sandbox", body={"image": "$response.body#/name"})}),
    Route("GET", "/metrics", metrics, "Prometheus metrics (docs/observability.md)",
          response="text"),
    Route("GET", "/dashboard", dashboard.dashboard_page, "The web dashboard's page (static; "
          "its data comes from /v1/dashboard with the token)", response="html"),
    Route("GET", "/dashboard/app.js", dashboard.dashboard_script, "The web dashboard's script",
          response="js"),
    Route("GET", "/v1/dashboard", dashboard_summary, "What the dashboard shows: live sandboxes "
          "(newest first, at most 1000), totals, errors by code, latency histograms",
          response=_DASH_RESPONSE),
    *image_api.ROUTES,
    *run_code_api.ROUTES,
)


# A request line holds a path of up to 4095 characters, percent-encoded (12 bytes each at
# worst): aiohttp's 8 KiB default would refuse valid requests before the app sees them.
MAX_LINE_SIZE, MAX_FIELD_SIZE = 1 << 16, 1 << 14
# /v1/sandboxes/batch is not a sandbox id: its methods are its own (405 names them).
_ID_RE = "{id:(?!batch$)[^/]+}"
# An image name may be a reference (slashes, colons); /v1/images/pull, prune, tag, push are not.
_NAME_RE = "{name:(?!(?:pull|prune|tag|push)$).+}"


def create_app(engine: Engine | None, token: str | None = None,
               tenants: Tenants | None = None) -> web.Application:
    """``token``: the admin's bearer token on TCP; ``tenants``: the tenants' tokens
    (corral.daemon.tenants), each reaching only its own sandboxes (corral.daemon.tenancy)."""
    app = web.Application(client_max_size=JSON_MAX)
    app[WAITING] = {"waiting": 0}
    app[METRICS] = Metrics(None if engine is None else lambda: _scrape(app))
    guard = tenancy.guard(engine) if engine is not None else None
    json_handlers = frozenset(r.handler for r in ROUTES if isinstance(r.body, type))
    app.middlewares.append(middleware(token, app[METRICS].error, tenants, guard,
                                      json_handlers, BodyMemory()))
    if engine is not None:
        app[ENGINE] = engine
        run_code_api.install(app, engine.config.state_dir, engine.config.cgroup_name)
    for r in ROUTES:
        app.router.add_route(r.method, r.path.replace("{id}", _ID_RE)
                             .replace("{name}", _NAME_RE), r.handler)
    return app
