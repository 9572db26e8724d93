"""The committed OpenAPI spec, the app's routes and docs/architecture.md agree."""

from __future__ import annotations

import json
import re
from pathlib import Path

from corral.daemon.app import ROUTES, create_app
from corral.daemon.app_errors import PUBLIC_PATHS
from corral.daemon.openapi import SPEC_PATH, build_spec, render

ARCH = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def app_routes() -> set[tuple[str, str]]:
    app = create_app(None)
    return {(r.method, r.resource.canonical) for r in app.router.routes()}


def spec_routes(spec: dict) -> set[tuple[str, str]]:
    return {(m.upper(), p) for p, ops in spec["paths"].items() for m in ops}


def test_spec_matches_app_routes():
    spec = json.loads(Path(SPEC_PATH).read_text())
    assert spec["openapi"].startswith("3.1")
    assert spec_routes(spec) == app_routes()
    assert len(app_routes()) == len(ROUTES)


def test_committed_spec_is_generated():
    assert Path(SPEC_PATH).read_text() == render(), \
        "openapi.json is stale: run python -m corral.daemon.openapi"


def test_spec_refs_resolve():
    spec = build_spec()
    schemas = spec["components"]["schemas"]
    refs = set(re.findall(r'"#/components/schemas/([^"]+)"', json.dumps(spec)))
    assert refs and refs <= set(schemas)


def test_architecture_table_matches_routes():
    rows = re.findall(r"^\| (GET|POST|PUT|DELETE) \| (\S+) \|", ARCH.read_text(), re.M)
    documented = {(m, p.split("?")[0]) for m, p in rows}
    assert documented == app_routes()


def test_spec_states_real_statuses_links_and_offered_substrates():
    from apiclient import client

    spec = build_spec()
    ops = {op["operationId"]: (path, method, op) for path, item in spec["paths"].items()
           for method, op in item.items()}
    for name, (path, _method, op) in ops.items():
        codes = set(op["responses"]) - {"default"}
        assert any(c.startswith("2") for c in codes) and any(c.startswith("4") for c in codes) \
            or path in PUBLIC_PATHS, (name, codes)
        for link in next(r for c, r in op["responses"].items() if c.startswith("2")).get(
                "links", {}).values():
            assert link["operationId"] in ops, (name, link)
    for public in ("health", "dashboard_page", "dashboard_script"):  # static, no data
        assert ops[public][2]["security"] == [], public
    assert spec["security"] == [{"bearer": []}]
    # Only what this daemon runs: a spec listing vm would promise a 501.
    offered = spec["components"]["schemas"]["SandboxSpec"]["properties"]["substrate"]["enum"]
    with client() as c:
        assert sorted(offered) == sorted(c.get("/v1/status").json()["substrates"])
    # Constraints the server enforces are in the spec.
    schemas = spec["components"]["schemas"]
    assert schemas["MkdirRequest"]["properties"]["path"]["pattern"].startswith("^(/")
    key = next(p for p in ops["exec_cmd"][2]["parameters"] if p["name"] == "Idempotency-Key")
    assert key["schema"]["pattern"] == "^[!-~]{1,256}$"
    for name in ("mkdir", "remove", "rename"):
        assert ops[f"file_{name}"][2]["requestBody"]["required"] is True
    assert ops["create_sandbox"][2]["requestBody"]["required"] is False
