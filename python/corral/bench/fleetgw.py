"""The cluster gateway of ``corral bench fleet``, alone in its process (so that its CPU and
memory are its own): the real ``corral.cluster.gateway.Gateway`` (its HTTP endpoint,
placement, batch splitting, report poller), with the one Ray piece replaced: a node's load
report comes from the simulated node agent over HTTP (``GET /v1/report``) instead of its
supervisor actor.

    python -m corral.bench.fleetgw    # config: one JSON line on stdin

prints one JSON line (``url``, ``pid``, ``rss_kib_before_nodes``) once it serves and knows
every node, then serves until its stdin closes.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
from typing import Any

from corral.cluster.gateway import Gateway


class FleetGateway(Gateway):
    """A supervisor here is the node agent's base URL."""

    async def report_of(self, supervisor: Any) -> dict[str, Any]:
        async with self.session().get(f"{supervisor}/v1/report",
                                      headers=self.node_headers()) as r:
            got: dict[str, Any] = await r.json()
            return got

    def node_gone(self, err: BaseException) -> bool:
        return False  # a simulated node never leaves


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def serve(cfg: dict[str, Any]) -> None:
    gw = FleetGateway("fleet", str(cfg["token"]), k=int(cfg.get("k", 2)))
    try:
        url = await gw.serve("127.0.0.1", _free_port())
        rss0 = _rss_kib()
        for ep in cfg["endpoints"]:
            r = await gw.report_of(ep)
            await gw.add_node(r["node"], ep, r)
        print(json.dumps({"url": url, "pid": os.getpid(), "rss_kib_before_nodes": rss0}),
              flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.buffer.read)
    finally:
        await gw.close()


def main() -> None:
    asyncio.run(serve(json.loads(sys.stdin.buffer.readline())))


if __name__ == "__main__":
    main()
