"""The TCP listener's guard against clients that hold connections without making requests.

A client that connects and sends nothing, or half a request's headers, holds a socket and an
fd of the daemon, and aiohttp waits for the rest as long as it takes. No token is needed for
that: twenty thousand such connections take every fd the daemon has, so that nobody can
connect any more, over TCP or the local socket, and accept(2)'s EMFILE fills the log.

On the TCP listener (the local socket is root's, not guarded):
- a connection has ``HEADERS_S`` to make a request that reaches the app (one refused, 401,
  leaves it watched);
- a connection is unauthenticated until a request of it passes the token check (the
  admin's or a tenant's token; ``/v1/health`` without one does not); it then counts as
  authenticated. Unauthenticated connections hold at most a quarter of the cap, and those of
  one source (an address, an IPv6 /64) a quarter of that: ``SWEEP_S`` after either is
  passed, the oldest past it are closed, those that have sent nothing first. A client's new
  connection has sent its request by then and is authenticated, so a squatter (no token,
  reconnecting each time one of its connections is closed) holds only what the caps leave
  it, and cannot keep a tenant's new connection out;
- at most ``max_connections`` are open at once: past that, the oldest unauthenticated
  connection is closed (those that have sent nothing first), so that a new one gets in;
  when every other one is authenticated (the tenants, each within its share) the new one is
  closed at once;
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

import array
import asyncio
import collections
import fcntl
import ipaddress
import itertools
import logging
import math
import socket
import termios
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from corral.daemon.app_errors import AUTHENTICATED, BY_TENANT_TOKEN, TENANT, json_error
from corral.errors import QuotaExceeded

log = logging.getLogger("corral.tcp")

HEADERS_S = 10.0
KEEPALIVE_S = 75.0
SEND_TIMEOUT_S = 120.0
DEFAULT_MAX_CONNECTIONS = 4096  # above the SDK's pool (2048 connections an endpoint)
SWEEP_S = 0.2  # after the unauthenticated caps were passed, they are enforced
# A connection this young is closed only when nothing older can be: a client sends its request
# within it, however busy this host is (at 0.2 s, a loaded host's clients lost new
# connections to a squatter's reconnects).
GRACE_S = 1.0


def _unread(transport: asyncio.BaseTransport) -> bool:
    """Bytes in the connection's socket that this process has not read yet."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    buf = array.array("i", [0])
    try:
        fcntl.ioctl(sock.fileno(), termios.FIONREAD, buf)
    except OSError:
        return False
    return buf[0] > 0


def source_of(peer: Any) -> str:
    """Whose a connection is, for the per-source cap: its peer's address, an IPv6 one's /64
    (one host's, as a single address is one IPv4 host's), an IPv4-mapped one as IPv4."""
    host = peer[0] if isinstance(peer, tuple) and peer else str(peer or "")
    try:
        ip = ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class _Waiting:
    """Unauthenticated connections (of one source, or of all), the oldest first, with when
    each opened: those that have sent nothing yet, then those that have sent something."""

    def __init__(self) -> None:
        self.silent: collections.OrderedDict[asyncio.BaseTransport, float] = \
            collections.OrderedDict()
        self.heard: collections.OrderedDict[asyncio.BaseTransport, float] = \
            collections.OrderedDict()

    def __len__(self) -> int:
        return len(self.silent) + len(self.heard)

    def add(self, transport: asyncio.BaseTransport, at: float) -> None:
        self.silent[transport] = at

    def hear(self, transport: asyncio.BaseTransport) -> None:
        if transport in self.silent:
            self.heard[transport] = self.silent.pop(transport)

    def remove(self, transport: asyncio.BaseTransport) -> None:
        self.silent.pop(transport, None)
        self.heard.pop(transport, None)

    def victim(self, spare: asyncio.BaseTransport | None = None,
               before: float = math.inf, silent_only: bool = False
               ) -> asyncio.BaseTransport | None:
        """The one to close first (never ``spare``), opened before ``before``: the oldest
        silent, else (unless ``silent_only``) the oldest that has sent something."""
        for group in (self.silent,) if silent_only else (self.silent, self.heard):
            for t in itertools.islice(group, 2):  # spare is one of them at most
                if t is not spare:
                    if group[t] < before:
                        return t
                    break  # the rest of the group is younger (heard: near enough)
        return None


