"""The Connect protocol over HTTP/1.1 with its JSON codec, as envd speaks it to the e2b SDK.

Unary calls: a POST with an ``application/json`` body; the answer is the JSON message, or an
error status with ``{"code": ..., "message": ...}``. Server streams: the request and every
answer message are enveloped (1 flag byte, 4-byte big-endian length, the JSON); the last
envelope has flag 0x02 and holds ``{}`` or ``{"error": {...}}``.
"""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

FLAG_COMPRESSED = 0x01
FLAG_END_STREAM = 0x02
MAX_MESSAGE = 16 << 20
STREAM_CONTENT_TYPE = "application/connect+json"
UNARY_CONTENT_TYPE = "application/json"
# The request's key for a callable told of each body byte read (app.py: the sandbox's quota).
TAKE = "corral.e2b.take"
STREAM = "corral.e2b.stream"  # the request's ServerStream, once it has one
# A stream whose client reads nothing for this long is cut (a handle kept and never waited
# on held its stream, one of its sandbox's and of the front's, for good, also past its
# sandbox's end); its last message gets less.
WRITE_TIMEOUT_S = 60.0
END_WRITE_TIMEOUT_S = 5.0

# Connect code -> HTTP status of a unary error (connectrpc.com/docs/protocol).
HTTP_STATUS = {
    "canceled": 499, "unknown": 500, "invalid_argument": 400, "deadline_exceeded": 504,
    "not_found": 404, "already_exists": 409, "permission_denied": 403,
    "resource_exhausted": 429, "failed_precondition": 400, "aborted": 409,
    "out_of_range": 400, "unimplemented": 501, "internal": 500, "unavailable": 503,
    "data_loss": 500, "unauthenticated": 401,
}


