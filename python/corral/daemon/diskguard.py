"""The state directory's disk: a reserve the daemon keeps for its own state, and the room
others have already claimed on it.

Every tenant shares the filesystem of ``<state_dir>``: the trajectory log (its journal files
are allocated as they are made, the SQLite database and WAL grow), the snapshot records, the
daemon's log, snapshots' layers, pulled images, request bodies being received, commands'
output spill files, and the sparse image of the btrfs scratch that holds every sandbox's
disk. A tenant that filled it would make every tenant's calls fail, each as infra, and a
full disk under the sparse scratch image is worse: the loop device's writes fail, btrfs
aborts its transaction and turns read-only, and every sandbox's disk answers EIO.

So the daemon counts, on top of what is used:
- the scratch image's room not written yet (its size less its allocated blocks): sandboxes
  fill it without asking the daemon, and it must always find the disk blocks it may grow to;
- the output spill files' budget not used yet (corral.daemon.outputmem);
- captures in flight: what each is expected to copy (its sandbox's disk use, when the
  scratch can tell), raised ahead of what it has copied as it goes (files that share their
  blocks, reflinks, cost the sandbox's quota once and the copy each time);
and keeps ``reserve`` bytes (``CORRAL_DISK_RESERVE_MB``, 1024) free of all of it for its own
state. Inodes likewise, on a filesystem that counts them (ext4: a fixed number, one per 16 KiB
by default): a snapshot of many empty files costs no bytes, and 250,000 of them took a 4 GiB
state dir's last inode (every tenant's uploads, snapshots and trajectory log writes failed).
A capture claims ``INODE_CLAIM`` inodes above the inode reserve (``INODE_RESERVE_MIN``,
``INODE_RESERVE_FRACTION``) and raises its claim as its copy lists more entries, each raise
checked as a claim is; one that cannot is stopped, ``capacity_exceeded``.

Tenant work that writes to the disk (a snapshot or fork, a file write or upload, a
pull, an image upload, a snapshot import) is refused before it starts with
``capacity_exceeded`` (infra) when what is left would cut into the reserve; a pull or an
import is checked again as it unpacks (every 32 MiB, and before a layer's conversion), since
its size is known only as it goes; what other work writes once started is bounded by its own
limits, and a disk that fills anyway (a write from outside the daemon) is
``capacity_exceeded`` too, never an error of the request.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from collections.abc import Iterator
from typing import Any

from corral.daemon import scratch
from corral.errors import CapacityExceeded

DEFAULT_RESERVE_MB = 1024
# Inodes kept free for the daemon's own state (journal files, databases, spill files, temp
# files of uploads): at least this many, or this fraction of the filesystem's.
INODE_RESERVE_MIN = 4096
INODE_RESERVE_FRACTION = 0.01
INODE_CLAIM = 65536  # what a capture claims at first, and each raise ahead of its copy
# The most entries one capture may make: an eighth of the state dir's inodes (INODE_CLAIM at
# least, up to a quarter of them). Past it the sandbox's own files are too many (too_large,
# task): a sandbox that made a few hundred thousand empty files (no bytes of its disk_mb)
# could otherwise have its own snapshots refused as the daemon's capacity_exceeded (infra,
# masked) at will.
INODE_SHARE = 8
DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


def reserve_from_env() -> int:
    """``CORRAL_DISK_RESERVE_MB`` in bytes (1024 MiB when unset)."""
    text = os.environ.get("CORRAL_DISK_RESERVE_MB", "").strip()
    try:
        mb = int(text) if text else DEFAULT_RESERVE_MB
    except ValueError:
        raise ValueError(f"CORRAL_DISK_RESERVE_MB must be a whole number of MiB, "
                         f"not {text!r}") from None
    if mb < 0:
        raise ValueError("CORRAL_DISK_RESERVE_MB must be >= 0")
    return mb << 20


def disk_full(what: str, e: OSError | None = None) -> CapacityExceeded:
    """The error for the daemon's disk found full by one of its own writes."""
    details: dict[str, Any] = {"disk": "state_dir"}
    if e is not None:
        details["errno"] = e.errno
    return CapacityExceeded(f"the daemon's disk is full: {what}", details=details)


