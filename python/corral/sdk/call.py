"""One API call, described independently of any HTTP library.

``corral.sdk.api`` builds ``Call`` objects (path, body, how to parse the answer, which errors
to absorb); the sync and async transports only move bytes. That is the single implementation
behind ``Sandbox`` and ``AsyncSandbox``: a method on either is "build the Call, send it".
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar
from urllib.parse import quote, urlencode

from corral.errors import (
    CapacityExceeded,
    Conflict,
    CorralError,
    DaemonRestarted,
    DaemonUnavailable,
    InfraError,
    InternalError,
    InvalidRequest,
    NotFound,
    SandboxLost,
    Unauthorized,
    Unsupported,
    error_from_payload,
)

T = TypeVar("T")

DEFAULT_READ_TIMEOUT = 120.0  # seconds for an ordinary call (the daemon answers in ms)
# A call the daemon may spend its whole 120 s wait on (a freeze a sandbox holds off, a kill
# of processes slow to end) and then answer: read past it, so that the answer, not the
# client's own timeout (infra), is what the caller gets.
WAIT_READ_TIMEOUT = 180.0
CONNECT_TIMEOUT = 10.0
# A cluster node's endpoint: connects give up sooner (docs/cluster.md, "Node loss"; the
# transports also probe its connections: corral.sdk.keepalive).
NODE_CONNECT_TIMEOUT = 3.0

# Status -> class, for error bodies that are not corral JSON (a proxy, an old daemon).
_BY_STATUS: dict[int, type[CorralError]] = {
    400: InvalidRequest, 401: Unauthorized, 403: Unauthorized, 404: NotFound, 409: Conflict,
    429: CapacityExceeded, 501: Unsupported, 502: DaemonUnavailable, 503: DaemonUnavailable,
}


@dataclass(slots=True)
class Call(Generic[T]):
    """A request and what to do with its answer."""

    method: str
    path: str                                   # already percent-encoded
    parse: Callable[[bytes], T]
    query: list[tuple[str, str]] | None = None
    body: bytes | None = None
    content_type: str = "application/json"
    timeout: float | None = DEFAULT_READ_TIMEOUT  # read timeout; None waits as long as it takes
    recover: Callable[[CorralError], T] | None = None  # turn some errors into a value
    retry_safe: bool = False                    # may be sent again if the connection dropped
    keyed: bool = False                         # mutating: may carry an idempotency key
    key: str | None = None                      # header Idempotency-Key (docs/trajectory.md)
    headers: dict[str, str] | None = None       # more request headers (a node selector)

    def target(self) -> str:
        if not self.query:
            return self.path
        # A path that is not UTF-8 (a name listed from the sandbox, decoded with
        # surrogateescape, as os.fsdecode does) goes as its bytes.
        return self.path + "?" + urlencode(self.query, quote_via=quote, safe="/",
                                           errors="surrogateescape")

    def finish(self, status: int, body: bytes) -> T:
        if status < 400:
            return self.parse(body)
        err = error_from_response(status, body)
        if self.recover is not None:
            return self.recover(err)
        raise err


def seg(value: str) -> str:
    """One path segment (a sandbox id): encoded so that nothing in it can change the route."""
    return quote(value, safe="")


def error_from_response(status: int, body: bytes) -> CorralError:
    try:
        payload: Any = json.loads(body)
    except ValueError:
        payload = None
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        return error_from_payload(payload, status)
    cls = _BY_STATUS.get(status) or (InternalError if status >= 500 else CorralError)
    text = body[:300].decode("utf-8", "replace").strip()
    return cls(f"HTTP {status} from corrald: {text}" if text else f"HTTP {status} from corrald")


def _node_lost(endpoint: object, exc: BaseException, connected: bool) -> SandboxLost | None:
    """A cluster node that stopped answering took its sandboxes with it (docs/cluster.md).
    ``connected``: whether the call reached it (if not, the call did nothing there)."""
    node = getattr(endpoint, "node", None)
    if node is None:
        return None
    return SandboxLost(f"cluster node {node} ({endpoint}) is gone, and its sandboxes with it: "
                       f"{_describe(exc)}",
                       details={"endpoint": str(endpoint), "node": node, "connected": connected})


def unavailable(endpoint: object, exc: BaseException) -> InfraError:
    if (gone := _node_lost(endpoint, exc, connected=False)) is not None:
        return gone
    return DaemonUnavailable(f"no corrald answered on {endpoint}: {_describe(exc)}",
                             details={"endpoint": str(endpoint)})


def lost(endpoint: object, call: Call[Any], exc: BaseException) -> InfraError:
    # The request may or may not have been carried out: the caller must not assume either.
    if (gone := _node_lost(endpoint, exc, connected=True)) is not None:
        return gone
    return DaemonRestarted(
        f"connection to corrald ({endpoint}) lost during {call.method} {call.path}; the "
        f"daemon may have restarted and the call's outcome is unknown: {_describe(exc)}",
        details={"endpoint": str(endpoint)})


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    cause = exc.__cause__ or exc.__context__
    if cause is not None and str(cause) and str(cause) not in text:
        text += f" ({cause})"
    return text
