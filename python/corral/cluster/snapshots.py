"""Where a snapshot lives on a cluster: a create from a snapshot (``snapshot=`` in its spec)
runs on a node that holds the snapshot's layers, which the gateway finds by asking every
node at once (it keeps no directory of snapshots, as it keeps none of sandboxes). When the
holders have no room, the snapshot is copied to the node placement chooses among the others
(:func:`copy_to`: the holder's export streamed into the target's import, through the gateway,
never whole in memory; one copy per snapshot and target however many creates wait for it),
and the create goes there."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import TYPE_CHECKING, Any

import aiohttp

from corral.cluster.reads import segment
from corral.errors import Conflict, SandboxLost, SnapshotCopyFailed, SnapshotNotFound

if TYPE_CHECKING:
    from corral.cluster.gateway import Gateway
    from corral.cluster.placement import NodeLoad

ASK_TIMEOUT_S = 5.0
COPY_CHUNK = 1 << 20
log = logging.getLogger("corral.cluster")


def snapshot_of(body: bytes) -> str | None:
    """The snapshot a create body starts from (the node validates the body)."""
    try:
        doc: Any = json.loads(body)
        snap = doc.get("snapshot")
    except (ValueError, AttributeError):
        return None
    return snap if isinstance(snap, str) and snap else None


async def holders(gw: Gateway, snapshot: str) -> tuple[str, list[NodeLoad]]:
    """The snapshot's id and the nodes that have ``snapshot`` (an id, or a name: one node's
    name; a copy keeps its id, and its name where the target had none such). Raises
    SnapshotNotFound if none has it and every node answered, SandboxLost if none has it
    while some node did not answer (it may be there), Conflict if a name names different
    snapshots on different nodes (names are per node; ids are unique).

    An id the nodes' load reports list is looked for on the nodes that reported it only
    (they confirm it, as the request's tenant): a create from a snapshot costs as many
    requests as it has holders, not one per node. A name, an id no report lists yet, or an
    id none of its reported holders confirms (deleted since), asks every node."""
    path = "/v1/snapshots/" + segment(snapshot, SnapshotNotFound)

    async def ask(n: NodeLoad) -> str | bool | None:
        """The snapshot's id, False (not there) or None (no answer)."""
        try:
            async with gw.session().get(n.endpoint + path, headers=gw.node_headers(),
                                      timeout=aiohttp.ClientTimeout(total=ASK_TIMEOUT_S)
                                      ) as r:
                raw = await r.read()
                if r.status == 200:
                    sid = json.loads(raw).get("id")
                    return sid if isinstance(sid, str) and sid else None
                return False if r.status == 404 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError):
            return None

    hint = [n for n in gw.by_snapshot().get(snapshot, ()) if n.node in gw.nodes]
    if hint:
        said = await asyncio.gather(*(ask(n) for n in hint))
        have = [n for n, g in zip(hint, said, strict=True) if g == snapshot]
        if have:
            return snapshot, have
    nodes = list(gw.nodes.values())
    got = await asyncio.gather(*(ask(n) for n in nodes))
    have = [n for n, g in zip(nodes, got, strict=True) if isinstance(g, str)]
    if not have and gw.moving:  # it may be on its way off a drained node: ask again after
        await asyncio.gather(*list(gw.moving), return_exceptions=True)
        return await holders(gw, snapshot)
    ids = {g for g in got if isinstance(g, str)}
    silent = [n.node for n, g in zip(nodes, got, strict=True) if g is None]
    if len(ids) > 1:
        raise Conflict(f"snapshot name {snapshot!r} names {len(ids)} different snapshots on "
                       "different nodes (a name is one node's); use the snapshot's id",
                       details={"snapshot": snapshot})
    if have:
        return ids.pop(), have
    if silent:
        raise SandboxLost(f"no answering node has snapshot {snapshot!r}, and {len(silent)} "
                          "did not answer: it may be there", details={"nodes": silent})
    raise SnapshotNotFound(f"no node of the cluster has snapshot {snapshot!r}",
                           details={"snapshot": snapshot})


