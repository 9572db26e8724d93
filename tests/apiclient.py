"""Raw HTTP helpers for the daemon API tests (no SDK: these tests pin the wire contract)."""

from __future__ import annotations

import uuid
from typing import Any

import httpx

from conftest import SOCKET


def client(socket_path: str = SOCKET, timeout: float = 120.0) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=socket_path),
                        base_url="http://corral", timeout=timeout)


def async_client(socket_path: str = SOCKET, timeout: float = 120.0) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=socket_path, retries=0),
                             base_url="http://corral", timeout=timeout,
                             limits=httpx.Limits(max_connections=1000))


def create(c: httpx.Client, **spec: Any) -> dict[str, Any]:
    r = c.post("/v1/sandboxes", json=spec)
    assert r.status_code == 201, r.text
    return r.json()


def kill(c: httpx.Client, sid: str) -> None:
    r = c.delete(f"/v1/sandboxes/{sid}")
    assert r.status_code == 200, r.text


def run(c: httpx.Client, sid: str, cmd: str | list[str], **kw: Any) -> dict[str, Any]:
    r = c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def expect_error(r: httpx.Response, code: str, status: int) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert body["error"]["code"] == code, body
    assert body["error"]["message"], body
    return body["error"]


def key() -> str:
    """A fresh idempotency key."""
    return uuid.uuid4().hex


def log_of(c: httpx.Client, sid: str) -> list[dict[str, Any]]:
    """The sandbox's trajectory-log entries (GET /v1/sandboxes/{id}/log)."""
    r = c.get(f"/v1/sandboxes/{sid}/log")
    assert r.status_code == 200, r.text
    return r.json()["entries"]


def api_waiting(c: httpx.Client) -> int:
    """Handlers waiting on a process for a client now (waits, streams): /metrics."""
    for line in c.get("/metrics").text.splitlines():
        if line.startswith("corral_api_waiting "):
            return int(float(line.split()[1]))
    raise AssertionError("no corral_api_waiting in /metrics")
