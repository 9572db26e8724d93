"""Asyncio transport: plain calls to a unix socket through corral.sdk.unix_http (httptools),
the rest (streams, TCP endpoints) through aiohttp (a dependency already: the daemon is an
aiohttp app).

Why not httpx.AsyncClient: measured on this machine against a trivial aiohttp server on a unix
socket, 1,000 concurrent requests in one loop took ~17 ms each with httpx/httpcore (its pool
rescans every waiting request on each change) and ~0.2 ms each with aiohttp. The Call layer
(corral.sdk.call) is shared, so only the byte moving differs from the sync transport.

One session per (event loop, endpoint): aiohttp connections belong to the loop that opened
them. The session is closed when ``asyncio.run`` shuts the loop down (see ``_closer``).
"""

from __future__ import annotations

import asyncio
import errno
import os
import resource
import socket
import weakref
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar, cast

import aiohttp
from yarl import URL

from corral.errors import Timeout
from corral.sdk import autostart, unix_http
from corral.sdk.call import (
    CONNECT_TIMEOUT,
    NODE_CONNECT_TIMEOUT,
    Call,
    lost,
    unavailable,
)
from corral.sdk.endpoint import Endpoint
from corral.sdk.keepalive import probe

T = TypeVar("T")

# Up to this many requests in flight per loop and endpoint; more wait for a free connection.
# Large on purpose: a foreground exec holds its connection for as long as the command runs.
MAX_CONNECTIONS = int(os.environ.get("CORRAL_MAX_CONNECTIONS", "2048"))


def _node_socket(addr_info: Any) -> socket.socket:
    """A socket to a cluster node, with keepalive probes (corral.sdk.keepalive)."""
    family, kind, proto, _, _ = addr_info
    sock = socket.socket(family=family, type=kind, proto=proto)
    probe(sock)
    return sock


class AsyncTransport:
    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.base = endpoint.base_url
        _raise_fd_limit(2 * MAX_CONNECTIONS + 256)
        if endpoint.unix_path:
            conn: aiohttp.BaseConnector = aiohttp.UnixConnector(
                path=endpoint.unix_path, limit=MAX_CONNECTIONS, keepalive_timeout=30)
        elif endpoint.node is not None:  # a cluster node: probed while a call waits
            conn = aiohttp.TCPConnector(limit=MAX_CONNECTIONS, keepalive_timeout=30,
                                        socket_factory=_node_socket)
        else:
            conn = aiohttp.TCPConnector(limit=MAX_CONNECTIONS, keepalive_timeout=30)
        self._session = aiohttp.ClientSession(
            connector=conn, skip_auto_headers=("User-Agent",),
            auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None))
        if endpoint.node is not None and hasattr(self._session, "_retry_connection"):
            # aiohttp sends an idempotent request again on a new connection when its
            # connection fails; to a node that vanished that is one more connect timeout
            # before sandbox_lost. Whether to retry is this transport's (_send) to decide.
            self._session._retry_connection = False
        # Plain calls to the local daemon skip aiohttp (corral.sdk.unix_http says why).
        self._unix = (unix_http.open_pool(endpoint.unix_path, MAX_CONNECTIONS, CONNECT_TIMEOUT)
                      if endpoint.unix_path else None)
        self._timeouts: dict[float | None, aiohttp.ClientTimeout] = {}
        self._start_lock = asyncio.Lock()
        self._seen = False

    def _timeout(self, read: float | None) -> aiohttp.ClientTimeout:
        t = self._timeouts.get(read)
        if t is None:
            connect = NODE_CONNECT_TIMEOUT if self.endpoint.node is not None else CONNECT_TIMEOUT
            t = self._timeouts[read] = aiohttp.ClientTimeout(
                total=None, sock_connect=connect, sock_read=read)
        return t

    def _headers(self, call: Call[Any]) -> dict[str, str]:
        headers = {"Content-Type": call.content_type} if call.body is not None else {}
        if call.key is not None:
            headers["Idempotency-Key"] = call.key
        if call.headers:
            headers.update(call.headers)
        if auth := self.endpoint.auth_header():  # per call: connect(token=) may switch it
            headers["Authorization"] = auth
        return headers

    def _connected(self) -> None:
        if not self._seen:
            self._seen = True
            autostart.connected(self.endpoint)

    async def _send(self, call: Call[Any]) -> aiohttp.ClientResponse:
        url = URL(self.base + call.target(), encoded=True)
        headers = self._headers(call) or None
        retried = started = False
        while True:
            try:
                resp = await self._session.request(
                    call.method, url, data=call.body, headers=headers,
                    timeout=self._timeout(call.timeout), allow_redirects=False)
                self._connected()
                return resp
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
                if not started and await self._autostart():
                    started = True
                    continue
                raise unavailable(self.endpoint, e) from None
            except asyncio.TimeoutError as e:  # includes aiohttp.SocketTimeoutError
                raise Timeout(f"corrald did not answer {call.method} {call.path} within "
                              f"{call.timeout} s") from e
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
                    aiohttp.ClientPayloadError) as e:
                # ETIMEDOUT: the peer stopped answering keepalive probes: gone, not restarted.
                if call.retry_safe and not retried and getattr(e, "errno", None) != errno.ETIMEDOUT:
                    retried = True
                    continue
                raise lost(self.endpoint, call, e) from None
            except aiohttp.ClientError as e:
                raise unavailable(self.endpoint, e) from None

    async def _autostart(self) -> bool:
        if not autostart.enabled(self.endpoint):
            return False
        async with self._start_lock:  # one thread for the whole loop, not one per task
            return await asyncio.to_thread(autostart.try_start, self.endpoint)

    async def _call_unix(self, pool: unix_http.UnixHTTP, call: Call[T]) -> T:
        """``call`` through the unix-socket pool, with ``_send``'s rules: autostart on a
        failed connect, one more try of a retry-safe call on a dropped connection."""
        headers = self._headers(call)
        retried = started = False
        while True:
            try:
                status, body = await pool.request(call.method, call.target(), headers,
                                                  call.body, call.timeout)
            except unix_http.ConnectError as e:
                if not started and await self._autostart():
                    started = True
                    continue
                raise unavailable(self.endpoint, e) from None
            except unix_http.ReadTimeout as e:
                raise Timeout(f"corrald did not answer {call.method} {call.path} within "
                              f"{call.timeout} s") from e
            except unix_http.ConnectionLost as e:
                if call.retry_safe and not retried:
                    retried = True
                    continue
                raise lost(self.endpoint, call, e) from None
            self._connected()
            return call.finish(status, body)

    async def call(self, call: Call[T]) -> T:
        if self._unix is not None and call.method != "HEAD":  # an answer to HEAD has no body
            return await self._call_unix(self._unix, call)
        resp = await self._send(call)
        try:
            body = await resp.read()
        except asyncio.TimeoutError:
            raise Timeout(f"corrald did not finish answering {call.method} {call.path}") \
                from None
        except aiohttp.ClientError as e:
            raise lost(self.endpoint, call, e) from None
        finally:
            resp.release()
        return call.finish(resp.status, body)

    async def lines(self, call: Call[Any]) -> AsyncIterator[bytes]:
        resp = await self._send(call)
        try:
            if resp.status >= 400:
                call.finish(resp.status, await resp.read())
            buf = b""
            # iter_any, not readline: the first chunk holds all buffered output, which can
            # be far longer than aiohttp's line limit.
            async for chunk in resp.content.iter_any():
                buf += chunk
                *done, buf = buf.split(b"\n")
                for line in done:
                    if line:
                        yield line
            if buf:
                yield buf
        except aiohttp.ClientError as e:
            raise lost(self.endpoint, call, e) from None
        finally:
            resp.release()

    async def chunks(self, call: Call[Any]) -> AsyncIterator[bytes]:
        """The answer's body as it comes (a big file read, passed on without holding it
        whole); an error answer raises before the first chunk."""
        resp = await self._send(call)
        try:
            if resp.status >= 400:
                call.finish(resp.status, await resp.read())
            async for chunk in resp.content.iter_any():
                yield chunk
        except aiohttp.ClientError as e:
            raise lost(self.endpoint, call, e) from None
        finally:
            resp.release()

    async def aclose(self) -> None:
        if self._unix is not None:
            await self._unix.aclose()
        await self._session.close()


