"""Memory the daemon gives JSON request bodies, all requests together.

A JSON body (at most 16 MiB) is read whole, parsed, and what it carries (an exec's stdin, a
batch's specs) lives as long as its request: about 3.6 times its size in the daemon's memory.
A client sending many big bodies at once, each with a command that runs a while, held 5.9 GB
with 100 of them. So a body of ``SMALL`` bytes or more takes its size (by its Content-Length,
or the most a JSON body may be when it is chunked) from one pool of ``LIMIT`` bytes for as
long as its request is handled; a body the pool cannot take now is refused with
``capacity_exceeded`` (429, infra: nothing was done; retry, or send less) instead of waiting,
so that no request ever waits behind another's. Smaller bodies, nearly every request, take
nothing: 4,096 connections of them hold under a GiB.
"""

from __future__ import annotations

from collections.abc import Mapping

from corral.errors import CapacityExceeded, InvalidRequest

SMALL = 64 << 10
LIMIT = 256 << 20


def check_not_encoded(headers: Mapping[str, str]) -> None:
    """Bodies are taken as sent (servers run with aiohttp's decompression off): an encoded one
    would be charged by its compressed length (15 KB of gzip held 15 MiB), and aiohttp does
    not check a gzip stream's end (an upload cut short would be written short)."""
    encoding = headers.get("Content-Encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        raise InvalidRequest(f"Content-Encoding {encoding[:40]!r} is not accepted: send the "
                             "body as it is")


class BodyMemory:
    def __init__(self, limit: int = LIMIT, small: int = SMALL) -> None:
        self.limit, self.small = limit, small
        self.held = 0

    def take(self, size: int) -> int:
        """Hold ``size`` bytes for a body (0 for a small one: nothing is held); what to give
        back. Raises CapacityExceeded when the pool cannot hold it now."""
        if size < self.small:
            return 0
        if self.held + size > self.limit:
            raise CapacityExceeded(
                f"the daemon is reading as many big request bodies as it may ({self.held >> 20}"
                f" of {self.limit >> 20} MiB); retry, or send a smaller body",
                details={"body_memory": self.limit, "held": self.held, "requested": size})
        self.held += size
        return size

    def give(self, size: int) -> None:
        self.held = max(0, self.held - size)
