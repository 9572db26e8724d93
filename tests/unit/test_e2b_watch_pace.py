"""The E2B front's directory watchers pace themselves by what their polls cost: the sandbox's
code decides how big the tree is, so it may decide how rarely it is polled, never how much of
corrald a watcher takes. A stand-in sandbox whose ``files.tree`` takes a known time."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from corral.e2b.connect import ConnectError
from corral.e2b.filesystem import MAX_WATCHED, POLL_S, WATCH_DUTY, _Watcher
from corral.models import FileEntry, FileTree

from .unitkit import run


class Tree:
    """``sandbox.files``: a tree of ``n`` files, answered after ``delay`` seconds."""

    def __init__(self, n: int, delay: float, truncated: bool = False) -> None:
        self.n, self.delay, self.truncated, self.calls = n, delay, truncated, []

    async def tree(self, path: str, depth: int, limit: int) -> FileTree:
        self.calls.append((path, depth, limit))
        await asyncio.sleep(self.delay)
        return FileTree(entries=[FileEntry(name=str(i), path=f"{path}/{i}", type="file",
                                           size=0, mode=0o644, mtime=0.0)
                                 for i in range(self.n)], truncated=self.truncated)


class Sb:
    def __init__(self, files: Tree) -> None:
        self.files = files


def watcher(files: Tree, recursive: bool = True) -> _Watcher:
    return _Watcher(Any, Sb(files), "sb-1", "/w", recursive, False)  # type: ignore[arg-type]


def test_a_slow_poll_spaces_the_next_ones() -> None:
    async def go() -> None:
        quick, slow = watcher(Tree(3, 0.0)), watcher(Tree(3, 0.05))
        await quick.prime()
        await slow.prime()
        assert quick.interval() == POLL_S
        assert slow.interval() >= WATCH_DUTY * 0.05
        assert await slow.poll() == []
        assert slow.interval() >= WATCH_DUTY * 0.05
    run(go())


def test_each_poll_is_one_bounded_tree_call() -> None:
    async def go() -> None:
        files = Tree(5, 0.0)
        w = watcher(files)
        await w.prime()
        await w.poll()
        assert files.calls == [("/w", 64, MAX_WATCHED)] * 2
        flat = Tree(5, 0.0)
        await watcher(flat, recursive=False).prime()
        assert flat.calls == [("/w", 1, MAX_WATCHED)]
    run(go())


def test_a_tree_past_what_a_watcher_follows_is_refused() -> None:
    with pytest.raises(ConnectError, match="entries to watch"):
        run(watcher(Tree(1, 0.0, truncated=True)).prime())
