"""A small HTTP/1.1 client: keep-alive connections over a unix socket or TCP (optionally TLS),
and a thread-safe pool of them. Used by the blocking facade.

Why not httpx / httpcore here (measured on a 2-core machine, client CPU per ``exec``):
httpx.Client ~400 us, httpcore ~280 us (h11's per-event state machine), this ~30 us; and
httpcore sends a request's head and body in two writes, each waking the daemon. corral's sync
exec is on the hot path of every rollout step, so the client must cost next to nothing.

Scope is deliberately narrow: requests with a bytes body (one ``sendall``), responses framed
by Content-Length, chunked encoding or connection close. Anything else is a protocol error.
"""

from __future__ import annotations

import select
import socket
import ssl
import threading
import time
from collections.abc import Iterator

MAX_HEAD = 64 * 1024
RECV = 256 * 1024


class ProtocolError(Exception):
    """The peer spoke something other than the HTTP/1.1 we expect."""


class Response:
    __slots__ = ("status", "headers", "keep_alive")

    def __init__(self, status: int, headers: dict[bytes, bytes], keep_alive: bool) -> None:
        self.status = status
        self.headers = headers
        self.keep_alive = keep_alive


class Connection:
    """One socket. Not thread-safe: the pool hands it to one caller at a time."""

    __slots__ = ("sock", "buf", "idle_since", "reused")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.idle_since = 0.0
        self.reused = False

    # ---- writing ----------------------------------------------------------------------------
    def send_request(self, head: bytes, body: bytes | None, timeout: float | None) -> None:
        self.sock.settimeout(timeout)
        if body and len(body) > RECV:
            self.sock.sendall(head)  # don't copy a big body just to save a syscall
            self.sock.sendall(body)
        else:
            self.sock.sendall(head + body if body else head)

    # ---- reading ----------------------------------------------------------------------------
    def _recv(self) -> None:
        chunk = self.sock.recv(RECV)
        if not chunk:
            raise ConnectionResetError("the daemon closed the connection")
        self.buf += chunk

    def _until(self, sep: bytes, limit: int) -> bytes:
        start = 0
        while True:
            i = self.buf.find(sep, start)
            if i >= 0:
                out = bytes(self.buf[:i])
                del self.buf[:i + len(sep)]
                return out
            if len(self.buf) > limit:
                raise ProtocolError("response head or chunk line too long")
            start = max(0, len(self.buf) - len(sep) + 1)
            self._recv()

    def _exact(self, n: int) -> bytes:
        if len(self.buf) >= n:
            out = bytes(self.buf[:n])
            del self.buf[:n]
            return out
        out = bytearray(n)
        have = len(self.buf)
        out[:have] = self.buf
        self.buf.clear()
        view = memoryview(out)
        while have < n:
            k = self.sock.recv_into(view[have:])
            if k == 0:
                raise ConnectionResetError("the daemon closed the connection mid-response")
            have += k
        return bytes(out)

    def read_head(self, timeout: float | None) -> Response:
        self.sock.settimeout(timeout)
        while True:
            head = self._until(b"\r\n\r\n", MAX_HEAD)
            lines = head.split(b"\r\n")
            parts = lines[0].split(b" ", 2)
            if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
                raise ProtocolError(f"bad status line {lines[0][:80]!r}")
            status = int(parts[1])
            if 100 <= status < 200:
                continue  # an interim response: the real one follows
            headers: dict[bytes, bytes] = {}
            for line in lines[1:]:
                k, _, v = line.partition(b":")
                headers[k.strip().lower()] = v.strip()
            conn = headers.get(b"connection", b"").lower()
            keep = parts[0] == b"HTTP/1.1" and conn != b"close" or conn == b"keep-alive"
            return Response(status, headers, keep)

    def iter_body(self, resp: Response) -> Iterator[bytes]:
        """The body in pieces as they arrive; sets resp.keep_alive False if framed by close."""
        h = resp.headers
        if resp.status in (204, 304):
            return
        if b"chunked" in h.get(b"transfer-encoding", b"").lower():
            while True:
                size = int(self._until(b"\r\n", 4096).split(b";", 1)[0].strip(), 16)
                if size == 0:
                    while self._until(b"\r\n", MAX_HEAD):  # trailers, then an empty line
                        pass
                    return
                yield self._exact(size)
                if self._exact(2) != b"\r\n":
                    raise ProtocolError("bad chunk terminator")
        elif b"content-length" in h:
            n = int(h[b"content-length"])
            if n:
                yield self._exact(n)
        else:
            resp.keep_alive = False
            if self.buf:
                yield bytes(self.buf)
                self.buf.clear()
            while chunk := self.sock.recv(RECV):
                yield chunk

    def read_body(self, resp: Response) -> bytes:
        h = resp.headers
        if b"content-length" in h and b"transfer-encoding" not in h:
            n = int(h[b"content-length"])
            return self._exact(n) if n else b""
        return b"".join(self.iter_body(resp))

    def stale(self) -> bool:
        """An idle keep-alive connection the daemon closed (or wrote to) is unusable."""
        try:
            p = select.poll()
            p.register(self.sock, select.POLLIN)
            return bool(p.poll(0))
        except (OSError, ValueError):
            return True

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class Pool:
    """Idle connections, reused most-recent first; connections idle too long are dropped."""

    def __init__(self, *, unix_path: str | None = None, host: str = "", port: int = 0,
                 tls: bool = False, connect_timeout: float = 10.0, max_idle: int = 64,
                 idle_expiry: float = 30.0) -> None:
        self.unix_path = unix_path
        self.host = host
        self.port = port
        self.tls = ssl.create_default_context() if tls else None
        self.connect_timeout = connect_timeout
        self.max_idle = max_idle
        self.idle_expiry = idle_expiry
        self._idle: list[Connection] = []
        self._lock = threading.Lock()

    def connect(self) -> Connection:
        """A new connection (raises OSError if nothing answers)."""
        if self.unix_path is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(self.connect_timeout)
                sock.connect(self.unix_path)
            except BaseException:
                sock.close()
                raise
        else:
            sock = socket.create_connection((self.host, self.port), self.connect_timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:
                sock = self.tls.wrap_socket(sock, server_hostname=self.host)
        return Connection(sock)

    def acquire(self) -> Connection | None:
        """An idle connection, or None (the caller then connects)."""
        now = time.monotonic()
        while True:
            with self._lock:
                if not self._idle:
                    return None
                conn = self._idle.pop()
            if now - conn.idle_since < self.idle_expiry and not conn.stale():
                conn.reused = True
                return conn
            conn.close()

    def release(self, conn: Connection) -> None:
        conn.idle_since = time.monotonic()
        with self._lock:
            if len(self._idle) < self.max_idle:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()
