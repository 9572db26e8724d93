"""The TCP listener's guard against clients that hold connections without making requests.

A client that connects and sends nothing, or half a request's headers, holds a socket and an
fd of the daemon, and aiohttp waits for the rest as long as it takes. No token is needed for
that: twenty thousand such connections take every fd the daemon has, so that nobody can
connect any more, over TCP or the local socket, and accept(2)'s EMFILE fills the log.

On the TCP listener (the local socket is root's, not guarded):
- a connection has ``HEADERS_S`` to make a request that passes the token check (one that
  does marks it, and it is no longer watched; one refused, 401, leaves it watched);
- at most ``max_connections`` are open at once: past that, a new one is closed at once;
- a connection belongs to the tenant of its first request made with that tenant's own token
  (the admin's token acting for a tenant, the cluster gateway's, counts for nobody), and a
  tenant holds at most ``per_tenant`` of them: its request on one more is answered
  ``quota_exceeded`` (``details.resource: connections``) and that connection closed, so one
  tenant's client (a leak, a pool far too big) cannot take the listener from the others;
- a kept-alive connection idle for ``KEEPALIVE_S`` is closed (aiohttp's default is an hour);
- a connection whose peer takes none of what the daemon sends for ``SEND_TIMEOUT_S`` (its
  receive window shut: a client that asked for results and stopped reading them) is dropped
  by the kernel (``TCP_USER_TIMEOUT``, zero-window probes included): the daemon would
  otherwise hold each answer it cannot send, up to a command's whole output, for as long as
  the connection stays open.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from corral.daemon.app_errors import BY_TENANT_TOKEN, TENANT, json_error
from corral.errors import QuotaExceeded

log = logging.getLogger("corral.tcp")

HEADERS_S = 10.0
KEEPALIVE_S = 75.0
SEND_TIMEOUT_S = 120.0
DEFAULT_MAX_CONNECTIONS = 4096  # above the SDK's pool (2048 connections an endpoint)


class TcpGuard:
    """Counts the listener's connections and closes those over the cap or too slow to ask."""

    def __init__(self, max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 headers_s: float = HEADERS_S, send_timeout_s: float = SEND_TIMEOUT_S,
                 per_tenant: int | None = None) -> None:
        self.max_connections = max_connections
        self.per_tenant = max(1, max_connections // 2) if per_tenant is None else per_tenant
        self.owner: dict[asyncio.BaseTransport, str] = {}  # connection -> its tenant
        self.held: collections.Counter[str] = collections.Counter()  # tenant -> connections
        self.over_share = 0  # closed: its tenant held its share
        self.headers_s = headers_s
        self.send_timeout_ms = max(1, int(send_timeout_s * 1000))
        self.open = 0
        self.refused = 0   # closed at once: over the cap
        self.too_slow = 0  # closed: no request within headers_s
        self._waiting: dict[asyncio.BaseTransport, asyncio.TimerHandle] = {}

    def opened(self, transport: asyncio.BaseTransport) -> None:
        self.open += 1
        if self.open > self.max_connections:
            self.refused += 1
            log.warning("TCP connection refused: %d open, the most the daemon takes",
                        self.max_connections)
            transport.close()
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT,
                                self.send_timeout_ms)
            except OSError as e:  # not TCP (a test's unix socket): nothing to bound
                log.debug("TCP_USER_TIMEOUT not set: %s", e)
        loop = asyncio.get_running_loop()
        self._waiting[transport] = loop.call_later(self.headers_s, self._late, transport)

    def closed(self, transport: asyncio.BaseTransport) -> None:
        self.open -= 1
        self.started(transport)
        tenant = self.owner.pop(transport, None)
        if tenant is not None:
            self.held[tenant] -= 1
            if not self.held[tenant]:
                del self.held[tenant]

    def claim(self, transport: asyncio.BaseTransport | None, tenant: str) -> bool:
        """The connection's first tenant request: count it against ``tenant``'s share. False:
        the tenant holds its share already (the caller refuses the request and closes)."""
        if transport is None or transport in self.owner:
            return True
        if self.held[tenant] >= self.per_tenant:
            self.over_share += 1
            return False
        self.owner[transport] = tenant
        self.held[tenant] += 1
        return True

    def started(self, transport: asyncio.BaseTransport | None) -> None:
        """A request of this connection reached the app: it is a client, not a squatter."""
        if transport is not None and (timer := self._waiting.pop(transport, None)):
            timer.cancel()

    def _late(self, transport: asyncio.BaseTransport) -> None:
        if self._waiting.pop(transport, None) is not None:
            self.too_slow += 1
            transport.close()

    def middleware(self) -> Callable[..., Awaitable[web.StreamResponse]]:
        @web.middleware
        async def mark(request: web.Request,
                       handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                       ) -> web.StreamResponse:
            self.started(request.transport)
            tenant = request.get(TENANT) if request.get(BY_TENANT_TOKEN) else None
            if tenant is not None and not self.claim(request.transport, tenant):
                if self.over_share % 1000 == 1:  # the first, then every 1,000th: a leaking
                    log.warning(  # client makes them as fast as it can
                        "TCP connection of tenant %s closed: it holds %d, its share (%d "
                        "closed so)", tenant, self.per_tenant, self.over_share)
                resp = json_error(QuotaExceeded(
                    f"this tenant holds {self.per_tenant} connections to the daemon, the "
                    "most one tenant may: reuse them (a smaller connection pool)",
                    details={"resource": "connections", "max": self.per_tenant}))
                resp.force_close()
                return resp
            return await handler(request)
        return mark

    def protocol_factory(self, server: web.Server,
                         **handler_args: Any) -> Callable[[], RequestHandler]:
        """What ``loop.create_server`` takes: aiohttp's handler of ``server``, counted."""
        guard = self

        class Guarded(RequestHandler):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                super().connection_made(transport)
                self.guarded = transport
                guard.opened(transport)

            def connection_lost(self, exc: BaseException | None) -> None:
                guard.closed(self.guarded)
                super().connection_lost(exc)

        loop = asyncio.get_running_loop()
        return lambda: Guarded(server, loop=loop, keepalive_timeout=KEEPALIVE_S, **handler_args)
