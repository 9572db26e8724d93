"""Snapshot, fork and restore as long calls (docs/daemon.md, long calls): streamed progress at
least once a second, and a client that leaves a snapshot or a fork leaves nothing behind.

Against the session's real corrald, over raw HTTP (the wire contract) and the SDK. The slow
cases write a few hundred MB into a sandbox so that its capture takes seconds.
"""

from __future__ import annotations

import json
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from corral import AsyncSandbox, Sandbox, _core

from apiclient import client, create, kill, run
from conftest import (
    SOCKET,
    STATE_DIR,
    host_mounts_under,
    leaked_sandbox_cgroups,
    pids_in_cgroups,
    wait_until,
)

BIG_MB = 1024  # written into a sandbox: its capture takes seconds (a copy and a hash)
STATE = Path(STATE_DIR)


def tag() -> dict[str, str]:
    return {"test": uuid.uuid4().hex[:12]}


def stream(c: httpx.Client, path: str, body: dict[str, Any]) -> list[tuple[float, Any]]:
    """POST with ?stream=ndjson: (arrival time, JSON line) per line, the status first."""
    out: list[tuple[float, Any]] = []
    with c.stream("POST", path, params={"stream": "ndjson"}, json=body) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson"), r.read()
        out.append((time.monotonic(), {"status": r.status_code}))
        for line in r.iter_lines():
            if line.strip():
                out.append((time.monotonic(), json.loads(line)))
    return out


def split(lines: list[tuple[float, Any]]) -> tuple[int, list[dict[str, Any]], Any]:
    """(status, progress objects, last line); every line but the last is progress."""
    *progress, last = [obj for _, obj in lines[1:]]
    assert all(set(p) == {"progress"} for p in progress), progress
    return lines[0][1]["status"], [p["progress"] for p in progress], last


@pytest.fixture
def box() -> Iterator[dict[str, Any]]:
    labels = tag()
    with client() as c:
        info = create(c, timeout=600, labels=labels, disk_mb=4096)
        try:
            yield info
        finally:
            kill(c, info["id"])


def write_big(c: httpx.Client, sid: str, mb: int = BIG_MB) -> None:
    res = run(c, sid, f"dd if=/dev/zero of=/big bs=1M count={mb} status=none && "
                      "echo data > /small", timeout=300)
    assert res["exit_code"] == 0, res


def snapshots(c: httpx.Client) -> set[str]:
    return {s["id"] for s in c.get("/v1/snapshots").json()["snapshots"]}


def entries(d: str) -> set[str]:
    p = STATE / d
    return {x.name for x in p.iterdir()} if p.is_dir() else set()


def labelled(c: httpx.Client, labels: dict[str, str]) -> list[str]:
    (k, v), = labels.items()
    return [s["id"] for s in c.get("/v1/sandboxes", params={"label": f"{k}={v}"})
            .json()["sandboxes"]]


class Leaves:
    """Post on a raw connection, read the stream until ``ready`` holds for a progress line
    (or, unstreamed, until ``ready(None)`` polls true), then close it: the client leaves."""

    def __init__(self, path: str, body: dict[str, Any], streamed: bool) -> None:
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.s.connect(SOCKET)
        data = json.dumps(body).encode()
        q = "?stream=ndjson" if streamed else ""
        self.s.sendall(f"POST {path}{q} HTTP/1.1\r\nHost: corral\r\nContent-Type: "
                       f"application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
                       + data)
        self.got = b""
        self.seen: list[dict[str, Any]] = []

    def progress_until(self, ready: Any, timeout: float = 120) -> dict[str, Any]:
        self.s.settimeout(timeout)
        while True:
            while b"\n" in self.got:
                line, self.got = self.got.split(b"\n", 1)
                line = line.strip()
                if line.startswith(b"{"):
                    obj = json.loads(line)
                    assert set(obj) == {"progress"}, obj  # ended before the client left
                    self.seen.append(obj["progress"])
                    if ready(obj["progress"]):
                        return obj["progress"]
            chunk = self.s.recv(65536)
            assert chunk, (self.got, self.seen)
            self.got += chunk

    def leave(self) -> None:
        self.s.close()


def capture_copying() -> bool:
    """A capture is copying now: a spare layer dir taken for it holds data."""
    spares = STATE / "spares"
    return any(p.is_file() and p.stat().st_size > 0 for p in spares.glob("*/0/*"))


def thawed_and_alive(c: httpx.Client, sid: str) -> bool:
    r = c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "cat /small", "timeout": 5})
    return r.status_code == 200 and r.json().get("stdout") == "data\n"


