"""Run the front: ``corral e2b serve`` or ``python -m corral.e2b``.

It listens on 127.0.0.1 unless told otherwise, refuses to start without an API key of at least
16 characters (``--api-key`` or ``CORRAL_E2B_API_KEY``; ``--generate-key`` makes one and prints
it), and reaches corrald the way the SDK does (``CORRAL_SOCKET`` / ``CORRAL_URL``). Once
listening it prints ``listening on http://HOST:PORT`` (the port it got, for ``--port 0``).
"""

from __future__ import annotations

import asyncio
import signal
import sys

from aiohttp import web

from corral.e2b.app import Front, make_app
from corral.e2b.config import DEFAULT_HOST, DEFAULT_PORT


async def serve(api_key: str, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                endpoint: str | None = None) -> None:
    front = Front(api_key, endpoint)
    # Bodies as sent: the handlers that take an encoded body inflate it themselves (files.py).
    runner = web.AppRunner(make_app(front), access_log=None, auto_decompress=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server = getattr(site, "_server", None)
    sockets = getattr(server, "sockets", None) or []
    got = sockets[0].getsockname()[1] if sockets else port
    print(f"listening on http://{host}:{got}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def run(api_key: str, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
        endpoint: str | None = None) -> None:
    try:
        asyncio.run(serve(api_key, host, port, endpoint))
    except ValueError as e:
        print(f"corral e2b serve: {e}", file=sys.stderr)
        raise SystemExit(2) from None
