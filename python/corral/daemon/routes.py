"""The shape of the route table (``app.ROUTES``): routes, their parameters with the JSON schema
of what the server accepts, their error statuses and their links (for clients and stateful
fuzzers: which response feeds which call). ``corral.daemon.openapi`` turns it into the spec."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from pydantic import BaseModel

from corral.daemon.params import LABEL_FILTER, MAX_CURSOR, MAX_PAGE, MAX_TREE_DEPTH, OCTAL_MODE
from corral.daemon.trajlog import KEY_HEADER, MAX_KEY_LEN
from corral.models import MAX_PATH, PATH_PATTERN

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SCHEMA_REF = "#/components/schemas/"
SB = "/v1/sandboxes/{id}"
PROC = SB + "/procs/{pid}"


@dataclass(frozen=True)
class Param:
    name: str
    type: str = "string"        # JSON schema type (when no schema is given)
    required: bool = False
    description: str = ""
    repeated: bool = False
    where: str = "query"        # or "header"
    schema: dict[str, Any] | None = None


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: Handler
    summary: str
    body: type[BaseModel] | str | None = None         # a model, "bytes", "tar" or None
    response: type[BaseModel] | str | dict | None = None  # a model, "bytes", "tar", "ndjson",
    status: int = 200                                   # "ok", "text" or a JSON schema
    query: tuple[Param, ...] = ()
    alt_response: type[BaseModel] | None = None         # exec: ProcessHandle if background
    errors: tuple[int, ...] = ()                        # statuses beyond the common ones
    links: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> OpenAPI link
    also: tuple[str, ...] = ()                          # other media of the response ("ndjson")


KEY_PATTERN = rf"^[!-~]{{1,{MAX_KEY_LEN}}}$"  # visible ASCII: a header carries it verbatim
PATH_Q = Param("path", required=True, description=f"absolute path inside the sandbox "
               f"(at most {MAX_PATH} bytes)",
               schema={"type": "string", "pattern": PATH_PATTERN})
KEY_H = Param(KEY_HEADER, where="header", description=(
    "idempotency key: a key already logged returns the logged result without running the "
    "call again; the same key with a different request is replay_divergence (409). Scope: "
    "the sandbox (create: global). See docs/trajectory.md"),
    schema={"type": "string", "pattern": KEY_PATTERN})
LIMIT_Q = Param("limit", description=f"items per page (default 1000, at most {MAX_PAGE})",
                schema={"type": "integer", "minimum": 1, "maximum": MAX_PAGE})
AFTER_Q = Param("after", description="the `next` cursor of the previous page (opaque)",
                schema={"type": "string", "maxLength": MAX_CURSOR})
PAGE_Q = (LIMIT_Q, AFTER_Q)
DEPTH_Q = Param("depth", description=f"levels below the directory (default and most "
                f"{MAX_TREE_DEPTH}; 1: its own entries)",
                schema={"type": "integer", "minimum": 1, "maximum": MAX_TREE_DEPTH})
LABEL_Q = Param("label", description="key=value (equal) or key (present); repeat to AND them",
                repeated=True, schema={"type": "string", "pattern": LABEL_FILTER})


def int_param(name: str, lo: int, hi: int, description: str) -> Param:
    """A decimal integer in a query string (no sign, no leading zero, no 0x or _)."""
    return Param(name, description=description,
                 schema={"type": "integer", "minimum": lo, "maximum": hi})


MODE_Q = Param("mode", description="permission bits: decimal (420) or octal with a leading "
                                   "0 or 0o (0644, 0o644); default 0644",
               schema={"anyOf": [{"type": "integer", "minimum": 0, "maximum": 0o7777},
                                 {"type": "string", "pattern": OCTAL_MODE}]})
STREAM_Q = Param("stream", description=(
    "ndjson: answer as JSON lines, a progress line `{\"progress\": {...}}` at least every "
    "second with what is known (a batch: `done`, `count`; a snapshot: `bytes` copied; a fork: "
    "all three; a restore: nothing), then the response object (or `{\"error\": {...}}`) as "
    "the last line. Without it the answer comes at the end. See docs/daemon.md, long calls"),
    schema={"type": "string", "enum": ["ndjson"]})
FORMAT_Q = Param("format", description="json (default) or jsonl (one LogEntry a line)",
                 schema={"type": "string", "enum": ["json", "jsonl"]})
MAX_LOG_TAIL = 1_000_000
MAX_LOG_OUTPUT = 1 << 20
LOG_TAIL_Q = Param("tail", description="only the last N entries (their `index` is kept)",
                   schema={"type": "integer", "minimum": 1, "maximum": MAX_LOG_TAIL})
LOG_OUTPUT_Q = Param("max_output", description=(
    "an exec's stdout and stderr cut to N characters (the entry then has `view_truncated`: "
    "true); a viewer's bound on what a sandbox printed"),
    schema={"type": "integer", "minimum": 0, "maximum": MAX_LOG_OUTPUT})


def list_of(key: str, model: type[BaseModel], paged: bool = True) -> dict[str, Any]:
    """A page of a list endpoint (or a plain list)."""
    out: dict[str, Any] = {"type": "object", "required": [key], "properties": {
        key: {"type": "array", "items": {"$ref": SCHEMA_REF + model.__name__}}}}
    if paged:
        out["required"].append("next")
        out["properties"]["next"] = {"type": ["string", "null"], "description": (
            "cursor of the next page (?after=); null on the last")}
    return out


def link(op: str, **params: str | dict[str, str]) -> dict[str, Any]:
    """An OpenAPI link to operation ``op`` (its handler's name); a ``body`` param is the
    request body (runtime expressions inside)."""
    out: dict[str, Any] = {"operationId": op}
    body = params.pop("body", None)
    if params:
        out["parameters"] = params
    if body is not None:
        out["requestBody"] = body
    return out