class TcpGuard:
    """Counts the listener's connections, unauthenticated ones apart, and closes those over
    the caps or too slow to ask."""

    def __init__(self, max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 headers_s: float = HEADERS_S, send_timeout_s: float = SEND_TIMEOUT_S,
                 per_tenant: int | None = None, max_unauthenticated: int | None = None,
                 per_source: int | None = None, sweep_s: float = SWEEP_S,
                 grace_s: float = GRACE_S) -> None:
        self.max_connections = max_connections
        self.per_tenant = max(1, max_connections // 2) if per_tenant is None else per_tenant
        self.max_unauthenticated = (max(1, max_connections // 4)
                                    if max_unauthenticated is None else max_unauthenticated)
        self.per_source = (max(1, self.max_unauthenticated // 4)
                           if per_source is None else per_source)
        self.owner: dict[asyncio.BaseTransport, str] = {}  # connection -> its tenant
        self.held: collections.Counter[str] = collections.Counter()  # tenant -> connections
        self.over_share = 0  # closed: its tenant held its share
        self.headers_s = headers_s
        self.send_timeout_ms = max(1, int(send_timeout_s * 1000))
        self.sweep_s, self.grace_s = sweep_s, grace_s
        self.open = 0
        self.refused = 0   # closed at once: the cap held by authenticated connections
        self.evicted = 0   # unauthenticated, closed to make room for a newer one
        self.idle_closed = 0  # a tenant's idle ones, closed to make room for another's
        self._busy: collections.Counter[asyncio.BaseTransport] = collections.Counter()
        self.too_slow = 0  # closed: no request within headers_s
        self._timers: dict[asyncio.BaseTransport, asyncio.TimerHandle] = {}
        # The unauthenticated: all of them, by source, and each one's source.
        self._unauth = _Waiting()
        self._by_source: dict[str, _Waiting] = {}
        self._source: dict[asyncio.BaseTransport, str] = {}
        self._closing: set[asyncio.BaseTransport] = set()  # closed by the guard, not yet lost
        self._sweep: asyncio.TimerHandle | None = None

    @property
    def unauthenticated(self) -> int:
        return len(self._unauth)

    @property
    def authenticated(self) -> int:
        return self.open - len(self._closing) - len(self._unauth)

    def opened(self, transport: asyncio.BaseTransport) -> None:
        self.open += 1
        source = source_of(transport.get_extra_info("peername"))
        now = time.monotonic()
        self._unauth.add(transport, now)
        self._by_source.setdefault(source, _Waiting()).add(transport, now)
        self._source[transport] = source
        if self.open - len(self._closing) > self.max_connections:
            # Full: an unauthenticated connection makes room, the oldest silent one first
            # (past its grace, if any is); when every other one is authenticated, an idle one
            # of the tenant holding more than its share; else the new one is refused.
            victim = (self._pick(self._unauth, transport, now - self.grace_s)
                      or self._pick(self._unauth, transport))
            if victim is not None:
                self._evict(victim)
            elif (idle := self._idle_of_the_most()) is not None:
                self._close(idle)
            else:
                self.refused += 1
                if self.refused % 1000 == 1:
                    log.warning("TCP connection refused: %d open, the most the daemon takes "
                                "(%d refused so)", self.max_connections, self.refused)
                self._close(transport)
                return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT,
                                self.send_timeout_ms)
            except OSError as e:  # not TCP (a test's unix socket): nothing to bound
                log.debug("TCP_USER_TIMEOUT not set: %s", e)
        loop = asyncio.get_running_loop()
        self._timers[transport] = loop.call_later(self.headers_s, self._late, transport)
        if self._sweep is None and (len(self._unauth) > self.max_unauthenticated
                                    or len(self._by_source[source]) > self.per_source):
            self._sweep = loop.call_later(self.sweep_s, self.sweep)

    def heard(self, transport: asyncio.BaseTransport) -> None:
        """The connection sent something (the guard closes those that sent nothing first)."""
        if (source := self._source.get(transport)) is not None:
            self._unauth.hear(transport)
            self._by_source[source].hear(transport)

    def sweep(self) -> None:
        """Closes silent unauthenticated connections (they sent nothing) past the caps, the
        oldest first: each source's past ``per_source``, then all of them past
        ``max_unauthenticated``. One that has sent something is a client being served (the
        headers timeout bounds it; a busy node's gateway holds hundreds of those): it is
        closed only at the hard cap, to let a new connection in. Run ``sweep_s`` after the
        caps were passed, and never on a connection in its grace."""
        self._sweep = None
        before = time.monotonic() - self.grace_s  # the younger are left to a later sweep
        for waiting in [w for w in self._by_source.values() if len(w) > self.per_source]:
            while len(waiting) > self.per_source and (
                    victim := self._pick(waiting, None, before, silent_only=True)):
                self._evict(victim)
        while len(self._unauth) > self.max_unauthenticated and (
                victim := self._pick(self._unauth, None, before, silent_only=True)):
            self._evict(victim)
        if any(len(w) > self.per_source and w.silent for w in self._by_source.values()) or \
                (len(self._unauth) > self.max_unauthenticated and self._unauth.silent):
            # silent ones still in their grace: closed once past it
            self._sweep = asyncio.get_running_loop().call_later(self.sweep_s, self.sweep)

    def _pick(self, waiting: _Waiting, spare: asyncio.BaseTransport | None,
              before: float = math.inf, silent_only: bool = False
              ) -> asyncio.BaseTransport | None:
        """``waiting``'s victim; a silent one whose bytes wait unread (this loop has not got
        to them yet) has sent something."""
        while (victim := waiting.victim(spare, before, silent_only)) is not None:
            if victim not in waiting.silent or not _unread(victim):
                return victim
            self.heard(victim)
        return None

    def _evict(self, transport: asyncio.BaseTransport) -> None:
        self.evicted += 1
        if self.evicted % 10000 == 1:
            log.warning("unauthenticated TCP connection closed to make room (%d closed so; "
                        "%d unauthenticated open, %d authenticated)", self.evicted,
                        len(self._unauth), self.authenticated)
        self._close(transport)

    def _close(self, transport: asyncio.BaseTransport) -> None:
        self._forget(transport)
        self._closing.add(transport)
        transport.close()

    def _forget(self, transport: asyncio.BaseTransport) -> None:
        """No longer unauthenticated (authenticated, closed or closing)."""
        if timer := self._timers.pop(transport, None):
            timer.cancel()
        source = self._source.pop(transport, None)
        if source is None:
            return
        self._unauth.remove(transport)
        waiting = self._by_source[source]
        waiting.remove(transport)
        if not waiting:
            del self._by_source[source]

    def closed(self, transport: asyncio.BaseTransport) -> None:
        self.open -= 1
        self._forget(transport)
        self._closing.discard(transport)
        tenant = self.owner.pop(transport, None)
        if tenant is not None:
            self.held[tenant] -= 1
            if not self.held[tenant]:
                del self.held[tenant]

    def _idle_of_the_most(self) -> asyncio.BaseTransport | None:
        """Every connection authenticated: the oldest idle one (no request in it, nothing
        unread) of the tenant holding the most, if it holds more than an equal share among
        the tenants and one more. Two tenants within their halves held every connection, and
        a third's new ones were closed at once; an idle kept-alive connection is one a
        client opens again when it needs it."""
        if not self.held:
            return None
        tenant, n = max(self.held.items(), key=lambda kv: kv[1])
        if n <= self.max_connections / (len(self.held) + 1):
            return None
        for t, owner in self.owner.items():  # the oldest first
            if owner == tenant and not self._busy.get(t) and t not in self._closing \
                    and not _unread(t):
                self.idle_closed += 1
                return t
        return None

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
        """A request of this connection reached the app: it is a client, not a squatter (no
        longer closed for taking too long to ask; a request without a token, to a public
        path, leaves it unauthenticated)."""
        if transport is not None and (timer := self._timers.pop(transport, None)):
            timer.cancel()

    def authenticate(self, transport: asyncio.BaseTransport | None) -> None:
        """A request of this connection passed the token check: it counts as authenticated."""
        if transport is not None:
            self._forget(transport)

    def _late(self, transport: asyncio.BaseTransport) -> None:
        if self._timers.pop(transport, None) is not None:
            self.too_slow += 1
            self._close(transport)

    def middleware(self) -> Callable[..., Awaitable[web.StreamResponse]]:
        @web.middleware
        async def mark(request: web.Request,
                       handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                       ) -> web.StreamResponse:
            self.started(request.transport)
            if request.get(AUTHENTICATED):
                self.authenticate(request.transport)
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
            t = request.transport
            if t is None:
                return await handler(request)
            self._busy[t] += 1  # not idle: never closed to make room while it is asked
            try:
                return await handler(request)
            finally:
                self._busy[t] -= 1
                if not self._busy[t]:
                    del self._busy[t]
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

            def data_received(self, data: bytes) -> None:
                guard.heard(self.guarded)
                super().data_received(data)

            def connection_lost(self, exc: BaseException | None) -> None:
                guard.closed(self.guarded)
                super().connection_lost(exc)

        loop = asyncio.get_running_loop()
        return lambda: Guarded(server, loop=loop, keepalive_timeout=KEEPALIVE_S, **handler_args)
