"""The init watcher (corral.daemon.initwatch): deaths of watched processes reach the event
loop; a removal, queued and never waited for, stops every report of its pid and leaves no
pidfd in the shard, even when it lands right behind its own ``add``, after the process was
reaped."""

from __future__ import annotations

import asyncio
import os
import subprocess

from corral.daemon.initwatch import InitWatcher


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
