"""An operation of a sandbox running in a worker thread holds off its destroy: a kill that
comes meanwhile waits for it (woken when it ends, not by polling), then destroys."""

from __future__ import annotations

import asyncio
import io
import threading

from .unitkit import engine_on, run, spec


class _HeldReader(io.RawIOBase):
    """Upload data whose read blocks until released (the worker thread stays busy)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        self.entered.set()
        self.release.wait(30)
        return b"data"


def test_a_kill_waits_for_a_file_operation_in_a_worker_thread(state, clock):
    async def go():
        async with engine_on(state, clock) as (eng, sub):
            sb = await eng.create(spec())
            data = _HeldReader()
            released_at_destroy: list[bool] = []
            destroy = sub.destroy

            def recording_destroy(runtime):
                released_at_destroy.append(data.release.is_set())
                destroy(runtime)

            sub.destroy = recording_destroy
            write = asyncio.ensure_future(eng.write_file(sb.id, "/f", data, 0o644))
            await asyncio.to_thread(data.entered.wait, 10)
            assert sb.threads == 1
            kill = asyncio.ensure_future(eng.kill(sb.id))
            for _ in range(50):  # the kill runs up to its wait
                await asyncio.sleep(0)
            assert not kill.done() and sb.threads_done is not None
            data.release.set()
            await write
            assert await kill is True
            assert released_at_destroy == [True] and sb.id in sub.destroyed
            assert sb.threads == 0 and sb.threads_done is None
    run(go())


def test_no_threads_returns_at_once_when_none_runs(state, clock):
    async def go():
        async with engine_on(state, clock) as (eng, _):
            sb = await eng.create(spec())
            await asyncio.wait_for(sb.no_threads(), 1)
            sb.enter_thread()
            waiters = [asyncio.ensure_future(sb.no_threads()) for _ in range(3)]
            await asyncio.sleep(0)
            assert not any(w.done() for w in waiters)
            sb.leave_thread()
            await asyncio.wait_for(asyncio.gather(*waiters), 1)
            assert sb.threads_done is None
    run(go())


def test_a_failed_creates_destroy_runs_off_the_loop(state, clock, monkeypatch):
    """A create that fails once its sandbox exists (here: its record cannot be written)
    destroys what it made in a worker thread: while that destroy waits (a sandbox's
    processes can take seconds to end), the loop serves other calls, and the create answers
    its error once the destroy is done, with nothing left."""
    from corral.daemon import persist

    async def go():
        async with engine_on(state, clock) as (eng, sub):
            entered, release = threading.Event(), threading.Event()
            destroy = sub.destroy

            def slow_destroy(runtime):
                entered.set()
                release.wait(30)
                destroy(runtime)

            def no_room(*a, **kw):
                raise OSError(28, "No space left on device")

            sub.destroy = slow_destroy
            monkeypatch.setattr(persist, "write_json_atomic", no_room)
            create = asyncio.ensure_future(eng.create(spec()))
            await asyncio.to_thread(entered.wait, 10)
            # Here while the destroy waits: the loop is free (it ran this test's await).
            assert eng.list({}) == [] and not create.done()
            release.set()
            try:
                await create
            except Exception as e:  # noqa: BLE001 - the create's own error
                err = e
            assert type(err).__name__ == "CapacityExceeded", err
            assert sub.destroyed and sub.boxes == {}

    run(go())


def test_a_read_that_needs_the_disk_runs_in_a_file_thread(state, clock):
    """A small read is tried on the loop from memory only; a file the substrate says is not
    in memory (a sandbox can keep its files cold and its disk busy) is read in a file thread,
    never on the loop. The same for the /etc/passwd a command's user is looked up in."""
    async def go():
        async with engine_on(state, clock) as (eng, sub):
            sb = await eng.create(spec())
            box = sub.boxes[sb.id]
            box.files.update({"/warm": b"w", "/cold": b"c",
                              "/etc/passwd": b"agent:x:1000:1000::/home/agent:/bin/sh\n"})
            box.cold.update({"/cold", "/etc/passwd"})
            loop = threading.current_thread().name
            assert (await eng.read_file(sb.id, "/warm", 100))[0] == b"w"
            assert box.read_threads == [loop]
            assert (await eng.read_file(sb.id, "/cold", 100))[0] == b"c"
            assert box.read_threads[1] != loop
            ident = await eng._identity(sb, "agent")
            assert (ident.uid, ident.home) == (1000, "/home/agent")
            assert box.read_threads[2] != loop  # /etc/passwd: cold
    run(go())


def test_a_stat_that_needs_the_disk_or_a_long_walk_runs_in_a_file_thread(state, clock):
    """A stat is tried on the loop from memory only; a path the substrate cannot resolve
    that way (a lookup from the disk, a symlink in it, a long path) is stat'ed in a file
    thread."""
    async def go():
        async with engine_on(state, clock) as (eng, sub):
            sb = await eng.create(spec())
            box = sub.boxes[sb.id]
            box.files.update({"/warm": b"w", "/s0/f": b"c"})
            box.cold.add("/s0/f")
            loop = threading.current_thread().name
            assert (await eng.stat(sb.id, "/warm")).type == "file"
            assert box.stat_threads == [loop]
            assert (await eng.stat(sb.id, "/s0/f")).size == 1
            assert box.stat_threads[1] != loop
    run(go())
