"""A drained node's snapshots move before it goes: Ray's autoscaler releases a drained node's
machine, and its snapshots with it. Each snapshot (oldest first: a parent before its
children, so a child's copy sends only its own layer) is copied (corral.cluster.snapshots
copy_to: the node's export streamed into another node's import) to a live node, keeping its
id, name and owner, unless a live node has it already. A node whose snapshots could not all
be moved is not drained (the gateway tries again at its next idle period)."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Any

import aiohttp

from corral.cluster import snapshots
from corral.cluster.reads import segment
from corral.daemon.app_errors import ACT_AS_HEADER
from corral.errors import SnapshotCopyFailed, SnapshotNotFound

if TYPE_CHECKING:
    from corral.cluster.gateway import Gateway
    from corral.cluster.placement import NodeLoad

log = logging.getLogger("corral.cluster")
ASK_TIMEOUT_S = 30.0


async def _listed(gw: Gateway, n: NodeLoad, tenant: str | None) -> list[dict[str, Any]]:
    """Every snapshot node ``n`` holds (a tenant's only, with ``tenant``), every page."""
    headers = gw.node_headers(admin=True)
    if tenant is not None:
        headers[ACT_AS_HEADER] = tenant
    out: list[dict[str, Any]] = []
    after: str | None = None
    while True:
        params = {"limit": "1000", **({"after": after} if after else {})}
        async with gw.session().get(n.endpoint + "/v1/snapshots", params=params,
                                    headers=headers,
                                    timeout=aiohttp.ClientTimeout(total=ASK_TIMEOUT_S)) as r:
            body = await r.read()
            if r.status != 200:
                raise SnapshotCopyFailed(f"node {n.node} did not list its snapshots: "
                                         f"{r.status} {body[:200]!r}", details={"node": n.node})
            page = json.loads(body)
        out += page.get("snapshots") or []
        after = page.get("next")
        if not after:
            return out


async def _has(gw: Gateway, n: NodeLoad, snap_id: str) -> bool:
    try:
        path = "/v1/snapshots/" + segment(snap_id, SnapshotNotFound)
        async with gw.session().get(n.endpoint + path,
                                    headers=gw.node_headers(admin=True),
                                    timeout=aiohttp.ClientTimeout(total=ASK_TIMEOUT_S)) as r:
            await r.read()
            return r.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return False


async def move_off(gw: Gateway, n: NodeLoad) -> int:
    """Copy every snapshot of node ``n`` (out of placement, still running) that no live node
    has to a live node; the number copied. Raises SnapshotCopyFailed (the drain is called
    off) if one cannot be."""
    from corral.cluster.gateway import _TENANT

    targets = [x for x in gw.nodes.values() if x.node != n.node]
    snaps = {s["id"]: s for s in await _listed(gw, n, None)}
    if snaps and not targets:
        raise SnapshotCopyFailed(f"node {n.node} holds {len(snaps)} snapshots and no other "
                                 "node is there to take them", details={"node": n.node})
    owner: dict[str, str] = {}
    for tenant in (gw.tenants.names() if gw.tenants is not None else []):
        owner.update((s["id"], tenant) for s in await _listed(gw, n, tenant))
    where: dict[str, NodeLoad] = {}  # snapshot id -> the live node that has it now
    moved = 0
    for s in sorted(snaps.values(), key=lambda s: (s.get("created_at") or 0, s["id"])):
        sid = s["id"]
        have = [t for t in targets if await _has(gw, t, sid)]
        if have:
            where[sid] = have[0]
            continue
        # With its parent if a node has that (the layers below are there), else the least
        # loaded node.
        parent = where.get(s.get("parent") or "")
        target = parent or min(targets, key=lambda t: (t.load, t.cpu_busy))
        token = _TENANT.set(owner.get(sid))  # the copy's owner: the snapshot's
        try:
            await snapshots.copy_to(gw, sid, [n], target)
        finally:
            _TENANT.reset(token)
        where[sid] = target
        moved += 1
        log.info("drained node's snapshot moved", extra={"snapshot": sid, "source": n.node,
                                                         "target": target.node})
    return moved


__all__ = ["move_off"]
