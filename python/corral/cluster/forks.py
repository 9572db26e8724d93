"""A fork through the gateway: one sandbox's state, ``count`` children over the cluster's nodes.

``POST /v1/sandboxes/{id}/fork`` on the gateway does what a node's fork does (snapshot, then
``count`` sandboxes on it with the parent's spec), but the children are placed as a gateway
batch: by default they fill the parent's node first and overflow to others; with
``?spread=true`` they are spread over the nodes as a group (corral.cluster.batch.split). The
snapshot's layers move to every node that gets a child (corral.cluster.snapshots).

1. The parent's node and info (its trajectory), and its spec (``GET .../spec`` on the node).
2. The snapshot, taken on that node (keyed like the fork: a replay finds it in the log).
3. The children:
   - unkeyed: one create batch per node, all or nothing (a failure destroys those made);
   - keyed ``T:S`` (a parent made for trajectory ``T``): child ``i`` is trajectory
     ``T/forkS/i``, made by a create keyed ``T/forkS/i:create`` on its node, as a node's fork
     names them. A child some node's log already has is taken as it is (a replay after a
     lost answer, or after a gateway restart), so a fork sent again returns the same
     children and makes only the missing ones; nothing is undone on a failure (the retry
     finishes it).
4. Unless ``keep_snapshot``, the snapshot is deleted on every node that has it once the
   children exist (they hold its layers).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from corral.cluster import batch, reads
from corral.cluster.placement import NodeLoad
from corral.daemon import batches
from corral.daemon.routes import KEY_PATTERN
from corral.daemon.trajlog.keys import KEY_HEADER, MAX_KEY_LEN
from corral.errors import InvalidRequest, SandboxNotFound
from corral.models import STORED, CreateManyRequest, ForkRequest, SandboxSpec
from corral.nodeselector import HEADER as SELECTOR_HEADER
from corral.nodeselector import parse_selector

if TYPE_CHECKING:
    from corral.cluster.gateway import Gateway

KEY_RE = re.compile(KEY_PATTERN)
# A keyed fork's children looked up at once, each on every node: a fork of 10,000 must not
# hold every connection of the gateway's pool (and every node's attention) at the same time.
LOOKUPS_AT_ONCE = 32


def children_of(trajectory: str | None, key: str | None, count: int) -> list[str] | None:
    """The trajectories of a keyed fork's children, by the node's own rule
    (corral.daemon.engine.snapshotting): key ``T:S`` of the parent's trajectory ``T``, or an
    explicit key ``S``, gives ``T/forkS/i``; else None (the children have none)."""
    if trajectory is None or key is None:
        return None
    head, sep, step = key.rpartition(":")
    if sep and head != trajectory:
        return None
    return [f"{trajectory}/fork{step}/{i}" for i in range(count)]


class Fork:
    """One fork request's work (``run``), its answer and its undo."""

    def __init__(self, gw: Gateway, sid: str, req: ForkRequest, key: str | None,
                 selector: dict[str, str], spread: bool) -> None:
        self.gw, self.sid, self.req, self.key = gw, sid, req, key
        self.selector, self.spread = selector, spread
        self.parent: NodeLoad | None = None
        self.snap: dict[str, Any] | None = None
        self.copies: list[NodeLoad] = []  # nodes the snapshot was copied to
        self.made: batch.CreateBatch | None = None

    async def run(self, progress: batches.Progress) -> dict[str, Any]:
        path = "/v1/sandboxes/" + reads.segment(self.sid, SandboxNotFound)
        found = await reads._whichever_has(self.gw, path)
        if found is None:
            raise SandboxNotFound(f"no sandbox {self.sid!r} on any node",
                                  details={"id": self.sid})
        parent, info = found
        self.parent = parent
        spec_d = await reads._get(self.gw, parent, path + "/spec")
        assert spec_d is not None
        kids = children_of(info.get("trajectory_id"), self.key, self.req.count)
        body = json.dumps({"name": self.req.name} if self.req.name else {}).encode()
        snap = await batch.watched(self.gw, parent, batch.streamed_call(
            self.gw, parent, path + "/snapshot", body,
            lambda _: None, {KEY_HEADER: self.key} if self.key else None))
        self.snap = dict(snap, node=parent.node, endpoint=parent.endpoint)
        spec = SandboxSpec.model_validate({**spec_d, "snapshot": snap["id"]}, context=STORED)
        if kids is None:
            items = await self._batch(spec, progress)
        else:
            items = await self._keyed(spec, kids, progress)
        if not self.req.keep_snapshot:
            await self.drop_snapshot()
        return {"snapshot": self.snap, "sandboxes": items}

    async def _batch(self, spec: SandboxSpec, progress: batches.Progress
                     ) -> list[dict[str, Any]]:
        """All or nothing: one create batch per node (corral.cluster.batch.CreateBatch)."""
        assert self.parent is not None
        try:
            req, shares = await self.gw.place_batch(
                CreateManyRequest(count=self.req.count, spec=spec), self.selector,
                self.spread, held=[self.parent])
            self.copies = [s.node for s in shares if s.node.node != self.parent.node]
            self.made = batch.CreateBatch(self.gw, req, shares, partial=False)
            return await self.made.run(progress)
        except BaseException:
            await asyncio.shield(self.drop_snapshot())  # all or nothing: not kept
            raise

    async def _keyed(self, spec: SandboxSpec, kids: list[str], progress: batches.Progress
                     ) -> list[dict[str, Any]]:
        """Each child by its trajectory: found on the node whose log has it, else made there
        by a keyed create."""
        assert self.parent is not None
        gate = asyncio.Semaphore(LOOKUPS_AT_ONCE)

        async def look(t: str) -> tuple[NodeLoad, dict[str, Any]] | None:
            async with gate:
                return await reads._whichever_has(self.gw, "/v1/trajectories/"
                                                  + reads.segment(t))
        looked = await asyncio.gather(*(look(t) for t in kids))
        out: list[dict[str, Any]] = [{} for _ in kids]
        missing = []
        for i, got in enumerate(looked):
            if got is None:
                missing.append(i)
                continue
            n, traj = got
            out[i] = dict(traj.get("sandbox") or {}, node=n.node, endpoint=n.endpoint)
            progress.tick()
        if not missing:
            return out
        req, shares = await self.gw.place_batch(
            CreateManyRequest(count=len(missing), spec=spec), self.selector, self.spread,
            held=[self.parent])
        self.copies = [s.node for s in shares if s.node.node != self.parent.node]
        body = req.spec.model_dump_json(exclude_unset=True).encode()

        async def one(n: NodeLoad, i: int) -> None:
            info: dict[str, Any] | None = None
            try:
                info = await batch.watched(self.gw, n, self._create(n, body, kids[i]))
            finally:
                batch.made(self.gw, n, 1, 0 if info is None else 1)
            out[i] = dict(info, node=n.node, endpoint=n.endpoint)
            progress.tick()
        await asyncio.gather(*(one(s.node, missing[j]) for s in shares for j in s.indexes))
        return out

    async def _create(self, n: NodeLoad, body: bytes, trajectory: str) -> dict[str, Any]:
        headers = {**self.gw.node_headers(), KEY_HEADER: f"{trajectory}:create"}
        try:
            async with self.gw.session().post(
                    n.endpoint + "/v1/sandboxes", data=body, headers=headers,
                    timeout=aiohttp.ClientTimeout(total=None, sock_connect=batch.SILENCE_S,
                                                  sock_read=reads.ASK_TIMEOUT_S)) as r:
                raw = await r.read()
                if r.status >= 300:
                    raise batch._answer_error(raw, r.status)
                got: dict[str, Any] = json.loads(raw)
                return got
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            raise batch.lost_error(n, f"{type(e).__name__}: {e}") from None

    async def drop_snapshot(self) -> None:
        """Delete the fork's snapshot on every node that has it (its children hold its
        layers); a node that fails to is left with a listed copy."""
        if self.snap is None or self.parent is None:
            return
        path = "/v1/snapshots/" + reads.segment(self.snap["id"])

        async def drop(n: NodeLoad) -> None:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with self.gw.session().delete(
                        n.endpoint + path, headers=self.gw.node_headers(),
                        timeout=aiohttp.ClientTimeout(total=reads.ASK_TIMEOUT_S)) as r:
                    await r.read()
        await asyncio.gather(*(drop(n) for n in [self.parent, *self.copies]))

    async def undo(self, _: Any) -> None:
        """The client left after the fork ended (unkeyed): its children are destroyed and its
        snapshot dropped, kept or not (as a node's fork does)."""
        if self.made is not None:
            await self.made.undo()
        await self.drop_snapshot()


async def fork(gw: Gateway, request: web.Request) -> web.StreamResponse:
    """``POST /v1/sandboxes/{id}/fork`` through the gateway (module docstring)."""
    key = request.headers.get(KEY_HEADER)
    if key is not None and not KEY_RE.match(key):
        raise InvalidRequest(f"{KEY_HEADER} must be 1 to {MAX_KEY_LEN} visible ASCII "
                             "characters (no spaces)")
    selector = parse_selector(request.headers.get(SELECTOR_HEADER, ""))
    batches.wants_stream(request)
    spread = batch.wants_spread(request.query)
    req = batch.parse_body(ForkRequest, await request.read())
    work = Fork(gw, request.match_info["id"], req, key, selector, spread)
    return await batches.run(request, batches.Progress(req.count), work.run, _same, 201,
                             cancel_when_gone=True, undo=None if key else work.undo)


def _same(value: Any) -> Any:
    return value


__all__ = ["children_of", "fork"]
