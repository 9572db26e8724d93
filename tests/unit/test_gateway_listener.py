"""The cluster gateway's listener is guarded as corrald's is (corral.daemon.tcpguard): no
token is needed to connect, and idle half-sent connections held all 20,000 fds the gateway
had while every tenant's call hung. Past the cap, the oldest silent ones are closed for new
ones, and a client with the cluster's token is served throughout."""

from __future__ import annotations

import asyncio

import aiohttp

from corral.cluster.gateway import Gateway
from corral.daemon.tcpguard import TcpGuard

from .unitkit import free_port

TOKEN = "cluster-token"


def test_silent_connections_cannot_keep_the_gateways_clients_out() -> None:
    async def main() -> None:
        gw = Gateway("unit", TOKEN)
        gw.guard = TcpGuard(32, sweep_s=0.05, grace_s=0.1)
        try:
            url = await gw.serve("127.0.0.1", free_port())
            port = int(url.rsplit(":", 1)[1])
            squat = [await asyncio.open_connection("127.0.0.1", port) for _ in range(64)]
            await asyncio.sleep(0.5)  # past the grace and the sweep
            closed = 0
            for r, _ in squat:
                try:
                    closed += await asyncio.wait_for(r.read(1), 0.05) == b""
                except asyncio.TimeoutError:
                    pass
            assert closed >= 64 - 8, closed  # a quarter of the cap without a token
            async with aiohttp.ClientSession() as http:
                for _ in range(5):
                    async with http.get(url + "/v1/cluster",
                                        headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
                        assert resp.status == 200, await resp.text()
            for _, w in squat:
                w.close()
        finally:
            await gw.close()
    asyncio.run(main())
