"""Long calls for a client: never silent, never orphaned.

A batch (create, exec or destroy of many sandboxes), a snapshot, a fork or a restore can take
longer than a client waits. Two rules hold for each of these routes:

- ``?stream=ndjson`` answers with JSON lines: ``{"progress": {...}}`` with what is known so
  far (a batch: ``done`` of ``count`` items; a snapshot: ``bytes`` copied; a fork: both) at
  least every ``PROGRESS_EVERY_S`` (every ``PROGRESS_TICK_S`` while it changes), then one
  last line, the route's usual response object, or ``{"error": {...}}``. A client's read
  timeout then measures silence, not the call's length.
- A client that leaves (closes the connection, or a stream write fails) cancels a create
  batch, a snapshot and a fork: what they made is undone (all or nothing: the sandboxes made
  are destroyed, the partial snapshot removed), so nothing lives on until a TTL. One that
  leaves after the work ended but before its answer went out gets it undone too (``undo``),
  unless the call is keyed: its retry fetches the logged result. Exec and
  destroy batches and a restore run to their end (each result is in its sandbox's trajectory
  log; a command or a restore cut half-way would be a result nobody asked for).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web

from corral.daemon import jsonbody, oserrors
from corral.errors import CorralError, InternalError, InvalidRequest

T = TypeVar("T")
log = logging.getLogger("corral.batches")
PROGRESS_EVERY_S = 1.0  # the longest a streamed batch stays silent
PROGRESS_TICK_S = 0.2   # a streamed batch's progress lines come at most this often
GONE_POLL_S = 0.25      # how often an unstreamed batch checks that its client is still there
STREAM_MEDIA = "ndjson"


class Progress:
    """What the call has done so far: items finished of ``count`` (the work calls ``tick``
    once per item), and bytes ``copied()`` when the call copies; a call that knows neither
    (a restore) sends ``{"progress": {}}``, still a sign of life."""

    def __init__(self, count: int | None = None,
                 copied: Callable[[], int] | None = None) -> None:
        self.count = count
        self.done = 0
        self.copied = copied

    def tick(self) -> None:
        self.done += 1

    def fields(self) -> dict[str, int]:
        out = {} if self.count is None else {"done": self.done, "count": self.count}
        if self.copied is not None:
            out["bytes"] = self.copied()
        return out

    def line(self) -> bytes:
        return _line({"progress": self.fields()})


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


async def _undo(task: asyncio.Future[T], undo: Callable[[T], Awaitable[Any]] | None) -> None:
    """The work ended but nobody is there for its answer: undo what it made (shielded: a
    shutdown meanwhile does not cut it half-way). Work that failed or was cancelled undid
    itself."""
    if undo is None or not task.done() or task.cancelled() or task.exception() is not None:
        return
    try:
        await asyncio.shield(undo(task.result()))
    except Exception:  # noqa: BLE001 - logged; the client is gone either way
        log.exception("undoing a call whose client left failed")


async def run(request: web.Request, progress: Progress,
              work: Callable[[Progress], Awaitable[T]],
              answer: Callable[[T], Awaitable[Any] | Any], status: int = 200,
              cancel_when_gone: bool = False,
              undo: Callable[[T], Awaitable[Any]] | None = None) -> web.StreamResponse:
    """Run ``work`` for ``request`` under the two rules above; ``answer`` turns its result
    into the response object (it may be a coroutine: the trajectory log of a create batch).
    ``progress`` is what the work reports (passed to it) and the progress lines say.
    ``cancel_when_gone``: a client that leaves cancels the work (else it runs to its end);
    ``undo``: what undoes the work's result when its client left after it ended."""
    streamed = wants_stream(request)  # a bad value is refused before anything is done
    task = asyncio.ensure_future(work(progress))
    if not cancel_when_gone:
        task = asyncio.ensure_future(_finishing(task))
    if streamed:
        return await _streamed(request, task, progress, answer, status, undo)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=GONE_POLL_S)
            if done and (undo is None or not client_gone(request)):
                break
            if client_gone(request):
                raise asyncio.CancelledError  # nobody to answer
    except asyncio.CancelledError:
        await _cancel(task)
        await _undo(task, undo)
        raise
    obj = answer(task.result())
    if asyncio.iscoroutine(obj):
        obj = await obj
    return jsonbody.response(obj, status)


async def _streamed(request: web.Request, task: asyncio.Future[T], progress: Progress,
                    answer: Callable[[T], Awaitable[Any] | Any], status: int,
                    undo: Callable[[T], Awaitable[Any]] | None) -> web.StreamResponse:
    """The status is sent first, so it is the route's success status; a failure is the
    stream's last line."""
    resp = web.StreamResponse(status=status, headers={"Content-Type": "application/x-ndjson"})
    try:
        await resp.prepare(request)
        sent, last = progress.fields(), time.monotonic()
        await resp.write(_line({"progress": sent}))
        while not task.done():
            await asyncio.wait({task}, timeout=PROGRESS_TICK_S)
            if client_gone(request):
                raise ConnectionResetError("the client left")
            now, fields = time.monotonic(), progress.fields()
            if not task.done() and (fields != sent or now - last >= PROGRESS_EVERY_S):
                await resp.write(_line({"progress": fields}))
                sent, last = fields, now
        if client_gone(request):  # it ended as the client left
            raise ConnectionResetError("the client left")
        try:
            obj = answer(task.result())
            if asyncio.iscoroutine(obj):
                obj = await obj
        except CorralError as e:
            obj = e.to_payload()
        except OSError as e:  # mapped as the middleware maps one (the daemon's limits: infra)
            obj = oserrors.request_error(e).to_payload()
        except Exception as e:  # noqa: BLE001 - the stream's last line says it; never a 500
            obj = InternalError(f"call failed: {e}").to_payload()
        await resp.write(progress.line())
        await jsonbody.write_line(resp, obj)
        await resp.write_eof()
    except (ConnectionError, asyncio.CancelledError):
        await _cancel(task)
        await _undo(task, undo)
        raise
    return resp
