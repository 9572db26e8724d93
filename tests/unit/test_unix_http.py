"""The SDK's unix-socket HTTP path (corral.sdk.unix_http, used for plain calls by
corral.sdk.async_transport and corral.sdk.sync_transport), against a real aiohttp server on a
unix socket:
what it sends, keep-alive reuse, chunked answers, and every way a call can fail (no daemon, a
connection dropped before the answer, a read timeout, a cancelled call), each leaving the pool
usable and no connection behind."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from corral.errors import DaemonRestarted, DaemonUnavailable, NotFound, Timeout
from corral.sdk import async_transport, sync_transport, unix_http
from corral.sdk.call import Call
from corral.sdk.endpoint import Endpoint


class Server:
    """An aiohttp app on a unix socket that records what it was sent and on which
    connection."""

    def __init__(self, sock: str) -> None:
        self.sock = sock
        self.seen: list[dict[str, Any]] = []
        self.drops_left = 0          # requests to /flaky answered by closing the connection
        self.release = asyncio.Event()
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/echo", self.echo)
        app.router.add_get("/chunked", self.chunked)
        app.router.add_get("/slow", self.slow)
        app.router.add_post("/flaky", self.flaky)
        app.router.add_get("/flaky", self.flaky)
        app.router.add_get("/missing", self.missing)
        app.router.add_get("/close", self.close)
        self.runner = web.AppRunner(app, access_log=None)

    def _record(self, req: web.Request, body: bytes) -> None:
        self.seen.append({"method": req.method, "path": req.path_qs,
                          "headers": dict(req.headers), "body": body,
                          "conn": id(req.transport)})

    async def echo(self, req: web.Request) -> web.Response:
        body = await req.read()
        self._record(req, body)
        return web.json_response({"method": req.method, "len": len(body)})

    async def chunked(self, req: web.Request) -> web.StreamResponse:
        self._record(req, b"")
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(req)
        for i in range(5):
            await resp.write(b"part%d;" % i)
        await resp.write_eof()
        return resp

    async def slow(self, req: web.Request) -> web.Response:
        self._record(req, b"")
        await self.release.wait()
        return web.json_response({"late": True})

    async def flaky(self, req: web.Request) -> web.Response:
        body = await req.read()
        self._record(req, body)
        if self.drops_left > 0:
            self.drops_left -= 1
            assert req.transport is not None
            req.transport.abort()  # no answer: the connection just ends
        return web.json_response({"ok": True})

    async def missing(self, req: web.Request) -> web.Response:
        self._record(req, b"")
        return web.json_response({"error": {"code": "not_found", "message": "no such thing"}},
                                 status=404)

    async def close(self, req: web.Request) -> web.Response:
        self._record(req, b"")
        return web.json_response({"bye": True}, headers={"Connection": "close"})

    async def start(self) -> None:
        await self.runner.setup()
        await web.UnixSite(self.runner, self.sock).start()

    async def stop(self) -> None:
        self.release.set()
        await self.runner.cleanup()


@asynccontextmanager
async def served(tmp_path: Path) -> AsyncIterator[tuple[Server, async_transport.AsyncTransport]]:
    srv = Server(str(tmp_path / "d.sock"))
    await srv.start()
    t = async_transport.AsyncTransport(Endpoint.parse(srv.sock))
    try:
        yield srv, t
    finally:
        await t.aclose()
        await srv.stop()


def run(tmp_path: Path, body: Callable[[Server, async_transport.AsyncTransport],
                                       Awaitable[None]]) -> None:
    async def main() -> None:
        async with served(tmp_path) as (srv, t):
            await body(srv, t)
    asyncio.run(main())


def _raw(body: bytes) -> bytes:
    return body


def _open_conns(t: async_transport.AsyncTransport) -> int:
    assert t._unix is not None
    return sum(1 for c in t._unix._all if not c.closed)


def test_a_call_sends_its_method_target_headers_and_body(tmp_path: Path) -> None:
    async def body(srv: Server, t: async_transport.AsyncTransport) -> None:
        call = Call("POST", "/echo", _raw, query=[("a", "b c")], body=b'{"x":1}',
                    key="k-1", headers={"X-Corral-Node": "n1"})
        assert await t.call(call) == b'{"method": "POST", "len": 7}'
        (seen,) = srv.seen
        assert seen["path"] == "/echo?a=b%20c"
        assert seen["body"] == b'{"x":1}'
        h = seen["headers"]
        assert h["Content-Type"] == "application/json"
        assert h["Content-Length"] == "7"
        assert h["Idempotency-Key"] == "k-1"
        assert h["X-Corral-Node"] == "n1"
        assert "Authorization" not in h  # a unix socket needs no token
        # No body: no content type; a POST still says its length is 0.
        await t.call(Call("POST", "/echo", _raw))
        assert "Content-Type" not in srv.seen[1]["headers"]
        assert srv.seen[1]["headers"]["Content-Length"] == "0"
    run(tmp_path, body)


def test_sequential_calls_reuse_one_connection(tmp_path: Path) -> None:
    async def body(srv: Server, t: async_transport.AsyncTransport) -> None:
        for _ in range(5):
            await t.call(Call("GET", "/echo", _raw))
        assert len({s["conn"] for s in srv.seen}) == 1
        assert _open_conns(t) == 1
    run(tmp_path, body)


def test_concurrent_calls_each_get_their_own_answer(tmp_path: Path) -> None:
    async def body(srv: Server, t: async_transport.AsyncTransport) -> None:
        sizes = list(range(0, 4000, 100))
        got = await asyncio.gather(*(t.call(Call("POST", "/echo", _raw, body=b"x" * n))
                                     for n in sizes))
        assert got == [b'{"method": "POST", "len": %d}' % n for n in sizes]
    run(tmp_path, body)


def test_a_large_body_both_ways(tmp_path: Path) -> None:
    async def body(srv: Server, t: async_transport.AsyncTransport) -> None:
        data = os.urandom(8 << 20)
        assert await t.call(Call("PUT", "/echo", _raw, body=data)) == \
            b'{"method": "PUT", "len": %d}' % len(data)
        assert srv.seen[0]["body"] == data
    run(tmp_path, body)


def test_a_chunked_answer_is_joined(tmp_path: Path) -> None:
    async def body(srv: Server, t: async_transport.AsyncTransport) -> None:
        assert await t.call(Call("GET", "/chunked", _raw)) == b"part0;part1;part2;part3;part4;"
        await t.call(Call("GET", "/echo", _raw))  # the connection is still good
        assert len({s["conn"] for s in srv.seen}) == 1
    run(tmp_path, body)


def test_an_error_status_raises_the_corral_error(tmp_path: Path) -> None:
    async def body(srv: Server, t: async_transport.AsyncTransport) -> None:
        with pytest.raises(NotFound, match="no such thing"):
            await t.call(Call("GET", "/missing", _raw))
    run(tmp_path, body)


def test_connection_close_is_not_reused(tmp_path: Path) -> None:
    async def body(srv: Server, t: async_transport.AsyncTransport) -> None:
        await t.call(Call("GET", "/close", _raw))
        await t.call(Call("GET", "/echo", _raw))
        assert srv.seen[0]["conn"] != srv.seen[1]["conn"]
    run(tmp_path, body)


def test_no_daemon_is_unavailable(tmp_path: Path) -> None:
    async def main() -> None:
        t = async_transport.AsyncTransport(Endpoint.parse(str(tmp_path / "none.sock")))
        try:
            with pytest.raises(DaemonUnavailable):
                await t.call(Call("GET", "/echo", _raw))
        finally:
            await t.aclose()
    asyncio.run(main())


def test_a_dropped_connection_retries_only_a_retry_safe_call(tmp_path: Path) -> None:
    async def body(srv: Server, t: async_transport.AsyncTransport) -> None:
        srv.drops_left = 1
        assert await t.call(Call("GET", "/flaky", _raw, retry_safe=True)) == b'{"ok": true}'
        assert len(srv.seen) == 2  # sent again, once
        srv.drops_left = 1
        with pytest.raises(DaemonRestarted):
            await t.call(Call("POST", "/flaky", _raw, body=b"{}"))
        assert len(srv.seen) == 3  # not sent again: its outcome is unknown
        await t.call(Call("GET", "/echo", _raw))  # the pool goes on
        assert _open_conns(t) == 1
    run(tmp_path, body)


def test_a_read_timeout_drops_the_connection(tmp_path: Path) -> None:
    async def body(srv: Server, t: async_transport.AsyncTransport) -> None:
        with pytest.raises(Timeout):
            await t.call(Call("GET", "/slow", _raw, timeout=0.2))
        # The late answer must not be taken for the next call's.
        srv.release.set()
        assert await t.call(Call("GET", "/echo", _raw)) == b'{"method": "GET", "len": 0}'
        assert srv.seen[0]["conn"] != srv.seen[1]["conn"]
        assert _open_conns(t) == 1
    run(tmp_path, body)


def test_a_cancelled_call_drops_its_connection(tmp_path: Path) -> None:
    async def body(srv: Server, t: async_transport.AsyncTransport) -> None:
        task = asyncio.ensure_future(t.call(Call("GET", "/slow", _raw, timeout=None)))
        while not srv.seen:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        srv.release.set()
        assert await t.call(Call("GET", "/echo", _raw)) == b'{"method": "GET", "len": 0}'
        assert srv.seen[0]["conn"] != srv.seen[1]["conn"]
        assert _open_conns(t) == 1
    run(tmp_path, body)


def test_an_idle_connection_the_daemon_closed_is_not_used(tmp_path: Path) -> None:
    async def body(srv: Server, t: async_transport.AsyncTransport) -> None:
        await t.call(Call("GET", "/echo", _raw))
        assert t._unix is not None
        (conn,) = t._unix._idle
        assert conn.transport is not None
        conn.transport.abort()  # as when the daemon drops a keep-alive connection
        await asyncio.sleep(0)
        assert await t.call(Call("GET", "/echo", _raw)) == b'{"method": "GET", "len": 0}'
        assert _open_conns(t) == 1
    run(tmp_path, body)


def test_a_header_with_a_line_break_is_refused() -> None:
    with pytest.raises(ValueError):
        unix_http.request_head("GET", "/x", "localhost", {"X-A": "1\r\nX-B: 2"}, None)


# ---- the blocking SDK's path (sync_transport._call_unix) ------------------------------------
class ThreadServer:
    """The same app, served by a loop in a thread, for the blocking transport."""

    def __init__(self, sock: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.srv: Server | None = None
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.srv = Server(sock)
            self.loop.run_until_complete(self.srv.start())
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert started.wait(10)

    def release(self) -> None:
        assert self.srv is not None
        self.loop.call_soon_threadsafe(self.srv.release.set)

    def stop(self) -> None:
        assert self.srv is not None
        asyncio.run_coroutine_threadsafe(self.srv.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def sync_served(tmp_path: Path) -> Iterator[tuple[Server, sync_transport.SyncTransport,
                                                  ThreadServer]]:
    ts = ThreadServer(str(tmp_path / "d.sock"))
    assert ts.srv is not None
    t = sync_transport.SyncTransport(Endpoint.parse(ts.srv.sock))
    try:
        yield ts.srv, t, ts
    finally:
        t.close()
        ts.stop()


def test_sync_a_call_sends_what_the_async_one_does(sync_served: Any) -> None:
    srv, t, _ = sync_served
    call = Call("POST", "/echo", _raw, query=[("a", "b c")], body=b'{"x":1}', key="k-1",
                headers={"X-Corral-Node": "n1"})
    assert t.call(call) == b'{"method": "POST", "len": 7}'
    (seen,) = srv.seen
    assert seen["path"] == "/echo?a=b%20c" and seen["body"] == b'{"x":1}'
    h = seen["headers"]
    assert (h["Content-Type"], h["Content-Length"], h["Idempotency-Key"], h["X-Corral-Node"]) \
        == ("application/json", "7", "k-1", "n1")
    for _ in range(4):
        t.call(Call("GET", "/echo", _raw))
    assert len({s["conn"] for s in srv.seen}) == 1  # kept alive
    assert t.call(Call("GET", "/chunked", _raw)) == b"part0;part1;part2;part3;part4;"
    with pytest.raises(NotFound, match="no such thing"):
        t.call(Call("GET", "/missing", _raw))
    t.call(Call("GET", "/close", _raw))
    t.call(Call("GET", "/echo", _raw))
    assert srv.seen[-1]["conn"] != srv.seen[-2]["conn"]  # not reused after Connection: close


def test_sync_failures_follow_the_transport_rules(sync_served: Any) -> None:
    srv, t, ts = sync_served
    srv.drops_left = 1
    assert t.call(Call("GET", "/flaky", _raw, retry_safe=True)) == b'{"ok": true}'
    srv.drops_left = 1
    with pytest.raises(DaemonRestarted):
        t.call(Call("POST", "/flaky", _raw, body=b"{}"))
    n = len(srv.seen)
    with pytest.raises(Timeout):
        t.call(Call("GET", "/slow", _raw, timeout=0.2))
    ts.release()
    assert t.call(Call("GET", "/echo", _raw)) == b'{"method": "GET", "len": 0}'
    assert srv.seen[n]["conn"] != srv.seen[n + 1]["conn"]  # the timed-out one was dropped
    # An idle connection the daemon closed: the next call goes out on a new one.
    (_, conn), = t._idle
    conn.sock.shutdown(socket.SHUT_RDWR)
    assert t.call(Call("POST", "/echo", _raw, body=b"x")) == b'{"method": "POST", "len": 1}'


def test_sync_no_daemon_is_unavailable(tmp_path: Path) -> None:
    t = sync_transport.SyncTransport(Endpoint.parse(str(tmp_path / "none.sock")))
    with pytest.raises(DaemonUnavailable):
        t.call(Call("GET", "/echo", _raw))
