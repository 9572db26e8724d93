"""File reads and tar downloads streamed with bounded buffers.

The daemon's memory must not depend on what a sandbox holds: a 1 GiB file (sparse, so it costs
the sandbox nothing) must not be read whole into memory. Here a file is sent in
``CHUNK`` pieces read in a worker thread from an fd the Rust core opened and checked
(``_core.fs_open_read``: resolved in the sandbox's root, regular files only, never on a kernel
pseudo-filesystem); a tar is made one header or chunk at a time. Caps count the bytes actually
sent, not the sizes files claim. A tar is planned first (a walk that only stats), so a tree past
a cap is refused with a clear error before the first byte.

Once the first byte is out, the tree is still live: code in the sandbox can change it between
the plan and the send, and a cut stream looks to the client like a lost daemon (infra, a
masked episode). So nothing the sandbox does fails a send: an entry that cannot be read when
its turn comes (removed, leased by a process, turned into a special file) is left out, a
directory that cannot be listed any more is sent empty, and when the tree has grown past the
cap the file that crosses it is cut to fit and the members after it are left out. Only a
fault of the host (an I/O error, the daemon's own limits) cuts the stream.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import tarfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from corral.errors import CorralError, ForbiddenPath, InvalidPath, TooLarge

CHUNK = 1 << 20
# Directory levels a download follows (paths are limited to 4096 bytes anyway).
TAR_MAX_DEPTH = 512
TAR_MAX_MEMBERS = 1_000_000  # of an upload or a download
# A download is streamed; this caps the bytes sent (a sparse file claims any size it likes).
TAR_MAX_BYTES = int(os.environ.get("CORRAL_TAR_MAX_BYTES", str(2 << 30)))
# Kernel-made trees a download of "/" records as empty directories.
NO_DESCEND = {"/proc", "/sys", "/dev"}


@dataclass
class Sent:
    """What a stream sent: bytes, their sha256 (hex, when asked for), cut short at a cap."""

    size: int
    sha256: str | None
    truncated: bool = False


def _pread(fd: int, off: int, n: int, h: Any) -> bytes:
    data = os.pread(fd, n, off)
    if h is not None:
        h.update(data)
    return data


async def send_file(resp: Any, fd: int, limit: int, digest: bool) -> Sent:
    """Write at most ``limit`` bytes of ``fd`` to the prepared response ``resp``; closes fd."""
    h = hashlib.sha256() if digest else None
    off = 0
    try:
        while off < limit:
            chunk = await asyncio.to_thread(_pread, fd, off, min(CHUNK, limit - off), h)
            if not chunk:
                break
            await resp.write(chunk)  # waits while the client is slower than us
            off += len(chunk)
    finally:
        os.close(fd)
    return Sent(off, h.hexdigest() if h is not None else None)


async def fd_sha256(fd: int, limit: int) -> str:
    """The sha256 (hex) of the first ``limit`` bytes of ``fd``, read in a worker thread in
    CHUNK pieces (the fd stays open)."""
    def digest() -> str:
        h = hashlib.sha256()
        off = 0
        while off < limit and (chunk := _pread(fd, off, min(CHUNK, limit - off), h)):
            off += len(chunk)
        return h.hexdigest()

    return await asyncio.to_thread(digest)


async def send_chunks(resp: Any, chunks: Iterator[bytes], digest: bool) -> Sent:
    """Write every chunk of a (blocking) iterator, each pulled in a worker thread."""
    h = hashlib.sha256() if digest else None
    size = 0
    try:
        while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
            if h is not None:
                h.update(chunk)
            await resp.write(chunk)
            size += len(chunk)
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            await asyncio.to_thread(close)
    return Sent(size, h.hexdigest() if h is not None else None)


@dataclass
class TreeOps:
    """The file primitives a tar walk uses (a substrate's, bound to one sandbox)."""

    stat: Callable[[str], tuple[str, int, int, float]]        # kind, size, mode, mtime
    list: Callable[[str], list[tuple[str, str]]]              # (name, kind), sorted
    readlink: Callable[[str], str]
    open_read: Callable[[str], tuple[int, int]]               # (fd, size)


def _join(d: str, name: str) -> str:
    return f"{d.rstrip('/')}/{name}"


def _sandboxs(e: CorralError) -> bool:
    """An error the sandbox's files caused (not the host's, not the daemon's)."""
    return e.category != "infra"


def _walk(ops: TreeOps, root: str, live: bool = False) -> Iterator[tuple[str, str, str]]:
    """(path, arcname, kind) depth first, names sorted; a loop, never a recursion. ``live``
    (while sending): what the sandbox changed since the plan is passed over, never raised."""
    try:
        kind = ops.stat(root)[0]
    except CorralError as e:
        if live and _sandboxs(e):
            return
        raise
    if kind != "dir":
        yield root, os.path.basename(root), kind
        return
    stack: list[tuple[str, str, int]] = [(root, ".", 0)]
    while stack:
        d, arc, depth = stack.pop()
        yield d, arc, "dir"
        if d in NO_DESCEND:
            continue
        if depth >= TAR_MAX_DEPTH:
            if live:
                continue
            raise TooLarge(f"{d} is more than {TAR_MAX_DEPTH} directories deep",
                           details={"limit": "depth", "max": TAR_MAX_DEPTH})
        try:
            entries = ops.list(d)
        except ForbiddenPath:
            continue  # a pseudo-filesystem mounted there: recorded as an empty dir
        except CorralError as e:
            if live and _sandboxs(e):
                continue
            raise
        subdirs = []
        for name, ekind in entries:
            p, a = _join(d, name), (f"{arc}/{name}" if arc != "." else name)
            if ekind == "dir":
                subdirs.append((p, a, depth + 1))
            else:
                yield p, a, ekind
        stack.extend(reversed(subdirs))


def _header(ti: tarfile.TarInfo) -> bytes:
    return ti.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def plan(ops: TreeOps, root: str, max_bytes: int, max_members: int) -> int:
    """Walk once, stats only: the tar's size, or TooLarge before anything is sent."""
    total, members = 1024, 0
    for path, arc, kind in _walk(ops, root):
        members += 1
        if members > max_members:
            raise TooLarge(f"the tar would have more than {max_members} members",
                           details={"limit": "members", "max": max_members})
        if len(path) > 4096:
            raise InvalidPath(f"a path under {root} is longer than 4096 bytes")
        size = link = 0
        if kind == "file":
            try:
                size = ops.stat(path)[1]
            except CorralError:
                size = 0
        elif kind == "symlink":
            try:
                link = len(ops.readlink(path).encode("utf-8", "surrogateescape"))
            except CorralError:
                link = 0
        # A member's headers: a pax header block, its records (path, linkpath, hdrcharset:
        # under 600 bytes with the names) rounded up to a block, the ustar block; never less
        # than chunks writes, so a tree that did not change is never cut to the cap.
        name = len(arc.encode("utf-8", "surrogateescape"))
        total += 2048 + name + link + size + (-size % 512)
        if total > max_bytes:
            raise TooLarge(f"the tar would exceed {max_bytes} bytes (at {path})",
                           details={"limit": "bytes", "max": max_bytes, "path": path})
    return total


def chunks(ops: TreeOps, root: str, max_bytes: int,
           max_members: int = TAR_MAX_MEMBERS) -> Iterator[bytes]:
    """The tar, in pieces of at most CHUNK bytes (blocking: run each step in a thread), at
    most ``max_bytes`` and ``max_members`` whatever the sandbox did since the plan (module
    docstring)."""
    room = max_bytes - 1024  # the two zero blocks that end the archive always fit
    members = 0
    for path, arc, kind in _walk(ops, root, live=True):
        members += 1
        if members > max_members:
            break
        try:
            _, _, mode, mtime = ops.stat(path)
        except CorralError as e:
            if _sandboxs(e):
                continue  # removed meanwhile
            raise
        ti = tarfile.TarInfo(arc)
        ti.mode, ti.mtime = mode, int(mtime)
        if kind in ("dir", "symlink"):
            ti.type = tarfile.DIRTYPE if kind == "dir" else tarfile.SYMTYPE
            if kind == "symlink":
                try:
                    ti.linkname = ops.readlink(path)
                except CorralError as e:
                    if _sandboxs(e):
                        continue
                    raise
            head = _header(ti)
            if len(head) > room:
                break
            room -= len(head)
            yield head
        elif kind == "file":
            try:
                fd, size = ops.open_read(path)
            except CorralError as e:  # gone, refused (pseudo-fs, special file), leased
                if _sandboxs(e):
                    continue
                raise
            try:
                fits = (room - len(_header(ti))) // 512 * 512
                ti.size = size = min(size, max(fits, 0))
                head = _header(ti)  # longer by a pax record past 8 GiB
                if fits < 0 or len(head) + size + (-size % 512) > room:
                    break
                room -= len(head) + size + (-size % 512)
                yield head
                off = 0
                while off < size:  # exactly `size` bytes: zeros if the file shrank
                    n = min(CHUNK, size - off)
                    data = os.pread(fd, n, off) or b""
                    data += bytes(n - len(data))
                    yield data
                    off += n
                if size % 512:
                    yield bytes(512 - size % 512)
            finally:
                os.close(fd)
        # sockets, FIFOs, devices: skipped
    yield bytes(1024)


async def pages_of(pages: Iterator[list[bytes]]) -> AsyncIterator[bytes]:
    """The pieces of ``pages`` (a trajectory log's, ``Reader.stream``), each page read in a
    worker thread (a page is a query)."""
    while (pieces := await asyncio.to_thread(next, pages, None)) is not None:
        for piece in pieces:
            yield piece


async def stream_out(request: Any, pieces: AsyncIterator[bytes], *, content_type: str,
                     cut_by: tuple[type[BaseException], ...], status: int = 200,
                     write: Callable[[Any, bytes], Awaitable[None]] | None = None,
                     on_cut: Callable[[BaseException], None] | None = None) -> Any:
    """Answer ``request`` with ``pieces`` as they come (``write``: how a piece is written,
    the response's own write by default). An error of ``cut_by`` once the status is sent
    aborts the connection (``on_cut`` told first): the client sees a cut stream, never a
    second answer."""
    from aiohttp import web

    out = web.StreamResponse(status=status, headers={"Content-Type": content_type})
    await out.prepare(request)
    try:
        async for piece in pieces:
            await (out.write(piece) if write is None else write(out, piece))
    except cut_by as e:
        if on_cut is not None:
            on_cut(e)
        if request.transport is not None:
            request.transport.abort()
        return out
    await out.write_eof()
    return out
