"""Memory the daemon promises to commands' output beyond the default cap.

A command's result keeps up to ``max_output_bytes`` of each stream in the daemon's memory
(256 MiB at most a stream). With the default cap (4 MiB) that is bounded by how many commands
run; a client asking for big caps on many commands at once could make the daemon hold more
than the host has (eight 256 MiB outputs at once held 2.4 GB). So the part of a command's caps
above the default is reserved from one daemon-wide pool before the command starts (both
streams, whether or not it will print that much); a command it does not fit is refused with
``capacity_exceeded`` (infra: nothing ran; retry, or ask for less) and commands with the
default cap never wait for it. The reservation is given back once the command's output is let
go: its result made (foreground), or the process forgotten (background, a dead sandbox).
"""

from __future__ import annotations

import weakref

from corral.daemon import capacity
from corral.errors import CapacityExceeded
from corral.models import DEFAULT_MAX_OUTPUT_BYTES

MEMORY_SHARE = 0.25  # of MemTotal, when CORRAL_OUTPUT_MEMORY_MB does not say


def default_limit() -> int:
    """A quarter of the host's memory (1 GiB if it cannot be read)."""
    total = capacity.meminfo_kib("MemTotal")
    return int((total or (4 << 20)) * 1024 * MEMORY_SHARE)


def need_of(cap: int) -> int:
    """What a command with ``cap`` a stream reserves: both streams' part above the default."""
    return 2 * max(0, cap - DEFAULT_MAX_OUTPUT_BYTES)


class Reservation:
    """Bytes reserved for one command; ``release`` (or the reservation's collection, should a
    path forget to) gives them back, once."""

    __slots__ = ("size", "_done", "__weakref__")

    def __init__(self, pool: OutputMemory, size: int) -> None:
        self.size = size
        self._done = weakref.finalize(self, pool._give_back, size)

    def release(self) -> None:
        self._done()


class OutputMemory:
    """The daemon's pool for output past the default cap, ``limit`` bytes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.reserved = 0

    def reserve(self, cap: int) -> Reservation | None:
        """A reservation for a command capped at ``cap`` a stream (None: it needs none), or
        CapacityExceeded."""
        need = need_of(cap)
        if need == 0:
            return None
        if self.reserved + need > self.limit:
            raise CapacityExceeded(
                f"the daemon holds as much command output as it may ({self.reserved >> 20} "
                f"of {self.limit >> 20} MiB promised to commands with a max_output_bytes "
                f"above {DEFAULT_MAX_OUTPUT_BYTES >> 20} MiB); retry, or ask for less",
                details={"output_memory": self.limit, "reserved": self.reserved,
                         "requested": need})
        self.reserved += need
        return Reservation(self, need)

    def _give_back(self, size: int) -> None:
        self.reserved = max(0, self.reserved - size)
