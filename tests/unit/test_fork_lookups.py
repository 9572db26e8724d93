"""A keyed fork through the gateway looks its children up a bounded number at a time
(corral.cluster.forks.LOOKUPS_AT_ONCE), however many it asks for: each lookup asks every
node, and a fork of thousands must not take every connection of the gateway at once."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from corral.cluster import forks, reads
from corral.cluster.gateway import Gateway
from corral.cluster.placement import NodeLoad
from corral.daemon import batches
from corral.models import ForkRequest, SandboxSpec


def test_a_keyed_forks_children_are_looked_up_a_bounded_number_at_a_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    node = NodeLoad(node="n1", endpoint="http://127.0.0.1:9", reported_at=0.0)
    in_flight, most = 0, 0

    async def whichever_has(gw: Any, path: str) -> tuple[NodeLoad, dict[str, Any]]:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        await asyncio.sleep(0)  # let every other lookup start, if it may
        await asyncio.sleep(0)
        in_flight -= 1
        return node, {"sandbox": {"id": path.rsplit("%2F", 1)[-1]}}

    monkeypatch.setattr(reads, "_whichever_has", whichever_has)

    async def run() -> list[dict[str, Any]]:
        fork = forks.Fork(Gateway("unit", "token"), "sb-1", ForkRequest(count=500), "T:1",
                          {}, False)
        fork.parent = node
        kids = [f"T/fork1/{i}" for i in range(500)]
        return await fork._keyed(SandboxSpec(), kids, batches.Progress(500))

    out = asyncio.run(run())
    assert [o["id"] for o in out] == [str(i) for i in range(500)]  # every child, in order
    assert most == forks.LOOKUPS_AT_ONCE
