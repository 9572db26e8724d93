"""A cluster node that vanishes without closing its connections (a machine powered off): the
SDK's calls to its sandboxes answer sandbox_lost within 5 s, a call already waiting on it and a
new one alike (docs/cluster.md, "Node loss"). Simulated on loopback: a node endpoint that takes
the request and never answers, then every packet to its port dropped (an nftables table of the
test's), as the network drops them for a machine that is off."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest

from corral.errors import SandboxLost
from corral.sdk import api
from corral.sdk.async_sandbox import transport as async_transport
from corral.sdk.endpoint import Endpoint
from corral.sdk.sync_transport import transport

from conftest import wait_until

LOST_WITHIN_S = 5.0


class SilentNode:
    """Accepts connections and reads what comes, answers nothing, closes nothing."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.requests = 0
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        try:
            if conn.recv(65536):
                self.requests += 1
            while conn.recv(65536):
                pass
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.fixture
def node() -> Iterator[SilentNode]:
    n = SilentNode()
    yield n
    n.close()


class Vanished:
    """Every packet to ``port`` on this machine dropped, until closed."""

    def __init__(self, port: int) -> None:
        self.table = f"corral_vanish_{os.getpid()}"
        nft = (f"table inet {self.table} {{\n chain out {{\n"
               f"  type filter hook output priority 0;\n  tcp dport {port} drop\n }}\n}}\n")
        subprocess.run(["nft", "-f", "-"], input=nft, text=True, check=True)

    def close(self) -> None:
        subprocess.run(["nft", "delete", "table", "inet", self.table], check=False,
                       capture_output=True)


def _endpoint(n: SilentNode) -> Endpoint:
    return Endpoint(f"http://127.0.0.1:{n.port}", "node-that-vanishes")


def _waiting_call_is_lost(n: SilentNode, call) -> float:  # type: ignore[no-untyped-def]
    """Start ``call()`` (it waits on the node), drop the node's packets once the node has the
    request: seconds from the drop until the call ended, with SandboxLost."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            call()
            out["result"] = "answered"
        except BaseException as e:  # noqa: BLE001 - the test checks what it was
            out["error"] = e
        out["at"] = time.monotonic()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert wait_until(lambda: n.requests >= 1, timeout=10)
    gone = Vanished(n.port)
    try:
        t0 = time.monotonic()
        t.join(timeout=30)
        assert not t.is_alive(), "the call still waits on a node that is gone"
    finally:
        gone.close()
    assert isinstance(out.get("error"), SandboxLost), out
    return float(out["at"]) - t0  # type: ignore[arg-type]


def test_a_call_waiting_on_a_vanished_node_is_lost_within_5s(node: SilentNode) -> None:
    ep = _endpoint(node)
    took = _waiting_call_is_lost(node, lambda: transport(ep).call(api.get("sb-" + "0" * 16)))
    assert took <= LOST_WITHIN_S, took


def test_an_async_call_waiting_on_a_vanished_node_is_lost_within_5s(node: SilentNode) -> None:
    ep = _endpoint(node)

    def call() -> None:
        async def go() -> None:
            await async_transport(ep).call(api.get("sb-" + "0" * 16))
        asyncio.run(go())

    took = _waiting_call_is_lost(node, call)
    assert took <= LOST_WITHIN_S, took


def test_a_new_call_to_a_vanished_node_is_lost_within_5s(node: SilentNode) -> None:
    gone = Vanished(node.port)
    try:
        t0 = time.monotonic()
        with pytest.raises(SandboxLost):
            transport(_endpoint(node)).call(api.get("sb-" + "0" * 16))
        assert time.monotonic() - t0 <= LOST_WITHIN_S
    finally:
        gone.close()
