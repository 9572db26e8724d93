"""Where a snapshot lives on a cluster: a create from a snapshot (``snapshot=`` in its spec)
runs on the node that holds the snapshot's layers, which the gateway finds by asking every
node at once (it keeps no directory of snapshots, as it keeps none of sandboxes). Layers do
not move between nodes: a snapshot's children are made where it is."""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import aiohttp

from corral.errors import Conflict, SandboxLost, SnapshotNotFound

if TYPE_CHECKING:
    from corral.cluster.gateway import Gateway
    from corral.cluster.placement import NodeLoad

ASK_TIMEOUT_S = 5.0


def snapshot_of(body: bytes) -> str | None:
    """The snapshot a create body starts from (the node validates the body)."""
    try:
        doc: Any = json.loads(body)
        snap = doc.get("snapshot")
    except (ValueError, AttributeError):
        return None
    return snap if isinstance(snap, str) and snap else None


async def holders(gw: Gateway, snapshot: str) -> list[NodeLoad]:
    """The nodes that have ``snapshot`` (an id, or a name: one node's name). Raises
    SnapshotNotFound if none has it and every node answered, SandboxLost if none has it
    while some node did not answer (it may be there), Conflict if a name is on several
    nodes (names are per node; ids are unique)."""
    nodes = list(gw.nodes.values())
    path = "/v1/snapshots/" + quote(snapshot, safe="")

    async def ask(n: NodeLoad) -> bool | None:
        try:
            async with gw.session().get(n.endpoint + path, headers=gw.node_headers(),
                                      timeout=aiohttp.ClientTimeout(total=ASK_TIMEOUT_S)
                                      ) as r:
                await r.read()
                if r.status == 200:
                    return True
                return False if r.status == 404 else None
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None

    got = await asyncio.gather(*(ask(n) for n in nodes))
    have = [n for n, g in zip(nodes, got, strict=True) if g]
    silent = [n.node for n, g in zip(nodes, got, strict=True) if g is None]
    if len(have) > 1 and not snapshot.startswith("snap-"):
        raise Conflict(f"snapshot name {snapshot!r} is on {len(have)} nodes (a name is one "
                       "node's); use the snapshot's id", details={"snapshot": snapshot})
    if have:
        return have
    if silent:
        raise SandboxLost(f"no answering node has snapshot {snapshot!r}, and {len(silent)} "
                          "did not answer: it may be there", details={"nodes": silent})
    raise SnapshotNotFound(f"no node of the cluster has snapshot {snapshot!r}",
                           details={"snapshot": snapshot})


__all__ = ["holders", "snapshot_of"]
