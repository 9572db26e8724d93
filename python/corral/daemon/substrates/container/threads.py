"""The daemon's exec path off the event loop: a thread per command, bounded waits."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from typing import Any

from corral.daemon import kernel
from corral.errors import ExecStalled


def _dup(fd: int) -> int:
    """A close-on-exec copy of ``fd`` (-1 stays -1)."""
    return os.dup(fd) if fd >= 0 else -1


def _kill_abandoned(job: asyncio.Future[int]) -> None:
    """A command the daemon started for a caller that is gone: kill its group, reap it."""
    if job.cancelled() or job.exception() is not None:
        return
    pid = job.result()
    kernel.killpg(pid, signal.SIGKILL)
    threading.Thread(target=_reap_later, args=(pid,), daemon=True).start()


async def _within(fut: asyncio.Future[Any], timeout: float, what: str) -> Any:
    """Await ``fut``; after ``timeout`` cancel it and raise ExecStalled(what). Unlike
    wait_for, a cancelled caller always gets CancelledError, even if ``fut`` just finished."""
    expired = False

    def expire() -> None:
        nonlocal expired
        expired = True
        fut.cancel()

    timer = asyncio.get_running_loop().call_later(timeout, expire)
    try:
        return await fut
    except asyncio.CancelledError:
        if expired:
            raise ExecStalled(what) from None
        raise
    finally:
        timer.cancel()


def _in_thread(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> asyncio.Future[Any]:
    """Run ``fn(*args)`` in a new thread (no pool shared across sandboxes); a future of the
    loop's. A pid it returns after the loop closed is killed and reaped."""
    fut: asyncio.Future[Any] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if fut.done():
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def run() -> None:
        try:
            out: tuple[bool, Any] = (True, fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            out = (False, e)
        try:
            loop.call_soon_threadsafe(settle, *out)
        except RuntimeError:  # the loop is closed: nobody will watch the command
            if out[0] and isinstance(out[1], int):
                kernel.killpg(out[1], signal.SIGKILL)
                _reap_later(out[1])

    threading.Thread(target=run, name="corral-exec", daemon=True).start()
    return fut


def _reap_later(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
