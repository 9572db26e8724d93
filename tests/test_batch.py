"""Batch endpoints: the same command in many sandboxes, many destroys in one request.

Against the session's real corrald: the wire contract (raw HTTP), then the SDK (sync and async).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import uuid

import pytest

from corral import AsyncSandbox, Sandbox
from corral.errors import ImageNotFound, SandboxNotFound, SandboxNotRunning

from apiclient import client, create, expect_error
from conftest import SOCKET, wait_until


def tag() -> dict[str, str]:
    return {"test": uuid.uuid4().hex[:12]}


# ---- wire ---------------------------------------------------------------------------------
def test_batch_exec_and_destroy_over_http(no_leaks):
    with client() as c:
        ids = [create(c, timeout=300)["id"] for _ in range(3)]
        r = c.post("/v1/sandboxes/batch/exec", json={
            "ids": [*ids, "sb-0000000000000000"],
            "exec": {"cmd": "hostname; echo $X >&2; exit 3", "env": {"X": "y"}}})
        assert r.status_code == 200, r.text
        res = r.json()["results"]
        assert len(res) == 4
        for sid, item in zip(ids, res, strict=False):
            assert item["exit_code"] == 3 and item["stderr"] == "y\n"
            assert item["stdout"].strip() == sid  # each ran in its own sandbox, in order
        assert res[3]["error"]["code"] == "sandbox_not_found"

        r = c.post("/v1/sandboxes/batch/destroy", json={"ids": [ids[0], ids[1], "sb-nope",
                                                                ids[0]]})
        assert r.status_code == 200, r.text
        # Counts, and only the ids not killed (index in the request): ids[0] twice is the
        # same destroy, in flight.
        res = r.json()
        assert (res["killed"], res["already_ended"], res["failed"]) == (3, 0, 1)
        (bad,) = res["not_killed"]
        assert bad["index"] == 2 and bad["id"] == "sb-nope" and bad["killed"] is False
        assert bad["error"]["code"] == "sandbox_not_found"

        # Ended sandboxes give the precise per-item error; the live one still runs.
        r = c.post("/v1/sandboxes/batch/exec", json={"ids": [ids[0], ids[2]],
                                                      "exec": {"cmd": ["true"]}})
        res = r.json()["results"]
        assert res[0]["error"]["code"] == "sandbox_not_running"
        assert res[0]["error"]["details"]["reason"] == "killed"
        assert res[1]["exit_code"] == 0
        r = c.post("/v1/sandboxes/batch/destroy", json={"ids": [ids[2], ids[0]]})
        assert r.json() == {"killed": 1, "already_ended": 1, "failed": 0, "not_killed": [
            {"index": 1, "id": ids[0], "killed": False}]}


def test_batch_requests_are_validated():
    with client() as c:
        expect_error(c.post("/v1/sandboxes/batch/exec", json={"ids": [], "exec": {"cmd": "x"}}),
                     "invalid_request", 400)
        expect_error(c.post("/v1/sandboxes/batch/exec", json={
            "ids": ["sb-0"], "exec": {"cmd": "x", "background": True}}), "invalid_request", 400)
        expect_error(c.post("/v1/sandboxes/batch/exec", json={"ids": ["a"] * 10_001,
                                                              "exec": {"cmd": "x"}}),
                     "invalid_request", 400)
        expect_error(c.post("/v1/sandboxes/batch/destroy", json={"ids": []}),
                     "invalid_request", 400)
        # The streamed form is named exactly; anything else is refused before any work.
        before = c.get("/v1/status").json()["sandboxes"]
        for q in ("stream=json", "stream=ndjson&stream=ndjson", "stream="):
            expect_error(c.post("/v1/sandboxes/batch?" + q, json={"count": 2}),
                         "invalid_request", 400)
        assert c.get("/v1/status").json()["sandboxes"] == before


# ---- SDK ----------------------------------------------------------------------------------
def test_sdk_exec_many_and_kill_many(no_leaks):
    labels = tag()
    boxes = Sandbox.create_many(5, labels=labels, timeout=300)
    try:
        res = Sandbox.exec_many(boxes, ["hostname"], concurrency=2)
        assert [r.stdout.strip() for r in res] == [b.last_info.hostname for b in boxes]
        assert all(r.ok for r in res)
        # Ids work as well as handles; per-item errors raise unless asked to return them.
        res = Sandbox.exec_many([b.id for b in boxes], "exit 7")
        assert {r.exit_code for r in res} == {7}
    finally:
        assert Sandbox.kill_many(boxes) == [True] * 5
    assert Sandbox.list(labels=labels) == []
    assert Sandbox.kill_many(boxes) == [False] * 5
    with pytest.raises(SandboxNotRunning):
        Sandbox.exec_many(boxes, "true")
    res = Sandbox.exec_many(boxes[:2], "true", return_exceptions=True)
    assert all(isinstance(r, SandboxNotRunning) for r in res)
    with pytest.raises(SandboxNotFound):
        Sandbox.kill_many(["sb-0000000000000000"])
    res = Sandbox.kill_many(["sb-0000000000000000", boxes[0]], return_exceptions=True)
    assert isinstance(res[0], SandboxNotFound) and res[1] is False
    # Nothing to do: no request, nothing to raise (the HTTP API refuses an empty batch).
    assert Sandbox.exec_many([], "true") == [] and Sandbox.kill_many([]) == []


def test_sdk_async_exec_many_and_kill_many(no_leaks):
    async def main() -> None:
        a = AsyncSandbox(timeout=300)  # not created yet: exec_many creates it first
        b = await AsyncSandbox.create(timeout=300)
        try:
            res = await AsyncSandbox.exec_many([a, b.id], "echo $((6*7))")
            assert [r.stdout for r in res] == ["42\n", "42\n"]
        finally:
            assert await AsyncSandbox.kill_many([a, b]) == [True, True]
        res = await AsyncSandbox.exec_many([a], "true", return_exceptions=True)
        assert isinstance(res[0], SandboxNotRunning)

    asyncio.run(main())


def _metrics() -> dict[str, float]:
    import re

    with client() as c:
        text = c.get("/metrics").text
    return {m[1]: float(m[2]) for m in re.finditer(r"^(corral_\w+) ([0-9.e+-]+)$", text, re.M)}


def test_batch_churn_loses_nothing_and_kills_paused_ones(no_leaks):
    """kill_many destroys a batch together (inits signalled ahead): a paused sandbox in the
    batch is killed too, and no death of a batch-killed init is ever taken for the death of a
    later sandbox that got its pid (which would report that one lost)."""
    lost0 = _metrics()["corral_lost_total"]
    for i in range(4):
        boxes = Sandbox.create_many(8, labels=tag(), timeout=300)
        res = Sandbox.exec_many(boxes, ["true"])
        assert all(r.ok for r in res)
        if i == 0:
            boxes[3].pause()
        assert Sandbox.kill_many(boxes) == [True] * 8
        res = Sandbox.exec_many(boxes, ["true"], return_exceptions=True)
        assert all(isinstance(r, SandboxNotRunning) and r.details["reason"] == "killed"
                   for r in res)
    assert _metrics()["corral_lost_total"] == lost0


# ---- never silent, never orphaned --------------------------------------------------------
def _stream_lines(c, path: str, body: dict) -> list[tuple[float, dict]]:  # type: ignore[no-untyped-def]
    """POST a batch with ?stream=ndjson; each JSON line with the time it arrived."""
    out = []
    with c.stream("POST", path, params={"stream": "ndjson"}, json=body) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        status = r.status_code
        for line in r.iter_lines():
            if line.strip():
                out.append((time.monotonic(), json.loads(line)))
    return [(0.0, {"status": status}), *out]


def test_streamed_batches_send_progress_then_the_answer(no_leaks):
    labels = tag()
    with client() as c:
        lines = _stream_lines(c, "/v1/sandboxes/batch", {"count": 6, "spec": {"labels": labels}})
        assert lines[0][1] == {"status": 201}
        *progress, last = [obj for _, obj in lines[1:]]
        assert [set(p) for p in progress] == [{"progress"}] * len(progress)
        done = [p["progress"]["done"] for p in progress]
        assert done == sorted(done) and done[0] == 0 and done[-1] == 6
        assert all(p["progress"]["count"] == 6 for p in progress)
        ids = [s["id"] for s in last["sandboxes"]]
        assert len(ids) == 6

        # A batch that waits on its commands is still heard from at least once a second.
        lines = _stream_lines(c, "/v1/sandboxes/batch/exec",
                              {"ids": ids, "exec": {"cmd": "sleep 3; echo done"}})
        stamps = [t for t, _ in lines[1:]]
        gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
        assert len(stamps) >= 4 and max(gaps) < 2.0, gaps
        results = lines[-1][1]["results"]
        assert [r["stdout"] for r in results] == ["done\n"] * 6

        lines = _stream_lines(c, "/v1/sandboxes/batch/destroy", {"ids": ids})
        assert lines[-1][1]["killed"] == 6


def test_streamed_batch_errors(no_leaks):
    """What a batch refuses at once is an error status, before any stream; what fails after the
    batch began is the stream's last line."""
    with client() as c:
        r = c.post("/v1/sandboxes/batch", params={"stream": "ndjson"},
                   json={"count": 3, "spec": {"image": "no-such-image"}})
        assert r.status_code == 404 and r.json()["error"]["code"] == "image_not_found", r.text
        # A registry reference is pulled inside the batch: nothing listens on port 1.
        lines = _stream_lines(c, "/v1/sandboxes/batch",
                              {"count": 2, "spec": {"image": "127.0.0.1:1/corral/none:1"}})
        last = lines[-1][1]
        assert set(last) == {"error"} and last["error"]["code"], last
    with pytest.raises(ImageNotFound):
        Sandbox.create_many(2, image="no-such-image")


