"""The HTTP layer on its own (a real aiohttp server on a private socket, no engine): an
unexpected exception becomes ``internal`` with a logged traceback and the server keeps serving;
log lines are JSON."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile

import httpx
from aiohttp import web

from corral.daemon.app import create_app
from corral.daemon.logs import JsonFormatter


def test_unexpected_exception_is_internal_and_logged(caplog):
    # A short path (a unix socket's is limited to 107 bytes), removed with its socket.
    with tempfile.TemporaryDirectory(prefix="corral-app-") as d:
        _unexpected_exception_is_internal_and_logged(caplog, os.path.join(d, "s.sock"))


def _unexpected_exception_is_internal_and_logged(caplog, path: str) -> None:

    async def main() -> list[httpx.Response]:
        runner = web.AppRunner(create_app(None), access_log=None)
        await runner.setup()
        await web.UnixSite(runner, path).start()
        try:
            async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=path),
                                         base_url="http://corral") as c:
                # No engine behind this app: the handler fails with a KeyError.
                return [await c.get("/v1/status"), await c.get("/v1/health"),
                        await c.get("/v1/status")]
        finally:
            await runner.cleanup()

    with caplog.at_level(logging.ERROR, logger="corral.api"):
        first, health, again = asyncio.run(main())
    assert first.status_code == 500
    err = first.json()["error"]
    assert err["code"] == "internal" and "KeyError" in err["message"]
    assert health.json() == {"ok": True} and again.status_code == 500
    rec = next(r for r in caplog.records if r.getMessage() == "unhandled error")
    assert rec.exc_info and rec.path == "/v1/status"


def test_json_log_lines():
    rec = logging.LogRecord("corral.engine", logging.WARNING, __file__, 1, "sandbox %s lost",
                            ("sb-1",), None)
    rec.sandbox = "sb-1"
    line = json.loads(JsonFormatter().format(rec))
    assert line["msg"] == "sandbox sb-1 lost" and line["level"] == "warning"
    assert line["sandbox"] == "sb-1" and line["logger"] == "corral.engine"
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        rec.exc_info = sys.exc_info()
    assert "ValueError: boom" in json.loads(JsonFormatter().format(rec))["exc"]


def test_oserror_from_a_handler_is_a_clear_4xx():
    """An OSError escaping a handler (what the request named could not be used) maps like a
    file error; only resource exhaustion stays an internal error. Never a traceback in the log
    for the 4xx ones."""
    import errno

    from corral.daemon.app_errors import middleware

    def raising(exc: OSError):
        async def handler(request: web.Request) -> web.Response:
            raise exc
        return handler

    cases = {
        "/perm": (PermissionError(errno.EACCES, "Permission denied", "/proc/self/mem"),
                  403, "permission_denied"),
        "/gone": (FileNotFoundError(errno.ENOENT, "No such file", "/x"), 404, "file_not_found"),
        "/eio": (OSError(errno.EIO, "Input/output error"), 400, "invalid_request"),
        "/loop": (OSError(errno.ELOOP, "Too many levels"), 409, "is_a_symlink"),
        "/fds": (OSError(errno.EMFILE, "Too many open files"), 500, "internal"),
    }
    with tempfile.TemporaryDirectory(prefix="corral-app-") as d:
        path = os.path.join(d, "s.sock")

        async def main() -> dict[str, httpx.Response]:
            app = web.Application(middlewares=[middleware(None)])
            for route, (exc, _, _) in cases.items():
                app.router.add_get(route, raising(exc))
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.UnixSite(runner, path).start()
            try:
                async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=path),
                                             base_url="http://corral") as c:
                    return {route: await c.get(route) for route in cases}
            finally:
                await runner.cleanup()

        got = asyncio.run(main())
    for route, (_, status, code) in cases.items():
        assert got[route].status_code == status, (route, got[route].text)
        assert got[route].json()["error"]["code"] == code, (route, got[route].text)
