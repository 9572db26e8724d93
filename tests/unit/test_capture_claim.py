"""A capture's copy stays within its sandbox's disk_mb and within a disk claim raised ahead of
it (corral.daemon.engine.snapshotting._within_claim): files that share their blocks cost the
sandbox's quota once and the copy each time."""

from __future__ import annotations

import asyncio
import threading

import pytest

from corral.daemon import diskguard
from corral.daemon.engine import snapshotting
from corral.errors import CapacityExceeded, TooLarge

MiB = 1 << 20


class _Copy:
    """A capture's worker as the loop sees it: a future and a control whose copied bytes the
    test moves on; cancelled, the worker ends."""

    def __init__(self) -> None:
        self.written = 0
        self.stop = threading.Event()

    def copied(self) -> int:
        return self.written

    def entries(self) -> int:
        return 0

    def cancel(self) -> None:
        self.stop.set()

    def cancelled(self) -> bool:
        return self.stop.is_set()


class _Guard(diskguard.DiskGuard):
    """A guard whose disk has ``room`` bytes above the reserve."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.claims = 0
        self.reserve = 0
        self.counters = {"refused": 0}

    def inodes_available(self) -> int | None:
        return None  # a filesystem that makes inodes as needed

    def state(self) -> dict[str, int]:
        return {"free": self.room, "claimed": self.claims, "reserve": 0,
                "available": self.room - self.claims}


async def _run(ctl: _Copy, guard: _Guard | None, disk_mb: int, steps: list[int]
               ) -> tuple[BaseException | None, int]:
    """Copy ``steps`` bytes in turn under the watch; (what it raised, the claim at the end)."""
    loop = asyncio.get_running_loop()
    copy: asyncio.Future[tuple[str, str, int]] = loop.create_future()

    async def worker() -> None:
        for n in steps:
            if ctl.stop.is_set():
                copy.set_exception(RuntimeError("cancelled"))
                return
            ctl.written += n
            await asyncio.sleep(snapshotting.WATCH_S * 2)  # the watch looks in between
        copy.set_result(("tmp", "digest", ctl.written))

    class _Store:
        dropped: list[str] = []

        def drop(self, tmp: str) -> None:
            self.dropped.append(tmp)

    task = asyncio.ensure_future(worker())
    claim = guard.claim("a snapshot", 0) if guard is not None else None
    held = claim.__enter__() if claim is not None else None
    try:
        watch = snapshotting._within_claim(copy, ctl, held, disk_mb)  # type: ignore[arg-type]
        try:
            await snapshotting._to_the_end(copy, ctl, _Store(), watch)  # type: ignore[arg-type]
        except (TooLarge, CapacityExceeded) as e:
            return e, held.bytes if held is not None else 0
        return None, held.bytes if held is not None else 0
    finally:
        await task
        if claim is not None:
            claim.__exit__(None, None, None)


def test_a_copy_past_its_sandboxs_disk_mb_is_the_sandboxs_limit():
    ctl = _Copy()
    err, _ = asyncio.run(_run(ctl, None, 64, [32 * MiB, 32 * MiB, 32 * MiB, 32 * MiB]))
    assert isinstance(err, TooLarge) and err.category == "limit", err
    assert err.details == {"limit": "disk_mb", "max": 64}
    assert ctl.cancelled() and ctl.written <= 96 * MiB  # stopped, not run to the end


def test_the_claim_is_raised_ahead_of_the_copy_and_the_disk_refuses_past_its_room():
    guard = _Guard(room=1 << 30)
    err, claimed = asyncio.run(_run(_Copy(), guard, 4096, [200 * MiB] * 3))
    assert err is None and claimed >= 600 * MiB, claimed  # raised as the copy went
    assert guard.claims == 0  # given back at the end
    ctl = _Copy()
    err, _ = asyncio.run(_run(ctl, _Guard(room=300 * MiB), 4096, [200 * MiB] * 4))
    assert isinstance(err, CapacityExceeded) and err.infra, err
    assert ctl.cancelled()


def test_a_copy_within_both_ends_with_its_result():
    err, claimed = asyncio.run(_run(_Copy(), _Guard(room=1 << 30), 64, [MiB, MiB]))
    assert err is None and claimed >= 2 * MiB


@pytest.mark.parametrize("room", [0, 100 * MiB])
def test_a_claim_grows_only_into_room(room: int):
    guard = _Guard(room=room)
    with guard.claim("a snapshot", 0) as held:
        if room:
            held.grow_to(room)
            assert guard.claims == room
        with pytest.raises(CapacityExceeded):
            held.grow_to(room + MiB)
    assert guard.claims == 0


class _Vfs:
    """What os.statvfs says of a state dir with ``files`` inodes, ``free`` of them free."""

    def __init__(self, files: int, free: int) -> None:
        self.f_files, self.f_favail, self.f_ffree = files, free, free
        self.f_bavail, self.f_frsize = 1 << 30, 4096


def test_concurrent_captures_on_a_normal_disk_are_not_stopped_by_each_others_bounds(
        monkeypatch, tmp_path):
    """Each capture may make up to 1,000,000 files; claiming all of it let 17 tiny captures
    stop the 18th (capacity_exceeded, masked) on a disk of 16.7M inodes. A capture claims a
    usual capture's files and raises its claim as its copy lists more."""
    monkeypatch.setattr(diskguard.os, "statvfs", lambda _p: _Vfs(16_777_216, 16_219_467))
    guard = diskguard.DiskGuard(str(tmp_path), 0)
    import contextlib

    with contextlib.ExitStack() as stack:
        for _ in range(64):
            stack.enter_context(guard.claim_inodes("a snapshot"))
        assert guard.inode_claims == 64 * diskguard.INODE_CLAIM
    assert guard.inode_claims == 0


