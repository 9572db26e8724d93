"""Blocking transport: stdlib ``http.client`` keep-alive connections to the unix socket or an
http(s) URL, a small thread-safe pool of them per endpoint. A plain call (not a stream) to the
unix socket writes its request and parses the answer itself (corral.sdk.unix_http) on the
same pooled connections: http.client's header parsing is a third of its cost.

Why http.client and not httpx: client CPU per ``exec`` (measured on a 2-core machine) is
~400 us with httpx.Client and about half that with http.client (a third of which is parsing the
response headers with the email package), pydantic included.

Maps socket failures to corral errors: nothing answering -> DaemonUnavailable (after starting
the embedded default, see corral.sdk.autostart); the connection dropping mid-call ->
DaemonRestarted (the outcome is unknown, so only calls marked ``retry_safe`` are sent again); no
answer in time -> Timeout.
One pool per endpoint per process; a forked child builds its own instead of sharing the
parent's sockets.
"""

from __future__ import annotations

import errno
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from http.client import (
    HTTPConnection,
    HTTPException,
    HTTPResponse,
    HTTPSConnection,
    IncompleteRead,
)
from typing import Any, TypeVar
from urllib.parse import urlsplit

from corral.errors import InternalError, Timeout
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
R = TypeVar("R")

READ = 256 * 1024    # bytes per read of a streamed response
MAX_IDLE = 64        # idle connections kept per endpoint
IDLE_EXPIRY = 30.0   # seconds; an older idle connection is closed rather than reused


class UnixConnection(HTTPConnection):
    """http.client over the daemon's unix socket."""

    def __init__(self, path: str) -> None:
        super().__init__("corral", timeout=CONNECT_TIMEOUT)
        self.path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self.path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