_registry: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Endpoint, AsyncTransport]] \
    = weakref.WeakKeyDictionary()
_closers: dict[int, Any] = {}


def transport(endpoint: Endpoint) -> AsyncTransport:
    loop = asyncio.get_running_loop()
    per_loop = _registry.get(loop)
    if per_loop is None:
        per_loop = _registry[loop] = {}
    t = per_loop.get(endpoint)
    if t is None:
        t = per_loop[endpoint] = AsyncTransport(endpoint)
        _start_closer(loop, t)
    return t


def _start_closer(loop: asyncio.AbstractEventLoop, t: AsyncTransport) -> None:
    """Tie the session's life to the loop's: an async generator suspended at its yield is
    closed by ``loop.shutdown_asyncgens()`` (asyncio.run calls it), running its ``finally``."""
    gen = _closer(loop, t)
    _closers[id(t)] = gen
    try:
        # runs to the yield synchronously (no await before it)
        cast(Coroutine[Any, Any, None], gen.__anext__()).send(None)
    except StopIteration:
        pass


async def _closer(loop: asyncio.AbstractEventLoop, t: AsyncTransport) -> AsyncIterator[None]:
    try:
        yield
    finally:
        _closers.pop(id(t), None)
        per_loop = _registry.get(loop)
        if per_loop is not None and per_loop.get(t.endpoint) is t:
            del per_loop[t.endpoint]
            if not per_loop:
                _registry.pop(loop, None)
        await t.aclose()


async def aclose() -> None:
    """Close this loop's connections to every endpoint (optional: asyncio.run does it)."""
    per_loop = _registry.pop(asyncio.get_running_loop(), {})
    for t in per_loop.values():
        gen = _closers.pop(id(t), None)
        if gen is not None:
            await gen.aclose()
        else:
            await t.aclose()


_fd_limit_done = False


def _raise_fd_limit(want: int) -> None:
    """Many concurrent calls need many sockets: lift the soft fd limit toward the hard one."""
    global _fd_limit_done
    if _fd_limit_done:
        return
    _fd_limit_done = True
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < want:
            new = want if hard == resource.RLIM_INFINITY else min(want, hard)
            if new > soft:
                resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    except (ValueError, OSError):
        pass
