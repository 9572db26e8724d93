"""corral's errors as the e2b SDK expects to see them.

Control plane: an HTTP status and ``{"code": <status>, "message": ...}`` (the SDK maps 404 to
SandboxNotFoundException, 401 to AuthenticationException, 429 to RateLimitException).
envd: Connect codes (``not_found`` becomes FileNotFoundException in the filesystem calls,
NotFoundException elsewhere) and, for a sandbox that has ended, what E2B's proxy answers: a
502 whose message says the sandbox "was not found" (SandboxNotRunningException).
"""

from __future__ import annotations

import json

from aiohttp import web

from corral import errors as ce
from corral.e2b.connect import ConnectError

# Substring the SDK looks for in a 502 / UNAVAILABLE to tell a sandbox that ended.
GONE = "was not found"


def gone_message(sandbox_id: str) -> str:
    return f"The sandbox {sandbox_id} {GONE}"


def api_error(status: int, message: str) -> web.Response:
    return web.Response(body=json.dumps({"code": status, "message": message}).encode(),
                        status=status, content_type="application/json")


def sandbox_ended(e: ce.CorralError) -> bool:
    return isinstance(e, (ce.SandboxNotFound, ce.SandboxNotRunning, ce.SandboxLost))


def control_status(e: ce.CorralError) -> int:
    """The control plane's HTTP status for a corral error."""
    if sandbox_ended(e):
        return 404
    if isinstance(e, ce.CapacityExceeded):
        return 429
    if isinstance(e, (ce.ImageNotFound, ce.SnapshotNotFound)):
        return 404
    if isinstance(e, ce.Unauthorized):
        return 401
    if isinstance(e, ce.InvalidRequest):
        return 400
    if isinstance(e, ce.Conflict):
        return 409
    if isinstance(e, ce.Timeout):
        return 504
    if isinstance(e, ce.InfraError):
        return 503
    return 500


def control_error(e: ce.CorralError, sandbox_id: str | None = None) -> web.Response:
    if sandbox_ended(e) and sandbox_id is not None:
        return api_error(404, f"sandbox {sandbox_id} not found")
    return api_error(control_status(e), f"{e.code}: {e.message}")


_CONNECT_CODES: list[tuple[type[ce.CorralError], str]] = [
    (ce.FileExists, "already_exists"),
    (ce.NotFound, "not_found"),
    (ce.TooLarge, "resource_exhausted"),
    (ce.PermissionDenied, "permission_denied"),
    (ce.InvalidRequest, "invalid_argument"),
    (ce.ProcessStillRunning, "failed_precondition"),
    (ce.Conflict, "failed_precondition"),
    (ce.Unsupported, "unimplemented"),
    (ce.CapacityExceeded, "resource_exhausted"),
    (ce.Timeout, "deadline_exceeded"),
    (ce.InfraError, "unavailable"),
]


def to_connect(e: ce.CorralError, sandbox_id: str) -> ConnectError:
    """The Connect error of a corral error raised by an envd call on ``sandbox_id``."""
    if sandbox_ended(e):
        return ConnectError("unavailable", gone_message(sandbox_id))
    for cls, code in _CONNECT_CODES:
        if isinstance(e, cls):
            return ConnectError(code, e.message)
    return ConnectError("internal", e.message)


def envd_http_error(e: ce.CorralError, sandbox_id: str) -> web.Response:
    """envd's HTTP API (/files) answers ``{"code": <status>, "message": ...}``."""
    if sandbox_ended(e):
        return api_error(502, gone_message(sandbox_id))
    if isinstance(e, ce.NotFound):
        return api_error(404, e.message)
    if isinstance(e, ce.TooLarge):
        return api_error(507, e.message)
    if isinstance(e, ce.PermissionDenied):
        return api_error(403, e.message)
    if isinstance(e, (ce.InvalidRequest, ce.Conflict)):
        return api_error(400, e.message)
    return api_error(control_status(e), e.message)
