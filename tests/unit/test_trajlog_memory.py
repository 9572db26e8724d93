"""What the trajectory log holds in memory for big entries (commands printing binary output):
the log's copies of results that wait for their turn or for the ingester, and the texts
SQLite keeps bound to its statements. A real SQLite database and journal in a private dir."""

from __future__ import annotations

import asyncio
import ctypes
import weakref
from typing import Any

import pytest

from corral.daemon.trajlog import base as trajlog_base
from corral.daemon.trajlog.base import BIG_AT_ONCE

from .test_trajlog_policy import Counted, opened
from .unitkit import run

# An output the log keeps whole (under its 1 Mi character cap) that JSON makes six times
# bigger: every character is a control character (\u0001).
BINARY = "\x01" * 400_000


class LogCopy(dict):  # type: ignore[type-arg]
    """A result as the log copies it (a dict that can be weakly referenced: counted alive)."""


def test_calls_waiting_for_the_log_hold_no_copy_of_their_results(state, clock, monkeypatch):
    """24 commands with big outputs end at once while the ingester is behind (its byte bound
    lowered to 1 MiB, so each call waits for it). The log's copies of their results (each an
    output made text, then its JSON twice) exist only while being encoded: never more than
    BIG_AT_ONCE at once, and what the ingester has not written stays within its bound but
    for those. Before, every call made its copy before waiting for its turn, and kept it (and
    its JSON texts) while it waited for the ingester: all 24 at once, ~12 MiB each for a
    default-capped binary output; and calls that had waited for their turn wrote past the
    bound, each having checked it before the wait."""
    monkeypatch.setattr(trajlog_base, "MAX_PENDING_BYTES", 1 << 20)
    alive, most = [0], [0]
    backlog = [0]  # most journal bytes not yet in the database

    def gone() -> None:
        alive[0] -= 1

    def to_log(value: dict[str, Any]) -> LogCopy:
        copy = LogCopy(value)
        weakref.finalize(copy, gone)
        alive[0] += 1
        most[0] = max(most[0], alive[0])
        return copy

    async def go() -> None:
        async with opened(state, clock) as tl:
            append = tl._append

            def counted(*args: Any, **kw: Any) -> int:
                n = append(*args, **kw)
                backlog[0] = max(backlog[0], tl._pending_bytes + tl._ingesting_bytes)
                return n

            tl._append = counted  # type: ignore[method-assign]
            for i in range(24):
                tl.sandbox_created(f"sb-{i}", {"image": "host"}, clock.time())
            calls = [tl.run(f"sb-{i}", "exec", {"cmd": "yes"}, None,
                            Counted(clock, {"exit_code": 0, "stdout": BINARY}), to_log=to_log)
                     for i in range(24)]
            results = await asyncio.gather(*calls)
            assert all(r["stdout"] == BINARY for r in results)
            await tl.flushed()
            for i in (0, 23):
                _, entries = tl.read(f"sb-{i}")
                assert entries[0]["result"]["stdout"] == BINARY
    run(go())
    assert 2 <= most[0] <= BIG_AT_ONCE, most[0]
    entry = 2_900_000  # one entry's journal line
    assert backlog[0] <= (1 << 20) + BIG_AT_ONCE * entry, backlog[0]


def _sqlite_memory_highwater() -> int:
    """SQLite's most memory in use since the last call (which resets it)."""
    import _sqlite3

    try:  # the library Python's sqlite3 module is linked to
        fn = ctypes.CDLL(_sqlite3.__file__).sqlite3_memory_highwater
    except (OSError, AttributeError):
        pytest.skip("sqlite3_memory_highwater is not reachable from the sqlite3 module")
    fn.restype = ctypes.c_int64
    fn.argtypes = [ctypes.c_int]
    return int(fn(1))


def test_sqlite_holds_one_big_entry_at_a_time_while_ingesting(state, clock):
    """A batch of 16 entries of 2.4 MB of JSON each, ingested at once: SQLite copies every
    text bound to a statement until it is done, so one multi-row INSERT for all of them
    held a second copy of the batch (~40 MB). Entries go in by statements of at most a
    megabyte of text, a bigger one alone."""
    async def go() -> None:
        async with opened(state, clock, flush_ms=60_000) as tl:  # one batch: the barrier's
            tl.sandbox_created("sb-1", {"image": "host"}, clock.time())
            await tl.flushed()
            _sqlite_memory_highwater()
            await asyncio.gather(*[
                tl.run("sb-1", "exec", {"cmd": f"{i}"}, None,
                       Counted(clock, {"exit_code": 0, "stdout": BINARY}))
                for i in range(16)])
            await tl.flushed()
            most = _sqlite_memory_highwater()
            assert most < 8 << 20, most
            _, entries = tl.read("sb-1")
            assert len(entries) == 16 and all(e["result"]["stdout"] == BINARY for e in entries)
    run(go())
