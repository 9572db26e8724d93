"""The cluster gateway reads every request body whole (creates, batches, forks, pulls), so the
bodies it holds at once come from one pool (corral.daemon.bodymem): 20 creates of 15 MiB at
once against a node that is slow to answer, 17 are taken (256 MiB) and 3 refused at once with
capacity_exceeded; small requests are never refused; the pool is whole again after."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
from aiohttp import web

from corral.cluster.gateway import Gateway
from corral.cluster.placement import NodeLoad
from corral.daemon.bodymem import LIMIT

from .unitkit import free_port

TOKEN = "cluster-token"
HEADERS = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}


def test_big_bodies_held_at_once_are_bounded() -> None:
    go = asyncio.Event()
    arrived = 0

    async def create(request: web.Request) -> web.Response:
        nonlocal arrived
        await request.read()
        arrived += 1
        await go.wait()
        return web.json_response({"id": f"sb-{arrived}", "state": "running"}, status=201)

    async def main() -> None:
        node = web.Application(client_max_size=32 << 20)
        node.router.add_post("/v1/sandboxes", create)
        runner = web.AppRunner(node, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        ep = f"http://127.0.0.1:{runner.addresses[0][1]}"
        gw = Gateway("unit", TOKEN)
        reporting: asyncio.Future[None] | None = None
        try:
            url = await gw.serve("127.0.0.1", free_port())
            gw.nodes["n1"] = NodeLoad(node="n1", endpoint=ep, capacity=1000,
                                      reported_at=time.monotonic())
            gw.nodes_changed()

            async def reports() -> None:  # the node reports as a live one does (a report
                while True:               # older than 3 s takes it out of placement)
                    gw.nodes["n1"].reported_at = time.monotonic()
                    await asyncio.sleep(0.5)

            reporting = asyncio.ensure_future(reports())
            big = json.dumps({"image": "host", "env": {"X": "x" * (15 << 20)}}).encode()
            async with aiohttp.ClientSession() as http:
                async def post(body: bytes) -> tuple[int, dict]:
                    async with http.post(url + "/v1/sandboxes", data=body,
                                         headers=HEADERS) as r:
                        return r.status, await r.json()

                sent = [asyncio.ensure_future(post(big)) for _ in range(20)]
                taken = LIMIT // len(big)
                deadline = time.monotonic() + 50  # a loaded 2-core machine moves 300 MB slowly
                while sum(t.done() for t in sent) < 20 - taken or arrived < taken:
                    assert time.monotonic() < deadline, (arrived, sum(t.done() for t in sent))
                    await asyncio.sleep(0.02)  # polling the fake node's count, with a deadline
                assert gw.bodies.held == taken * len(big)
                small = asyncio.ensure_future(post(json.dumps({"image": "host"}).encode()))
                while arrived < taken + 1:  # a small body is never refused
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.02)
                go.set()
                got = [await t for t in sent]
                assert (await small)[0] == 201
            refused = [b for s, b in got if s != 201]
            assert len(refused) == 20 - taken == 3, [s for s, _ in got]
            assert all(b["error"]["code"] == "capacity_exceeded" for b in refused), refused
            assert gw.bodies.held == 0
        finally:
            if reporting is not None:
                reporting.cancel()
            await gw.close()
            await runner.cleanup()
    asyncio.run(main())
