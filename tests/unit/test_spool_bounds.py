"""A request body spooled to the state dir (corral.daemon.spool): its bytes are claimed from the
room above the daemon's reserve before they are written, so bodies arriving at once cannot
each pass the check on the same room; a body that stalls, or does not end, is cut instead of
holding that room for as long as its client keeps the connection."""

from __future__ import annotations

import asyncio
import io
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from corral.daemon import diskguard, spool
from corral.errors import CapacityExceeded, InvalidRequest

MiB = 1 << 20


class _Body:
    """What spool reads of a request: its declared length and its chunks."""

    def __init__(self, chunks: AsyncIterator[bytes], length: int | None = None) -> None:
        self.content_length = length
        self.content = self
        self._chunks = chunks

    def iter_chunked(self, n: int) -> AsyncIterator[bytes]:
        return self._chunks


class _SlowFile(io.BytesIO):
    """A file whose writes take a while to land (a disk under dirty-page throttling): what it
    holds counts on the disk only once written."""

    def write(self, b: Any) -> int:
        time.sleep(0.1)
        return super().write(b)


class _Guard(diskguard.DiskGuard):
    """``room`` bytes above the reserve, less what ``files`` hold."""

    def __init__(self, room: int, files: list[io.BytesIO]) -> None:
        self.room, self.files = room, files
        self.claims = 0
        self.reserve = 0
        self.counters = {"refused": 0}
        self.lock = threading.Lock()

    def inodes_available(self) -> int | None:
        return None

    def state(self) -> dict[str, int]:
        free = self.room - sum(len(f.getbuffer()) for f in self.files)
        return {"free": free, "claimed": self.claims, "reserve": 0,
                "available": free - self.claims}


async def _chunks(n: int, size: int = MiB) -> AsyncIterator[bytes]:
    for _ in range(n):
        await asyncio.sleep(0)
        yield bytes(size)


def test_bodies_arriving_at_once_claim_the_room_before_they_write():
    files: list[io.BytesIO] = [_SlowFile(), _SlowFile()]
    guard = _Guard(int(1.5 * MiB), files)

    async def both() -> list[Any]:
        return await asyncio.gather(
            *(spool.spool(_Body(_chunks(1)), f, 1 << 30, disk=guard)  # type: ignore[arg-type]
              for f in files), return_exceptions=True)

    got = asyncio.run(both())
    refused = [r for r in got if isinstance(r, CapacityExceeded)]
    assert len(refused) == 1 and refused[0].infra, got  # one fits, the other is refused
    assert sum(len(f.getbuffer()) for f in files) <= 1.5 * MiB
    assert guard.claims == 0  # given back


def test_a_body_that_stalls_is_cut(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(spool, "STALL_S", 0.2)

    async def stalls() -> AsyncIterator[bytes]:
        yield b"x" * 10
        await asyncio.sleep(3600)
        yield b"never"

    t0 = time.monotonic()
    with pytest.raises(InvalidRequest) as got:
        asyncio.run(spool.spool(_Body(stalls()), io.BytesIO(), 1 << 30))  # type: ignore[arg-type]
    assert got.value.status == 408 and got.value.details["reason"] == "body_stalled"
    assert time.monotonic() - t0 < 5


def test_a_body_that_trickles_past_its_deadline_is_cut(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(spool, "STALL_S", 0.2)
    monkeypatch.setattr(spool, "DEADLINE_S", 0.5)

    async def trickles() -> AsyncIterator[bytes]:
        while True:
            await asyncio.sleep(0.05)
            yield b"x"

    with pytest.raises(InvalidRequest) as got:
        asyncio.run(spool.spool(_Body(trickles()), io.BytesIO(), 1 << 30))  # type: ignore[arg-type]
    assert got.value.status == 408 and "in time" in got.value.message


def test_a_body_that_keeps_coming_is_whole(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(spool, "STALL_S", 0.2)
    out = io.BytesIO()
    got = asyncio.run(spool.spool(_Body(_chunks(3)), out, 1 << 30))  # type: ignore[arg-type]
    assert got.size == 3 * MiB and len(out.getbuffer()) == 3 * MiB


def test_a_declared_size_is_checked_but_claimed_only_as_it_arrives(
        monkeypatch: pytest.MonkeyPatch):
    """Claimed whole before a byte came, a body declaring 1 GiB that then trickled held a
    GiB of the room other tenants' work needs, for as long as it kept coming."""
    monkeypatch.setattr(spool, "STALL_S", 0.5)
    out = io.BytesIO()
    guard = _Guard(4 << 30, [out])
    seen: list[int] = []

    async def trickles() -> AsyncIterator[bytes]:
        for _ in range(3):
            yield bytes(MiB)
            await asyncio.sleep(0.05)
            seen.append(guard.claims)
        await asyncio.sleep(3600)
        yield b""

    with pytest.raises(InvalidRequest):
        asyncio.run(spool.spool(_Body(trickles(), length=1 << 30), out, 2 << 30,  # type: ignore[arg-type]
                                disk=guard))
    assert seen and max(seen) <= 2 * MiB, seen  # what came, not what was declared
    assert guard.claims == 0
    with pytest.raises(CapacityExceeded):  # a declared size the disk lacks: refused at once
        asyncio.run(spool.spool(_Body(_chunks(1), length=8 << 30), io.BytesIO(), 16 << 30,  # type: ignore[arg-type]
                                disk=_Guard(4 << 30, [])))



def test_one_tenants_bodies_hold_at_most_their_share_of_the_room():
    """58 bodies sent whole but for their last byte took all the room above the reserve:
    every other tenant's upload, snapshot and pull was capacity_exceeded. One tenant's
    bodies in flight hold at most a quarter of it; another tenant's still fit."""
    files: list[io.BytesIO] = []
    guard = _Guard(16 * MiB, files)

    async def held_open() -> AsyncIterator[bytes]:
        yield bytes(MiB)
        await asyncio.sleep(3600)
        yield b""

    async def attack() -> tuple[list[Any], Any]:
        outs = [io.BytesIO() for _ in range(8)]
        files.extend(outs)
        tasks = [asyncio.ensure_future(spool.spool(_Body(held_open()), f, 1 << 30, disk=guard,  # type: ignore[arg-type]
                                                    tenant="alice")) for f in outs]
        await asyncio.sleep(0.3)
        done = [t.exception() for t in tasks if t.done()]
        bob = io.BytesIO()
        files.append(bob)
        got = await spool.spool(_Body(_chunks(2)), bob, 1 << 30, disk=guard,  # type: ignore[arg-type]
                                tenant="bob")
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return done, got

    done, got = asyncio.run(attack())
    refused = [e for e in done if isinstance(e, CapacityExceeded)]
    assert refused and all(e.code == "quota_exceeded" and e.details["resource"] == "body_bytes"
                           for e in refused), done
    assert got.size == 2 * MiB  # bob's body fits
    assert not spool._held  # given back, also by the bodies cut short


def test_a_tenants_one_body_is_bounded_by_the_disk_not_its_share():
    """The share bounds a tenant's bodies together: one body alone may use the room (a 1 GiB
    upload with 2 GiB above the reserve was refused at 512 MiB, and waiting never helped)."""
    out = io.BytesIO()
    guard = _Guard(8 * MiB, [out])
    got = asyncio.run(spool.spool(_Body(_chunks(6)), out, 1 << 30, disk=guard,  # type: ignore[arg-type]
                                  tenant="alice"))
    assert got.size == 6 * MiB and not spool._held
