"""envd's HTTP API: ``GET/POST /files`` (download and upload) and ``GET /health``.

Uploads come as ``multipart/form-data`` (each part's file name is its path) or as an
``application/octet-stream`` body (the ``path`` query parameter), which may be gzip- or
deflate-encoded: the front inflates it as it is read, a bounded piece at a time, and a
stream that ends before its end (a truncated upload) is refused, never written short.
envd writes as the calling user, so for a user other than root the file and the directories
it needs are made by that user (a command in the sandbox, its permissions apply); a file too
big to pass that way is written by the daemon and then handed to the user (``chown``). Root's
files are written by the daemon directly.

Memory: a download is passed on as corrald sends it, never held whole, and holds one of its
sandbox's streams. An upload is held whole until written: its bytes, as they are read (and
inflated), are taken from the front's quota of request bytes held (app.py), MAX_BODY per
sandbox and BODY_BYTES_TOTAL in all, and a request past it is 429.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import posixpath
import re
import secrets
import zlib
from typing import Any

from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError

from corral import errors as ce
from corral.e2b import users
from corral.e2b.connect import WRITE_TIMEOUT_S, ConnectError, read_all
from corral.e2b.errors import api_error, envd_http_error, gone_message
from corral.e2b.state import Held, QuotaExceeded
from corral.sdk import api
from corral.sdk.async_sandbox import AsyncSandbox, transport
from corral.sdk.results import ExecResult

MAX_UPLOAD = 256 << 20
MAX_BODY = MAX_UPLOAD + (1 << 20)  # and multipart's framing
BODY_BYTES_TOTAL = 2 * MAX_BODY
TOO_LARGE = f"uploads are at most {MAX_UPLOAD} bytes"
# Passed as base64 on a command's stdin, which rides in a JSON request to the daemon.
AS_USER_MAX = 8 << 20
WRITE_AS_USER = 'mkdir -p -- "$(dirname -- "$1")" && base64 -d > "$1"'
# The body encodings an upload may come in (zlib's window bits for each): the front reads
# bodies as sent (the app runs with aiohttp's decompression off, which let a gzip stream cut
# short pass as a whole, shorter file).
BODY_ENCODINGS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS,
                  "deflate": zlib.MAX_WBITS}
COPY_AS_USER = 'mkdir -p -- "$(dirname -- "$1")" && cat -- "$2" > "$1"'


class FilesApi:
    def __init__(self, front: Any) -> None:
        self.f = front

    def _sb(self, request: web.Request) -> AsyncSandbox:
        return AsyncSandbox.from_id(request["sandbox_id"], endpoint=self.f.endpoint)

    async def health(self, request: web.Request) -> web.Response:
        try:
            running = await self._sb(request).is_running()
        except ce.SandboxNotFound:
            running = False
        if not running:
            return api_error(502, gone_message(request["sandbox_id"]))
        return web.Response(status=204)

    async def download(self, request: web.Request) -> web.StreamResponse:
        user = users.from_query(request)
        path = users.resolve(request.query.get("path", ""), user)
        sid = request["sandbox_id"]
        with self.f.streams.slot(sid):
            async with contextlib.aclosing(
                    transport(self.f.endpoint).chunks(api.read(sid, path))) as chunks:
                first = await anext(chunks, b"")  # corrald's error, if any, comes before it
                resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
                try:
                    await resp.prepare(request)
                    await asyncio.wait_for(resp.write(first), WRITE_TIMEOUT_S)
                    async for chunk in chunks:
                        await asyncio.wait_for(resp.write(chunk), WRITE_TIMEOUT_S)
                except (ConnectionError, ce.CorralError, asyncio.TimeoutError):
                    # the client left, stopped reading, or corrald left mid-file: cut the
                    # connection, so a partial file never looks complete
                    if request.transport is not None:
                        request.transport.close()
                    return resp
                await resp.write_eof()
                return resp

    async def _write(self, sb: AsyncSandbox, path: str, data: bytes, user: str,
                     written: list[dict[str, str]]) -> None:
        if user == "root":
            await sb.files.write(path, data)
        elif len(data) <= AS_USER_MAX:
            _written_as_user(path, await sb.exec(
                ["/bin/sh", "-c", WRITE_AS_USER, "write", path], user=user, cwd="/",
                stdin=base64.b64encode(data).decode(), timeout=60))
        else:
            # too big for stdin: the daemon writes it to a file of a fresh name only root can
            # read, handed to the user, whose shell copies it to ``path``; the target is
            # opened as the user, so a symlink planted there leads only where the user could
            # write anyway
            staged = f"/tmp/.corral-upload-{secrets.token_hex(16)}"
            await sb.files.write(staged, data, mode=0o600)
            try:
                r = await sb.exec(["chown", "--", f"{user}:", staged], cwd="/", timeout=30)
                if not r.ok:
                    raise ce.InvalidRequest(f"chown to {user}: {r.stderr.strip()}")
                _written_as_user(path, await sb.exec(
                    ["/bin/sh", "-c", COPY_AS_USER, "copy", path, staged], user=user,
                    cwd="/", timeout=120))
            finally:
                await sb.files.remove(staged)
        written.append({"name": posixpath.basename(path), "type": "file", "path": path})

    async def upload(self, request: web.Request) -> web.Response:
        user = users.from_query(request)
        sb = self._sb(request)
        written: list[dict[str, str]] = []
        if request.content_length is not None and request.content_length > MAX_BODY:
            return api_error(413, TOO_LARGE)
        with Held(self.f.bodies, request["sandbox_id"]) as held:
            encoding = request.headers.get("Content-Encoding", "").strip().lower() or "identity"
            if request.content_type == "multipart/form-data":
                if encoding != "identity":
                    return api_error(415, "a multipart upload cannot be content-encoded "
                                          "(each part is sent as is)")
                reader = await request.multipart()
                default = request.query.get("path")
                total = 0
                while True:
                    part = await reader.next()
                    if part is None:
                        break
                    if not isinstance(part, BodyPartReader) or part.name != "file":
                        continue
                    data = await read_all(part.read_chunk, part.at_eof, MAX_UPLOAD - total,
                                          TOO_LARGE, held.take)
                    total += len(data)
                    name = default if default and not written else _part_path(part)
                    if not name:
                        return api_error(400, "a file part without a path")
                    await self._write(sb, users.resolve(name, user), data, user, written)
            else:
                path = request.query.get("path")
                if not path:
                    return api_error(400, "path is required")
                if encoding == "identity":
                    data = await read_all(request.content.readany, request.content.at_eof,
                                          MAX_UPLOAD, TOO_LARGE, held.take)
                elif encoding in BODY_ENCODINGS:
                    data = await _inflated(request, BODY_ENCODINGS[encoding], held.take)
                else:
                    return api_error(415, f"unsupported Content-Encoding {encoding!r} "
                                          f"(gzip, deflate or none)")
                await self._write(sb, users.resolve(path, user), data, user, written)
        return web.json_response(written)


async def _inflated(request: web.Request, wbits: int, take: Any) -> bytes:
    """The body inflated, at most MAX_UPLOAD bytes (``take`` told of each piece kept); a
    stream that is not whole (cut short, or with bytes after its end) is a ConnectError."""
    d = zlib.decompressobj(wbits)
    out = bytearray()
    try:
        while not request.content.at_eof():
            chunk = await request.content.readany()
            piece = d.decompress(chunk, MAX_UPLOAD + 1 - len(out))
            take(len(piece))
            out += piece
            if d.unconsumed_tail or len(out) > MAX_UPLOAD:
                raise ConnectError("resource_exhausted", TOO_LARGE)
    except zlib.error as e:
        raise ConnectError("invalid_argument", f"the body does not inflate: {e}") from None
    if not d.eof:
        raise ConnectError("invalid_argument", "the compressed body ends before its end "
                                               "(a truncated upload)")
    if d.unused_data:
        raise ConnectError("invalid_argument", "bytes after the end of the compressed body")
    return bytes(out)


_FILENAME = re.compile(r'(?:^|;)\s*filename\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^;\s]+))', re.I)


def _written_as_user(path: str, r: ExecResult) -> None:
    """The outcome of the user's own shell writing ``path``: its permission errors as
    permission_denied, others as invalid_request."""
    if not r.ok:
        err = r.stderr.strip() or f"writing {path} failed"
        if "ermission denied" in err:
            raise ce.PermissionDenied(err)
        raise ce.InvalidRequest(err)


def _part_path(part: BodyPartReader) -> str | None:
    """A part's file name as sent: it is the file's path (aiohttp's parsers drop a leading
    "/", made for saving uploads by name)."""
    m = _FILENAME.search(part.headers.get("Content-Disposition", ""))
    if m is None:
        return part.filename
    if m.group(1) is not None:
        return re.sub(r"\\(.)", r"\1", m.group(1))
    return m.group(2)


async def guarded(handler: Any, request: web.Request) -> web.StreamResponse:
    try:
        return await handler(request)
    except QuotaExceeded as e:
        return api_error(429, e.message)
    except ConnectError as e:
        return api_error(400 if e.code != "resource_exhausted" else 413, e.message)
    except ce.CorralError as e:
        return envd_http_error(e, request["sandbox_id"])
    except (ValueError, HttpProcessingError) as e:  # aiohttp: a multipart body that ends
        return api_error(400, f"malformed request body: {e}")  # early, a bad part header
    except ConnectionError:  # the client left mid-request: nobody reads the answer
        return api_error(400, "the connection was lost")


def routes(api: FilesApi) -> list[web.RouteDef]:
    return [web.get("/health", api.health), web.get("/files", api.download),
            web.post("/files", api.upload)]
