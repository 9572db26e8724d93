"""The cluster gateway streams logs through connections every placement and read shares: a
tenant holds at most LOG_STREAMS_PER_TENANT of them at once, all tenants and the admin at most
LOG_STREAMS, and a client that takes nothing for LOG_WRITE_STALL_S is cut (a slow one that
keeps taking is not)."""

from __future__ import annotations

import asyncio
import collections
from typing import Any

import pytest

from corral.cluster import gateway as gw
from corral.errors import CapacityExceeded, QuotaExceeded


def _gateway() -> Any:
    g = gw.Gateway.__new__(gw.Gateway)  # only the stream counters: no cluster, no Ray
    g._log_streams = collections.Counter()
    return g


def test_a_tenant_holds_its_share_of_log_streams_and_the_admin_the_gateways() -> None:
    async def go() -> None:
        g, gate = _gateway(), asyncio.Event()

        async def stream() -> str:
            await gate.wait()
            return "done"

        def start(tenant: str | None) -> asyncio.Task[Any]:
            gw._TENANT.set(tenant)
            return asyncio.ensure_future(g._streaming(stream()))

        alice = [start("alice") for _ in range(gw.LOG_STREAMS_PER_TENANT)]
        await asyncio.sleep(0)
        gw._TENANT.set("alice")
        with pytest.raises(QuotaExceeded) as e:
            await g._streaming(stream())
        assert e.value.details["resource"] == "log_streams"
        admin = [start(None) for _ in range(gw.LOG_STREAMS - len(alice))]  # not capped at 8
        await asyncio.sleep(0)
        gw._TENANT.set("bob")
        with pytest.raises(CapacityExceeded) as e2:  # the gateway's own bound
            await g._streaming(stream())
        assert not isinstance(e2.value, QuotaExceeded)
        gate.set()
        assert await asyncio.gather(*alice, *admin) == ["done"] * gw.LOG_STREAMS
        assert not g._log_streams  # every stream let go
        assert await g._streaming(stream()) == "done"

    asyncio.run(go())


def test_a_client_that_takes_nothing_is_cut_and_a_slow_one_is_not(monkeypatch) -> None:
    class Client:
        def __init__(self, delay: float) -> None:
            self.delay, self.got = delay, 0

        async def write(self, data: Any) -> None:
            await asyncio.sleep(self.delay)
            self.got += len(data)

    monkeypatch.setattr(gw, "LOG_WRITE_STALL_S", 0.05)
    slow = Client(0.01)  # takes 64 KiB every 10 ms: a MiB in 160 ms, never stalled
    asyncio.run(gw._write_paced(slow, b"x" * (1 << 20)))  # type: ignore[arg-type]
    assert slow.got == 1 << 20
    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(gw._write_paced(Client(1.0), b"x" * 10))  # type: ignore[arg-type]
