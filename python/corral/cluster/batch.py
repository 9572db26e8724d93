"""A batch create through the gateway: ``count`` sandboxes split over the nodes by placement.

Each item is placed as a single create would be (power-of-k over the load reports, the node
selector, image locality), the items of one node go to it as one streamed create batch, and
the answer lists the sandboxes in the order asked, each naming its node and endpoint. The
client gets the progress of all the nodes together (``?stream=ndjson``, corral.daemon.batches).

A node's share fails as a whole (a node's batch is all or nothing): a node that is lost, stops
answering for ``SILENCE_S``, or refuses, fails the items placed on it. Then, by default, the
shares made elsewhere are destroyed and the batch answers the first error (all or nothing, as
on one node); with ``?partial=true`` the answer keeps the sandboxes made and puts the error at
the place of each item that failed. A node lost mid-batch never makes the client wait: the
gateway's report poller marks it lost within a report interval, and a node that goes silent is
given up after ``SILENCE_S`` (a node streams progress at least every second).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import aiohttp
from pydantic import BaseModel, ValidationError

from corral.cluster import snapshots
from corral.cluster.placement import SCAN_MAX, NodeLoad, choose
from corral.daemon import batches
from corral.errors import (
    CapacityExceeded,
    CorralError,
    InternalError,
    InvalidRequest,
    SandboxLost,
    error_from_payload,
)
from corral.models import CreateManyRequest

if TYPE_CHECKING:
    from corral.cluster.gateway import Gateway

T = TypeVar("T")
SILENCE_S = 5.0        # a node's batch stream silent this long: the node is given up on
LOSS_CHECK_S = 0.25    # how often a share looks whether the poller saw its node lost
PARTIAL_Q = "partial"
SPREAD_Q = "spread"


M = TypeVar("M", bound=BaseModel)


def parse_body(model: type[M], body: bytes) -> M:
    """A batch request's body, or invalid_request saying what is wrong (the nodes' words)."""
    try:
        return model.model_validate_json(body or b"{}")
    except ValidationError as e:
        msgs = [f"{'.'.join(str(x) for x in d['loc']) or 'value'}: {d['msg']}"
                for d in e.errors(include_url=False)[:5]]
        raise InvalidRequest(f"invalid {model.__name__}: {'; '.join(msgs)}") from None


def wants_partial(query: Any) -> bool:
    return _flag(query, PARTIAL_Q)


def wants_spread(query: Any) -> bool:
    return _flag(query, SPREAD_Q)


def _flag(query: Any, name: str) -> bool:
    values = query.getall(name, [])
    if values not in ([], ["true"], ["false"]):
        raise InvalidRequest(f"bad {name} {values!r}: true or false, given once")
    return values == ["true"]


@dataclass
class Share:
    """The items of the batch placed on one node."""

    node: NodeLoad
    indexes: list[int] = field(default_factory=list)
    done: int = 0
    infos: list[dict[str, Any]] = field(default_factory=list)
    error: CorralError | None = None


def split(nodes: list[NodeLoad], count: int, k: int, selector: dict[str, str],
          image: str, overflow: list[NodeLoad] | None = None,
          by_image: dict[str, list[NodeLoad]] | None = None,
          spread: bool = False) -> list[Share]:
    """Place each of ``count`` items; every placed item holds a slot on its node (``inflight``)
    until its share ends, so the next items see it; an item ``nodes`` have no room for goes
    to ``overflow`` (a batch from a snapshot: the nodes that lack it). ``spread``: the items
    are a group to spread over the nodes (a fork's children): each goes to the node of its
    draw that holds the fewest of them, load deciding ties; on a cluster of up to SCAN_MAX
    nodes the draw is every node, so the group is as even over them as room allows. Raises
    CapacityExceeded (nothing held)."""
    shares: dict[str, Share] = {}
    group: dict[str, int] | None = {} if spread else None
    if spread and len(nodes) <= SCAN_MAX:
        k = max(k, len(nodes))
    try:
        for i in range(count):
            try:
                n = choose(nodes, time.monotonic(), k=k, selector=selector, image=image,
                           by_image=by_image, group=group)
            except CapacityExceeded:
                if not overflow:
                    raise
                n = choose(overflow, time.monotonic(), k=k, selector=selector, image=image)
            n.inflight += 1
            shares.setdefault(n.node, Share(n)).indexes.append(i)
            if group is not None:
                group[n.node] = group.get(n.node, 0) + 1
    except CorralError:
        for s in shares.values():
            s.node.inflight -= len(s.indexes)
        raise
    return list(shares.values())


async def copy_for(gw: Gateway, snap_id: str, held: list[NodeLoad],
                   shares: list[Share]) -> None:
    """Copy the snapshot to every share's node that lacks it, side by side. A failed copy
    fails the batch before anything is made: the shares' slots are given back."""
    have = {h.node for h in held}
    try:
        await asyncio.gather(*(snapshots.copy_to(gw, snap_id, held, s.node)
                               for s in shares if s.node.node not in have))
    except BaseException:
        for s in shares:
            s.node.inflight -= len(s.indexes)
        raise


class CreateBatch:
    def __init__(self, gw: Gateway, req: CreateManyRequest, shares: list[Share],
                 partial: bool) -> None:
        self.gw, self.req, self.shares, self.partial = gw, req, shares, partial
        self.spec = req.spec.model_dump(mode="json", exclude_unset=True)

    async def run(self, progress: batches.Progress) -> list[dict[str, Any]]:
        tasks = [asyncio.ensure_future(self._watched(s, progress)) for s in self.shares]
        try:
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:
            # The client left: the shares in flight are cancelled (their nodes see the
            # connection close and destroy what they made); the ones made are destroyed here.
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.shield(self.undo())
            raise
        failed = [s for s in self.shares if s.error is not None]
        if failed and not self.partial:
            await self.undo()
            err = failed[0].error
            assert err is not None
            raise err
        out: list[dict[str, Any]] = [{} for _ in range(self.req.count)]
        for s in self.shares:
            for j, i in enumerate(s.indexes):
                out[i] = s.error.to_payload() if s.error is not None else s.infos[j]
        return out

    async def _watched(self, s: Share, progress: batches.Progress) -> None:
        n = s.node
        body = json.dumps({"count": len(s.indexes), "spec": self.spec}).encode()

        def tick(done: int) -> None:
            progress.done += done - s.done
            s.done = done
        try:
            last = await watched(self.gw, n, streamed_call(self.gw, n, "/v1/sandboxes/batch",
                                                           body, tick))
            infos = last.get("sandboxes")
            if not isinstance(infos, list) or len(infos) != len(s.indexes):
                raise lost_error(n, "its stream ended before its answer")
            for info in infos:
                info["node"], info["endpoint"] = n.node, n.endpoint
            s.infos = infos
        except CorralError as e:
            s.error = e
        finally:
            made(self.gw, n, len(s.indexes), len(s.infos) if s.error is None else 0)
            progress.done += len(s.indexes) - s.done  # failed items are done too
            s.done = len(s.indexes)

    async def undo(self) -> None:
        """Destroy what the shares made (all or nothing)."""
        await asyncio.gather(*(self.gw.destroy_on(s.node, [i["id"] for i in s.infos])
                               for s in self.shares if s.infos), return_exceptions=True)


def made(gw: Gateway, n: NodeLoad, placed: int, count: int) -> None:
    """``placed`` items placed on node ``n`` ended, ``count`` of them made: their slots are
    given back, and the made ones count on the node until a report has them."""
    n.inflight -= placed
    if count:
        now = time.monotonic()
        n.finished.extend(now for _ in range(count))
        gw.placed += count


async def watched(gw: Gateway, n: NodeLoad, call: Awaitable[T]) -> T:
    """``call`` to node ``n``, given up on (``sandbox_lost``) as soon as the gateway's
    poller reports the node lost."""
    task = asyncio.ensure_future(call)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=LOSS_CHECK_S)
            if not task.done() and n.node in gw.lost:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                raise SandboxLost(f"cluster node {n.node} was lost during the batch",
                                  details={"node": n.node})
        return task.result()
    except asyncio.CancelledError:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise


