"""Structured logs: one JSON object per line, on stderr or in a size-bounded rotated file.

What a client can make the daemon log (a malformed request) is one line without a traceback,
rate-limited: no client fills the disk through the log.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import os
import sys
import time

# Attributes every LogRecord has; anything else was passed through ``extra=`` and is logged.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message",
                                                                               "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class RateLimited(logging.Filter):
    """A token bucket (``rate`` lines a second, bursts of ``burst``); each line passed loses
    its traceback (the exception's type and message stay) and says how many were dropped."""

    def __init__(self, rate: float = 1.0, burst: int = 10, keep_exc: bool = False) -> None:
        super().__init__()
        self.rate, self.burst, self.keep_exc = rate, burst, keep_exc
        self.tokens, self.last, self.dropped = float(burst), time.monotonic(), 0

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens < 1:
            self.dropped += 1
            return False
        self.tokens -= 1
        if record.exc_info and not self.keep_exc:
            exc = record.exc_info[1]
            record.msg = f"{record.getMessage()}: {type(exc).__name__}: {str(exc)[:200]}"
            record.args, record.exc_info, record.exc_text = None, None, None
        if self.dropped:
            record.dropped = self.dropped
            self.dropped = 0
        return True


class RotatingFile(logging.handlers.RotatingFileHandler):
    """Rotates at ``max_bytes`` keeping ``backups`` old files; after a rollover stdout and
    stderr (anything written outside logging: a fatal error's dump) follow the new file."""

    def doRollover(self) -> None:  # noqa: N802 - logging's name
        super().doRollover()
        if self.stream is not None and self.redirect_std:
            for fd in (1, 2):
                os.dup2(self.stream.fileno(), fd)

    redirect_std = False


def setup(level: str = "INFO", log_file: str = "", max_bytes: int = 16 << 20,
          backups: int = 3) -> None:
    handler: logging.Handler
    if log_file:
        handler = RotatingFile(log_file, maxBytes=max(4096, max_bytes),
                               backupCount=max(1, backups))
        handler.redirect_std = True
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # aiohttp's access log costs a line per request; errors are logged by the app itself.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    # aiohttp.server logs requests it cannot parse (a NUL byte in a header ...) with a
    # traceback each: a client's doing, so one short line at most, rate-limited.
    server = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, RateLimited) for f in server.filters):
        server.addFilter(RateLimited())
    # A request that hits a daemon bug keeps its traceback, but a client repeating it cannot
    # make the log grow faster than a few lines a second.
    # A listener out of fds logs each failed accept (asyncio), and the TCP guard each
    # connection it refuses: a flood of connections must not become a flood of lines.
    for name in ("asyncio", "corral.tcp"):
        noisy = logging.getLogger(name)
        if not any(isinstance(f, RateLimited) for f in noisy.filters):
            noisy.addFilter(RateLimited())
    api = logging.getLogger("corral.api")
    if not any(isinstance(f, RateLimited) for f in api.filters):
        api.addFilter(RateLimited(rate=2.0, burst=20, keep_exc=True))