async def copy_to(gw: Gateway, snap_id: str, holders: list[NodeLoad],
                  target: NodeLoad) -> None:
    """Copy snapshot ``snap_id`` from one of ``holders`` to ``target``; concurrent callers for
    the same snapshot and target wait for one copy. Raises SnapshotCopyFailed (the target's
    import is all or nothing: a failed copy leaves nothing there)."""
    key = (snap_id, target.node)
    fut = gw.copies.get(key)
    if fut is None:
        fut = asyncio.ensure_future(_copy(gw, snap_id, holders, target))
        gw.copies[key] = fut
        fut.add_done_callback(lambda _: gw.copies.pop(key, None))
    await asyncio.shield(fut)


async def _copy(gw: Gateway, snap_id: str, holders: list[NodeLoad],
                target: NodeLoad) -> None:
    src = min(holders, key=lambda n: (n.cpu_busy, n.load))
    path = "/v1/snapshots/" + segment(snap_id, SnapshotNotFound)
    details = {"snapshot": snap_id, "source": src.node, "target": target.node}
    started = time.monotonic()
    try:
        have = await _target_has(gw, src, target, path)
        # As the admin (export and import are node to node): the holder has shown the
        # snapshot to the request's tenant (holders), and the import names that tenant.
        admin = gw.node_headers(admin=True)
        owner = gw.tenant()
        async with gw.session().get(src.endpoint + path + "/export",
                                    params=[("have", d) for d in have],
                                    headers=admin) as out:
            if out.status != 200:
                raise _failed(details, f"the holder answered {out.status}", await out.read())
            async with gw.session().post(
                    target.endpoint + "/v1/snapshots", data=out.content.iter_chunked(
                        COPY_CHUNK), params=[("tenant", owner)] if owner else [],
                    headers={**admin, "Content-Type": "application/x-tar"}) as into:
                raw = await into.read()
                if into.status >= 300:
                    raise _failed(details, f"the target answered {into.status}", raw)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise SnapshotCopyFailed(f"copying snapshot {snap_id} from node {src.node} to node "
                                 f"{target.node} failed: {type(e).__name__}: {e}",
                                 details={**details, "cause": type(e).__name__}) from None
    log.info("snapshot copied", extra={**details, "have": len(have),
                                       "seconds": round(time.monotonic() - started, 3)})


async def _target_has(gw: Gateway, src: NodeLoad, target: NodeLoad, path: str) -> list[str]:
    """Layers of the chain the target has already: its copy of the snapshot's parent, if
    any (a fork tree's levels share all but their top layer). Best effort: the target's
    import stores a layer it has once whatever it is sent."""
    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ValueError,
                             AttributeError):
        timeout = aiohttp.ClientTimeout(total=ASK_TIMEOUT_S)
        async with gw.session().get(src.endpoint + path, headers=gw.node_headers(),
                                    timeout=timeout) as r:
            parent = json.loads(await r.read()).get("parent") if r.status == 200 else None
        if isinstance(parent, str) and parent:
            parent_path = "/v1/snapshots/" + segment(parent, SnapshotNotFound)
            async with gw.session().get(target.endpoint + parent_path,
                                        headers=gw.node_headers(),
                                        timeout=timeout) as r:
                if r.status == 200:
                    layers = json.loads(await r.read()).get("layers")
                    return [d for d in layers if isinstance(d, str)]
    return []


def _failed(details: dict[str, Any], why: str, raw: bytes) -> SnapshotCopyFailed:
    try:
        cause = json.loads(raw)["error"]
        cause = {"code": cause.get("code"), "message": cause.get("message")}
    except (ValueError, KeyError, TypeError, AttributeError):
        cause = {"code": None, "message": raw[:200].decode("utf-8", "replace")}
    return SnapshotCopyFailed(f"copying snapshot {details['snapshot']} to node "
                              f"{details['target']} failed: {why}: {cause['message']}",
                              details={**details, "cause": cause})


def with_snapshot(body: bytes, snap_id: str) -> bytes:
    """A create body naming the snapshot by id (a copy's name may be another's on its node)."""
    doc = json.loads(body)
    doc["snapshot"] = snap_id
    return json.dumps(doc).encode()


__all__ = ["copy_to", "holders", "snapshot_of", "with_snapshot"]
