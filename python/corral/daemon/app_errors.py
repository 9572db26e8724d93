"""The API's middleware: bearer auth on TCP, and every failure as a JSON error with a stable code.

Bad input is a 4xx, never a 500: HTTP-level errors (no route, wrong method, body too large) get
their own codes, an ``OSError`` that escapes a handler is mapped by errno like a file error, and
only a truly unexpected exception is ``internal`` (logged with its traceback).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from corral.daemon import dashboard, oserrors
from corral.daemon.bodymem import BodyMemory, check_not_encoded
from corral.daemon.spool import too_large
from corral.daemon.tenants import NAME_RE, Tenants
from corral.errors import CorralError, InternalError, InvalidRequest, NotFound, Unauthorized

log = logging.getLogger("corral.api")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
MAX_BODY = 1 << 30           # file and tar uploads come as request bodies (spooled to disk)
# Every other body is JSON, read whole: bounded small, so concurrent requests cannot grow the
# daemon by more than this each (an exec's stdin is the largest legitimate one).
JSON_MAX = 16 << 20
# Unauthenticated on TCP: the liveness probe, and the dashboard's static page and script (no
# data in them: what they show comes through the API, with the token).
PUBLIC_PATHS = frozenset({"/v1/health"}) | dashboard.PUBLIC


def is_unix(request: web.Request) -> bool:
    """True for the local admin socket (root-only, 0600): root-equivalent credentials."""
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    return sock is not None and sock.family == socket.AF_UNIX


def json_error(err: CorralError, status: int | None = None,
               headers: dict[str, str] | None = None) -> web.Response:
    import json

    return web.Response(body=json.dumps(err.to_payload(), separators=(",", ":")).encode(),
                        status=status or err.status, content_type="application/json",
                        headers=headers)


def _bearer(header: str) -> str | None:
    """The token of ``Authorization: Bearer <token>``; the scheme is case-insensitive (RFC
    7235)."""
    scheme, _, got = header.strip().partition(" ")
    return got.strip() if scheme.lower() == "bearer" else None


# request[TENANT]: the tenant a request acts for; absent for the admin (unix socket, token).
TENANT = "corral.tenant"
# An admin's request on a tenant's behalf (the cluster gateway's, which checked the tenant's
# token): honoured with the admin's credentials only, so a tenant cannot name another.
ACT_AS_HEADER = "X-Corral-Tenant"
# request[BY_TENANT_TOKEN]: True when a tenant's own token authenticated it (not the admin's
# acting for a tenant): its connection is the tenant's (corral.daemon.tcpguard).
BY_TENANT_TOKEN = "corral.by_tenant_token"
# request[AUTHENTICATED]: True when a token (the admin's or a tenant's) authenticated it; a
# request to a public path without one is not (corral.daemon.tcpguard).
AUTHENTICATED = "corral.authenticated"
Guard = Callable[[web.Request, str], Awaitable[None]]


def _http_error(request: web.Request, e: web.HTTPException
                ) -> tuple[CorralError, int | None, dict[str, str] | None]:
    """The error, status and headers answering an aiohttp HTTP exception."""
    if e.status == 404:
        return NotFound(f"no route {request.method} {request.path}"), None, None
    if e.status == 405:
        allowed = sorted(getattr(e, "allowed_methods", ()) or ())
        return (InvalidRequest(f"method {request.method} not allowed on {request.path}",
                               details={"allowed": allowed}),
                405, {"Allow": ", ".join(allowed)})
    if e.status == 413:  # aiohttp's client_max_size: the JSON bodies
        return too_large(JSON_MAX, "JSON request body"), None, None
    return CorralError(e.reason or str(e), code="http_error"), e.status, None


def middleware(token: str | None, on_error: Callable[[CorralError], None] | None = None,
               tenants: Tenants | None = None, guard: Guard | None = None,
               json_handlers: frozenset[Handler] = frozenset(),
               bodies: BodyMemory | None = None) -> Any:
    """``on_error`` sees every error answered with a code (the /metrics error counters).
    ``tenants``: the tenants' tokens; a tenant's request passes ``guard`` (which raises if the
    route or what it names is not the tenant's) before its handler. A request to one of
    ``json_handlers`` (they read their body whole) holds its body's size in ``bodies`` while
    it is handled (corral.daemon.bodymem)."""
    expected = token.encode() if token else None

    async def authenticate(request: web.Request) -> None:
        """Raises unless the request is the admin's or a tenant's; a tenant's passes the
        guard."""
        if is_unix(request):
            tenant = request.headers.get(ACT_AS_HEADER)
        else:
            got = _bearer(request.headers.get("Authorization", ""))
            if got is None:
                raise Unauthorized("missing or wrong bearer token")
            if expected is not None and hmac.compare_digest(got.encode(), expected):
                tenant = request.headers.get(ACT_AS_HEADER)  # the admin (cluster) token
            else:
                tenant = tenants.tenant(got) if tenants is not None else None
                if tenant is None:
                    raise Unauthorized("missing or wrong bearer token")
                request[BY_TENANT_TOKEN] = True
            request[AUTHENTICATED] = True
        if tenant is None:
            return
        if not NAME_RE.match(tenant):
            raise Unauthorized(f"{ACT_AS_HEADER} must be a tenant name (1-63 of "
                               "A-Za-z0-9_.-)")
        request[TENANT] = tenant
        if guard is not None:
            await guard(request, tenant)

    def answer(err: CorralError, status: int | None = None,
               headers: dict[str, str] | None = None) -> web.Response:
        if on_error is not None:
            on_error(err)
        return json_error(err, status, headers)

    def body_size(request: web.Request) -> int:
        """What the request's JSON body will hold (0: none, or not a JSON route)."""
        if bodies is None or not request.body_exists:
            return 0
        if getattr(request.match_info, "handler", None) not in json_handlers:
            return 0
        n = request.content_length
        return JSON_MAX if n is None else min(n, JSON_MAX)  # chunked: the most it may be

    @web.middleware
    async def handle(request: web.Request, handler: Handler) -> web.StreamResponse:
        held = 0
        try:
            if request.path not in PUBLIC_PATHS:
                await authenticate(request)
            check_not_encoded(request.headers)
            if bodies is not None:
                held = bodies.take(body_size(request))
            return await handler(request)
        except CorralError as e:
            return answer(e)
        except web.HTTPException as e:
            return answer(*_http_error(request, e))
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except OSError as e:
            return answer(oserrors.request_error(e))
        except Exception as e:  # noqa: BLE001 - one bad request must not hurt the others
            log.exception("unhandled error", extra={"method": request.method,
                                                    "path": request.path})
            return answer(InternalError(f"internal error: {type(e).__name__}: {e}"))
        finally:
            if held and bodies is not None:
                bodies.give(held)

    return handle
