"""Exposed ports: a sandbox's TCP port reachable from the host at 127.0.0.1:<host port>, by a
relay in the daemon's event loop (inbound only, chosen by the trainer; egress never goes
through userspace). Loopback only: nothing off the host can reach a sandbox this way.

A relay ends with its port: unexposing a port or ending the sandbox aborts its connections
too (a host client must not hang on a sandbox that is gone: the sandbox's own FIN never
arrives once its rules are removed). Each direction is closed on its own (a half-close
passes through), and a reset from either side resets the other.

Every relay of the loop copies within one budget of bytes a second (RelayBudget): a sandbox's
server answering as fast as it can, to a host client reading as fast, made the daemon copy
471 MB/s with a whole core (its one event loop); past the budget a relay waits and TCP pushes
back on the sender."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from corral.errors import CapacityExceeded, InvalidRequest

MAX_PORTS_PER_SANDBOX = 64  # as many as a create may ask for (SandboxSpec.expose)
MAX_PORTS = 4096  # every sandbox's together: a share of the host's ephemeral ports
MAX_CONNECTIONS_PER_PORT = 256  # two daemon fds each
CONNECT_TIMEOUT_S = 10.0
KEEPALIVE_IDLE_S = 60  # a peer that vanished without a FIN or RST is found within ~1.5 min
# Bytes a second over every relay of the loop together (both directions), and the burst:
# ~1/7 of a core at the copy's measured cost.
RELAY_RATE = 64 * 1024 * 1024
RELAY_BURST = 8 * 1024 * 1024
CHUNK = 256 * 1024  # the most one read takes


class RelayBudget:
    """The bytes a second the loop spends relaying (RELAY_RATE), shared by every relay. A
    relay that copied ``n`` bytes waits ``take(n)`` seconds before it reads again: the first
    chunks of a burst pass at once, then each waits out its share of the deficit, so relays
    running together are served in turn and their sum stays at the rate."""

    def __init__(self, rate: float = RELAY_RATE, burst: float = RELAY_BURST,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self.tokens = burst
        self.stamp = clock()

    def take(self, n: int) -> float:
        """Spend ``n`` bytes; the seconds to wait before the next read (0: none)."""
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate) - n
        self.stamp = now
        return -self.tokens / self.rate if self.tokens < 0 else 0.0


@dataclass
class _Port:
    server: asyncio.Server
    host_port: int
    conns: set[asyncio.Task[None]] = field(default_factory=set)

    def close(self) -> None:
        """(on the loop) Stop listening, and end every relay of this port."""
        self.server.close()
        for task in list(self.conns):
            task.cancel()


def _keepalive(w: asyncio.StreamWriter) -> None:
    sock = w.get_extra_info("socket")
    if sock is None:
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)


async def _pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, budget: RelayBudget) -> None:
    """Copy one direction to its EOF within ``budget``, then pass the EOF on (a half-close).
    A reset or error raises: the caller resets both sides."""
    while data := await r.read(CHUNK):
        w.write(data)
        wait = budget.take(len(data))
        if wait:
            await asyncio.sleep(wait)
        await w.drain()
    if w.can_write_eof():
        w.write_eof()


def _abort(*writers: asyncio.StreamWriter) -> None:
    for w in writers:
        w.transport.abort()  # an RST, at once: no waiting for unsent data


async def _relay(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter,
                 addr: str, port: int, budget: RelayBudget) -> None:
    try:
        up_r, up_w = await asyncio.wait_for(asyncio.open_connection(addr, port),
                                            CONNECT_TIMEOUT_S)
    except (OSError, asyncio.TimeoutError):
        _abort(client_w)
        return
    except asyncio.CancelledError:
        _abort(client_w)
        raise
    _keepalive(up_w)
    _keepalive(client_w)
    pipes = [asyncio.ensure_future(_pipe(client_r, up_w, budget)),
             asyncio.ensure_future(_pipe(up_r, client_w, budget))]
    try:
        await asyncio.gather(*pipes)
    except asyncio.CancelledError:
        _abort(client_w, up_w)
        raise
    except (OSError, ConnectionError, RuntimeError):
        _abort(client_w, up_w)
    else:
        client_w.close()
        up_w.close()
    finally:
        for p in pipes:
            p.cancel()


class Exposer:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._ports: dict[str, dict[int, _Port]] = {}
        self.budget = RelayBudget()

    def _count(self) -> int:
        return sum(len(m) for m in list(self._ports.values()))

    async def expose(self, sandbox_id: str, addr: str, port: int, host_port: int = 0) -> int:
        """The host port (on 127.0.0.1) relaying to ``addr:port``; the same one again if
        ``port`` is exposed already. ``host_port``: that one if it is free, else any."""
        mine = self._ports.setdefault(sandbox_id, {})
        if port in mine:
            return mine[port].host_port
        if len(mine) >= MAX_PORTS_PER_SANDBOX:
            raise InvalidRequest(f"a sandbox exposes at most {MAX_PORTS_PER_SANDBOX} ports",
                                 details={"limit": "exposed_ports",
                                          "max": MAX_PORTS_PER_SANDBOX})
        if self._count() >= MAX_PORTS:
            raise CapacityExceeded(f"this node relays at most {MAX_PORTS} exposed ports",
                                   details={"limit": "exposed_ports", "max": MAX_PORTS})
        entry: _Port | None = None

        async def accept(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            if entry is None or task is None or len(entry.conns) >= MAX_CONNECTIONS_PER_PORT:
                _abort(w)
                return
            entry.conns.add(task)
            try:
                await _relay(r, w, addr, port, self.budget)
            finally:
                entry.conns.discard(task)

        try:
            server = await asyncio.start_server(accept, "127.0.0.1", host_port)
        except OSError:
            if not host_port:
                raise
            server = await asyncio.start_server(accept, "127.0.0.1", 0)
        entry = _Port(server, server.sockets[0].getsockname()[1])
        mine[port] = entry
        return entry.host_port

    def ports(self, sandbox_id: str) -> dict[int, int]:
        return {p: e.host_port for p, e in list(self._ports.get(sandbox_id, {}).items())}

    def connections(self, sandbox_id: str) -> int:
        """Relays open to the sandbox, over all its ports."""
        return sum(len(e.conns) for e in list(self._ports.get(sandbox_id, {}).values()))

    def unexpose(self, sandbox_id: str, port: int) -> bool:
        entry = self._ports.get(sandbox_id, {}).pop(port, None)
        if entry is None:
            return False
        self.loop.call_soon_threadsafe(entry.close)
        return True

    def drop(self, sandbox_id: str) -> None:
        """Every port of a sandbox that ended, and their relays (from any thread)."""
        for entry in self._ports.pop(sandbox_id, {}).values():
            self.loop.call_soon_threadsafe(entry.close)

    def close(self) -> None:
        for sid in list(self._ports):
            self.drop(sid)
