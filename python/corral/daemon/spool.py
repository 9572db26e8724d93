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
import collections
import hashlib
import os
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import BinaryIO

from aiohttp import web

from corral.daemon.diskguard import DISK_FULL, Claim, DiskGuard, disk_full
from corral.errors import InvalidRequest, QuotaExceeded, TooLarge

BUFFER = 1 << 20  # bytes gathered from the socket before one write to disk
# A body that sends nothing for STALL_S, or is not whole after DEADLINE_S (1 GiB at ~0.6
# MB/s), is cut: what it spooled holds room on the state dir that other tenants' work
# needs, and a client could otherwise hold it for as long as it keeps the connection.
STALL_S = 60.0
DEADLINE_S = 1800.0
# One tenant's bodies in flight hold at most this share of the room above the reserve (the
# room as if it held none), a body of its own alone excepted: 58 bodies sent whole but their
# last byte held back took all of it, and every other tenant's upload, snapshot and pull was
# capacity_exceeded.
TENANT_SHARE = 0.25

_held: collections.Counter[str] = collections.Counter()  # tenant -> bytes its bodies hold


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


def body_stalled(what: str, after: float) -> InvalidRequest:
    err = InvalidRequest(f"the request body {what} ({after:.0f} s): it was cut",
                         details={"reason": "body_stalled", "after_s": after})
    err.status = 408
    return err


async def spool(request: web.Request, out: BinaryIO, limit: int, keep: int = -1,
                disk: DiskGuard | None = None, tenant: str | None = None) -> Spooled:
    """Copy the request's body into ``out`` (left at offset 0 when seekable); more than
    ``limit`` bytes is 413 too_large, refused from Content-Length before reading when the
    client declares it. ``disk``: the state dir's disk: the body's bytes are claimed from
    the room above the daemon's reserve as they arrive, before they are written (else
    ``capacity_exceeded``, the file dropped by the caller), so bodies arriving at once do not
    each see the same room. A body that stalls STALL_S or takes longer than DEADLINE_S is
    408 invalid_request (``details.reason``: body_stalled). A ``tenant``'s bodies together
    hold at most TENANT_SHARE of the room (past it: ``quota_exceeded``, ``body_bytes``)."""
    if request.content_length is not None and request.content_length > limit:
        raise too_large(limit)
    if disk is None:
        return await _spool(request, out, limit, keep, None)
    # A declared size is checked before a byte is read, and claimed only as its bytes come:
    # claimed whole at once, a body that trickles would hold room it never sends.
    disk.check("a request body", request.content_length or 0)
    with disk.claim("a request body", 0) as held:
        try:
            return await _spool(request, out, limit, keep, held, tenant)
        finally:
            if tenant is not None:
                _held[tenant] -= held.bytes
                if _held[tenant] <= 0:
                    del _held[tenant]


async def _spool(request: web.Request, out: BinaryIO, limit: int, keep: int,
                 held: Claim | None, tenant: str | None = None) -> Spooled:
    digest = hashlib.sha256()
    head: bytearray | None = bytearray() if keep >= 0 else None
    size, written, buf = 0, 0, bytearray()
    deadline = asyncio.get_running_loop().time() + DEADLINE_S
    chunks = request.content.iter_chunked(BUFFER).__aiter__()
    while (chunk := await _next_chunk(chunks, deadline)) is not None:
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
            written = await _write(out, buf, held, written, tenant)
            buf = bytearray()
    if buf:
        written = await _write(out, buf, held, written, tenant)
    await _write(out, None, None, written)
    if out.seekable():
        out.seek(0)
    return Spooled(size, digest.hexdigest(), bytes(head) if head is not None else None)


async def _next_chunk(chunks: AsyncIterator[bytes], deadline: float) -> bytes | None:
    """The body's next chunk (None at its end), cut after STALL_S without one or at
    ``deadline``. Only the socket read is timed, never a write in flight (a write cancelled
    under its thread would leave the thread writing to a file the caller closes)."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    fired = False

    def expire() -> None:
        nonlocal fired
        fired = True
        task.cancel()

    timer = loop.call_at(min(loop.time() + STALL_S, deadline), expire)
    try:
        return await chunks.__anext__()
    except StopAsyncIteration:
        return None
    except asyncio.CancelledError:
        if not fired:
            raise
        if hasattr(task, "uncancel"):  # our own cancel, answered here (Python 3.11+)
            task.uncancel()
        if loop.time() >= deadline:
            raise body_stalled("was not whole in time", DEADLINE_S) from None
        raise body_stalled("sent nothing", STALL_S) from None
    finally:
        timer.cancel()


async def _write(out: BinaryIO, buf: bytearray | None, held: Claim | None,
                 written: int, tenant: str | None = None) -> int:
    """One piece of a body to disk (``None``: the flush), claimed first (within the tenant's
    share); the bytes written so far after it. A full disk is the daemon's
    (``capacity_exceeded``), never an error of the request."""
    total = written + (len(buf) if buf is not None else 0)
    if held is not None:
        more = total - held.bytes
        others = _held[tenant] - held.bytes if tenant is not None else 0
        if tenant is not None and more > 0 and others > 0:  # one body alone: the disk decides
            share = int((held.guard.state()["available"] + _held[tenant]) * TENANT_SHARE)
            if _held[tenant] + more > share:
                raise QuotaExceeded(
                    f"tenant {tenant!r}'s request bodies being received hold "
                    f"{_held[tenant]} bytes of the daemon's disk, their share of its room",
                    details={"tenant": tenant, "resource": "body_bytes",
                             "in_use": _held[tenant], "limit": max(0, share)})
        held.grow_to(total)
        if tenant is not None and more > 0:
            _held[tenant] += more
    try:
        await asyncio.to_thread(_put, out, buf)
    except OSError as e:
        if e.errno in DISK_FULL:
            raise disk_full("a request body", e) from None
        raise
    if held is not None:
        held.wrote(total)
    return total


def _put(out: BinaryIO, buf: bytearray | None) -> None:
    if buf is None:
        out.flush()
    else:
        out.write(buf)
