"""What the unit tests share: an engine on a fake substrate and a manual clock, in a private
state dir, and stepping the clock so that the tasks it wakes run."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

from corral.config import Config
from corral.daemon.clock import ManualClock
from corral.daemon.engine import Engine
from corral.daemon.substrates import registry
from corral.models import SandboxSpec

from .fakes import FakeImages, FakeSubstrate

T = TypeVar("T")
REAPER_S = 0.5


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def spec(**kw: Any) -> SandboxSpec:
    return SandboxSpec(substrate="fake", **kw)


def config(state_dir: str, **kw: Any) -> Config:
    kw.setdefault("max_sandboxes", 100)
    kw.setdefault("reaper_interval_s", REAPER_S)
    kw.setdefault("trajlog_flush_ms", 0.0)
    return Config(state_dir=state_dir, socket_path=f"{state_dir}/corrald.sock",
                  cgroup_name="corral-unit", **kw)


@contextlib.asynccontextmanager
async def engine_on(state_dir: str, clock: ManualClock, sub: FakeSubstrate | None = None,
                    *, stop: bool = True, **cfg: Any) -> AsyncIterator[tuple[Engine,
                                                                            FakeSubstrate]]:
    """An engine serving the fake substrate; at the end its sandboxes are destroyed
    (``stop``, a graceful stop) or left for the next engine on the same state dir."""
    sub = sub if sub is not None else FakeSubstrate()
    registry.register("fake", lambda ctx: sub)
    eng = Engine(config(state_dir, **cfg), substrates=["fake"], images=FakeImages(state_dir),
                 clock=clock)
    try:
        await eng.start()
        try:
            yield eng, sub
        finally:
            if stop:
                await eng.shutdown()
            eng.close()
    finally:
        registry.unregister("fake")


async def settle(clock: ManualClock, turns: int = 200) -> None:
    """Let the tasks the clock just woke run until one sleeps on the clock again (the reaper
    goes back to its sleep after each pass) or the loop has nothing left to do for them."""
    for _ in range(turns):
        if clock.armed.is_set():
            return
        await asyncio.sleep(0)


async def tick(clock: ManualClock, seconds: float) -> None:
    """Move the clock forward ``seconds``, timer by timer: each sleeper woken on the way
    (the reaper) runs its pass before the clock moves on."""
    end = clock.monotonic() + seconds
    while True:
        due = clock.next_due()
        if due is None or clock.monotonic() + due > end:
            break
        clock.armed.clear()
        clock.advance(due)
        await settle(clock)
    clock.advance(max(0.0, end - clock.monotonic()))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a server under test)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port
