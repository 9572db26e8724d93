"""The E2B front's edges that need no sandbox: a stream whose client stops reading, and
corrald out of reach. A real aiohttp server on loopback and raw sockets as clients."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

from aiohttp import web

from corral.e2b import connect
from corral.e2b.app import Front, make_app

from .unitkit import run

KEY = "e2b_unit_test_key_0123456789"


async def _serve(app: web.Application) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, access_log=None, auto_decompress=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, port


def test_a_stream_whose_client_stops_reading_is_cut(monkeypatch: Any) -> None:
    """A handle kept and never read held its stream for good: the front's write waited for
    the client for ever, also past the sandbox's end, and the stream's slot with it. A write
    the client does not take within WRITE_TIMEOUT_S cuts the connection."""
    monkeypatch.setattr(connect, "WRITE_TIMEOUT_S", 0.5)
    ended: list[float] = []

    async def flood(request: web.Request) -> web.StreamResponse:
        stream = connect.ServerStream(request)
        chunk = {"data": "x" * (1 << 16)}
        while stream.open:
            await stream.send(chunk)
        ended.append(time.monotonic())
        return stream.response

    async def go() -> None:
        app = web.Application()
        app.router.add_post("/flood", flood)
        runner, port = await _serve(app)
        try:
            s = socket.create_connection(("127.0.0.1", port))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.sendall(b"POST /flood HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
            t0 = time.monotonic()
            while not ended and time.monotonic() - t0 < 20:
                await asyncio.sleep(0.05)
            s.close()
            assert ended and ended[0] - t0 < 10, ended
        finally:
            await runner.cleanup()

    run(go())


def test_corrald_out_of_reach_is_unavailable_not_internal(tmp_path: Any) -> None:
    """An envd call for a sandbox the front has not seen yet (a front restarted) asks corrald
    whose it is. corrald out of reach answered 500 `internal`, which a trainer cannot sort;
    it is what the same call gets for a sandbox the front knows: unavailable."""
    front = Front(KEY, f"unix://{tmp_path}/no-daemon.sock")
    sid = "sb-0123456789abcdef"
    h = {"E2b-Sandbox-Id": sid, "X-Access-Token": front.keys.access_token(sid)}

    async def go() -> None:
        runner, port = await _serve(make_app(front))
        try:
            import httpx
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}",
                                         timeout=60) as c:
                r = await c.post("/filesystem.Filesystem/Stat", content=b'{"path": "/"}',
                                 headers=dict(h, **{"Content-Type": "application/json"}))
                assert r.status_code == 503 and r.json()["code"] == "unavailable", r.text
                r = await c.get("/health", headers=h)
                assert r.status_code == 503, r.text
                r = await c.post("/process.Process/List", content=b"{}",
                                 headers=dict(h, **{"Content-Type": "application/json"}))
                assert json.loads(r.content)["code"] == "unavailable", r.text
        finally:
            await runner.cleanup()

    run(go())
