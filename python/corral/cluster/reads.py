"""Reads the gateway answers by asking every node at once (it keeps no directory of
sandboxes or snapshots): the sandbox list, merged in the nodes' own order (created_at, then
id) and paged with the same cursor, and a snapshot from the node that holds it; each answer
names its node and endpoint, so the SDK's handles talk to their nodes."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import aiohttp
from aiohttp import web

from corral.errors import DaemonUnavailable, NotFound, SandboxNotFound, error_from_payload

if TYPE_CHECKING:
    from corral.cluster.gateway import Gateway
    from corral.cluster.placement import NodeLoad

DEFAULT_PAGE, MAX_PAGE = 1000, 10_000
ASK_TIMEOUT_S = 30.0


def segment(value: str, missing: type[NotFound] = NotFound) -> str:
    """``value`` (an id from a client) as one segment of a node's URL path. A dot segment is
    refused as ``missing``: URL normalisation would resolve it into another of the node's
    routes, called with the gateway's credentials."""
    if value in ("", ".", ".."):
        raise missing(f"no such id {value!r}", details={"id": value})
    return quote(value, safe="")


def _key(info: dict[str, Any]) -> str:
    """The nodes' own list order (corral.daemon.app list_sandboxes): one cursor for all."""
    return f"{float(info.get('created_at') or 0):020.6f}/{info.get('id')}"


async def _get(gw: Gateway, n: NodeLoad, path: str, query: list[tuple[str, str]] | None = None,
               missing_ok: bool = False) -> dict[str, Any] | None:
    """GET ``path`` of node ``n`` as the current tenant: its JSON answer, its error raised
    (None for a 404 with ``missing_ok``), daemon_unavailable when it does not answer."""
    try:
        async with gw.session().get(n.endpoint + path, params=query, headers=gw.node_headers(),
                                    timeout=aiohttp.ClientTimeout(total=ASK_TIMEOUT_S)) as r:
            body = await r.read()
            if r.status == 404 and missing_ok:
                return None
            if r.status != 200:
                raise error_from_payload(json.loads(body), r.status)
            got: dict[str, Any] = json.loads(body)
            return got
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        raise DaemonUnavailable(f"node {n.node} did not answer {path}: {e}",
                                details={"node": n.node}) from None


async def _page(gw: Gateway, n: NodeLoad, query: list[tuple[str, str]]) -> dict[str, Any]:
    got = await _get(gw, n, "/v1/sandboxes", query)
    assert got is not None
    return got


async def list_sandboxes(gw: Gateway, request: web.Request) -> dict[str, Any]:
    """One page of every node's sandboxes (``?label=``, ``?limit=``, ``?after=`` as on a
    node). A node that does not answer fails the list (a partial list would look whole)."""
    try:
        limit = min(max(int(request.query.get("limit", DEFAULT_PAGE)), 1), MAX_PAGE)
    except ValueError:
        limit = DEFAULT_PAGE
    query = [(k, v) for k, v in request.query.items() if k != "limit"]
    query.append(("limit", str(limit)))
    nodes = list(gw.nodes.values())
    pages = await asyncio.gather(*(_page(gw, n, query) for n in nodes),
                                 return_exceptions=True)
    items: list[dict[str, Any]] = []
    more = False
    for n, p in zip(nodes, pages, strict=True):
        if isinstance(p, BaseException):
            raise p  # a node's error (CorralError) or DaemonUnavailable: no partial list
        more = more or bool(p.get("next"))
        items += [dict(i, node=n.node, endpoint=n.endpoint) for i in p.get("sandboxes", [])]
    items.sort(key=_key)
    more = more or len(items) > limit
    items = items[:limit]
    return {"sandboxes": items, "next": _key(items[-1]) if more and items else None}


async def get_snapshot(gw: Gateway, key: str) -> dict[str, Any]:
    """Snapshot ``key`` (an id or a name) from a node that holds it, naming that node and its
    endpoint (cluster.snapshots.holders: not found, lost or ambiguous as there)."""
    from corral.cluster import snapshots

    _, held = await snapshots.holders(gw, key)
    n = held[0]
    info = await _get(gw, n, "/v1/snapshots/" + segment(key))
    assert info is not None
    return dict(info, node=n.node, endpoint=n.endpoint)


async def _whichever_has(gw: Gateway, path: str) -> tuple[NodeLoad, dict[str, Any]] | None:
    """GET ``path`` of every node at once: the first node that has it and its answer; None
    when every node says not found; a node's failure when none has it but one did not answer
    (it may be the one)."""
    nodes = list(gw.nodes.values())
    got = await asyncio.gather(*(_get(gw, n, path, missing_ok=True) for n in nodes),
                               return_exceptions=True)
    failed: BaseException | None = None
    for n, g in zip(nodes, got, strict=True):
        if isinstance(g, BaseException):
            failed = failed or g
        elif g is not None:
            return n, g
    if failed is not None:
        raise failed
    return None


async def get_sandbox(gw: Gateway, sid: str) -> dict[str, Any]:
    """Sandbox ``sid`` from the node that has it, naming that node and its endpoint:
    ``Sandbox.connect(id)`` through a gateway."""
    found = await _whichever_has(gw, "/v1/sandboxes/" + segment(sid, SandboxNotFound))
    if found is None:
        raise SandboxNotFound(f"no sandbox {sid!r} on any node", details={"id": sid})
    n, info = found
    return dict(info, node=n.node, endpoint=n.endpoint)


async def get_trajectory(gw: Gateway, tid: str) -> dict[str, Any]:
    """Where trajectory ``tid`` stands, from the node whose log has it, its sandbox's info
    naming that node and endpoint: ``Sandbox.from_trajectory`` through a gateway resumes on
    the sandbox's node."""
    found = await _whichever_has(gw, "/v1/trajectories/" + segment(tid))
    if found is None:
        raise NotFound(f"no trajectory {tid!r} on any node", details={"trajectory_id": tid})
    n, got = found
    return dict(got, sandbox=dict(got.get("sandbox") or {}, node=n.node, endpoint=n.endpoint))


__all__ = ["get_sandbox", "get_snapshot", "get_trajectory", "list_sandboxes", "segment"]
