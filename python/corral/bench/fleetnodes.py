"""Simulated node agents for ``corral bench fleet``: N small HTTP servers in one process, each
answering the part of a node's API the cluster gateway uses, with a real node's measured
costs and a live count, but no sandbox.

    python -m corral.bench.fleetnodes    # its config: one JSON line on stdin

prints one JSON line (``{"endpoints": [...]}``) once every node listens, then serves until its
stdin closes (the bench holds the other end: if the bench dies, so does the fleet).

One port per node, not one port with a path per node: the gateway keeps a connection pool
per host and port, as it does with real nodes, and each node's endpoint is a plain base URL
as a real node's is. The routes:

- ``POST /v1/sandboxes``: one create; answers a SandboxInfo (a real one's JSON, its id
  replaced) after the node's cost;
- ``POST /v1/sandboxes/batch?stream=ndjson``: ``count`` creates; a progress line, then
  ``{"sandboxes": [...]}``;
- ``POST /v1/sandboxes/batch/destroy``: ``ids`` destroyed (the gateway's undo);
- ``GET /v1/report``: the load report a supervisor gives the gateway.

Cost model, per node: a node makes ``rate`` sandboxes per second at most (its throughput,
measured on a real corrald as a batch create) and none in less than ``latency_ms`` (a real
single create's latency). A request of n sandboxes ends at max(now + latency, the node's
queue + n / rate): requests queue behind each other as on a busy node.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web


@dataclass
class SimNode:
    node: str
    endpoint: str
    capacity: int
    latency_s: float
    rate: float
    info: str          # a SandboxInfo's JSON with the id as "@ID@"
    live: int = 0
    made: int = 0
    free_at: float = 0.0

    def finish_at(self, n: int) -> float:
        now = time.monotonic()
        self.free_at = max(now, self.free_at) + n / self.rate
        return max(now + self.latency_s, self.free_at)

    def infos(self, n: int) -> list[str]:
        base = self.made
        self.made += n
        return [self.info.replace("@ID@", f"{self.node}-{base + i:08x}") for i in range(n)]

    def report(self) -> dict[str, Any]:
        return {"node": self.node, "endpoint": self.endpoint, "labels": {},
                "live": self.live, "capacity": self.capacity, "mem_free_mb": 100_000,
                "cpu_busy": 0.0, "images": [], "pid": 0}


def _authorized(request: web.Request, token: str) -> bool:
    return request.headers.get("Authorization", "") == f"Bearer {token}"


def app_for(n: SimNode, token: str) -> web.Application:
    async def create(request: web.Request) -> web.Response:
        if not _authorized(request, token):
            return web.json_response({"error": {"code": "unauthorized"}}, status=401)
        await request.read()
        await asyncio.sleep(max(0.0, n.finish_at(1) - time.monotonic()))
        n.live += 1
        return web.Response(body=n.infos(1)[0].encode(), status=201,
                            content_type="application/json")

    async def batch(request: web.Request) -> web.StreamResponse:
        if not _authorized(request, token):
            return web.json_response({"error": {"code": "unauthorized"}}, status=401)
        count = int(json.loads(await request.read())["count"])
        resp = web.StreamResponse(status=201)
        resp.content_type = "application/x-ndjson"
        await resp.prepare(request)
        await resp.write(json.dumps({"progress": {"done": 0, "count": count}}).encode() + b"\n")
        await asyncio.sleep(max(0.0, n.finish_at(count) - time.monotonic()))
        n.live += count
        await resp.write(b'{"sandboxes": [' + ",".join(n.infos(count)).encode() + b"]}\n")
        await resp.write_eof()
        return resp

    async def destroy(request: web.Request) -> web.Response:
        if not _authorized(request, token):
            return web.json_response({"error": {"code": "unauthorized"}}, status=401)
        ids = json.loads(await request.read()).get("ids") or []
        n.live = max(0, n.live - len(ids))
        return web.json_response({"results": [{"id": i} for i in ids]})

    async def report(request: web.Request) -> web.Response:
        if not _authorized(request, token):
            return web.json_response({"error": {"code": "unauthorized"}}, status=401)
        return web.json_response(n.report())

    app = web.Application(client_max_size=16 << 20)
    app.router.add_post("/v1/sandboxes", create)
    app.router.add_post("/v1/sandboxes/batch", batch)
    app.router.add_post("/v1/sandboxes/batch/destroy", destroy)
    app.router.add_get("/v1/report", report)
    return app


async def serve(cfg: dict[str, Any]) -> None:
    runners: list[web.AppRunner] = []
    nodes: list[SimNode] = []
    try:
        for i in range(int(cfg["nodes"])):
            n = SimNode(node=f"sim{i:04d}", endpoint="", capacity=int(cfg["capacity"]),
                        latency_s=float(cfg["latency_ms"]) / 1000, rate=float(cfg["rate"]),
                        info=str(cfg["info"]))
            runner = web.AppRunner(app_for(n, str(cfg["token"])), access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
            await site.start()
            runners.append(runner)
            port = runner.addresses[0][1]
            n.endpoint = f"http://127.0.0.1:{port}"
            nodes.append(n)
        print(json.dumps({"endpoints": [n.endpoint for n in nodes]}), flush=True)
        # Until the bench closes our stdin (or dies).
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.buffer.read)
    finally:
        for r in runners:
            await r.cleanup()


def main() -> None:
    # The config comes on stdin, not the command line: it holds the fleet's token.
    asyncio.run(serve(json.loads(sys.stdin.buffer.readline())))


if __name__ == "__main__":
    main()
