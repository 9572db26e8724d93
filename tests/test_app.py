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
