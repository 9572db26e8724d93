"""The log's retention prune, which the ingester runs every minute: what it deletes, and
that finding it reads the log's small columns, never the outputs it holds. A real SQLite
database and journal in a private dir."""

from __future__ import annotations

import pytest

from .test_trajlog_policy import Counted, opened
from .unitkit import run

OUTPUT = "x" * (1 << 20)  # an output the log keeps whole: each entry ~1 MiB of the file


def _bytes_read() -> int:
    """The bytes this process (every thread: the ingester's too) has read from files."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def test_a_prune_reads_the_logs_index_not_its_outputs(state, clock):
    """48 entries of 1 MiB outputs, of live sandboxes and of an ended one, and an entry of an
    id with no sandbox row (whose entries a prune does read: a rare case): a prune that finds
    nothing to delete reads a few pages, not the 48 MiB of entries (before, it read every
    entry's row to its end: the outputs' overflow pages, the whole file, every minute, on the
    ingester's thread, which a daemon's stop waits for)."""
    async def go() -> None:
        async with opened(state, clock, retention_s=3600) as tl:
            for i in range(4):
                tl.sandbox_created(f"sb-{i}", {"image": "host"}, clock.time())
            for n in range(48):
                await tl.run(f"sb-{n % 4}", "exec", {"cmd": "cat"}, None,
                             Counted(clock, {"exit_code": 0, "stdout": OUTPUT}))
            await tl.run("nobody", "exec", {"cmd": "true"}, None, Counted(clock, {}))
            tl.sandbox_ended("sb-0", "killed")
            await tl.flushed()
            clock.advance(60)
            before = _bytes_read()
            assert await tl.prune() == 0
            read = _bytes_read() - before
            assert read < 2 << 20, read
            _, entries = tl.read("sb-1")
            assert len(entries) == 12 and entries[0]["result"]["stdout"] == OUTPUT
    run(go())


@pytest.mark.parametrize("ended_first", [True, False])
def test_a_prune_deletes_what_retention_ended_and_keeps_the_rest(state, clock, ended_first):
    """After retention: an ended sandbox's log goes, a live one's stays; the entries of an id
    with no sandbox row go once they are older than retention (newer ones stay), whether or
    not they are already in the by-sandbox index."""
    async def go() -> None:
        async with opened(state, clock, retention_s=3600) as tl:
            for sid in ("live", "ended"):
                tl.sandbox_created(sid, {"image": "host"}, clock.time())
            for sid in ("live", "ended", "nobody"):
                await tl.run(sid, "mkdir", {"path": "/old"}, None, Counted(clock, {}))
            if ended_first:
                tl.sandbox_ended("ended", "killed")
            clock.advance(1800)
            await tl.run("nobody", "mkdir", {"path": "/new"}, None, Counted(clock, {}))
            if not ended_first:
                tl.sandbox_ended("ended", "killed")
            await tl.flushed()
            clock.advance(3600 - 1800 + 1)
            assert await tl.prune() == (1 if ended_first else 0)
            assert len(tl.read("live")[1]) == 1
            assert (tl.read("ended") is None) == ended_first
            conn = tl._reader
            left = [r[0] for r in conn.execute(
                "SELECT request FROM entries WHERE sandbox_id='nobody'")]
            assert left == ['{"path":"/new"}'] or left == ['{"path": "/new"}'], left
    run(go())

