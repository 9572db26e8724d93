"""The local proxy of ``corral dashboard`` when corrald listens on its unix socket only.

A browser cannot speak HTTP over a unix socket, so the proxy listens on 127.0.0.1 (a free port)
and forwards to the socket. The socket is root-only; the port is open to every local user, so
the proxy must not hand that access out: it makes a random token for its own lifetime and
forwards a request only if it carries ``Authorization: Bearer <that token>`` (the page sends
it from the URL fragment, like the daemon's own token on TCP), except the two static files.
It forwards only GETs of the paths the dashboard reads: a read-only view, never a way to
create, exec or kill.
"""

from __future__ import annotations

import hmac
import re
import secrets
import socket
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web
from yarl import URL

STATIC = frozenset({"/dashboard", "/dashboard/app.js"})
# What the page reads: the summary, one sandbox and its log, and /metrics. Matched on the
# decoded path, which is what is forwarded (re-encoded whole): an id is plain characters
# only, so no escape (%2F) or dot segment can reach another route of the daemon.
READABLE = re.compile(r"^/(v1/dashboard|metrics|v1/sandboxes/[A-Za-z0-9_-]{1,200}(/log)?)$")
_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length",
                  "content-encoding"})


def _denied(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message, "details": {},
                                        "category": "task", "infra": False}}, status=status)


def make_app(socket_path: str, token: str) -> web.Application:
    expected = token.encode()
    session: dict[str, aiohttp.ClientSession] = {}

    async def forward(request: web.Request) -> web.StreamResponse:
        path = request.path
        if request.method != "GET" or not (path in STATIC or READABLE.match(path)):
            return _denied(403, "forbidden", "the dashboard proxy only reads the dashboard")
        if path not in STATIC:
            scheme, _, got = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(got.strip().encode(),
                                                                     expected):
                return _denied(401, "unauthorized", "missing or wrong bearer token")
        if "s" not in session:
            session["s"] = aiohttp.ClientSession(connector=aiohttp.UnixConnector(socket_path))
        url = URL.build(scheme="http", host="corral", path=path, query=request.query)
        async with session["s"].get(url) as r:
            # streamed as it comes: a sandbox's log can be big, the proxy holds one chunk
            headers = {k: v for k, v in r.headers.items() if k.lower() not in _HOP}
            out = web.StreamResponse(status=r.status, headers=headers)
            await out.prepare(request)
            async for chunk in r.content.iter_chunked(1 << 16):
                await out.write(chunk)
            await out.write_eof()
            return out

    async def close(app: web.Application) -> None:
        if "s" in session:
            await session["s"].close()

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", forward)
    app.on_cleanup.append(close)
    return app


def serve(socket_path: str, port: int,
          ready: Callable[[str], Awaitable[None] | None] | None = None) -> None:
    """Run the proxy on 127.0.0.1:``port`` (0: a free one) until interrupted; ``ready`` gets
    the dashboard's URL (with the session token in its fragment) once it listens."""
    import asyncio

    token = secrets.token_urlsafe(24)

    async def main() -> None:
        runner = web.AppRunner(make_app(socket_path, token))
        await runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        await web.SockSite(runner, sock).start()
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/dashboard#token={token}"
        if ready is not None:
            res = ready(url)
            if res is not None:
                await res
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