class DiskGuard:
    """Room left on the state dir's filesystem for tenant work, above ``reserve`` bytes.
    ``spill``: the engine's output store (its ``disk_limit`` and ``spilled``), or None."""

    def __init__(self, state_dir: str, reserve: int, spill: Any = None) -> None:
        self.state_dir = state_dir
        self.reserve = reserve
        self.spill = spill
        self.scratch_image = os.path.join(state_dir, scratch.IMAGE)
        self.claims = 0  # bytes captures in flight are expected to write
        self.inode_claims = 0  # inodes captures in flight are expected to make
        self._inode_lock = threading.Lock()  # captures claim from worker threads
        self.counters = {"refused": 0}

    def _scratch_room(self) -> int:
        """Bytes the sparse scratch image may still take from the disk."""
        try:
            st = os.stat(self.scratch_image)
        except OSError:
            return 0
        return max(0, st.st_size - st.st_blocks * 512)

    def _spill_room(self) -> int:
        if self.spill is None:
            return 0
        limit = int(getattr(self.spill, "disk_limit", 0) or 0)
        used = int(getattr(self.spill, "spilled", 0) or 0)
        return max(0, limit - used)

    def state(self) -> dict[str, int]:
        """free (the filesystem's, for an unprivileged writer), claimed, available (free less
        claimed less the reserve; negative when the reserve is cut into)."""
        st = os.statvfs(self.state_dir)
        free = st.f_bavail * st.f_frsize
        claimed = self._scratch_room() + self._spill_room() + self.claims
        return {"free": free, "claimed": claimed, "reserve": self.reserve,
                "available": free - claimed - self.reserve}

    def inodes_available(self) -> int | None:
        """Inodes left above the inode reserve and the claims; None on a filesystem that does
        not count them (btrfs, xfs: inodes are made as needed)."""
        st = os.statvfs(self.state_dir)
        if st.f_files == 0:
            return None
        return st.f_favail - self.inode_claims - self._inode_reserve(st)

    def _inode_reserve(self, st: os.statvfs_result | None = None) -> int:
        """Inodes kept for the daemon's own state (bulk work, captures, stops short of it;
        a small write, one inode, may use its first half)."""
        st = st or os.statvfs(self.state_dir)
        return max(INODE_RESERVE_MIN, int(st.f_files * INODE_RESERVE_FRACTION))

    @contextlib.contextmanager
    def claim_inodes(self, what: str) -> Iterator[InodeClaim]:
        """Claim INODE_CLAIM inodes (a capture's usual files; what is left above the reserve
        when less) until the block ends; the holder raises it as its files pass it
        (``InodeClaim.grow_to``). None left is ``capacity_exceeded``."""
        with self._inode_lock:
            left = self.inodes_available()
            n = INODE_CLAIM if left is None else min(INODE_CLAIM, left)
            if n <= 0:
                self.counters["refused"] += 1
                raise self._short_of_inodes(what, left)
            self.inode_claims += n
        held = InodeClaim(self, what, n, self.inode_share())
        try:
            yield held
        finally:
            with self._inode_lock:
                self.inode_claims -= held.n

    def inode_share(self) -> int | None:
        """The most entries one capture may make (INODE_SHARE); None on a filesystem that
        makes inodes as needed."""
        files = os.statvfs(self.state_dir).f_files
        if not files:
            return None
        # A usual capture's claim where that is at most a quarter of the filesystem: a share
        # above what the filesystem has would make a sandbox's own files the daemon's fault.
        return max(files // INODE_SHARE, min(INODE_CLAIM, files // 4))

    def _short_of_inodes(self, what: str, left: int | None) -> CapacityExceeded:
        return CapacityExceeded(
            f"the daemon's disk is short of inodes: {what} is refused to keep the inodes the "
            f"daemon needs for its own state",
            details={"disk": "state_dir", "inodes": max(0, left or 0)})

    def check(self, what: str, need: int = 0) -> None:
        """Refuse (``capacity_exceeded``) work that would leave less than the reserve, of
        bytes or of inodes."""
        left = self.inodes_available()
        if left is not None and left <= -self._inode_reserve() // 2:
            self.counters["refused"] += 1
            raise CapacityExceeded(
                f"the daemon's disk is short of inodes: {what} is refused to keep the "
                f"inodes the daemon needs for its own state",
                details={"disk": "state_dir", "inodes": 0})
        s = self.state()
        if s["available"] < need:
            self.counters["refused"] += 1
            raise CapacityExceeded(
                f"the daemon's disk is short of room: {what} needs {need} bytes, "
                f"{max(0, s['available'])} are left above the {self.reserve}-byte reserve "
                f"the daemon keeps for its own state",
                details={"disk": "state_dir", "need": need, **s})

    @contextlib.contextmanager
    def claim(self, what: str, need: int) -> Iterator[Claim]:
        """``check`` then count ``need`` bytes as taken until the block ends (a capture in
        flight: concurrent ones do not each see the same room); the block may raise it
        (``Claim.grow_to``)."""
        self.check(what, need)
        held = Claim(self, what, need)
        self.claims += need
        try:
            yield held
        finally:
            held.release()


class InodeClaim:
    """The inodes one capture in flight has claimed (``DiskGuard.claim_inodes``)."""

    def __init__(self, guard: DiskGuard, what: str, n: int, share: int | None = None) -> None:
        self.guard = guard
        self.what = what
        self.n = n
        self.share = share  # the most entries the capture may make (None: no bound)

    def grow_to(self, total: int) -> None:
        """Claim up to ``total`` inodes; refused (``capacity_exceeded``) past what is left
        above the reserve."""
        g = self.guard
        with g._inode_lock:
            more = total - self.n
            if more <= 0:
                return
            left = g.inodes_available()
            if left is not None and left < more:
                g.counters["refused"] += 1
                raise g._short_of_inodes(self.what, left)
            g.inode_claims += more
            self.n = total


class Claim:
    """The bytes one piece of work in flight may write (``DiskGuard.claim``): ``bytes`` in
    all, of which ``written`` are on the disk already. The guard counts only what is still to
    come: what was written is gone from the filesystem's free count, and counting it in the
    claim as well made a copy look twice its size (one from an estimate that lagged was
    refused at half the room)."""

    def __init__(self, guard: DiskGuard, what: str, need: int) -> None:
        self.guard = guard
        self.what = what
        self.bytes = need
        self.written = 0

    def _outstanding(self) -> int:
        return max(0, self.bytes - self.written)

    def wrote(self, total: int) -> None:
        """``total`` bytes of it are on the disk now."""
        before = self._outstanding()
        self.written = max(self.written, total)
        self.guard.claims -= before - self._outstanding()

    def grow_to(self, total: int) -> None:
        """Claim up to ``total`` bytes, the growth checked as a new claim is (a copy found to
        write more than expected: files sharing their blocks are copied whole)."""
        more = total - self.bytes
        if more <= 0:
            return
        before = self._outstanding()
        more = max(self.written, total) - max(self.written, self.bytes)
        if more > 0:
            self.guard.check(self.what, more)
        self.bytes = total
        self.guard.claims += self._outstanding() - before

    def grow_up_to(self, total: int) -> None:
        """Claim up to ``total`` bytes, as much of it as the disk has room for above the
        reserve (none: the claim stays as it is); never raises. The room is read once: a
        second look (``check``) could find less, written meanwhile, and refuse a claim that
        is only opportunistic."""
        room = self.guard.state()["available"]
        if room <= 0 or total <= self.bytes:
            return
        before = self._outstanding()
        self.bytes = min(total, max(self.bytes, self.written) + room)
        self.guard.claims += self._outstanding() - before

    def release(self) -> None:
        """The work is done: nothing more is to come."""
        self.guard.claims -= self._outstanding()
        self.bytes = self.written