class SyncTransport:
    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        u = urlsplit(endpoint.base_url)
        self._headers = {"Host": u.netloc}
        self._auth: str | None = None
        self._tls = ssl.create_default_context() if u.scheme == "https" else None
        self._host = u.hostname or "localhost"
        self._port = u.port or (443 if self._tls else 80)
        self._connect_timeout = (NODE_CONNECT_TIMEOUT if endpoint.node is not None
                                 else CONNECT_TIMEOUT)
        self._idle: list[tuple[float, HTTPConnection]] = []
        self._lock = threading.Lock()

    # ---- connections ---------------------------------------------------------------------
    def _new(self) -> HTTPConnection:
        """A connected HTTPConnection (raises OSError if nothing answers)."""
        conn: HTTPConnection
        if self.endpoint.unix_path is not None:
            conn = UnixConnection(self.endpoint.unix_path)
        elif self._tls is not None:
            conn = HTTPSConnection(self._host, self._port, timeout=self._connect_timeout,
                                   context=self._tls)
        else:
            conn = HTTPConnection(self._host, self._port, timeout=self._connect_timeout)
        conn.auto_open = 0  # never reconnect behind our back: a dead daemon must be noticed
        try:
            conn.connect()
            if self.endpoint.unix_path is None:
                # http.client sends a request's headers and its body in two writes: without
                # this the body may wait for the peer to acknowledge the headers (Nagle).
                conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.endpoint.node is not None:
                probe(conn.sock)
        except BaseException:
            conn.close()
            raise
        return conn

    def _connect(self) -> HTTPConnection:
        try:
            conn = self._new()
        except OSError as e:
            if not autostart.try_start(self.endpoint):
                raise unavailable(self.endpoint, e) from None
            try:
                conn = self._new()
            except OSError as e2:
                raise unavailable(self.endpoint, e2) from None
        autostart.connected(self.endpoint)
        return conn

    def _acquire(self) -> HTTPConnection | None:
        """An idle connection the daemon has not closed, most recent first; or None."""
        now = time.monotonic()
        while True:
            with self._lock:
                if not self._idle:
                    return None
                since, conn = self._idle.pop()
            if now - since < IDLE_EXPIRY and not _stale(conn):
                return conn
            conn.close()

    def _release(self, conn: HTTPConnection) -> None:
        """Pool a connection whose response was read to the end."""
        if conn.sock is not None:  # None: the response said the connection closes
            with self._lock:
                if len(self._idle) < MAX_IDLE:
                    self._idle.append((time.monotonic(), conn))
                    return
        conn.close()

    # ---- calls ---------------------------------------------------------------------------
    def _start(self, call: Call[Any]) -> tuple[HTTPConnection, HTTPResponse]:
        """Send the request and read the response head."""
        auth = self.endpoint.auth_header()  # looked up per call: connect(token=) may switch it
        if auth != self._auth:
            self._auth = auth
            self._headers = {k: v for k, v in self._headers.items() if k != "Authorization"}
            if auth:
                self._headers["Authorization"] = auth
        headers = {**self._headers, **_call_headers(call)}

        def attempt(conn: HTTPConnection, sent: list[bool]) -> HTTPResponse:
            conn.request(call.method, call.target(), call.body, headers)
            sent[0] = True
            return conn.getresponse()

        return self._exchange(call, attempt)

    def _exchange(self, call: Call[Any],
                  attempt: Callable[[HTTPConnection, list[bool]], R]) -> tuple[HTTPConnection, R]:
        """``attempt(conn, sent)`` (it sets ``sent[0]`` once the request is written) on a
        pooled or new connection, with the transport's rules: an idle connection the daemon
        closed before the request left is replaced; a retry-safe call goes out once more on a
        dropped connection; else the outcome is unknown (DaemonRestarted)."""
        retried = False
        while True:
            conn = self._acquire()
            reused = conn is not None
            if conn is None:
                conn = self._connect()
            sent = [False]
            try:
                conn.sock.settimeout(call.timeout)
                return conn, attempt(conn, sent)
            except BaseException as e:
                conn.close()
                if isinstance(e, TimeoutError) and e.errno is None:  # our read timeout
                    raise Timeout(f"corrald did not answer {call.method} {call.path} within "
                                  f"{call.timeout} s") from None
                if isinstance(e, OSError):
                    if reused and not sent[0]:
                        continue  # an idle connection the daemon closed: the request never left
                    if call.retry_safe and not retried and e.errno != errno.ETIMEDOUT:
                        retried = True  # (ETIMEDOUT: the peer stopped answering probes: gone)
                        continue
                    raise lost(self.endpoint, call, e) from None
                if isinstance(e, (HTTPException, ValueError)):
                    raise InternalError(f"bad HTTP response from {self.endpoint}: {e!r}") \
                        from None
                raise

    def _fail(self, call: Call[Any], e: BaseException) -> BaseException:
        if isinstance(e, TimeoutError) and e.errno is None:  # ours, not the peer's ETIMEDOUT
            return Timeout(f"corrald did not finish answering {call.method} {call.path} "
                           f"within {call.timeout} s")
        if isinstance(e, IncompleteRead):  # the connection closed mid-body
            return lost(self.endpoint, call, ConnectionResetError(
                f"the daemon closed the connection mid-response ({e!r})"))
        if isinstance(e, (HTTPException, ValueError)):
            return InternalError(f"bad HTTP response from {self.endpoint}: {e!r}")
        return lost(self.endpoint, call, e)

    def _call_unix(self, call: Call[T]) -> T:
        """``call`` on a pooled unix-socket connection, bypassing http.client: the request's
        bytes written at once and the answer parsed by httptools (corral.sdk.unix_http), with
        ``_exchange``'s rules for failures."""
        head = unix_http.request_head(call.method, call.target(), "corral", _call_headers(call),
                                      call.body)
        data = head + call.body if call.body else head

        def attempt(conn: HTTPConnection, sent: list[bool]) -> tuple[int, bytes, bool]:
            conn.sock.sendall(data)
            sent[0] = True
            return unix_http.read_answer(conn.sock)

        conn, (status, body, keep) = self._exchange(call, attempt)
        if keep:
            self._release(conn)
        else:
            conn.close()
        return call.finish(status, body)

    def call(self, call: Call[T]) -> T:
        if self.endpoint.unix_path is not None and call.method != "HEAD":
            return self._call_unix(call)
        conn, resp = self._start(call)
        try:
            body = resp.read()
        except (OSError, HTTPException, ValueError) as e:
            conn.close()
            raise self._fail(call, e) from None
        except BaseException:
            conn.close()
            raise
        self._release(conn)
        return call.finish(resp.status, body)

    def lines(self, call: Call[Any]) -> Iterator[bytes]:
        """The response body as lines (NDJSON streams); an error status raises as usual."""
        conn, resp = self._start(call)
        done = False
        try:
            if resp.status >= 400:
                body = resp.read()
                done = True
                call.finish(resp.status, body)
            buf = b""
            while chunk := resp.read1(READ):  # http.client undoes the chunked encoding
                buf += chunk
                *complete, buf = buf.split(b"\n")
                yield from (line for line in complete if line)
            done = True
            if buf:
                yield buf
        except (OSError, HTTPException, ValueError) as e:
            done = False
            raise self._fail(call, e) from None
        finally:
            # A stream abandoned half-way has unread data on the socket: don't reuse it.
            if done:
                self._release(conn)
            else:
                conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for _, c in idle:
            c.close()


def _call_headers(call: Call[Any]) -> dict[str, str]:
    """The headers a call adds: its body's type, its idempotency key (docs/trajectory.md),
    its own."""
    headers = {"Content-Type": call.content_type} if call.body is not None else {}
    if call.key is not None:
        headers["Idempotency-Key"] = call.key
    if call.headers:
        headers.update(call.headers)
    return headers


def _stale(conn: HTTPConnection) -> bool:
    """An idle keep-alive connection the daemon closed (or wrote to) is unusable."""
    try:
        p = select.poll()
        p.register(conn.sock, select.POLLIN)
        return bool(p.poll(0))
    except (OSError, ValueError, TypeError):
        return True


_lock = threading.Lock()
_pid = os.getpid()
_transports: dict[Endpoint, SyncTransport] = {}


def transport(endpoint: Endpoint) -> SyncTransport:
    global _pid
    t = _transports.get(endpoint)
    if t is not None and _pid == os.getpid():
        return t
    with _lock:
        if _pid != os.getpid():  # forked: the parent's pooled sockets are not ours
            _transports.clear()
            _pid = os.getpid()
        t = _transports.get(endpoint)
        if t is None:
            t = _transports[endpoint] = SyncTransport(endpoint)
        return t
