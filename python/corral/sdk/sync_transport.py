"""Blocking transport: corral.sdk.h1 connections to the unix socket or an http(s) URL.

Maps socket failures to corral errors: nothing answering -> DaemonUnavailable (after trying the
embedded default once); the connection dropping mid-call -> DaemonRestarted (the outcome is
unknown, so only calls marked ``retry_safe`` are sent again); no answer in time -> Timeout.
One pool per endpoint per process; a forked child builds its own instead of sharing the
parent's sockets.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any, TypeVar
from urllib.parse import urlsplit

from corral.errors import InternalError, Timeout
from corral.sdk import autostart, h1
from corral.sdk.call import CONNECT_TIMEOUT, Call, lost, unavailable
from corral.sdk.endpoint import Endpoint

T = TypeVar("T")


class SyncTransport:
    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        u = urlsplit(endpoint.base_url)
        if endpoint.unix_path:
            self._pool = h1.Pool(unix_path=endpoint.unix_path, connect_timeout=CONNECT_TIMEOUT)
        else:
            tls = u.scheme == "https"
            self._pool = h1.Pool(host=u.hostname or "localhost",
                                 port=u.port or (443 if tls else 80), tls=tls,
                                 connect_timeout=CONNECT_TIMEOUT)
        extra = f"Authorization: {auth}\r\n" if (auth := endpoint.auth_header()) else ""
        self._head_tail = f" HTTP/1.1\r\nHost: {u.netloc}\r\n{extra}"

    def _head(self, call: Call[Any]) -> bytes:
        if call.body is None:
            return f"{call.method} {call.target()}{self._head_tail}\r\n".encode()
        return (f"{call.method} {call.target()}{self._head_tail}Content-Type: "
                f"{call.content_type}\r\nContent-Length: {len(call.body)}\r\n\r\n").encode()

    def _connect(self) -> h1.Connection:
        try:
            conn = self._pool.connect()
        except OSError as e:
            if not autostart.try_start(self.endpoint):
                raise unavailable(self.endpoint, e) from None
            try:
                conn = self._pool.connect()
            except OSError as e2:
                raise unavailable(self.endpoint, e2) from None
        autostart.connected(self.endpoint)
        return conn

    def _start(self, call: Call[Any]) -> tuple[h1.Connection, h1.Response]:
        """Send the request and read the response head."""
        head = self._head(call)
        retried = False
        while True:
            conn = self._pool.acquire() or self._connect()
            try:
                conn.send_request(head, call.body, call.timeout)
                return conn, conn.read_head(call.timeout)
            except BaseException as e:
                conn.close()
                if isinstance(e, TimeoutError):
                    raise Timeout(f"corrald did not answer {call.method} {call.path} within "
                                  f"{call.timeout} s") from None
                if isinstance(e, OSError):
                    if call.retry_safe and not retried:
                        retried = True
                        continue
                    raise lost(self.endpoint, call, e) from None
                if isinstance(e, (h1.ProtocolError, ValueError)):
                    raise InternalError(f"bad HTTP response from {self.endpoint}: {e}") \
                        from None
                raise

    def _fail(self, call: Call[Any], e: BaseException) -> BaseException:
        if isinstance(e, TimeoutError):
            return Timeout(f"corrald did not finish answering {call.method} {call.path} "
                           f"within {call.timeout} s")
        if isinstance(e, (h1.ProtocolError, ValueError)):
            return InternalError(f"bad HTTP response from {self.endpoint}: {e}")
        return lost(self.endpoint, call, e)

    def call(self, call: Call[T]) -> T:
        conn, resp = self._start(call)
        try:
            body = conn.read_body(resp)
        except (OSError, h1.ProtocolError, ValueError) as e:
            conn.close()
            raise self._fail(call, e) from None
        except BaseException:
            conn.close()
            raise
        if resp.keep_alive:
            self._pool.release(conn)
        else:
            conn.close()
        return call.finish(resp.status, body)

    def lines(self, call: Call[Any]) -> Iterator[bytes]:
        """The response body as lines (NDJSON streams); an error status raises as usual."""
        conn, resp = self._start(call)
        done = False
        try:
            if resp.status >= 400:
                body = conn.read_body(resp)
                done = True
                call.finish(resp.status, body)
            buf = b""
            for chunk in conn.iter_body(resp):
                buf += chunk
                *complete, buf = buf.split(b"\n")
                yield from (line for line in complete if line)
            done = True
            if buf:
                yield buf
        except (OSError, h1.ProtocolError, ValueError) as e:
            done = False
            raise self._fail(call, e) from None
        finally:
            # A stream abandoned half-way has unread data on the socket: don't reuse it.
            if done and resp.keep_alive:
                self._pool.release(conn)
            else:
                conn.close()

    def close(self) -> None:
        self._pool.close()


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