def _sandboxes_labelled(c, labels: dict[str, str]) -> list[str]:  # type: ignore[no-untyped-def]
    (k, v), = labels.items()
    return [s["id"] for s in c.get("/v1/sandboxes", params={"label": f"{k}={v}"})
            .json()["sandboxes"]]


def _created(c) -> int:  # type: ignore[no-untyped-def]
    for line in c.get("/metrics").text.splitlines():
        if line.startswith("corral_created_total "):
            return int(float(line.split()[1]))
    raise AssertionError("no corral_created_total in /metrics")


def _post_then_leave(body: bytes, query: str, read_first_line: bool) -> None:
    """Send a create batch on a raw connection and close it while the batch runs."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(SOCKET)
    s.sendall(b"POST /v1/sandboxes/batch" + query.encode() + b" HTTP/1.1\r\nHost: corral\r\n"
              b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode()
              + b"\r\n\r\n" + body)
    if read_first_line:
        got = b""
        while b"progress" not in got:  # the status line, headers and the first progress line
            chunk = s.recv(4096)
            assert chunk, got
            got += chunk
    s.close()


@pytest.mark.parametrize("streamed", [True, False])
def test_a_client_that_leaves_a_create_batch_leaves_no_sandboxes(no_leaks, streamed):
    """The batch is cancelled and undone: nothing waits for a TTL to be cleaned up."""
    labels = tag()
    body = json.dumps({"count": 400, "spec": {"labels": labels, "timeout": 3600}}).encode()
    with client() as c:
        made_before = c.get("/v1/status").json()
        created_before = _created(c)
        _post_then_leave(body, "?stream=ndjson" if streamed else "", read_first_line=streamed)
        # Left while it runs: some of its sandboxes are made by then...
        assert wait_until(lambda: _created(c) > created_before, timeout=30)
        # ...and undone: every one is gone (destroyed, not left to its TTL).
        assert wait_until(lambda: not _sandboxes_labelled(c, labels), timeout=60)
        assert wait_until(lambda: c.get("/v1/status").json()["sandboxes"]
                          <= made_before["sandboxes"], timeout=60)