def test_an_inode_claim_grows_only_into_room_and_the_reserve_stays(monkeypatch, tmp_path):
    vfs = _Vfs(100_000, 10_000)
    monkeypatch.setattr(diskguard.os, "statvfs", lambda _p: vfs)
    guard = diskguard.DiskGuard(str(tmp_path), 0)
    room = 10_000 - diskguard.INODE_RESERVE_MIN
    with guard.claim_inodes("a snapshot") as held:
        assert held.n == room  # less than a usual claim is left
        held.grow_to(room)
        with pytest.raises(CapacityExceeded):
            held.grow_to(room + 1)
    with guard.claim_inodes("a") as a:
        assert a.n == room
        with pytest.raises(CapacityExceeded):  # a holds all of it
            with guard.claim_inodes("b"):
                pass
    vfs.f_favail = diskguard.INODE_RESERVE_MIN
    with pytest.raises(CapacityExceeded):
        with guard.claim_inodes("a snapshot"):
            pass
    guard.check("a small write")  # half the reserve is still small writes'
    vfs.f_favail = diskguard.INODE_RESERVE_MIN // 2
    with pytest.raises(CapacityExceeded):
        guard.check("a small write")


def test_three_big_captures_at_once_cannot_pass_what_is_free(monkeypatch, tmp_path):
    """Bounds handed out whole let three captures of 1,000,000 files each plan 3,000,000 on
    a disk with 1,700,000 free; claims raised as copies list entries stop the third."""
    monkeypatch.setattr(diskguard.os, "statvfs", lambda _p: _Vfs(16_777_216, 1_700_000))
    guard = diskguard.DiskGuard(str(tmp_path), 0)
    import contextlib

    with contextlib.ExitStack() as stack:
        claims = [stack.enter_context(guard.claim_inodes("a snapshot")) for _ in range(3)]
        claims[0].grow_to(700_000)
        claims[1].grow_to(700_000)
        with pytest.raises(CapacityExceeded):
            claims[2].grow_to(700_000)
