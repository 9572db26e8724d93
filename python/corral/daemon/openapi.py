"""Generate the API's OpenAPI 3.1 spec from ``app.ROUTES`` and the pydantic models.

``python -m corral.daemon.openapi`` rewrites ``openapi.json`` next to this file;
``--check`` exits 1 if the committed file is stale (tests/test_openapi.py does the same).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from corral import __version__
from corral.daemon.app import ROUTES
from corral.daemon.app_errors import PUBLIC_PATHS
from corral.daemon.routes import SCHEMA_REF, Route
from corral.daemon.tenancy import ADMIN_ONLY
from corral.errors import ERROR_CLASSES

SPEC_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "openapi.json")

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["code", "message"],
        "properties": {
            "code": {"type": "string", "description": "stable error code (corral/errors.py)"},
            "message": {"type": "string"},
            "details": {"type": "object"},
            "category": {"type": "string", "enum": ["infra", "limit", "task"],
                         "description": "infra: outside the sandbox and the agent (mask the "
                                        "rollout); limit: the agent's own resource limits; "
                                        "task: the request's or command's own failure"},
            "infra": {"type": "boolean", "description": 'category == "infra"'},
        },
    }},
}
_OK = {"type": "object", "required": ["ok"], "properties": {"ok": {"type": "boolean"}}}
_BINARY = {"type": "string", "format": "binary"}
_MEDIA = {"bytes": "application/octet-stream", "tar": "application/x-tar",
          "ndjson": "application/x-ndjson", "text": "text/plain", "html": "text/html",
          "js": "text/javascript"}


def _models() -> list[tuple[type[BaseModel], JsonSchemaMode]]:
    seen: dict[tuple[type[BaseModel], JsonSchemaMode], None] = {}
    for r in ROUTES:
        if isinstance(r.body, type):
            seen[(r.body, "validation")] = None
        for resp in (r.response, r.alt_response):
            if isinstance(resp, type):
                seen[(resp, "serialization")] = None
        if isinstance(r.response, dict):  # list wrappers name their item model
            props: dict[str, Any] = r.response.get("properties", {})
            first: dict[str, Any] = next(iter(props.values()), {})
            items = first.get("items", {})
            ref = items.get("$ref", "")
            if ref.startswith(SCHEMA_REF):
                from corral import models

                seen[(getattr(models, ref[len(SCHEMA_REF):]), "serialization")] = None
    return list(seen)


def _schema_ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": SCHEMA_REF + model.__name__}


def _response(r: Route) -> dict[str, Any]:
    resp = r.response
    schema: dict[str, Any]
    if isinstance(resp, str) and resp in _MEDIA:
        media = _MEDIA[resp]
        # JSON lines are no one JSON document (a single line parses as one value): no schema
        # of the whole body, as for the "also" media below.
        schema = {} if resp == "ndjson" else \
            {"type": "string"} if resp in ("text", "html", "js") else _BINARY
        return {"description": "OK", "content": {media: {"schema": schema}}}
    if resp == "ok":
        schema = _OK
    elif isinstance(resp, type):
        schema = _schema_ref(resp)
        if r.alt_response is not None:
            schema = {"oneOf": [schema, _schema_ref(r.alt_response)]}
    elif isinstance(resp, dict):
        schema = resp
    else:
        schema = {}
    content = {"application/json": {"schema": schema}}
    for kind in r.also:
        # JSON lines, one value each (the operation's description says which): not one JSON
        # document, so no schema of the whole body.
        content[_MEDIA[kind]] = {"schema": {}}
    return {"description": "OK", "content": content}


# The substrates this daemon runs; a spec naming others would promise what it cannot do.
OFFERED_SUBSTRATES = ["container", "gvisor", "process"]
_PATH_PARAMS: dict[str, dict[str, Any]] = {
    "id": {"type": "string", "minLength": 1, "maxLength": 200},
    "pid": {"type": "integer", "minimum": 0, "maximum": (1 << 31) - 1},
    "snap": {"type": "string", "minLength": 1, "maxLength": 200},
    "name": {"type": "string", "pattern": r"^[a-z0-9][a-z0-9_.\-]{0,62}$"},
    "tid": {"type": "string", "minLength": 1, "maxLength": 200},
    "port": {"type": "integer", "minimum": 1, "maximum": 65535},
}


def _codes(status: int) -> str:
    codes = sorted(c for c, cls in ERROR_CLASSES.items() if cls.status == status)
    return ", ".join(codes)


# Handlers whose body is spooled to disk (corral.daemon.spool): cut when it stalls (408).
SPOOLED = frozenset({"file_write", "tar_upload", "upload_image"})


def _error_response(status: int) -> dict[str, Any]:
    codes = {413: "too_large",  # a body past its cap
             408: "invalid_request (body_stalled)"}.get(status) or _codes(status)
    return {"description": f"error: {codes or 'http_error'}", "content": {
        "application/json": {"schema": {"$ref": SCHEMA_REF + "Error"}}}}


def _statuses(r: Route) -> list[int]:
    """The error statuses an operation answers: bad input (400) wherever a request carries
    input, 401 without the token on TCP, 500 for a daemon bug, and the route's own."""
    out = {500} | set(r.errors)
    if r.handler.__name__ in ADMIN_ONLY:  # to a tenant's token (docs/daemon.md, Tenants)
        out.add(403)
    if r.path not in PUBLIC_PATHS:
        out.add(401)
    if r.body is not None or r.query or "{" in r.path:
        out.add(400)
    if r.body is not None:  # every body has a cap (JSON 16 MiB, raw 1 GiB)
        out.add(413)
    if r.handler.__name__ in SPOOLED:  # a body that stalls is cut; the disk's room, shared
        out.update((408, 429))
    if isinstance(r.body, type):  # a big JSON body the daemon's pool cannot take now (bodymem)
        out.add(429)
    return sorted(out)


