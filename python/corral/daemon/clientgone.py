"""Work done for a client that stops when the client hangs up (aiohttp does not cancel a
handler when its connection closes)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from aiohttp import web

# Handlers waiting on a process for a client (streams, waits): /metrics corral_api_waiting.
WAITING: web.AppKey[dict[str, int]] = web.AppKey("waiting", dict)
# How often a handler that waits on a process checks that its client is still there.
DISCONNECT_POLL_S = 0.25
T = TypeVar("T")


async def unless_gone(request: web.Request, aw: Awaitable[T]) -> T:
    """``await aw``, cancelled if the client hangs up first: a waiter nobody reads costs
    nothing after that. Raises ConnectionResetError then, which aiohttp drops silently."""
    task = asyncio.ensure_future(aw)
    counts = request.app.get(WAITING)
    if counts is not None:
        counts["waiting"] += 1
    try:
        while True:
            done, _ = await asyncio.wait((task,), timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            transport = request.transport
            if transport is None or transport.is_closing():
                raise ConnectionResetError("client disconnected")
    finally:
        if counts is not None:
            counts["waiting"] -= 1
        if not task.done():
            task.cancel()
            await asyncio.wait((task,))