def no_partial_layers(layers_before: set[str]) -> bool:
    """No new layer, nothing half-made left in spares (the store keeps 2 empty ones) or the
    trash (emptied in the background)."""
    spares = STATE / "spares"
    return (entries("layers") <= layers_before and not entries("trash")
            and not any(spares.glob("*/0/*")))


# ---- the capture's control -------------------------------------------------------------------
def test_capture_control_counts_bytes_and_cancels(tmp_path):
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "big").write_bytes(b"x" * (3 << 20))  # copied in the kernel, hashed alongside
    (src / "d" / "small").write_bytes(b"y" * 1000)
    control = _core.CaptureControl()
    digest, size = _core.capture_layer([(0, str(src), str(tmp_path / "a"))], control=control)
    assert size == control.copied() == (3 << 20) + 1000
    assert not control.cancelled()
    # Cancelled: it raises, whatever it had copied is the caller's to remove.
    control = _core.CaptureControl()
    control.cancel()
    with pytest.raises(_core.CaptureCancelled):
        _core.capture_layer([(0, str(src), str(tmp_path / "b"))], control=control)
    assert control.copied() == 0


# ---- progress, then the answer ------------------------------------------------------------
def test_snapshot_fork_restore_stream_progress_then_the_answer(no_leaks, box):
    sid = box["id"]
    with client() as c:
        before = snapshots(c)  # other tests' (the session daemon is shared)
        run(c, sid, "echo hi > /f && head -c 3000000 /dev/zero > /g")
        status, prog, snap = split(stream(c, f"/v1/sandboxes/{sid}/snapshot", {"name": None}))
        assert status == 201 and snap["id"].startswith("snap-") and snap["size"] >= 3000000
        assert prog and all(set(p) == {"bytes"} for p in prog), prog
        got = [p["bytes"] for p in prog]
        assert got == sorted(got) and got[-1] == snap["size"], (got, snap)

        status, prog, fork = split(stream(c, f"/v1/sandboxes/{sid}/fork",
                                          {"count": 3, "keep_snapshot": False}))
        assert status == 201 and len(fork["sandboxes"]) == 3
        assert all(set(p) == {"bytes", "done", "count"} and p["count"] == 3 for p in prog)
        assert [p["done"] for p in prog] == sorted(p["done"] for p in prog)
        assert prog[0]["done"] == 0 and prog[-1]["done"] == 3, prog
        assert fork["snapshot"]["id"] not in snapshots(c)  # not kept: the children hold it
        for kid in fork["sandboxes"]:
            assert run(c, kid["id"], "cat /f")["stdout"] == "hi\n"
            kill(c, kid["id"])

        run(c, sid, "rm /f")
        status, prog, info = split(stream(c, f"/v1/sandboxes/{sid}/restore",
                                          {"snapshot": snap["id"]}))
        assert status == 200 and info["id"] == sid and info["snapshot"] == snap["id"]
        assert prog and all(p == {} for p in prog), prog
        assert run(c, sid, "cat /f")["stdout"] == "hi\n"

        # A failure after the stream began is its last line, never a 500 nor a cut stream.
        status, _, last = split(stream(c, f"/v1/sandboxes/{sid}/restore",
                                       {"snapshot": "snap-0000000000000000"}))
        assert status == 200 and last["error"]["code"] == "snapshot_not_found", last
        assert c.delete(f"/v1/snapshots/{snap['id']}").status_code == 200
        # The streamed form is named exactly: anything else is refused before any work.
        for q in ("stream=json", "stream=ndjson&stream=ndjson"):
            r = c.post(f"/v1/sandboxes/{sid}/snapshot?{q}", json={})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
        assert snapshots(c) <= before  # none of this test's is left


def test_sdk_snapshot_fork_restore_stream_and_keep_their_types(no_leaks):
    """The SDK always asks for the stream (sync and async) and returns what it always did."""
    with Sandbox(timeout=120) as sb:
        sb.exec("echo one > /f").check()
        snap = sb.snapshot(name=f"lc-{uuid.uuid4().hex[:8]}")
        assert snap.id.startswith("snap-") and snap.name
        kids = sb.fork(2)
        try:
            assert [k.exec("cat /f").stdout for k in kids] == ["one\n", "one\n"]
        finally:
            for k in kids:
                k.kill()
        sb.exec("echo two > /f").check()
        info = sb.restore(snap)
        assert info.id == sb.id and sb.exec("cat /f").stdout == "one\n"
        snap.delete()

    import asyncio

    async def main() -> None:
        a = await AsyncSandbox.create(timeout=120)
        try:
            await a.exec("echo three > /f")
            s = await a.snapshot()
            kids = await a.fork(1)
            assert (await kids[0].exec("cat /f")).stdout == "three\n"
            await kids[0].kill()
            await a.exec("rm /f")
            info = await a.restore(s)
            assert info.id == a.id and (await a.exec("cat /f")).stdout == "three\n"
            await s.delete()
        finally:
            await a.kill()

    asyncio.run(main())


