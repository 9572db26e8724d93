"""Batch calls for a client: never silent, never orphaned.

A batch (create, exec or destroy of many sandboxes) can take longer than a client waits. Two
rules hold for every batch route:

- ``?stream=ndjson`` answers with JSON lines: ``{"progress": {"done", "count"}}`` at least
  every ``PROGRESS_EVERY_S`` (every ``PROGRESS_TICK_S`` while items finish), then one last
  line, the route's usual response object, or ``{"error": {...}}``. A client's read timeout
  then measures silence, not the batch's length.
- A client that leaves (closes the connection, or a stream write fails) cancels a create
  batch: it destroys the sandboxes it made (all or nothing), so none lives on until its TTL.
  A batch that finished just as its client left (the answer could not be delivered) is
  undone too (``undo``).
  Exec and destroy batches run to their end (each result is in its sandbox's trajectory log;
  a command cut half-way would be a result nobody asked for).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web

from corral.errors import CorralError, InternalError, InvalidRequest

T = TypeVar("T")
PROGRESS_EVERY_S = 1.0  # the longest a streamed batch stays silent
PROGRESS_TICK_S = 0.2   # a streamed batch's progress lines come at most this often
GONE_POLL_S = 0.25      # how often an unstreamed batch checks that its client is still there
STREAM_MEDIA = "ndjson"


class Progress:
    """Items of the batch finished so far (the work calls ``tick`` once per item)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.done = 0

    def tick(self) -> None:
        self.done += 1

    def line(self) -> bytes:
        return _line({"progress": {"done": self.done, "count": self.count}})


def _line(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def client_gone(request: web.Request) -> bool:
    t = request.transport
    return t is None or t.is_closing()


def wants_stream(request: web.Request) -> bool:
    values = request.query.getall("stream", [])
    if not values:
        return False
    if values != [STREAM_MEDIA]:
        raise InvalidRequest(f"bad stream {values!r}: the one streamed form is "
                             f"{STREAM_MEDIA!r}, given once")
    return True


async def _finishing(task: asyncio.Future[T]) -> T:
    """``task``, shielded: cancelling the wrapper leaves the work running."""
    return await asyncio.shield(task)


async def _cancel(task: asyncio.Future[Any]) -> None:
    """Cancel the batch and wait for its undo (a cancelled create batch destroys what it
    made before it returns)."""
    task.cancel()
    with contextlib.suppress(BaseException):
        await task


async def run(request: web.Request, count: int,
              work: Callable[[Progress], Awaitable[T]],
              answer: Callable[[T], Awaitable[Any] | Any], status: int = 200,
              cancel_when_gone: bool = False,
              undo: Callable[[T], Awaitable[Any]] | None = None) -> web.StreamResponse:
    """Run ``work`` for ``request`` under the two rules above; ``answer`` turns its result
    into the response object (it may be a coroutine: the trajectory log of a create batch).
    ``cancel_when_gone``: a client that leaves cancels the work (else it runs to its end);
    ``undo``: what to do with a result whose client left before it could have it."""
    streamed = wants_stream(request)  # a bad value is refused before anything is done
    progress = Progress(count)
    task = asyncio.ensure_future(work(progress))
    if not cancel_when_gone:
        task = asyncio.ensure_future(_finishing(task))
    if streamed:
        return await _streamed(request, task, progress, answer, status, undo)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=GONE_POLL_S)
            if done:
                break
            if client_gone(request):
                await _cancel(task)
                raise asyncio.CancelledError  # nobody to answer
    except asyncio.CancelledError:
        await _cancel(task)
        raise
    if undo is not None and client_gone(request):
        await _undo(task, undo)
        raise asyncio.CancelledError  # nobody to answer
    obj = answer(task.result())
    if asyncio.iscoroutine(obj):
        obj = await obj
    return web.Response(body=json.dumps(obj, separators=(",", ":")).encode(), status=status,
                        content_type="application/json")


async def _undo(task: asyncio.Future[T], undo: Callable[[T], Awaitable[Any]] | None) -> None:
    """A finished batch nobody will hear of: undo what it made."""
    if undo is not None and task.done() and not task.cancelled() and task.exception() is None:
        with contextlib.suppress(Exception):
            await asyncio.shield(undo(task.result()))


async def _streamed(request: web.Request, task: asyncio.Future[T], progress: Progress,
                    answer: Callable[[T], Awaitable[Any] | Any], status: int,
                    undo: Callable[[T], Awaitable[Any]] | None) -> web.StreamResponse:
    """The status is sent first, so it is the route's success status; a failure is the
    stream's last line."""
    resp = web.StreamResponse(status=status, headers={"Content-Type": "application/x-ndjson"})
    try:
        await resp.prepare(request)
        await resp.write(progress.line())
        sent, last = progress.done, time.monotonic()
        while not task.done():
            await asyncio.wait({task}, timeout=PROGRESS_TICK_S)
            if client_gone(request):
                raise ConnectionResetError("the client left")
            now = time.monotonic()
            if not task.done() and (progress.done != sent or now - last >= PROGRESS_EVERY_S):
                await resp.write(progress.line())
                sent, last = progress.done, now
        try:
            obj = answer(task.result())
            if asyncio.iscoroutine(obj):
                obj = await obj
        except CorralError as e:
            obj = e.to_payload()
        except Exception as e:  # noqa: BLE001 - the stream's last line says it; never a 500
            obj = InternalError(f"batch failed: {e}").to_payload()
        await resp.write(progress.line())
        await resp.write(_line(obj))
        await resp.write_eof()
    except (ConnectionError, asyncio.CancelledError):
        await _undo(task, undo)
        await _cancel(task)
        raise
    return resp
