"""A capture's copy stays within its sandbox's disk_mb and within a disk claim raised ahead of
it (corral.daemon.engine.snapshotting._within_claim), waiting at its allowance: files that
share their blocks cost the sandbox's quota once and the copy each time, and the claim's
estimate can lag what the sandbox holds. Real copies (``_core.capture_layer``) of small
trees."""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

import pytest

from corral import _core
from corral.daemon import diskguard
from corral.daemon.engine import snapshotting
from corral.errors import CapacityExceeded, TooLarge

MiB = 1 << 20


class _Guard(diskguard.DiskGuard):
    """A guard whose disk has ``room`` bytes above the reserve, less what ``under`` holds on
    the disk (the copy's own blocks, as a filesystem's free count sees them)."""

    def __init__(self, room: int, under: Path | None = None) -> None:
        self.room = room
        self.under = under
        self.claims = 0
        self.reserve = 0
        self.counters = {"refused": 0}

    def inodes_available(self) -> int | None:
        return None  # a filesystem that makes inodes as needed

    def state(self) -> dict[str, int]:
        free = self.room - (_blocks(self.under) if self.under is not None else 0)
        return {"free": free, "claimed": self.claims, "reserve": 0,
                "available": free - self.claims}


def _blocks(top: Path) -> int:
    """Bytes of disk the tree under ``top`` holds (blocks, directories included)."""
    total = 0
    for d, dirs, files in os.walk(top):
        for name in [*dirs, *files]:
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(d, name)).st_blocks * 512
    return total


def _tree(root: Path, files: int, size: int = MiB) -> Path:
    """An upper dir of ``files`` files of ``size`` random bytes (data, no holes)."""
    src = root / "upper"
    src.mkdir(parents=True)
    for i in range(files):
        (src / f"f{i}").write_bytes(os.urandom(size))
    return src


class _Store:
    def __init__(self) -> None:
        self.dropped: list[str] = []

    def drop(self, tmp: str) -> None:
        self.dropped.append(tmp)


async def _run(root: Path, files: int, guard: _Guard | None, disk_mb: int, estimate: int = 0,
               size: int = MiB) -> tuple[BaseException | None, int, _core.CaptureControl,
                                         _Store]:
    """A real capture of ``files`` files of ``size`` bytes under the watch, its claim
    starting at ``estimate``: (what it raised, the claim at its end, its control, its store).
    The guard's disk holds the copy (``root/layer``)."""
    src = _tree(root, files, size)
    if guard is not None:
        guard.under = root / "layer"  # the copy is on the guard's disk
    control = _core.CaptureControl()
    store = _Store()
    claim = guard.claim("a snapshot", estimate) if guard is not None else None
    held = claim.__enter__() if claim is not None else None
    try:
        snapshotting._allow_first(control, held)
        copy = asyncio.ensure_future(asyncio.to_thread(
            _core.capture_layer, [(0, str(src), str(root / "layer"))], control=control))
        watch = snapshotting._within_claim(copy, control, held, disk_mb)  # type: ignore[arg-type]
        err: BaseException | None = None
        try:
            await snapshotting._to_the_end(copy, control, store, watch)  # type: ignore[arg-type]
        except (TooLarge, CapacityExceeded) as e:
            err = e
        return err, held.bytes if held is not None else 0, control, store
    finally:
        if claim is not None:
            claim.__exit__(None, None, None)


@pytest.fixture(autouse=True)
def _small_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """A claim raised 2 MiB ahead: the copies here are a few MiB."""
    monkeypatch.setattr(snapshotting, "CLAIM_AHEAD", 2 * MiB)


def test_a_copy_past_its_sandboxs_disk_mb_is_the_sandboxs_limit(tmp_path: Path):
    err, _, _, store = asyncio.run(_run(tmp_path, 8, None, 4))
    assert isinstance(err, TooLarge) and err.category == "limit", err
    assert err.details == {"limit": "disk_mb", "max": 4}
    assert store.dropped  # a copy that ended before the look is dropped all the same


def test_the_claim_is_raised_ahead_of_the_copy_and_the_disk_refuses_past_its_room(
        tmp_path: Path):
    guard = _Guard(room=1 << 30)
    err, claimed, control, _ = asyncio.run(_run(tmp_path / "a", 8, guard, 4096))
    assert err is None and control.copied() == 8 * MiB, err
    assert claimed >= control.charged() > 8 * MiB  # data and a block for each entry
    assert guard.claims == 0  # given back at the end
    guard = _Guard(room=3 * MiB)
    err, claimed, control, _ = asyncio.run(_run(tmp_path / "b", 8, guard, 4096))
    assert isinstance(err, CapacityExceeded) and err.infra, err
    assert _blocks(tmp_path / "b" / "layer") <= 3 * MiB  # never past the disk's room


