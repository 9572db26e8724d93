"""The control plane of E2B's OpenAPI spec, over corral's SDK.

Only sandboxes made through the front with its API key (label ``corral.e2b``, a fingerprint
of the key) are visible to it: an API key for the front opens no other sandbox of the daemon,
also none another front's key made. A sandbox that has ended is 404, as E2B
answers. Paused sandboxes stop their TTL clock (corral ``pause_ttl="stop"``), as E2B's
paused sandboxes do not time out.
"""

from __future__ import annotations

import json
import time
from typing import Any
from urllib.parse import parse_qsl

from aiohttp import web

from corral import errors as ce
from corral.e2b.errors import api_error, control_error
from corral.e2b.pbjson import timestamp
from corral.models import DEFAULT_DISK_MB, SandboxInfo
from corral.sdk.async_sandbox import AsyncSandbox

LABEL = "corral.e2b"
TEMPLATE_LABEL = "corral.e2b.template"
ENVD_VERSION = "0.5.7"
CLIENT_ID = "corral"
DEFAULT_TIMEOUT = 15          # E2B's default when a create names none
MAX_TIMEOUT = 7 * 24 * 3600   # corral's TTL bound
MAX_LIST = 100


class BadRequest(Exception):
    pass


def _body_object(raw: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(raw or b"{}")
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("the body is not JSON") from None
    except RecursionError:
        raise BadRequest("the body is nested too deep") from None
    if not isinstance(obj, dict):
        raise BadRequest("the body is not a JSON object")
    return obj


async def body(request: web.Request) -> dict[str, Any]:
    if request.content_length is not None and request.content_length > 1 << 20:
        raise BadRequest("the body is too large")
    raw = await request.content.read((1 << 20) + 1)
    if len(raw) > 1 << 20:
        raise BadRequest("the body is too large")
    return _body_object(raw)


def _timeout(obj: dict[str, Any], name: str, default: int | None) -> int | None:
    v = obj.get(name, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_TIMEOUT:
        raise BadRequest(f"{name} must be an integer number of seconds, 0 to {MAX_TIMEOUT}")
    return v


def _str_map(obj: dict[str, Any], name: str) -> dict[str, str]:
    v = obj.get(name) or {}
    if not isinstance(v, dict) or not all(isinstance(k, str) and isinstance(x, str)
                                          for k, x in v.items()):
        raise BadRequest(f"{name} must map strings to strings")
    return v


def _iso(unix: float) -> str:
    return timestamp(unix)


def _state(info: SandboxInfo) -> str:
    return "paused" if info.state == "paused" else "running"


class ControlPlane:
    def __init__(self, front: Any) -> None:
        self.f = front

    # ---- shapes ---------------------------------------------------------------------------
    def sandbox(self, info: SandboxInfo) -> dict[str, Any]:
        return {"templateID": info.labels.get(TEMPLATE_LABEL, ""), "sandboxID": info.id,
                "clientID": CLIENT_ID, "envdVersion": ENVD_VERSION,
                "envdAccessToken": self.f.keys.access_token(info.id), "domain": None}

    def listed(self, info: SandboxInfo) -> dict[str, Any]:
        return {"templateID": info.labels.get(TEMPLATE_LABEL, ""), "sandboxID": info.id,
                "clientID": CLIENT_ID, "startedAt": _iso(info.created_at),
                "endAt": _iso(info.expires_at), "cpuCount": max(1, round(info.cpu)),
                "memoryMB": info.memory_mb, "diskSizeMB": DEFAULT_DISK_MB,
                "state": _state(info), "envdVersion": ENVD_VERSION,
                "metadata": dict(info.metadata)}

    def detail(self, info: SandboxInfo) -> dict[str, Any]:
        d = self.listed(info)
        d["envdAccessToken"] = self.f.keys.access_token(info.id)
        d["domain"] = None
        return d

    # ---- helpers --------------------------------------------------------------------------
    def handle(self, sid: str) -> AsyncSandbox:
        return AsyncSandbox.from_id(sid, endpoint=self.f.endpoint)

    async def owned(self, sid: str) -> tuple[AsyncSandbox, SandboxInfo]:
        """The sandbox and its info if it is alive and the front's; SandboxNotFound if not."""
        sb = self.handle(sid)
        info = await sb.info()
        if info.labels.get(LABEL) != self.f.label or info.state in ("dead", "stopping"):
            raise ce.SandboxNotFound(f"sandbox {sid} not found")
        self.f.known.add(sid)
        return sb, info

    # ---- routes ---------------------------------------------------------------------------
    async def create(self, request: web.Request) -> web.Response:
        b = await body(request)
        template = b.get("templateID")
        if not isinstance(template, str) or not template:
            raise BadRequest("templateID is required")
        if b.get("autoPause"):
            raise BadRequest("autoPause is not supported by corral")
        timeout = _timeout(b, "timeout", DEFAULT_TIMEOUT) or DEFAULT_TIMEOUT
        metadata = _str_map(b, "metadata")
        env = _str_map(b, "envVars")
        try:
            sb = await self.f.templates.create(
                template, timeout=timeout, metadata=metadata, env=env,
                labels={LABEL: self.f.label, TEMPLATE_LABEL: template[:256]},
                pause_ttl="stop",
                cwd="/home/user" if template == "base" else None)
        except (ce.ImageNotFound, ce.SnapshotNotFound):
            return api_error(404, f"template {template!r} not found")
        assert sb.last_info is not None
        self.f.known.add(sb.last_info.id)
        return web.json_response(self.sandbox(sb.last_info), status=201)

    async def _all(self) -> list[SandboxInfo]:
        boxes = await AsyncSandbox.list({LABEL: self.f.label}, endpoint=self.f.endpoint)
        return sorted((b.last_info for b in boxes if b.last_info is not None),
                      key=lambda i: (i.created_at, i.id))

    def _filter(self, request: web.Request, infos: list[SandboxInfo],
                default_states: tuple[str, ...]) -> list[SandboxInfo]:
        want = dict(parse_qsl(request.query.get("metadata", ""), keep_blank_values=True))
        raw_states = request.query.getall("state", [])
        states = {s for v in raw_states for s in v.split(",") if s} or set(default_states)
        if not states <= {"running", "paused"}:
            raise BadRequest("state must be running and/or paused")
        out = []
        for i in infos:
            if i.state not in ("running", "paused") or _state(i) not in states:
                continue
            if all(i.metadata.get(k) == v for k, v in want.items()):
                out.append(i)
        return out

    async def list_v1(self, request: web.Request) -> web.Response:
        infos = self._filter(request, await self._all(), ("running", "paused"))
        return web.json_response([self.listed(i) for i in infos])

    async def list_v2(self, request: web.Request) -> web.Response:
        limit_raw = request.query.get("limit", str(MAX_LIST))
        if not limit_raw.isdigit() or not 1 <= int(limit_raw) <= MAX_LIST:
            raise BadRequest(f"limit must be 1 to {MAX_LIST}")
        limit = int(limit_raw)
        infos = self._filter(request, await self._all(), ("running", "paused"))
        after = request.query.get("nextToken")
        if after:
            ids = [i.id for i in infos]
            if after not in ids:
                raise BadRequest("nextToken names no listed sandbox")
            infos = infos[ids.index(after) + 1:]
        page = infos[:limit]
        headers = {"x-next-token": page[-1].id} if len(infos) > limit else {}
        return web.json_response([self.listed(i) for i in page], headers=headers)

    async def get(self, request: web.Request) -> web.Response:
        sid = request.match_info["sid"]
        _, info = await self.owned(sid)
        return web.json_response(self.detail(info))

    async def kill(self, request: web.Request) -> web.Response:
        sid = request.match_info["sid"]
        sb, _ = await self.owned(sid)
        if not await sb.kill():
            return api_error(404, f"sandbox {sid} not found")
        self.f.state.forget(sid)
        return web.Response(status=204)

    async def set_timeout(self, request: web.Request) -> web.Response:
        sid = request.match_info["sid"]
        t = _timeout(await body(request), "timeout", None)
        if t is None:
            raise BadRequest("timeout is required")
        sb, _ = await self.owned(sid)
        await sb.set_timeout(max(t, 1))
        return web.Response(status=204)

    async def refresh(self, request: web.Request) -> web.Response:
        sid = request.match_info["sid"]
        d = _timeout(await body(request), "duration", 60) or 60
        sb, info = await self.owned(sid)
        if info.expires_at < time.time() + d:
            await sb.set_timeout(d)
        return web.Response(status=204)

    async def pause(self, request: web.Request) -> web.Response:
        sid = request.match_info["sid"]
        sb, info = await self.owned(sid)
        if info.state == "paused":
            return api_error(409, f"sandbox {sid} is already paused")
        await sb.pause()
        return web.Response(status=204)

    async def _resume_or_extend(self, sb: AsyncSandbox, info: SandboxInfo,
                                timeout: int | None) -> tuple[SandboxInfo, bool]:
        resumed = False
        if info.state == "paused":
            info = await sb.resume()
            resumed = True
        if timeout and info.expires_at < time.time() + timeout:
            info = await sb.set_timeout(timeout)
        return info, resumed

    async def resume(self, request: web.Request) -> web.Response:
        sid = request.match_info["sid"]
        t = _timeout(await body(request), "timeout", None)
        sb, info = await self.owned(sid)
        if info.state != "paused":
            return api_error(409, f"sandbox {sid} is not paused")
        info, _ = await self._resume_or_extend(sb, info, t)
        return web.json_response(self.sandbox(info), status=201)

    async def connect(self, request: web.Request) -> web.Response:
        sid = request.match_info["sid"]
        t = _timeout(await body(request), "timeout", None)
        sb, info = await self.owned(sid)
        info, resumed = await self._resume_or_extend(sb, info, t)
        return web.json_response(self.sandbox(info), status=201 if resumed else 200)

    async def fork(self, request: web.Request) -> web.Response:
        sid = request.match_info["sid"]
        b = await body(request)
        count = b.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 100:
            raise BadRequest("count must be 1 to 100")
        t = _timeout(b, "timeout", None)
        sb, _ = await self.owned(sid)
        kids = await sb.fork(count)
        out = []
        for k in kids:
            info = k.last_info
            if t:
                info = await k.set_timeout(t)
            if info is None:
                info = await k.info()
            out.append({"sandbox": self.sandbox(info)})
        return web.json_response(out, status=201)

    async def metrics(self, request: web.Request) -> web.Response:
        """No samples: corral keeps no per-sandbox usage history (an empty list, not an error,
        so ``get_metrics()`` does not claim the sandbox is missing)."""
        await self.owned(request.match_info["sid"])
        return web.json_response([])

    async def snapshot(self, request: web.Request) -> web.Response:
        sid = request.match_info["sid"]
        b = await body(request)
        name = b.get("name")
        if name is not None and not isinstance(name, str):
            raise BadRequest("name must be a string")
        sb, _ = await self.owned(sid)
        snap = await sb.snapshot(name or None)
        names = [snap.name] if getattr(snap, "name", None) else []
        return web.json_response({"snapshotID": snap.id, "names": names}, status=201)


def routes(cp: ControlPlane) -> list[web.RouteDef]:
    sid = "/sandboxes/{sid}"
    return [
        web.post("/sandboxes", cp.create), web.post("/v2/sandboxes", cp.create),
        web.get("/sandboxes", cp.list_v1), web.get("/v2/sandboxes", cp.list_v2),
        web.get(sid, cp.get), web.delete(sid, cp.kill),
        web.post(sid + "/timeout", cp.set_timeout), web.post(sid + "/refreshes", cp.refresh),
        web.post(sid + "/pause", cp.pause), web.post(sid + "/resume", cp.resume),
        web.post(sid + "/connect", cp.connect), web.post("/v2" + sid + "/connect", cp.connect),
        web.post(sid + "/fork", cp.fork), web.post(sid + "/snapshots", cp.snapshot),
        web.get(sid + "/metrics", cp.metrics),
    ]


async def guarded(handler: Any, request: web.Request) -> web.StreamResponse:
    """Run a control-plane handler with corral's and the body's errors mapped."""
    try:
        return await handler(request)
    except BadRequest as e:
        return api_error(400, str(e))
    except ce.CorralError as e:
        return control_error(e, request.match_info.get("sid"))
