"""Worker threads for file operations that may take long, shared fairly between tenants.

A files call that may take long (a page of a big directory, a tar upload or the plan of a
download, a remove, a rename, a mkdir, a write, a big read) runs in a worker thread. Those were the
default executor's, which every create and destroy needs too: one tenant's 40 uploads of a
tar of many small files held all 32 for minutes and another tenant's create waited for them
(over 10 minutes, measured), and 32 threads running tarfile's Python took the GIL from the
event loop (a health check took 2.5 s). Here such operations run in threads of their own
(``THREADS``), of which one tenant's operations hold at most ``PER_TENANT`` at once; its
others wait, holding no thread, for one of its own to end. A share is held until its
thread's work has ended, not until its caller stops waiting: a client that hangs up (its
handler cancelled) cannot start more threads than its share.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import threading
import weakref
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

THREADS = 32     # file operations of all tenants at once
PER_TENANT = 8   # of them one tenant's (a sandbox without a tenant is the admin's, "")


class _Share:
    __slots__ = ("running", "waiters")

    def __init__(self) -> None:
        self.running = 0
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()


# Per event loop (a daemon has one; the unit tests run many): tenant -> its share.
_SHARES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, _Share]] = \
    weakref.WeakKeyDictionary()
_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = concurrent.futures.ThreadPoolExecutor(THREADS,
                                                          thread_name_prefix="corral-files")
        return _POOL


def _release(shares: dict[str, _Share], key: str, share: _Share) -> None:
    """One of ``key``'s threads is free: hand it to its next waiter, else give it back."""
    while share.waiters:
        waiter = share.waiters.popleft()
        if not waiter.done():
            waiter.set_result(None)  # the share passes to it as it is
            return
    share.running -= 1
    if not share.running and shares.get(key) is share:
        del shares[key]


def running(tenant: str | None) -> int:
    """Threads ``tenant``'s file operations hold now (for tests and metrics)."""
    share = _SHARES.get(asyncio.get_running_loop(), {}).get(tenant or "")
    return share.running if share is not None else 0


async def run(tenant: str | None, fn: Callable[[], T], start: Callable[[], None] | None = None,
              end: Callable[[], None] | None = None) -> T:
    """``fn()`` in a file thread, within ``tenant``'s share of them. ``start`` is called on
    the loop once the thread is had, right before ``fn`` is handed to it (what it raises is
    raised, nothing run); ``end`` on the loop once ``fn`` has ended, or will never run: a
    sandbox's operation counts as in a thread from its start to its end, queued ones not,
    so a destroy waits for the ones running only, and never for a thread still at work."""
    loop = asyncio.get_running_loop()
    shares = _SHARES.setdefault(loop, {})
    key = tenant or ""
    share = shares.get(key)
    if share is None:
        share = shares[key] = _Share()
    if share.running >= PER_TENANT or share.waiters:
        waiter = loop.create_future()
        share.waiters.append(waiter)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                _release(shares, key, share)  # handed a thread as it was cancelled
            else:
                with contextlib.suppress(ValueError):
                    share.waiters.remove(waiter)
            raise
    else:
        share.running += 1

    def ended() -> None:
        _release(shares, key, share)
        if end is not None:
            end()

    def done(_: concurrent.futures.Future[T]) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nothing left to share
            loop.call_soon_threadsafe(ended)

    try:
        if start is not None:
            start()
    except BaseException:
        _release(shares, key, share)
        raise
    try:
        job = _pool().submit(fn)
    except BaseException:
        ended()
        raise
    # Released when the work has ended (or was cancelled before it started), never before.
    job.add_done_callback(done)
    return await asyncio.wrap_future(job, loop=loop)
