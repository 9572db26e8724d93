"""Bounds on what the daemon writes into a sandbox for a client.

An upload's body is bounded as it is spooled to disk (corral.daemon.spool); what it
*decompresses* to is bounded here: a gzip, bzip2 or xz stream is read through
:class:`Bounded`, which counts the decompressed bytes and stops at the limit (a 1 MiB gzip of
zeros can claim terabytes). The tar is read as a stream (``r|``: never a seek, so no member is
decompressed twice) and each member is written in chunks, so the daemon holds at most one
chunk of it; its headers are read through corral.daemon.safetar.

On the btrfs scratch the kernel bounds what the daemon writes into a sandbox (its quota,
corral.daemon.scratch). On the tmpfs fallback :class:`DiskBudget` keeps, per sandbox, the bytes
the daemon has written into it (uploads, files.write, tar extraction) against the sandbox's
``disk_mb``: those pages are the daemon's, not the sandbox's, so the sandbox's own memory limit
does not bound them (docs/daemon.md, "Disk").
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import threading
from typing import IO, cast

from corral.errors import TooLarge

CHUNK = 1 << 20


class Bounded(io.RawIOBase):
    """A reader that refuses to yield more than ``limit`` bytes of ``inner``."""

    def __init__(self, inner: IO[bytes], limit: int) -> None:
        super().__init__()
        self.inner, self.limit, self.count = inner, limit, 0

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0 or n > CHUNK:
            n = CHUNK  # never one unbounded read
        data = self.inner.read(n)
        self.count += len(data)
        if self.count > self.limit:
            raise TooLarge(f"the upload decompresses to more than {self.limit} bytes",
                           details={"limit": "upload_bytes", "max": self.limit})
        return data

    def readinto(self, b: bytearray | memoryview) -> int:  # type: ignore[override]
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)


def open_bounded(data: bytes | IO[bytes], limit: int) -> Bounded:
    """The tar in ``data`` (bytes, or a seekable binary file at its start: a spooled body;
    plain, gzip, bzip2 or xz), decompressed lazily, bounded."""
    raw = io.BytesIO(data) if isinstance(data, (bytes, bytearray, memoryview)) else data
    magic = raw.read(6)
    raw.seek(0)
    inner: IO[bytes]
    if magic[:2] == b"\x1f\x8b":
        inner = cast(IO[bytes], gzip.GzipFile(fileobj=raw, mode="rb"))
    elif magic[:3] == b"BZh":
        inner = bz2.BZ2File(raw, mode="rb")
    elif magic[:6] == b"\xfd7zXZ\x00":
        inner = lzma.LZMAFile(raw, mode="rb")
    else:
        inner = raw
    return Bounded(inner, limit)


class DiskBudget:
    """Bytes the daemon wrote into each sandbox, against its limit (thread-safe)."""

    def __init__(self) -> None:
        self._used: dict[str, int] = {}
        self._lock = threading.Lock()

    def charge(self, sid: str, delta: int, limit: int) -> None:
        """Add ``delta`` bytes (negative: freed); a growth past ``limit`` raises TooLarge."""
        with self._lock:
            used = self._used.get(sid, 0) + delta
            if delta > 0 and used > limit:
                raise TooLarge(f"writing {delta} more bytes would pass the sandbox's disk_mb "
                               f"({limit >> 20} MiB written by the daemon already counts "
                               f"{self._used.get(sid, 0)} bytes)",
                               details={"limit": "disk_mb", "max": limit >> 20})
            self._used[sid] = max(0, used)

    def used(self, sid: str) -> int:
        with self._lock:
            return self._used.get(sid, 0)

    def forget(self, sid: str) -> None:
        with self._lock:
            self._used.pop(sid, None)