def test_a_copy_from_an_estimate_that_lagged_never_passes_its_claim(tmp_path: Path):
    """The scratch's quota counts lag until its next commit: a claim of 0 for a sandbox that
    holds 6 MiB. The copy waits at its claim while the claim is raised."""
    guard = _Guard(room=5 * MiB)
    err, _, control, _ = asyncio.run(_run(tmp_path, 6, guard, 4096, estimate=0))
    assert isinstance(err, CapacityExceeded), err
    assert _blocks(tmp_path / "layer") <= 5 * MiB


def test_what_the_copy_wrote_is_not_counted_twice(tmp_path: Path):
    """The disk's free count drops as the copy writes: a claim that still counted those bytes
    made a copy look twice its size, and one from a lagging estimate was refused at half the
    room (16 MiB with 12 MiB of room)."""
    guard = _Guard(room=12 * MiB)
    err, _, control, _ = asyncio.run(_run(tmp_path, 8, guard, 4096, estimate=0))
    assert err is None and control.copied() == 8 * MiB, err
    assert guard.claims == 0


def test_small_files_are_charged_the_blocks_they_take(tmp_path: Path):
    """2,000 one-byte files are 2 KB of data and 8 MB of blocks on the copy's disk (and a
    few hundred bytes of metadata each on the btrfs scratch, whose count is the estimate):
    the copy is charged a block for each entry, and stops at the disk's room."""
    guard = _Guard(room=4 * MiB)
    err, _, control, _ = asyncio.run(_run(tmp_path, 2000, guard, 4096, size=1))
    assert isinstance(err, CapacityExceeded), err
    assert _blocks(tmp_path / "layer") <= 4 * MiB and control.copied() < 2000


def test_a_sandbox_past_its_share_of_the_state_dirs_inodes_is_its_own_failure(tmp_path: Path):
    """Empty files cost a sandbox's disk_mb nothing: a few hundred thousand of them made its
    own snapshots capacity_exceeded (infra: masked) at will. Past a capture's share of the
    state dir's inodes the sandbox's files are too many: too_large, as past the snapshot's
    other bounds (task: scored, never masked)."""
    src = _tree(tmp_path, 300, size=0)
    guard = _Guard(room=1 << 30)
    guard.under = tmp_path / "layer"
    control = _core.CaptureControl()

    async def run() -> BaseException | None:
        inodes = diskguard.InodeClaim(guard, "a snapshot", 1000, share=100)
        copy = asyncio.ensure_future(asyncio.to_thread(
            _core.capture_layer, [(0, str(src), str(tmp_path / "layer"))], control=control))
        watch = snapshotting._within_claim(copy, control, None, 4096, inodes)  # type: ignore[arg-type]
        store = _Store()
        try:
            await snapshotting._to_the_end(copy, control, store, watch)  # type: ignore[arg-type]
        except TooLarge as e:
            assert store.dropped or control.cancelled()
            return e
        return None

    err = asyncio.run(run())
    assert isinstance(err, TooLarge) and err.category == "task" and not err.infra, err
    assert err.details == {"limit": "snapshot_entries", "max": 100}


def test_an_opportunistic_raise_never_refuses(tmp_path: Path):
    """Raising a claim ahead of the copy takes what the disk has room for: a second look
    that found less (the copy wrote meanwhile) refused it, capacity_exceeded (infra), for a
    capture that would fit."""

    class _Shrinking(_Guard):
        def state(self) -> dict[str, int]:
            self.room -= MiB  # something writes between any two looks
            return super().state()

    guard = _Shrinking(room=50 * MiB)
    with guard.claim("a snapshot", 0) as held:
        held.grow_up_to(64 * MiB)
        assert 0 < held.bytes <= 50 * MiB and guard.claims == held.bytes


def test_a_copy_within_both_ends_with_its_result(tmp_path: Path):
    err, claimed, control, _ = asyncio.run(_run(tmp_path, 2, _Guard(room=1 << 30), 64))
    assert err is None and control.copied() == 2 * MiB and claimed >= 2 * MiB


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
