"""HTTP/1.1 over the local daemon's unix socket, for the SDK's plain calls.

Every call that is not a stream (create, exec, kill, run_code, ...) to a unix-socket endpoint
goes through here: the async SDK's through ``UnixHTTP``, the blocking SDK's through
``request_head`` and ``read_answer`` on its own pooled sockets. Streams and TCP endpoints go
through aiohttp and http.client (corral.sdk.async_transport, corral.sdk.sync_transport).
Why: per call, aiohttp's client spends ~0.3 ms of CPU in Python (its request and response
objects, timers, cookie jar, connector), which on a 2-core machine is a tenth of a run_code
call and of a sandbox's create -> exec -> destroy. Here a call is one write of the request's
bytes and llhttp (httptools, C) parsing the answer into a future: ~0.1 ms, measured against
the same daemon in docs/sdk.md.

A connection is an ``asyncio.Protocol`` carrying one request at a time, kept for the next
call while the daemon keeps it open (keep-alive). Nothing is retried here: a failure raises
``ConnectError`` (no connection: the request was not sent) or ``ConnectionLost`` (sent, no
complete answer), and the caller decides (async_transport: autostart, retry_safe, errors).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import deque
from typing import Any

import httptools

IDLE_KEEP_S = 30.0       # an idle connection older than this is closed, not reused
MAX_IDLE = 64            # idle connections kept per pool; more are closed when freed
READ_CHUNK = 256 * 1024  # bytes per read of a blocking exchange


class ConnectError(OSError):
    """No connection to the socket: the request was not sent."""


class ConnectionLost(OSError):
    """The connection ended (or broke) before the whole answer came."""


class ReadTimeout(TimeoutError):
    """No byte of the answer for the read timeout."""


def request_head(method: str, target: str, host: str, headers: dict[str, str],
                 body: bytes | None) -> bytes:
    """The request line and headers, ready to send before ``body``."""
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}"]
    if body is not None or method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(body) if body else 0}")
    for k, v in headers.items():
        if "\r" in k or "\n" in k or "\r" in v or "\n" in v:
            raise ValueError(f"a header with a line break: {k!r}")
        lines.append(f"{k}: {v}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class _Answer:
    """httptools callbacks of one blocking exchange (``read_answer``). The status and
    keep-alive are read at completion: the parser resets for the next message after it."""

    def __init__(self) -> None:
        self.parser: Any = None
        self.body: list[bytes] = []
        self.done = False
        self.status = 0
        self.keep = False

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.done = True
        self.status = self.parser.get_status_code()
        self.keep = self.parser.should_keep_alive()


def read_answer(sock: socket.socket) -> tuple[int, bytes, bool]:
    """Read one answer from a blocking socket (its own timeout applies to each read):
    (status, body, whether the connection may be used again). Raises ConnectionLost if it
    ends first or is not HTTP; the socket's TimeoutError as is."""
    ans = _Answer()
    parser = ans.parser = httptools.HttpResponseParser(ans)
    while not ans.done:
        data = sock.recv(READ_CHUNK)
        if not data:
            raise ConnectionLost("the daemon closed the connection before its answer")
        try:
            parser.feed_data(data)
        except httptools.HttpParserError as e:
            raise ConnectionLost(f"a malformed answer: {e}") from None
    return ans.status, b"".join(ans.body), ans.keep


class _Conn(asyncio.Protocol):
    """One connection; one request in flight at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.body: list[bytes] = []
        self.closed = False
        self.reusable = False
        self.last_data = 0.0
        self.idle_since = 0.0

    # -- asyncio.Protocol --
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.last_data = time.monotonic()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(ConnectionLost(f"a malformed answer: {e}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(ConnectionLost(str(exc) if exc else "the daemon closed the connection"))

    # -- httptools callbacks --
    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        # Not when part of the request is still unsent (an early answer, say 413): the
        # daemon would read the rest as the next request.
        self.reusable = (self.parser.should_keep_alive() and self.transport is not None
                         and self.transport.get_write_buffer_size() == 0)
        waiter, self.waiter = self.waiter, None
        body, self.body = b"".join(self.body), []
        if waiter is not None and not waiter.done():
            waiter.set_result((self.parser.get_status_code(), body))

    # --
    def _fail(self, exc: BaseException) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    async def request(self, head: bytes, body: bytes | None,
                      timeout: float | None) -> tuple[int, bytes]:
        assert self.transport is not None and self.waiter is None
        loop = asyncio.get_running_loop()
        self.waiter = waiter = loop.create_future()
        self.reusable = False
        self.body = []
        self.transport.write(head + body if body else head)
        if timeout is None:
            return await waiter
        # A read timeout: ``timeout`` seconds without a byte (aiohttp's sock_read). One timer,
        # moved forward only when it fires and data came meanwhile.
        self.last_data = start = time.monotonic()
        timer: asyncio.TimerHandle | None = None

        def check() -> None:
            nonlocal timer
            if waiter.done():
                return
            left = max(self.last_data, start) + timeout - time.monotonic()
            if left > 0:
                timer = loop.call_later(left, check)
            else:
                waiter.set_exception(ReadTimeout(f"no answer within {timeout} s"))

        timer = loop.call_later(timeout, check)
        try:
            return await waiter
        finally:
            timer.cancel()


class UnixHTTP:
    """Connections to one unix socket, reused across calls of one event loop."""

    def __init__(self, path: str, host: str, max_connections: int,
                 connect_timeout: float) -> None:
        self.path = path
        self.host = host
        self.connect_timeout = connect_timeout
        self._idle: deque[_Conn] = deque()
        self._slots = asyncio.Semaphore(max_connections)
        self._all: set[_Conn] = set()

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(loop.create_unix_connection(_Conn, self.path),
                                             self.connect_timeout)
        except asyncio.TimeoutError as e:
            raise ConnectError(f"connect to {self.path} timed out") from e
        except OSError as e:
            raise ConnectError(f"cannot connect to {self.path}: {e.strerror or e}") from e
        self._all.add(conn)
        return conn

    def _take_idle(self) -> _Conn | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()  # the most recent: the least likely to be closed
            if not conn.closed and now - conn.idle_since < IDLE_KEEP_S:
                return conn
            self._drop(conn)
        return None

    def _drop(self, conn: _Conn) -> None:
        conn.close()
        self._all.discard(conn)

    def _give_back(self, conn: _Conn) -> None:
        if conn.closed or not conn.reusable or len(self._idle) >= MAX_IDLE:
            self._drop(conn)
            return
        conn.idle_since = time.monotonic()
        self._idle.append(conn)

    async def request(self, method: str, target: str, headers: dict[str, str],
                      body: bytes | None, timeout: float | None) -> tuple[int, bytes]:
        """(status, body). Raises ConnectError, ConnectionLost or ReadTimeout."""
        head = request_head(method, target, self.host, headers, body)
        async with self._slots:
            conn = self._take_idle() or await self._connect()
            ok = False
            try:
                status, data = await conn.request(head, body, timeout)
                ok = True
                return status, data
            finally:
                # A call that failed or was cancelled may leave bytes of its answer on the
                # way: its connection is never used again.
                if ok:
                    self._give_back(conn)
                else:
                    self._drop(conn)

    async def aclose(self) -> None:
        for conn in list(self._all):
            self._drop(conn)
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports' close callbacks run


def open_pool(path: str, max_connections: int, connect_timeout: float) -> UnixHTTP:
    return UnixHTTP(path, "corral", max_connections, connect_timeout)


__all__ = ["ConnectError", "ConnectionLost", "ReadTimeout", "UnixHTTP", "open_pool",
           "read_answer", "request_head"]
