"""An image pulled through the gateway is pulled on every node (or every node a node
selector names), once per node: ``POST /v1/images/pull`` asks each node's corrald, which
shares one pull per reference at a time (corral.daemon.oci). A pull ahead of a burst of
creates keeps the registry round trip out of them; without it a node pulls on its first
create of the image.

The answer is the node's ``ImageInfo`` (the same digests everywhere) plus ``nodes``: the
nodes that have it. A node that failed fails the pull with its own error (a registry's 5xx
stays ``image_pull_failed``, an infra error), its details naming what each node answered, so
a retry pulls only where it is missing. With ``"progress": true`` the nodes' events are
streamed as they come, each naming its ``node``; a node's end is ``node_done`` (or
``node_error``), and the last line is ``done`` or the error, as on one node.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from corral.cluster import batch
from corral.daemon.bodies import parse
from corral.errors import CapacityExceeded, CorralError, DaemonUnavailable, error_from_payload
from corral.models import PullImageRequest

if TYPE_CHECKING:
    from corral.cluster.gateway import Gateway
    from corral.cluster.placement import NodeLoad

# A pull moves an image's layers: no bound on the whole, but a node silent this long is
# taken for gone.
SILENT_S = 300.0
PATH = "/v1/images/pull"

Event = dict[str, Any]


def _line(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


async def _pull_on(gw: Gateway, n: NodeLoad, reference: str,
                   events: asyncio.Queue[Event] | None) -> dict[str, Any]:
    """Pull ``reference`` on node ``n``: its ImageInfo; its progress events (with ``node``)
    put on ``events``. Raises the node's error, or daemon_unavailable."""
    body = {"reference": reference, "progress": events is not None}
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=SILENT_S)
    try:
        async with gw.session().post(n.endpoint + PATH, json=body, headers=gw.node_headers(),
                                     timeout=timeout) as r:
            if events is None or r.status != 201:
                raw = await r.read()
                got = json.loads(raw)
                if r.status != 201:
                    raise error_from_payload(got, r.status)
                return dict(got)
            async for line in batch.ndjson_lines(r.content):
                if not line.strip():
                    continue
                ev = json.loads(line)
                if "error" in ev:
                    raise error_from_payload(ev)
                if ev.get("event") == "done":
                    return dict(ev["image"])
                events.put_nowait({**ev, "node": n.node})
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        raise DaemonUnavailable(f"node {n.node} did not answer the pull: {e}",
                                details={"node": n.node}) from None
    raise DaemonUnavailable(f"node {n.node}'s pull ended without a result",
                            details={"node": n.node})


def _nodes(gw: Gateway, selector: dict[str, str] | None) -> list[NodeLoad]:
    nodes = [n for n in gw.nodes.values() if n.matches(selector)]
    if not nodes:
        raise CapacityExceeded("no node of the cluster " + (
            f"has the labels {selector}" if selector else "answers"),
            details={"selector": selector or {}})
    return nodes


def _outcome(nodes: list[NodeLoad], got: list[dict[str, Any] | BaseException]
             ) -> dict[str, Any]:
    """The answer of a pull every node made, or the first failure with every node's."""
    failed = [(n, g) for n, g in zip(nodes, got, strict=True) if isinstance(g, BaseException)]
    if not failed:
        first = got[0]
        assert isinstance(first, dict)
        return {**first, "nodes": sorted(n.node for n in nodes)}
    per_node = {n.node: ("pulled" if isinstance(g, dict) else
                         g.code if isinstance(g, CorralError) else "failed")
                for n, g in zip(nodes, got, strict=True)}
    node, err = failed[0]
    if not isinstance(err, CorralError):
        raise err
    err.details = {**err.details, "node": node.node, "nodes": per_node}
    raise err


async def pull(gw: Gateway, request: web.Request,
               selector: dict[str, str] | None) -> web.StreamResponse:
    """``POST /v1/images/pull`` on the gateway: on every (selected) node at once."""
    req: PullImageRequest = parse(await request.read(), PullImageRequest)
    nodes = _nodes(gw, selector)
    if not req.progress:
        got = await asyncio.gather(*(_pull_on(gw, n, req.reference, None) for n in nodes),
                                   return_exceptions=True)
        return web.json_response(_outcome(nodes, list(got)), status=201)

    events: asyncio.Queue[Event] = asyncio.Queue()

    async def one(n: NodeLoad) -> dict[str, Any]:
        try:
            info = await _pull_on(gw, n, req.reference, events)
        except CorralError as e:
            # Not an "error" key: that line is the stream's last (the SDK raises it).
            events.put_nowait({"event": "node_error", "node": n.node, "code": e.code,
                               "message": e.message})
            raise
        events.put_nowait({"event": "node_done", "node": n.node})
        return info

    resp = web.StreamResponse(status=201, headers={"Content-Type": "application/x-ndjson"})
    await resp.prepare(request)
    tasks = [asyncio.ensure_future(one(n)) for n in nodes]
    try:
        pending: set[asyncio.Future[Any]] = set(tasks)
        while pending:
            get = asyncio.ensure_future(events.get())
            done, _ = await asyncio.wait(pending | {get}, return_when=asyncio.FIRST_COMPLETED)
            pending -= done
            if get in done:
                await resp.write(_line(get.result()))
            else:
                get.cancel()
        while not events.empty():
            await resp.write(_line(events.get_nowait()))
        got = [t.exception() or t.result() for t in tasks]
        try:
            final = {"event": "done", "image": _outcome(nodes, got)}
        except CorralError as e:
            final = e.to_payload()
        await resp.write(_line(final))
        await resp.write_eof()
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()  # this caller only: each node's pull is its own to finish
    return resp
