"""The init watcher (corral.daemon.initwatch): deaths of watched processes reach the event
loop; a removal, queued and never waited for, stops every report of its pid and leaves no
pidfd in the shard, even when it lands right behind its own ``add``, after the process was
reaped."""

from __future__ import annotations

import asyncio
import os
import subprocess

from corral.daemon.initwatch import InitWatcher, run_batch


def _shard_fds(w: InitWatcher) -> set[str]:
    """The fds in the shard thread's own table (it unshared it)."""
    (shard,) = w._shards
    return set(os.listdir(f"/proc/self/task/{shard.thread.native_id}/fd"))


async def _watch() -> tuple[InitWatcher, asyncio.Queue[int]]:
    died: asyncio.Queue[int] = asyncio.Queue()

    def on_dead(pids: list[int]) -> None:
        for pid in pids:
            died.put_nowait(pid)

    return InitWatcher(asyncio.get_running_loop(), on_dead), died


async def _flushed(w: InitWatcher, died: asyncio.Queue[int]) -> list[int]:
    """Everything queued to the shard so far has been handled: a sentinel added after it is
    reported dead (the shard runs its queue in order). The pids reported before it."""
    sentinel = subprocess.Popen(["true"])
    w.add(sentinel.pid)
    got: list[int] = []
    while (pid := await asyncio.wait_for(died.get(), 10)) != sentinel.pid:
        got.append(pid)
    sentinel.wait()
    return got


def test_a_watched_death_is_reported():
    async def main() -> None:
        w, died = await _watch()
        try:
            p = subprocess.Popen(["sleep", "60"])
            w.add(p.pid)
            await _flushed(w, died)  # its pidfd is open in the shard
            p.kill()
            assert await asyncio.wait_for(died.get(), 10) == p.pid
            p.wait()
            assert not w.watching(p.pid)
        finally:
            w.close()

    asyncio.run(main())


def test_a_removed_pid_is_never_reported_and_leaves_no_pidfd():
    async def main() -> None:
        w, died = await _watch()
        try:
            await _flushed(w, died)  # the shard exists
            base = _shard_fds(w)
            p = subprocess.Popen(["sleep", "60"])
            w.add(p.pid)
            await _flushed(w, died)
            assert len(_shard_fds(w)) == len(base) + 1  # its pidfd
            w.remove(p.pid)  # queued: returns at once
            p.kill()
            p.wait()  # reaped before the shard may have handled the removal
            assert await _flushed(w, died) == []
            assert _shard_fds(w) == base
        finally:
            w.close()

    asyncio.run(main())


def test_a_removal_right_behind_its_add_after_the_reap():
    """``add`` and ``remove`` of a process already reaped (its pid free for reuse): the shard
    keeps nothing, and no death is reported for the pid, whether it took the ``add`` before
    the removal was queued or both at once."""
    async def main() -> None:
        w, died = await _watch()
        try:
            await _flushed(w, died)
            base = _shard_fds(w)
            p = subprocess.Popen(["true"])
            p.wait()  # dead and reaped
            w.add(p.pid)  # the shard may take it before the removal comes, or both at once
            w.remove(p.pid)
            assert await _flushed(w, died) == []
            assert _shard_fds(w) == base
            assert not w.watching(p.pid) and len(w) == 0
        finally:
            w.close()

    asyncio.run(main())


class _LowestFdTable:
    """A shard's table with the kernel's rule for new fd numbers (the lowest free one) and
    no real pidfds: what ``run_batch`` does with a batch, step by step."""

    def __init__(self) -> None:
        self.fds: dict[int, tuple[int, int]] = {}
        self.alive: set[int] = set()

    def add(self, pid: int, token: int) -> bool:
        if pid not in self.alive:
            return False
        fd = next(n for n in range(10, 1000) if n not in self.fds)
        self.fds[fd] = (pid, token)
        return True

    def remove(self, pid: int) -> None:
        for fd, (p, _) in list(self.fds.items()):
            if p == pid:
                del self.fds[fd]

    def ended(self, fd: int) -> tuple[int, int] | None:
        return self.fds.pop(fd, None)

    def close_all(self) -> None:
        self.fds.clear()


def test_a_death_in_the_same_batch_as_a_removal_is_not_another_process_s():
    """The destroy of A queues A's removal and the next create queues B's add; A dies. The
    shard's epoll hands it the wake and A's pidfd in one batch, the wake first. The removal
    closes A's pidfd and B's add gets the same fd number: A's death must stay A's (ignored
    by its token), never B's (a live sandbox reported lost)."""
    wake = 3
    table = _LowestFdTable()
    table.alive = {100, 200}
    assert table.add(100, 1)
    (a_fd,) = table.fds
    table.alive.discard(100)  # A exits: its pidfd turns readable
    cmds = [("remove", 100, None), ("add", 200, 2)]
    died: list[tuple[int, int]] = []
    assert run_batch([wake, a_fd], wake, table, lambda: cmds, lambda p, t: died.append((p, t)))
    assert died == [(100, 1)]  # A's, with A's token: the watcher ignores it (A was removed)
    assert table.fds == {a_fd: (200, 2)}  # B watched, on the number A's pidfd had


def test_an_add_of_a_process_already_gone_reports_it():
    table = _LowestFdTable()
    died: list[tuple[int, int]] = []
    assert run_batch([3], 3, table, lambda: [("add", 300, 7)], lambda p, t: died.append((p, t)))
    assert died == [(300, 7)] and table.fds == {}