def test_a_slow_snapshot_is_heard_from_every_second(no_leaks, box):
    sid = box["id"]
    with client() as c:
        # A capture copies everything the sandbox changed: a GiB more per round until one
        # takes over a second on this machine (the test is of silence, not of speed).
        for n in range(3):
            res = run(c, sid, f"dd if=/dev/zero of=/big{n} bs=1M count={BIG_MB} status=none",
                      timeout=300)
            assert res["exit_code"] == 0, res
            lines = stream(c, f"/v1/sandboxes/{sid}/snapshot", {})
            status, prog, snap = split(lines)
            assert status == 201 and snap["size"] >= (n + 1) * BIG_MB << 20, snap
            assert c.delete(f"/v1/snapshots/{snap['id']}").status_code == 200
            stamps = [t for t, _ in lines]
            if stamps[-1] - stamps[0] > 1.0:
                break
        assert stamps[-1] - stamps[0] > 1.0, "no capture was slow: no test of silence"
        gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
        assert max(gaps) < 1.5, gaps  # every second (+ one 0.2 s tick), never silent
        got = [p["bytes"] for p in prog]
        assert got == sorted(got) and len(set(got)) >= 3, got  # counted as it copies
        assert got[-1] == snap["size"]


# ---- a client that leaves leaves nothing ----------------------------------------------------
@pytest.mark.parametrize("streamed", [True, False])
def test_a_client_that_leaves_a_snapshot_leaves_no_snapshot(no_leaks, box, streamed):
    sid = box["id"]
    with client() as c:
        write_big(c, sid)
        snaps, layers = snapshots(c), entries("layers")
        call = Leaves(f"/v1/sandboxes/{sid}/snapshot", {"name": f"gone-{uuid.uuid4().hex}"},
                      streamed)
        if streamed:  # copying, far from done
            at = call.progress_until(lambda p: 0 < p["bytes"] < BIG_MB << 20)  # mid-copy
            assert at["bytes"] < BIG_MB << 20
        else:
            assert wait_until(capture_copying, timeout=120)
        call.leave()
        # Cancelled: thawed and running, no record, the partial copy removed.
        assert wait_until(lambda: thawed_and_alive(c, sid), timeout=30)
        assert wait_until(lambda: no_partial_layers(layers), timeout=30), (
            entries("layers") - layers, entries("trash"), list((STATE / "spares").glob("*/*/*")))
        assert snapshots(c) == snaps
        # The sandbox snapshots fine afterwards (no capture left holding it).
        r = c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "rm /big"})
        assert r.status_code == 200
        snap = c.post(f"/v1/sandboxes/{sid}/snapshot", json={}).json()
        assert snap["size"] < 1 << 20
        assert c.delete(f"/v1/snapshots/{snap['id']}").status_code == 200


def _baseline() -> dict[str, Any]:
    return {"sandboxes": entries("sandboxes"), "pids": len(pids_in_cgroups()),
            "cgroups": set(leaked_sandbox_cgroups()),
            "mounts": len(host_mounts_under(STATE_DIR))}


def _back_to(before: dict[str, Any]) -> bool:
    now = _baseline()
    return (now["sandboxes"] <= before["sandboxes"] and now["pids"] <= before["pids"]
            and now["cgroups"] <= before["cgroups"] and now["mounts"] <= before["mounts"])


@pytest.mark.parametrize("phase", ["snapshot", "children"])
def test_a_client_that_leaves_a_fork_leaves_nothing(no_leaks, phase):
    """Left while its snapshot copies, or while its children are made: every child made is
    destroyed (processes, cgroups, mounts, dirs), the snapshot dropped and its layer refs
    released (the layer goes once the parent is gone too)."""
    labels = tag()
    count = 2 if phase == "snapshot" else 400
    with client() as c:
        big = {"disk_mb": 4096} if phase == "snapshot" else {}
        parent = create(c, timeout=600, labels=labels, **big)
        sid = parent["id"]
        if phase == "snapshot":
            write_big(c, sid)
        else:
            run(c, sid, "echo data > /small")
        layers, snaps, before = entries("layers"), snapshots(c), _baseline()
        call = Leaves(f"/v1/sandboxes/{sid}/fork", {"count": count, "keep_snapshot": True},
                      streamed=True)
        if phase == "snapshot":
            call.progress_until(lambda p: 0 < p["bytes"] < BIG_MB << 20)  # mid-copy
        else:
            call.progress_until(lambda p: p["done"] >= 1)  # children exist
        call.leave()
        assert wait_until(lambda: labelled(c, labels) == [sid], timeout=120), \
            len(labelled(c, labels))
        assert wait_until(lambda: _back_to(before), timeout=60), (_baseline(), before)
        assert snapshots(c) == snaps  # kept or not, a cancelled fork keeps no snapshot
        assert thawed_and_alive(c, sid)
        kill(c, sid)
        # No child or record holds a ref: the fork's layer is collected with the parent.
        assert wait_until(lambda: no_partial_layers(layers), timeout=60), (
            entries("layers") - layers, entries("trash"))


