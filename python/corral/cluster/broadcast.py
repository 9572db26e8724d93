"""Exec and destroy batches of plain sandbox ids through the gateway.

The gateway does not know which node holds an id (it places creates; it keeps no directory
of sandboxes), so a batch of ids is sent to every node, each runs its own ids and answers
``sandbox_not_found`` for the others, and the answers are merged in the order asked. This is
the path for clients that have ids only; the SDK sends a batch of handles to their nodes
directly (the gateway then carries no exec output at all). An id no answering node has, while
some node failed (lost, silent), answers ``sandbox_lost``: it most likely lived there.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from corral.cluster.batch import parse_body, streamed_call, watched
from corral.daemon import batches
from corral.errors import CapacityExceeded, CorralError, SandboxLost
from corral.models import ExecManyRequest, KillManyRequest

if TYPE_CHECKING:
    from corral.cluster.gateway import Gateway
    from corral.cluster.placement import NodeLoad

NOT_FOUND = "sandbox_not_found"


class Broadcast:
    """One batch of ``ids`` sent to every node; ``merge`` picks each id's answer."""

    def __init__(self, gw: Gateway, path: str, body: bytes, count: int) -> None:
        self.gw, self.path, self.body, self.count = gw, path, body, count
        self.nodes: list[NodeLoad] = list(gw.nodes.values())
        if not self.nodes:
            raise CapacityExceeded("the cluster has no node that answers")

    async def run(self, progress: batches.Progress) -> list[dict[str, Any] | CorralError]:
        done = [0] * len(self.nodes)

        def ticker(i: int) -> Any:
            def tick(d: int) -> None:
                done[i] = d
                progress.done = min(done)  # an item is done once every node answered it
            return tick
        got = await asyncio.gather(
            *(watched(self.gw, n, streamed_call(self.gw, n, self.path, self.body, ticker(i)))
              for i, n in enumerate(self.nodes)), return_exceptions=True)
        for g in got:
            if isinstance(g, BaseException) and not isinstance(g, CorralError):
                raise g
        return list(got)  # type: ignore[arg-type]

    def failed(self, got: list[dict[str, Any] | CorralError]) -> SandboxLost | None:
        lost = [(n, g) for n, g in zip(self.nodes, got, strict=True)
                if isinstance(g, CorralError)]
        if not lost:
            return None
        return SandboxLost(f"no answering node has this sandbox, and {len(lost)} node(s) "
                           f"failed the batch ({lost[0][1]}): it was most likely there",
                           details={"nodes": [n.node for n, _ in lost]})


async def exec_batch(gw: Gateway, request: Any, body: bytes) -> Any:
    req = parse_body(ExecManyRequest, body)
    b = Broadcast(gw, "/v1/sandboxes/batch/exec", body, len(req.ids))

    def answer(got: list[dict[str, Any] | CorralError]) -> dict[str, Any]:
        gone = b.failed(got)
        out: list[dict[str, Any]] = []
        for i in range(len(req.ids)):
            items = [g["results"][i] for g in got if isinstance(g, dict)]
            found = [x for x in items if x.get("error", {}).get("code") != NOT_FOUND]
            if found:
                out.append(found[0])
            elif gone is not None:
                out.append(gone.to_payload())
            else:
                out.append(items[0])  # not found anywhere
        return {"results": out}
    return await batches.run(request, batches.Progress(len(req.ids)), b.run, answer)


async def destroy_batch(gw: Gateway, request: Any, body: bytes) -> Any:
    req = parse_body(KillManyRequest, body)
    b = Broadcast(gw, "/v1/sandboxes/batch/destroy", body, len(req.ids))

    def answer(got: list[dict[str, Any] | CorralError]) -> dict[str, Any]:
        gone = b.failed(got)
        answers = [{x["index"]: x for x in g["not_killed"]} for g in got if isinstance(g, dict)]
        not_killed: list[dict[str, Any]] = []
        for i, sid in enumerate(req.ids):
            if any(i not in a for a in answers):
                continue  # killed by the node that had it
            items = [a[i] for a in answers]
            ended = [x for x in items if "error" not in x]
            if ended:
                not_killed.append(ended[0])
            elif gone is not None:
                not_killed.append({**gone.to_payload(), "index": i, "id": sid, "killed": False})
            else:
                not_killed.append(items[0])
        failed = sum(1 for x in not_killed if "error" in x)
        return {"killed": len(req.ids) - len(not_killed),
                "already_ended": len(not_killed) - failed, "failed": failed,
                "not_killed": not_killed}
    return await batches.run(request, batches.Progress(len(req.ids)), b.run, answer)

