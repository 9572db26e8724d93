"""Batch endpoints: the same command in many sandboxes, many destroys in one request.

Against the session's real corrald: the wire contract (raw HTTP), then the SDK (sync and async).
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from corral import AsyncSandbox, Sandbox
from corral.errors import SandboxNotFound, SandboxNotRunning

from apiclient import client, create, expect_error


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