def metric(c: httpx.Client, name: str) -> float:
    for line in c.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


@pytest.mark.parametrize("what", ["snapshot", "fork", "batch"])
def test_a_client_that_leaves_as_the_call_ends_leaves_nothing(no_leaks, what):
    """A small call ends before the daemon sees its client gone (unstreamed: it looks every
    0.25 s): the answer has nobody to go to, so what it made is undone (an unkeyed call
    cannot be fetched again). Streamed, the first write finds the client gone at once."""
    labels = tag()
    with client() as c:
        sid = create(c, timeout=120, labels=labels)["id"]
        try:
            _leave_as_it_ends(c, sid, labels, what)
        finally:
            kill(c, sid)


def _leave_as_it_ends(c: httpx.Client, sid: str, labels: dict[str, str], what: str) -> None:
    run(c, sid, "echo data > /small")
    snaps, made0 = snapshots(c), metric(c, "corral_created_total")
    snapped0 = metric(c, "corral_snapshots_total")
    path, body, makes = {
        "snapshot": (f"/v1/sandboxes/{sid}/snapshot", {}, 0),
        "fork": (f"/v1/sandboxes/{sid}/fork", {"count": 2, "keep_snapshot": True}, 2),
        "batch": ("/v1/sandboxes/batch", {"count": 2, "spec": {"labels": labels}}, 2),
    }[what]
    Leaves(path, body, streamed=False).leave()  # sent whole, then gone at once
    # It ran to its end (all it makes was made)...
    assert wait_until(lambda: metric(c, "corral_created_total") >= made0 + makes
                      and (what == "batch"
                           or metric(c, "corral_snapshots_total") > snapped0), timeout=60)
    # ...and was undone: no child, no snapshot record.
    assert wait_until(lambda: labelled(c, labels) == [sid], timeout=60), labelled(c, labels)
    assert wait_until(lambda: snapshots(c) == snaps, timeout=30)


def test_a_keyed_fork_whose_client_left_is_kept_for_its_retry(no_leaks):
    labels = tag()
    with client() as c:
        sid = create(c, timeout=120, labels=labels)["id"]
        made0 = metric(c, "corral_created_total")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(SOCKET)
        data = b'{"count": 2}'
        s.sendall(f"POST /v1/sandboxes/{sid}/fork HTTP/1.1\r\nHost: corral\r\nIdempotency-Key: "
                  f"k-{labels['test']}\r\nContent-Type: application/json\r\nContent-Length: "
                  f"{len(data)}\r\n\r\n".encode() + data)
        s.close()
        assert wait_until(lambda: metric(c, "corral_created_total") >= made0 + 2, timeout=60)
        r = c.post(f"/v1/sandboxes/{sid}/fork", json={"count": 2},
                   headers={"Idempotency-Key": f"k-{labels['test']}"})
        assert r.status_code == 201, r.text
        kids = [k["id"] for k in r.json()["sandboxes"]]
        assert sorted(labelled(c, labels)) == sorted([sid, *kids])
        assert all(run(c, k, "cat /etc/hostname")["exit_code"] == 0 for k in kids)
        for k in (*kids, sid):
            kill(c, k)


@pytest.mark.parametrize("op,body", [("snapshot", {}), ("fork", {"count": 1}),
                                     ("restore", {"snapshot": "x"})])
@pytest.mark.parametrize("sid", ["sb-0000000000000000", "0" * 300])
def test_a_streamed_call_on_an_unknown_sandbox_is_a_404_not_a_stream(op: str, body: dict,
                                                                    sid: str):
    """The status of a streamed call goes out before its work ends; a sandbox that does not
    exist is known at once and answered as the unstreamed call would be, keyed or not."""
    with client() as c:
        for headers in ({}, {"Idempotency-Key": uuid.uuid4().hex}):
            r = c.post(f"/v1/sandboxes/{sid}/{op}", params={"stream": "ndjson"}, json=body,
                       headers=headers)
            assert r.status_code == 404, (r.status_code, r.text)
            assert r.json()["error"]["code"] == "sandbox_not_found"