class ConnectError(Exception):
    """An error answered in Connect's shape: a code from HTTP_STATUS and a message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code if code in HTTP_STATUS else "unknown"
        self.message = message

    def payload(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _loads_object(data: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(data or b"{}")
    except (ValueError, UnicodeDecodeError) as e:
        raise ConnectError("invalid_argument", f"the message is not JSON: {e}") from None
    except RecursionError:  # nested past the parser's depth: not a message of envd's
        raise ConnectError("invalid_argument", "the message is nested too deep") from None
    if not isinstance(obj, dict):
        raise ConnectError("invalid_argument", "the message is not a JSON object")
    return obj


def error_response(err: ConnectError) -> web.Response:
    return web.Response(body=_dumps(err.payload()), status=HTTP_STATUS[err.code],
                        content_type=UNARY_CONTENT_TYPE)


def is_stream(request: web.Request) -> bool:
    return request.content_type == STREAM_CONTENT_TYPE


async def read_unary(request: web.Request) -> dict[str, Any]:
    if request.content_type != UNARY_CONTENT_TYPE:
        raise ConnectError("invalid_argument",
                           f"content type {request.content_type!r}: this server speaks JSON")
    if request.headers.get("Content-Encoding", "identity") not in ("identity", ""):
        raise ConnectError("unimplemented", "compressed requests are not supported")
    return _loads_object(await _read_bounded(request))


async def read_all(read: Callable[[], Awaitable[bytes]], at_eof: Callable[[], bool],
                   limit: int, too_large: str,
                   take: Callable[[int], None] | None = None) -> bytes:
    """A body (or a multipart part) whole, at most ``limit`` bytes; ``take`` is told of each
    chunk before it is kept (the front's quota of bytes held, which may refuse it)."""
    buf = bytearray()
    while not at_eof():
        chunk = await read()
        if take is not None:
            take(len(chunk))
        buf += chunk
        if len(buf) > limit:
            raise ConnectError("resource_exhausted", too_large)
    return bytes(buf)


async def _read_bounded(request: web.Request) -> bytes:
    if request.content_length is not None and request.content_length > MAX_MESSAGE + 5:
        raise ConnectError("resource_exhausted", "the request is too large")
    return await read_all(request.content.readany, request.content.at_eof, MAX_MESSAGE + 5,
                          "the request is too large", request.get(TAKE))


def split_envelopes(data: bytes) -> list[tuple[int, bytes]]:
    """Every (flags, message) of an enveloped body; a truncated envelope is an error."""
    out = []
    i = 0
    while i < len(data):
        if len(data) - i < 5:
            raise ConnectError("invalid_argument", "a truncated envelope")
        flags, size = struct.unpack_from(">BI", data, i)
        i += 5
        if size > MAX_MESSAGE or len(data) - i < size:
            raise ConnectError("invalid_argument", "a truncated or oversized envelope")
        if flags & FLAG_COMPRESSED:
            raise ConnectError("unimplemented", "compressed messages are not supported")
        out.append((flags, data[i:i + size]))
        i += size
    return out


async def read_stream_request(request: web.Request) -> dict[str, Any]:
    """The one message a server-streaming call carries."""
    if not is_stream(request):
        raise ConnectError("invalid_argument",
                           f"content type {request.content_type!r} for a streaming call")
    messages = [m for f, m in split_envelopes(await _read_bounded(request))
                if not f & FLAG_END_STREAM]
    if len(messages) != 1:
        raise ConnectError("invalid_argument", "a server stream takes exactly one message")
    return _loads_object(messages[0])


async def read_client_stream(request: web.Request) -> list[dict[str, Any]]:
    """Every message of a client stream (the body is read whole: inputs are small)."""
    if not is_stream(request):
        raise ConnectError("invalid_argument",
                           f"content type {request.content_type!r} for a streaming call")
    return [_loads_object(m) for f, m in split_envelopes(await _read_bounded(request))
            if not f & FLAG_END_STREAM]


def envelope(message: dict[str, Any], flags: int = 0) -> bytes:
    data = _dumps(message)
    return struct.pack(">BI", flags, len(data)) + data


def timeout_s(request: web.Request) -> float | None:
    """The call's deadline from ``Connect-Timeout-Ms`` (at most 10 digits), in seconds."""
    raw = request.headers.get("Connect-Timeout-Ms")
    if raw is None:
        return None
    if not raw.isdigit() or len(raw) > 10:
        raise ConnectError("invalid_argument", f"bad Connect-Timeout-Ms {raw!r}")
    return int(raw) / 1000 or None


class ServerStream:
    """A server-streaming answer: prepare once, send messages, end with or without an error.
    A client gone mid-stream (disconnect) ends the writes quietly: ``open`` turns False."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response = web.StreamResponse(status=200,
                                           headers={"Content-Type": STREAM_CONTENT_TYPE})
        self.open = True
        self._prepared = False
        request[STREAM] = self

    async def _write(self, data: bytes, timeout: float | None = None) -> None:
        if not self.open:
            return
        try:
            if not self._prepared:
                self._prepared = True
                await self.response.prepare(self.request)
            await asyncio.wait_for(self.response.write(data),
                                   WRITE_TIMEOUT_S if timeout is None else timeout)
        except (ConnectionError, RuntimeError):
            self.open = False
        except asyncio.TimeoutError:  # a client that stopped reading: cut
            self.open = False
            if self.request.transport is not None:
                self.request.transport.close()

    async def send(self, message: dict[str, Any]) -> None:
        await self._write(envelope(message))

    async def end(self, err: ConnectError | None = None) -> web.StreamResponse:
        end = {"error": err.payload()} if err is not None else {}
        await self._write(envelope(end, FLAG_END_STREAM), END_WRITE_TIMEOUT_S)
        if self.open:
            try:
                await self.response.write_eof()
            except (ConnectionError, RuntimeError):
                self.open = False
        return self.response


def stream_of(request: web.Request) -> ServerStream:
    """The request's stream: the one its handler began, or a new one."""
    s = request.get(STREAM)
    return s if isinstance(s, ServerStream) else ServerStream(request)


def unary_response(message: dict[str, Any]) -> web.Response:
    return web.Response(body=_dumps(message), content_type=UNARY_CONTENT_TYPE)