def _required_body(model: type[BaseModel]) -> bool:
    return any(f.is_required() for f in model.model_fields.values())


def _operation(r: Route) -> dict[str, Any]:
    params: list[dict[str, Any]] = []
    for name, path_schema in _PATH_PARAMS.items():
        if "{" + name + "}" in r.path:
            params.append({"name": name, "in": "path", "required": True, "schema": path_schema})
    for q in r.query:
        schema: dict[str, Any] = q.schema or {"type": q.type}
        if q.repeated:
            schema = {"type": "array", "items": schema}
        params.append({"name": q.name, "in": q.where, "required": q.required,
                       "description": q.description, "schema": schema})
    ok = _response(r)
    if r.links:
        ok["links"] = r.links
    responses: dict[str, Any] = {str(r.status): ok}
    for st in _statuses(r):
        responses[str(st)] = _error_response(st)
    responses["default"] = {"description": "error", "content": {"application/json": {
        "schema": {"$ref": SCHEMA_REF + "Error"}}}}
    op: dict[str, Any] = {
        "operationId": r.handler.__name__,
        "summary": r.summary,
        "responses": responses,
    }
    if r.path in PUBLIC_PATHS:
        op["security"] = []
    if params:
        op["parameters"] = params
    if isinstance(r.body, type):
        # An empty body is {}: required exactly when the model has a required field.
        op["requestBody"] = {"required": _required_body(r.body), "content": {
            "application/json": {"schema": _schema_ref(r.body)}}}
    elif isinstance(r.body, str) and r.body in _MEDIA:
        op["requestBody"] = {"required": True, "content": {
            _MEDIA[r.body]: {"schema": _BINARY}}}
    return op


def build_spec() -> dict[str, Any]:
    _, defs = models_json_schema(_models(), ref_template=SCHEMA_REF + "{model}")
    schemas = dict(sorted(defs.get("$defs", {}).items()))
    schemas["Error"] = _ERROR
    schemas["SandboxSpec"]["properties"]["substrate"]["enum"] = OFFERED_SUBSTRATES
    paths: dict[str, dict[str, Any]] = {}
    for r in ROUTES:
        paths.setdefault(r.path, {})[r.method.lower()] = _operation(r)
    return {
        "openapi": "3.1.0",
        "info": {"title": "corrald", "version": __version__,
                 "description": (
                     "The corral daemon API: sandboxes, exec, files, images. On the local "
                     "unix socket (root only, no token: root-equivalent, may name host "
                     "paths) or over TCP with a bearer token (sandbox operations only; no "
                     "host paths). Integers in query strings are decimal digits only (no "
                     "sign, leading zero, 0x or _), except file modes, which may be octal "
                     "(0644, 0o644). Errors are {\"error\": {code, message, details}} "
                     "with a stable code (docs/sdk.md#errors).")},
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
        "paths": paths,
    }


def render() -> str:
    return json.dumps(build_spec(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m corral.daemon.openapi")
    p.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    p.add_argument("-o", "--output", default=SPEC_PATH)
    args = p.parse_args(argv)
    text = render()
    if args.check:
        try:
            with open(args.output) as f:
                current = f.read()
        except OSError:
            current = ""
        if current != text:
            print(f"{args.output} is stale: run python -m corral.daemon.openapi",
                  file=sys.stderr)
            return 1
        return 0
    with open(args.output, "w") as f:
        f.write(text)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
