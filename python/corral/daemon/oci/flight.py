"""One pull per reference at a time on a node, however many callers ask (``corral image pull``
and every ``Sandbox(image=REF)`` of a burst): the first starts it in a worker thread, the
others await the same result; each caller gets the progress events from the moment it joined.
A caller that goes away (a closed connection) does not cancel the pull for the others."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

Listener = Callable[[dict[str, Any]], None]


class Flight:
    def __init__(self) -> None:
        self.listeners: list[Listener] = []
        self.task: asyncio.Future[Any] | None = None

    def emit(self, event: dict[str, Any]) -> None:
        for fn in list(self.listeners):
            fn(event)


async def join(flights: dict[str, Flight], key: str,
               work: Callable[[Callable[[dict[str, Any]], None]], Any],
               listener: Listener | None = None, executor: Executor | None = None,
               started: Callable[[asyncio.Future[Any]], None] | None = None) -> Any:
    """``work(emit)`` runs in a thread (of ``executor``, else the loop's default) once per
    ``key`` at a time; its result for all. ``started(task)`` is called when this call is the
    one that starts it (the task ends when the work does, whoever still waits)."""
    loop = asyncio.get_running_loop()
    fl = flights.get(key)
    if fl is None:
        fl = flights[key] = Flight()
        this = fl

        def emit(event: dict[str, Any]) -> None:  # from the worker thread
            loop.call_soon_threadsafe(this.emit, event)

        async def run() -> Any:
            try:
                return await loop.run_in_executor(executor, work, emit)
            finally:
                flights.pop(key, None)

        fl.task = asyncio.ensure_future(run())
        if started is not None:
            started(fl.task)
    if listener is not None:
        fl.listeners.append(listener)
    assert fl.task is not None
    try:
        return await asyncio.shield(fl.task)
    finally:
        if listener is not None and listener in fl.listeners:
            fl.listeners.remove(listener)