async def streamed_call(gw: Gateway, n: NodeLoad, path: str, body: bytes,
                        tick: Callable[[int], None],
                        headers: dict[str, str] | None = None) -> dict[str, Any]:
    """POST a batch to node ``n`` as a stream: ``tick`` gets its progress (items done), the
    answer is its last line. A node error is raised as it is; a broken or silent stream
    (``SILENCE_S``) as ``sandbox_lost``. ``headers``: more than the node's own."""
    try:
        async with gw.session().post(
                n.endpoint + path, data=body, params={"stream": "ndjson"},
                headers={**gw.node_headers(), **(headers or {})},
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=SILENCE_S,
                                              sock_read=SILENCE_S)) as r:
            if r.status >= 300:
                raise _answer_error(await r.read(), r.status)
            last: dict[str, Any] = {}
            async for raw in ndjson_lines(r.content):
                if not raw.strip():
                    continue
                line = json.loads(raw)
                if set(line) == {"progress"}:
                    if "done" in line["progress"]:  # a snapshot's counts bytes, not items
                        tick(int(line["progress"]["done"]))
                else:
                    last = line
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        raise lost_error(n, f"{type(e).__name__}: {e}") from None
    if "error" in last:
        raise error_from_payload(last)
    if not last:
        raise lost_error(n, "its stream ended before its answer")
    return last


async def ndjson_lines(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The lines of a stream, however long: a batch's answer line lists every sandbox's info
    (metadata up to 256 KiB each), far past the limit of aiohttp's own line reader."""
    buf = bytearray()
    searched = 0  # bytes of buf known to hold no newline
    async for chunk in content.iter_any():
        buf += chunk
        while (i := buf.find(b"\n", searched)) >= 0:
            yield bytes(buf[:i])
            del buf[:i + 1]
            searched = 0
        searched = len(buf)
    if buf:
        yield bytes(buf)


def lost_error(n: NodeLoad, why: str) -> SandboxLost:
    # A node whose batch stream broke: its corrald destroys a create batch whose client
    # left, so nothing of a create share lives on.
    return SandboxLost(f"cluster node {n.node} stopped answering during the batch ({why})",
                       details={"node": n.node})


def _answer_error(raw: bytes, status: int) -> CorralError:
    try:
        return error_from_payload(json.loads(raw), status)
    except ValueError:
        return InternalError(f"the node answered {status}: {raw[:200]!r}")
