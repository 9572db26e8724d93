"""Big request bodies (file writes, tar and image uploads) streamed to disk, never held whole.

``request.read()`` would keep a whole body in the daemon's memory, so N concurrent 1 GiB
uploads would cost N GiB. Here a body is read from the socket in pieces (aiohttp pauses the
socket while its small buffer is full) and written to a file on disk, counted against the
limit and hashed on the way: a request costs the daemon at most ``BUFFER`` bytes of memory
(plus ``keep`` for the trajectory log), whatever its size and however many run at once.

Uploads to a sandbox go to an unnamed file (``O_TMPFILE`` under ``<state>/tmp``; where the
filesystem lacks it, a named one unlinked at once): it has no name, so an error, a client
that hangs up mid-body, a cancelled handler or a daemon crash leave nothing behind.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import tempfile
from dataclasses import dataclass
from typing import BinaryIO

from aiohttp import web

from corral.daemon.diskguard import DISK_FULL, DiskGuard, disk_full
from corral.errors import TooLarge

BUFFER = 1 << 20  # bytes gathered from the socket before one write to disk


def too_large(limit: int, what: str = "request body") -> TooLarge:
    err = TooLarge(f"{what} too large (max {limit} bytes)",
                   details={"limit": "body_bytes", "max": limit})
    err.status = 413
    return err


@dataclass
class Spooled:
    """What a body spooled: its size, its sha256 (hex), the whole of it when it was at most
    ``keep`` bytes (else None)."""

    size: int
    sha256: str
    head: bytes | None


def tmp_file(directory: str) -> BinaryIO:
    """An unnamed read-write file under ``directory`` (made 0700 if missing)."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    try:
        fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError:  # a filesystem without O_TMPFILE: a name that lives for one unlink
        fd, name = tempfile.mkstemp(prefix=".body-", dir=directory)
        os.unlink(name)
    return os.fdopen(fd, "w+b")


async def spool(request: web.Request, out: BinaryIO, limit: int, keep: int = -1,
                disk: DiskGuard | None = None) -> Spooled:
    """Copy the request's body into ``out`` (left at offset 0 when seekable); more than
    ``limit`` bytes is 413 too_large, refused from Content-Length before reading when the
    client declares it. ``disk``: the state dir's disk, which each piece must leave room on
    above the daemon's reserve (else ``capacity_exceeded``, the file dropped by the caller)."""
    if request.content_length is not None and request.content_length > limit:
        raise too_large(limit)
    if disk is not None:  # a declared size is refused before a byte is read
        disk.check("a request body", request.content_length or 0)
    digest = hashlib.sha256()
    head: bytearray | None = bytearray() if keep >= 0 else None
    size, buf = 0, bytearray()
    async for chunk in request.content.iter_chunked(BUFFER):
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        digest.update(chunk)
        if head is not None:
            if size <= keep:
                head += chunk
            else:
                head = None
        buf += chunk
        if len(buf) >= BUFFER:  # the disk may block (dirty-page throttling): not on the loop
            await _write(out, buf, disk)
            buf = bytearray()
    if buf:
        await _write(out, buf, disk)
    await _write(out, None, None)
    if out.seekable():
        out.seek(0)
    return Spooled(size, digest.hexdigest(), bytes(head) if head is not None else None)


async def _write(out: BinaryIO, buf: bytearray | None, disk: DiskGuard | None) -> None:
    """One piece of a body to disk (``None``: the flush); a full disk is the daemon's
    (``capacity_exceeded``), never an error of the request."""
    if disk is not None and buf is not None:
        disk.check("a request body", len(buf))
    try:
        await asyncio.to_thread(_put, out, buf)
    except OSError as e:
        if e.errno in DISK_FULL:
            raise disk_full("a request body", e) from None
        raise


def _put(out: BinaryIO, buf: bytearray | None) -> None:
    if buf is None:
        out.flush()
    else:
        out.write(buf)
