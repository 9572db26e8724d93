"""Exposed ports: a sandbox's TCP port reachable from the host at 127.0.0.1:<host port>, by a
relay in the daemon's event loop (inbound only, chosen by the trainer; egress never goes
through userspace). Loopback only: nothing off the host can reach a sandbox this way."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


async def _pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    try:
        while data := await r.read(1 << 16):
            w.write(data)
            await w.drain()
    except (OSError, asyncio.CancelledError):
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            w.close()


class Exposer:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._servers: dict[str, dict[int, tuple[Any, int]]] = {}

    async def expose(self, sandbox_id: str, addr: str, port: int, host_port: int = 0) -> int:
        """The host port (on 127.0.0.1) relaying to ``addr:port``; the same one again if
        ``port`` is exposed already. ``host_port``: that one if it is free, else any."""
        mine = self._servers.setdefault(sandbox_id, {})
        if port in mine:
            return mine[port][1]

        async def relay(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            try:
                ur, uw = await asyncio.wait_for(asyncio.open_connection(addr, port), 10)
            except (OSError, asyncio.TimeoutError):
                w.close()
                return
            await asyncio.gather(_pipe(r, uw), _pipe(ur, w))

        try:
            server = await asyncio.start_server(relay, "127.0.0.1", host_port)
        except OSError:
            if not host_port:
                raise
            server = await asyncio.start_server(relay, "127.0.0.1", 0)
        host_port = server.sockets[0].getsockname()[1]
        mine[port] = (server, host_port)
        return host_port

    def ports(self, sandbox_id: str) -> dict[int, int]:
        return {p: hp for p, (_, hp) in self._servers.get(sandbox_id, {}).items()}

    def unexpose(self, sandbox_id: str, port: int) -> bool:
        entry = self._servers.get(sandbox_id, {}).pop(port, None)
        if entry is None:
            return False
        self.loop.call_soon_threadsafe(entry[0].close)
        return True

    def drop(self, sandbox_id: str) -> None:
        """Every port of a sandbox that ended (from any thread)."""
        for _, (server, _) in self._servers.pop(sandbox_id, {}).items():
            self.loop.call_soon_threadsafe(server.close)

    def close(self) -> None:
        for sid in list(self._servers):
            self.drop(sid)
