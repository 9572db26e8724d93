"""The front's aiohttp application: the control plane and envd's APIs on one port, so
``E2B_API_URL`` and ``E2B_SANDBOX_URL`` name the same address.

Every request is authenticated before its handler runs: the control plane by the API key,
envd's APIs by the sandbox's access token (auth.py). Every failure is answered in the shape its
caller expects (errors.py); an unexpected one is logged and answered as an internal error,
never a traceback.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from corral import errors as ce
from corral.e2b import files, filesystem, process, sandboxes
from corral.e2b.auth import (
    ACCESS_TOKEN_HEADER,
    API_KEY_HEADER,
    SANDBOX_ID_HEADER,
    FrontSandboxes,
    Keys,
)
from corral.e2b.connect import TAKE, ConnectError, error_response, is_stream, stream_of
from corral.e2b.errors import api_error, envd_http_error, to_connect
from corral.e2b.state import STREAMS_PER_SANDBOX, STREAMS_TOTAL, FrontState, Held, Quota
from corral.e2b.templates import Templates
from corral.sdk.async_sandbox import AsyncSandbox
from corral.sdk.endpoint import Endpoint

log = logging.getLogger("corral.e2b")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
RPC_PREFIXES = ("/process.Process/", "/filesystem.Filesystem/")
ENVD_HTTP = frozenset({"/files", "/health"})
MAX_BODY = files.MAX_BODY


class Front:
    """What every part of the front shares."""

    def __init__(self, api_key: str, endpoint: str | Endpoint | None = None) -> None:
        self.keys = Keys(api_key)
        self.label = self.keys.front_label()  # on every sandbox it makes (sandboxes.LABEL)
        self.known = FrontSandboxes()
        self.endpoint = Endpoint.parse(endpoint)
        self.state = FrontState()
        self.streams = Quota("streams", STREAMS_PER_SANDBOX, STREAMS_TOTAL)
        self.watchers = Quota("directory watchers", filesystem.WATCHERS_PER_SANDBOX,
                              filesystem.MAX_WATCHERS)
        # request bodies held in memory: uploads, and envd's RPC messages
        self.bodies = Quota("bytes of requests in memory", files.MAX_BODY,
                            files.BODY_BYTES_TOTAL)
        self.templates = Templates(self.endpoint)


def _is_rpc(path: str) -> bool:
    return path.startswith(RPC_PREFIXES)


def _envd_auth(front: Front, request: web.Request) -> str | None:
    sid = request.headers.get(SANDBOX_ID_HEADER, "")
    if sid and front.keys.access_token_ok(sid, request.headers.get(ACCESS_TOKEN_HEADER)):
        return sid
    return None


async def _front_made(front: Front, sid: str) -> bool:
    """Whether ``sid`` is one of the front's sandboxes, or none at all (its handler answers
    that it is gone): a valid token for a sandbox made some other way opens nothing."""
    if sid in front.known:
        return True
    try:
        info = await AsyncSandbox.from_id(sid, endpoint=front.endpoint).info()
    except ce.SandboxNotFound:
        return True
    if info.labels.get(sandboxes.LABEL) != front.label:
        return False
    front.known.add(sid)
    return True


@web.middleware
async def _middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    front: Front = request.app["front"]
    path = request.path
    rpc = _is_rpc(path)
    if rpc or path in ENVD_HTTP:
        sid = _envd_auth(front, request)
        if sid is None:
            if rpc:
                return error_response(ConnectError(
                    "unauthenticated", "a valid X-Access-Token for E2b-Sandbox-Id is required"))
            return api_error(401, "a valid X-Access-Token for E2b-Sandbox-Id is required")
        request["sandbox_id"] = sid
    elif not front.keys.api_key_ok(request.headers.get(API_KEY_HEADER)):
        return api_error(401, "Invalid API key")
    try:
        try:
            made = "sandbox_id" not in request or await _front_made(front, request["sandbox_id"])
        except ce.CorralError as e:  # corrald out of reach: unavailable, not internal
            if rpc:
                err = to_connect(e, request["sandbox_id"])
                return await stream_of(request).end(err) if is_stream(request) \
                    else error_response(err)
            return envd_http_error(e, request["sandbox_id"])
        if not made:
            log.warning("envd call for sandbox %s, which the front did not make, refused",
                        request["sandbox_id"])
            if rpc:
                return error_response(ConnectError(
                    "unauthenticated", "a valid X-Access-Token for E2b-Sandbox-Id is required"))
            return api_error(401, "a valid X-Access-Token for E2b-Sandbox-Id is required")
        if rpc:
            with Held(front.bodies, request["sandbox_id"]) as held:
                request[TAKE] = held.take  # the message's bytes, as connect.py reads them
                return await _rpc(handler, request)
        if path in ENVD_HTTP:
            return await files.guarded(handler, request)
        return await sandboxes.guarded(handler, request)
    except web.HTTPException as e:
        if e.status == 404:
            return (error_response(ConnectError("unimplemented", f"no method {path}")) if rpc
                    else api_error(404, f"no route {request.method} {path}"))
        if e.status == 405:
            return api_error(405, f"method {request.method} not allowed on {path}")
        if e.status == 413:
            return api_error(413, "the request body is too large")
        return api_error(e.status, e.reason)
    except Exception:
        log.exception("unexpected error on %s %s", request.method, path)
        if rpc:
            if is_stream(request):  # ended in its own stream, begun or not
                return await stream_of(request).end(ConnectError("internal", "internal error"))
            return error_response(ConnectError("internal", "internal error"))
        return api_error(500, "internal error")


async def _rpc(handler: Handler, request: web.Request) -> web.StreamResponse:
    """Connect errors: a unary call's as an HTTP status, a stream's in its end message."""
    try:
        return await handler(request)
    except (ConnectError, ce.CorralError) as e:
        err = e if isinstance(e, ConnectError) else to_connect(e, request["sandbox_id"])
        if is_stream(request):
            return await stream_of(request).end(err)
        return error_response(err)


def make_app(front: Front) -> web.Application:
    app = web.Application(middlewares=[_middleware], client_max_size=MAX_BODY)
    app["front"] = front
    fs = filesystem.FilesystemService(front)
    app.add_routes(sandboxes.routes(sandboxes.ControlPlane(front)))
    app.add_routes(process.routes(process.ProcessService(front)))
    app.add_routes(filesystem.routes(fs))
    app.add_routes(files.routes(files.FilesApi(front)))

    async def closing(_: Any) -> None:
        await fs.close()

    app.on_cleanup.append(closing)
    return app
