"""The cluster gateway's create handler (corral.cluster.gateway.Gateway) in this process, without
Ray: its real HTTP endpoint and placement in front of two small HTTP servers on loopback that
answer a create as a node does, one of them full. A node that is full before its load report
says so is passed over for another node; when none is left the refusal is the gateway's own,
counted as demand for the autoscaler; and placements obey the per-tenant limit."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from corral import placing
from corral.cluster.gateway import Gateway
from corral.cluster.placement import NodeLoad
from corral.errors import CapacityExceeded

from .unitkit import free_port

TOKEN = "cluster-token"


class RecordingGateway(Gateway):
    """The gateway, with the refusals it hands to its autoscaler recorded."""

    def __init__(self) -> None:
        super().__init__("unit", TOKEN)
        self.refusals: list[int] = []

    def refused(self, err: CapacityExceeded, count: int) -> None:
        self.refusals.append(count)
        super().refused(err, count)


def _node_app(name: str, full: bool, asked: list[str]) -> web.Application:
    async def create(request: web.Request) -> web.Response:
        asked.append(name)
        if full:  # the daemon's admission refusal
            return web.json_response(CapacityExceeded("sandbox limit reached").to_payload(),
                                     status=CapacityExceeded.status)
        return web.json_response({"id": f"sb-{name}-{len(asked)}", "state": "running"},
                                 status=201)

    app = web.Application()
    app.router.add_post("/v1/sandboxes", create)
    return app


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


Fixture = tuple[RecordingGateway, str, list[str], Callable[[], None]]


async def _gateway(nodes: dict[str, bool]) -> AsyncIterator[Fixture]:
    """A serving gateway whose nodes are ``nodes`` (name -> full), each with 8 free slots as
    its (fresh) report says, and a function that keeps those reports fresh."""
    asked: list[str] = []
    runners = []
    gw = RecordingGateway()
    try:
        url = await gw.serve("127.0.0.1", free_port())
        for name, full in nodes.items():
            runner, ep = await _serve(_node_app(name, full, asked))
            runners.append(runner)
            gw.nodes[name] = NodeLoad(node=name, endpoint=ep, capacity=8)
        gw.nodes_changed()

        def fresh() -> None:
            for n in gw.nodes.values():
                n.reported_at = time.monotonic()
        fresh()
        yield gw, url, asked, fresh
    finally:
        await gw.close()
        for r in runners:
            await r.cleanup()


async def _post(url: str, placement: str = "") -> tuple[int, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    if placement:
        headers[placing.HEADER] = placement
    async with aiohttp.ClientSession() as http, http.post(
            url + "/v1/sandboxes", data=json.dumps({"image": "host"}), headers=headers,
            allow_redirects=False) as r:
        return r.status, await r.json()


def _run(nodes: dict[str, bool], test: Callable[[Fixture], Any]) -> None:
    async def main() -> None:
        gen = _gateway(nodes)
        fx = await gen.__anext__()
        try:
            await test(fx)
        finally:
            await gen.aclose()
    asyncio.run(main())


def test_a_node_full_before_its_report_says_so_is_passed_over():
    async def test(fx: Fixture) -> None:
        gw, url, asked, fresh = fx
        for _ in range(6):
            fresh()
            status, body = await _post(url)
            assert status == 201 and body["node"] == "roomy", body
        assert "full" in asked  # it was chosen (least loaded) and answered full
        assert gw.refusals == []
    _run({"full": True, "roomy": False}, test)


def test_when_every_node_is_full_the_refusal_is_the_gateways_and_counts_as_demand():
    async def test(fx: Fixture) -> None:
        gw, url, asked, _ = fx
        status, body = await _post(url)
        assert status == CapacityExceeded.status and body["error"]["code"] == "capacity_exceeded"
        assert "the cluster cannot place" in body["error"]["message"]
        assert "was tried" in body["error"]["message"]
        assert asked == ["full"] and gw.refusals == [1]
    _run({"full": True}, test)


def test_placements_ahead_and_the_per_tenant_limit():
    async def test(fx: Fixture) -> None:
        gw, url, asked, _ = fx
        status, body = await _post(url, "node; ahead=2")
        assert status == placing.STATUS and len(body["ahead"]) == 2, body
        assert gw.placed == 3 and asked == []  # placed, nothing made
        # Each counts on its node: 3 placed of the 16 slots.
        assert sum(n.placed for n in gw.nodes.values()) == 3
        await gw.set_placement_limit(4)  # counts from now
        status, body = await _post(url, "node; ahead=8")
        assert status == placing.STATUS and len(body["ahead"]) == 3, body
        status, body = await _post(url, "node")  # past the limit: made by the gateway
        assert status == 201 and body["id"].startswith("sb-") and len(asked) == 1
    _run({"a": False, "b": False}, test)


@pytest.mark.parametrize("bad", ["sandbox", "node; ahead=100", "node; exclude"])
def test_a_bad_placement_ask_is_refused_before_anything_is_placed(bad: str):
    async def test(fx: Fixture) -> None:
        gw, url, asked, _ = fx
        status, body = await _post(url, bad)
        assert status == 400 and body["error"]["code"] == "invalid_request"
        assert gw.placed == 0 and asked == []
    _run({"a": False}, test)
