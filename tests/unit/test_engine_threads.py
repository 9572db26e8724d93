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
