"""corral.daemon.filethreads: one tenant's file operations hold at most its share of the file
threads, and a share is held until its thread's work ends, not until its caller leaves."""

from __future__ import annotations

import asyncio
import threading

import pytest

from corral.daemon import filethreads


def test_a_tenant_holds_its_share_and_no_more(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(filethreads, "PER_TENANT", 2)
    gate = threading.Event()
    started: list[str] = []
    ended: list[str] = []

    def work(name: str) -> str:
        started.append(name)
        gate.wait(30)
        return name

    async def main() -> None:
        loop = asyncio.get_running_loop()

        async def until(pred, what: str) -> None:  # type: ignore[no-untyped-def]
            deadline = loop.time() + 10
            while not pred():
                assert loop.time() < deadline, what
                await asyncio.sleep(0.01)

        a = [asyncio.ensure_future(filethreads.run("a", lambda i=i: work(f"a{i}"),
                                                   end=lambda i=i: ended.append(f"a{i}")))
             for i in range(5)]
        await until(lambda: len(started) == 2, "a's first two start")
        assert filethreads.running("a") == 2
        # another tenant is not queued behind a's
        b = asyncio.ensure_future(filethreads.run("b", lambda: "b"))
        assert await asyncio.wait_for(asyncio.shield(b), 10) == "b"
        # a caller that leaves while its work runs keeps its thread counted
        a[0].cancel()
        a[2].cancel()  # a queued one leaves the queue: it never runs
        await asyncio.wait([a[0], a[2]])
        assert filethreads.running("a") == 2 and len(started) == 2
        gate.set()
        assert sorted(await asyncio.gather(a[1], a[3], a[4])) == ["a1", "a3", "a4"]
        await until(lambda: len(ended) == 4, "every started one ends")
        assert "a2" not in started and filethreads.running("a") == 0

    asyncio.run(main())


def test_start_failing_runs_nothing_and_frees_the_share() -> None:
    ran: list[int] = []

    def refuse() -> None:
        raise LookupError("gone")

    async def main() -> None:
        with pytest.raises(LookupError):
            await filethreads.run("t", lambda: ran.append(1), start=refuse)
        assert filethreads.running("t") == 0
        assert await filethreads.run("t", lambda: 7) == 7

    asyncio.run(main())
    assert not ran
