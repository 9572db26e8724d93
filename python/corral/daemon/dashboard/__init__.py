"""The web dashboard: a static page and script (``GET /dashboard``, ``/dashboard/app.js``) and
the JSON it polls (``GET /v1/dashboard``); a sandbox's page reads ``/v1/sandboxes/{id}/log``.

The page and script are static files without data, served without a token (a browser's
navigation cannot carry a bearer header): everything they show comes from API calls that the
script makes with ``Authorization: Bearer``, token taken from the URL fragment (never sent to a
server), so on TCP the dashboard needs the token exactly as the API does. The script renders
every value as text (labels, commands and their output come from sandboxes). A strict
Content-Security-Policy forbids inline script and foreign origins. docs/observability.md.
"""

from __future__ import annotations

import time
from importlib import resources
from typing import Any

from aiohttp import web

# Static, served to anyone who can reach the port (they hold no data).
PUBLIC = frozenset({"/dashboard", "/dashboard/app.js"})
MAX_LISTED = 1000  # sandboxes in one summary (newest first); the total is always given
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self' "
                               "'unsafe-inline'; connect-src 'self'; img-src 'self' data:; "
                               "base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer", "Cache-Control": "no-store",
}
_FILES = {"page": ("index.html", "text/html"), "script": ("app.js", "text/javascript")}


def _static(which: str) -> web.Response:
    name, ctype = _FILES[which]
    body = resources.files(__package__).joinpath(name).read_bytes()
    return web.Response(body=body, content_type=ctype, charset="utf-8", headers=_HEADERS)


async def dashboard_page(request: web.Request) -> web.Response:
    return _static("page")


async def dashboard_script(request: web.Request) -> web.Response:
    return _static("script")


def summary(sandboxes: list[Any], capacity: int, engine_metrics: dict[str, int],
            errors: dict[str, float], infra: float, latency: dict[str, Any]) -> dict[str, Any]:
    """What the dashboard's main page shows: live sandboxes (newest first), totals the page
    turns into rates between two polls, and the latency histograms."""
    now = time.time()
    newest = sorted(sandboxes, key=lambda sb: sb.created_at, reverse=True)[:MAX_LISTED]
    rows = []
    for sb in newest:
        i = sb.info()
        rows.append({k: i[k] for k in ("id", "state", "substrate", "image", "labels",
                                       "created_at")})
        rows[-1]["age_s"] = round(max(0.0, now - i["created_at"]), 3)
    m = engine_metrics
    totals = {"created": m.get("created", 0), "execs": m.get("execs", 0),
              "snapshots": m.get("snapshots", 0), "crashed": m.get("crashed", 0),
              "lost": m.get("lost", 0), "errors": sum(errors.values()),
              "infra_failures": infra}
    return {"now": now, "capacity": capacity, "count": len(sandboxes), "sandboxes": rows,
            "totals": totals, "errors_by_code": errors, "latency": latency}
