"""A sandbox's output cannot take the daemon's CPU or memory: output the daemon only throws
away (past a command's cap, or written by a background process after its command is done)
is read within a rate for all streams together (procs.DISCARD_RATE), the writer waiting on
its full pipe beyond it; and a client following output more slowly than the process writes
it stops the daemon reading (procs.FOLLOW_HIGH), so nothing piles up in between. Attacked with
`yes`, the fastest writer a shell has."""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import pytest

import corral
from corral.daemon.discard import DISCARD_BURST, DISCARD_RATE
from corral.daemon.procs import (
    DRAIN_CHUNKS,
    FOLLOW_HIGH,
    READ_CHUNK,
)

MIB = 1024 * 1024
T = TypeVar("T")


@pytest.fixture
def sb():
    with corral.Sandbox(timeout=300) as box:
        yield box


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100


def _rss_mib(pid: int, field: str = "VmRSS") -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith(field + ":")) / 1024


def _anon_mib(pid: int) -> float:
    """The daemon's anonymous memory (its RSS less the files it maps: the trajectory log's
    journal, which a tmpfs state dir would count)."""
    return _rss_mib(pid, "RssAnon")


def test_output_past_the_cap_is_read_at_a_bounded_rate(sb):
    """`yes` for 2 s with a 4 KiB cap: the daemon read (and hashed) no more than the discard
    rate allows in that time, where it read ~1 GB/s before; another command answers at once."""
    r = sb.exec("timeout 2 yes", max_output_bytes=4096, timeout=30)
    assert r.exit_code == 124 and r.truncated and len(r.stdout) == 4096, r.exit_code
    bound = DISCARD_RATE * (r.duration_s + 1) + DISCARD_BURST + DRAIN_CHUNKS * READ_CHUNK
    assert r.stdout_bytes <= bound, (r.stdout_bytes / MIB, r.duration_s)
    assert sb.exec("echo alive").stdout == "alive\n"


def test_a_writer_left_behind_costs_the_daemon_little(sb, daemon):
    """Background `yes` processes left writing into the pipes of commands that returned: the
    daemon drains them (so they never get SIGPIPE) within the discard rate, using a small
    part of a core where it used all of one."""
    for _ in range(3):
        r = sb.exec("(yes &) ; echo started")  # the command is done; its `yes` writes on
        assert r.exit_code == 0, r.exit_code
    pid = daemon.proc.pid
    c0, t0 = _cpu_s(pid), time.monotonic()
    time.sleep(3)  # the measurement's window: the writers alone (a command costs CPU too)
    share = (_cpu_s(pid) - c0) / (time.monotonic() - t0)
    assert share < 0.3, share
    lat = []
    for _ in range(20):  # and commands are answered meanwhile
        t = time.monotonic()
        assert sb.exec("true").exit_code == 0
        lat.append(time.monotonic() - t)
    assert sorted(lat)[len(lat) // 2] < 0.5, lat


def test_a_slow_follower_bounds_the_daemons_memory(sb, daemon):
    """A client that follows `yes` and reads slowly: the daemon holds at most FOLLOW_HIGH
    bytes for it (plus what one read brings), where it buffered ~400 MB a second before."""
    pid = daemon.proc.pid
    before = _rss_mib(pid)
    p = sb.exec("yes", background=True)
    t0 = time.monotonic()
    got = 0
    for _stream, data in p.stream():
        got += len(data)
        if time.monotonic() - t0 > 3:
            break
        time.sleep(0.005)  # the slow client, the thing under test
    grown = _rss_mib(pid) - before
    assert grown < 64 + 4 * FOLLOW_HIGH / MIB, grown
    p.kill()
    assert got > 0


def test_a_followed_flood_arrives_whole_and_in_order(sb):
    """Backpressure loses nothing: ~21 MB of numbered lines, followed by a client that
    stops reading for a second after its first chunk (the process waits on its full pipe
    meanwhile), arrive complete and in order, with the exit code."""
    n = 3_000_000
    p = sb.exec(f"seq 1 {n}; echo done >&2", background=True)
    out, err = [], []
    for stream, data in p.stream():
        if not out and not err:
            time.sleep(1)  # the slow client, the thing under test
        (out if stream == "stdout" else err).append(data)
    text = "".join(out)
    assert len(text) > 4 * FOLLOW_HIGH
    assert text == "".join(f"{i}\n" for i in range(1, n + 1))
    assert "".join(err) == "done\n"
    assert p.wait(timeout=30).exit_code == 0


def test_run_code_output_past_its_cap_is_read_at_a_bounded_rate():
    """A run_code request writing as fast as it can for 1.5 s, past a 4 KiB cap: what it
    managed to write (it tells on stderr) is bounded by the discard rate, and the result is
    `output_truncated` with the first 4 KiB."""
    code = ("import sys, time\n"
            "t, n, b = time.monotonic(), 0, b'y' * 65536\n"
            "while time.monotonic() - t < 1.5:\n"
            "    n += sys.stdout.buffer.write(b)\n"
            "sys.stdout.flush()\n"
            "sys.stderr.write(str(n))\n")
    r = corral.run_code(code, timeout=20, max_output_bytes=4096)
    assert r.status == "output_truncated" and r.stdout == "y" * 4096, (r.status, r.stderr)
    written = int(r.stderr)
    assert written <= DISCARD_RATE * 2.5 + DISCARD_BURST + 4 * MIB, written / MIB


def test_a_fast_follower_gets_output_past_the_cap_at_the_bounded_rate(sb):
    """A client following `yes` as fast as it reads: past the command's cap it is sent no
    more than the discard rate allows (the daemon's work per byte is the same whether it
    drops the byte or sends it), where the daemon forwarded ~1 GB a second before."""
    cap = 64 * 1024
    p = sb.exec("timeout 2 yes", background=True, max_output_bytes=cap)
    t0 = time.monotonic()
    got = sum(len(data) for _stream, data in p.stream())
    elapsed = time.monotonic() - t0
    assert got <= cap + DISCARD_RATE * (elapsed + 1) + DISCARD_BURST, (got / MIB, elapsed)
    assert p.wait(timeout=30).exit_code == 124


def test_output_kept_for_finished_background_processes_is_bounded(sb, daemon):
    """Background commands nobody waits for, 4 MiB of output each: the daemon keeps at most
    MAX_KEPT_OUTPUT of finished processes' output per sandbox (the oldest are forgotten,
    ``ProcessNotFound``), where 256 of them kept 2 GiB. The newest still answers in full."""
    from corral.daemon.engine.base import MAX_KEPT_OUTPUT

    pid = daemon.proc.pid
    before = _rss_mib(pid)
    n = 3 * MAX_KEPT_OUTPUT // (4 * MIB)
    procs = []
    for _ in range(n):
        p = sb.exec("head -c 4M /dev/zero | tr '\\0' x", background=True)
        p.wait(timeout=60)
        procs.append(p)
    assert _rss_mib(pid) - before < 3 * MAX_KEPT_OUTPUT / MIB, _rss_mib(pid) - before
    with pytest.raises(corral.errors.ProcessNotFound):
        procs[0].wait(timeout=5)
    assert len(procs[-1].wait(timeout=5).stdout) == 4 * MIB


# Output that JSON writes six bytes to the byte: control characters, and bytes that are not
# UTF-8 (each becomes U+FFFD, "\ufffd").
_BINARY = ("head -c 4M /dev/zero | tr '\\0' '\\1'; "
           "head -c 4M /dev/zero | tr '\\0' '\\377' >&2")


def _peak_rss_while(pid: int, work: Callable[[], T],
                    rss: Callable[[int], float] = _rss_mib) -> tuple[T, float]:
    """``work()``'s result and the daemon's highest RSS seen while it ran (sampled)."""
    peak = [0.0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss(pid))
            done.wait(0.01)

    t = threading.Thread(target=sample)
    t.start()
    try:
        return work(), peak[0]
    finally:
        done.set()
        t.join()


def _binary_ok(r: corral.ExecResult) -> None:
    assert r.exit_code == 0, r
    assert r.stdout == "\x01" * (4 * MIB), (len(r.stdout), r.stdout[:10])
    assert r.stderr == "\ufffd" * (4 * MIB), (len(r.stderr), r.stderr[:10])


def test_results_of_binary_output_cost_the_daemon_about_their_size(daemon):
    """Sandboxes printing binary at once, 4 MiB to each stream (the default cap): each result
    costs the daemon about its output's size, where its JSON (six bytes a byte, then a copy as
    bytes) took ~100 MiB each. The results arrive whole, single and batched."""
    n = 12
    pid = daemon.proc.pid
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        boxes = list(pool.map(lambda _: corral.Sandbox(timeout=300), range(n)))
        try:
            before = _rss_mib(pid)
            results, peak = _peak_rss_while(
                pid, lambda: list(pool.map(lambda sb: sb.exec(_BINARY, timeout=120), boxes)))
            for r in results:
                _binary_ok(r)
            # Kept output: 8 MiB a command, up to 2x as text; the old JSON alone was 96 MiB.
            assert peak - before < n * 40, (before, peak)
            for r in corral.Sandbox.exec_many(boxes[:2], _BINARY, timeout=120):
                _binary_ok(r)
        finally:
            list(pool.map(lambda sb: sb.kill(), boxes))


def _fds(pid: int) -> int:
    import os

    return len(os.listdir(f"/proc/{pid}/fd"))


def test_pipes_left_open_by_returned_commands_are_bounded(sb, daemon):
    """Each command leaves a process holding its output pipes (``(sleep &)``): the daemon
    drains them so the process never gets SIGPIPE, at most engine.base.MAX_LINGERING a
    sandbox; past that the oldest are closed, where every command cost two fds for as long
    as the sandbox lived."""
    from corral.daemon.engine.base import MAX_LINGERING

    pid = daemon.proc.pid
    before = _fds(pid)
    n = 3 * MAX_LINGERING
    for _ in range(n):
        assert sb.exec("(sleep 600 &); echo ok").stdout == "ok\n"
    assert _fds(pid) - before <= 2 * MAX_LINGERING + 16, (before, _fds(pid))
    assert sb.exec("echo alive").stdout == "alive\n"


_EMOJI = ("python3 -c 'import sys; s = \"\\U0001F600\" * (4 << 20); "
          "sys.stdout.write(s); sys.stderr.write(s)'")


def test_reading_a_big_log_costs_the_daemon_a_page_not_the_log(sb, daemon):
    """The agent decides how big its log is: 8 commands printing 4 Mi emoji to each stream
    are ~190 MiB of stored JSON (the log keeps 1 Mi characters an output, 12 bytes each as
    JSON escapes). Reading the log, four readers at once, costs the daemon a page of rows
    each, where it held the whole log twice (~530 MiB a reader); a viewer's read (tail,
    max_output) is small."""
    from apiclient import client

    n = 8
    for _ in range(n):
        assert sb.exec(_EMOJI, timeout=120).exit_code == 0
    pid = daemon.proc.pid

    def read_all() -> int:
        with client() as c, c.stream("GET", f"/v1/sandboxes/{sb.id}/log") as r:
            assert r.status_code == 200
            return sum(len(chunk) for chunk in r.iter_bytes())

    before = _rss_mib(pid)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        sizes, peak = _peak_rss_while(pid, lambda: list(pool.map(lambda _: read_all(),
                                                                 range(4))))
    assert min(sizes) > n * (20 << 20), sizes
    assert peak - before < 4 * 80, (before, peak)

    with client() as c:
        r = c.get(f"/v1/sandboxes/{sb.id}/log", params={"tail": 3, "max_output": 100})
        assert r.status_code == 200 and len(r.content) < 64 << 10, len(r.content)
        entries = r.json()["entries"]
        total = len(c.get(f"/v1/sandboxes/{sb.id}/log", params={"format": "jsonl"})
                    .content.splitlines())
    assert [e["index"] for e in entries] == [total - 3, total - 2, total - 1]
    last = entries[-1]["result"]
    assert last["stdout"] == "\U0001F600" * 100 and last["stderr"] == "\U0001F600" * 100
    assert last["view_truncated"] is True and last["exit_code"] == 0


_FLOOD = ("head -c 8M /dev/zero | tr '\\0' '\\1'; "
          "head -c 8M /dev/zero | tr '\\0' '\\377' >&2")


def _flood_ok(r: corral.ExecResult) -> None:
    assert r.exit_code == 0, r
    assert r.truncated and r.stdout_bytes == r.stderr_bytes == 8 * MIB, r
    assert r.stdout == "\x01" * (4 * MIB), (len(r.stdout), r.stdout[:10])
    assert r.stderr == "\ufffd" * (4 * MIB), (len(r.stderr), r.stderr[:10])


def test_an_output_flood_holds_the_daemons_memory_to_its_pool(monkeypatch):
    """Sandboxes all printing 8 MiB of binary to each stream at once, the default cap: the
    daemon keeps each stream's first 64 KiB and what its pool (CORRAL_OUTPUT_MEMORY_MB, here
    32 MiB) takes in memory, the rest in spill files, and its trajectory log lets go of its
    copies once written. Every result is byte-exact with the same truncation, and a command
    with a cap far above the pool is not refused. Before, each command cost the daemon ~16
    MiB (48 at once: +0.8-1.1 GB), big caps were refused past the pool, and the log's
    ingester kept ~450 MiB of written entries alive. ``CORRAL_TEST_OLD_CODE``: a source tree
    to run the daemon from (checking that this test fails on it)."""
    from corral.daemon import outputmem

    from conftest import CGROUP_NAME, private_daemon

    if os.environ.get("CORRAL_TEST_OLD_CODE"):
        monkeypatch.setenv("PYTHONPATH", os.environ["CORRAL_TEST_OLD_CODE"])
    n = 32
    with private_daemon("corral-test-outmem-", f"{CGROUP_NAME}-outmem",
                        CORRAL_OUTPUT_MEMORY_MB="32") as d:
        ep = f"unix://{d.socket_path}"
        pid = d.proc.pid
        boxes = corral.Sandbox.create_many(n, endpoint=ep, timeout=300)
        try:
            with concurrent.futures.ThreadPoolExecutor(n) as pool:
                before = _anon_mib(pid)
                results, peak = _peak_rss_while(pid, lambda: list(
                    pool.map(lambda sb: sb.exec(_FLOOD, timeout=240), boxes)), _anon_mib)
            for r in results:
                _flood_ok(r)
            # The pool, the floors, 64 MiB of log entries not yet written, two being copied,
            # encoded and journaled, a few answers: ~190-215 MiB; before, ~16 MiB a command.
            floors = 2 * n * outputmem.FLOOR / MIB
            assert peak - before < 32 + floors + 128 + 136, (before, peak)
            for sb in boxes[:2]:  # the log has them all: its ingester is done with them
                assert sb.log()
            after = _anon_mib(pid)
            assert after - before < 64, (before, after)
            big = boxes[0].exec("head -c 40M /dev/zero | tr '\\0' z; echo end >&2",
                                max_output_bytes=64 * MIB, timeout=120)
            assert big.exit_code == 0 and not big.truncated, big
            assert big.stdout == "z" * (40 * MIB) and big.stderr == "end\n"
        finally:
            corral.Sandbox.kill_many(boxes)


def test_a_batchs_results_hold_their_output_from_the_pool():
    """A stream's first 64 KiB is free because a running command's pipe holds as much, but a
    batch holds every item's result until its answer is written: 10,000 items printing 64 KiB
    to each stream held 1.4 GB of the daemon that no pool counted. Here the pool is 4 MiB and
    the spill share 1 MiB: a batch of 96 such items keeps what they take (64 in memory, 16 in
    spill files), the rest are capacity_exceeded (infra, never a short stdout), and both are
    whole again once the answer is written."""
    from apiclient import client, create, kill
    from conftest import CGROUP_NAME, private_daemon

    with private_daemon("corral-test-batchout-", f"{CGROUP_NAME}-batchout",
                        CORRAL_OUTPUT_MEMORY_MB="4", CORRAL_OUTPUT_DISK_MB="1") as d, \
            client(d.socket_path) as c:
        ids = [create(c)["id"] for _ in range(2)]
        try:
            def batch(n: int) -> list[dict]:
                r = c.post("/v1/sandboxes/batch/exec", json={
                    "ids": [ids[i % 2] for i in range(n)], "concurrency": 8,
                    "exec": {"cmd": "head -c 65536 /dev/zero | tr '\\0' x"}})
                assert r.status_code == 200, r.text
                return r.json()["results"]

            out = batch(96)
            kept = [r for r in out if "error" not in r]
            refused = [r["error"] for r in out if "error" in r]
            assert all(r["stdout"] == "x" * 65536 and not r["truncated"] for r in kept)
            assert 48 <= len(kept) <= 80 and len(kept) + len(refused) == 96, len(kept)
            assert {(e["code"], e["infra"], e["details"]["resource"]) for e in refused} == \
                {("capacity_exceeded", True, "output_memory")}
            again = batch(48)  # the first batch's answer is written: its charge is back
            assert all(r.get("stdout") == "x" * 65536 for r in again)
        finally:
            for sid in ids:
                kill(c, sid)


def test_output_the_daemon_could_not_keep_is_infra_never_the_commands_truncation():
    """Output within a command's cap that the daemon cannot keep (its pool and its spill
    disk share taken, by other commands, maybe another tenant's) is the daemon's failure:
    ``infra_error``, cause ``output_store_full``, with what the result would have said; as a
    truncated result it would be scored as the command's. A command past its own cap is
    still a truncated result. Here the pool and the disk share are 1 MiB each."""
    from corral.errors import InfraError

    from conftest import CGROUP_NAME, private_daemon

    with private_daemon("corral-test-outlost-", f"{CGROUP_NAME}-outlost",
                        CORRAL_OUTPUT_MEMORY_MB="1", CORRAL_OUTPUT_DISK_MB="1") as d:
        with corral.Sandbox(endpoint=f"unix://{d.socket_path}", timeout=120) as sb:
            with pytest.raises(InfraError) as e:
                sb.exec("head -c 3M /dev/zero; exit 3", timeout=60)
            assert e.value.details["cause"] == "output_store_full", e.value.details
            assert e.value.details["streams"] == ["stdout"]
            assert (e.value.details["exit_code"], e.value.details["stdout_bytes"]) == \
                (3, 3 * MIB)
            own = sb.exec("head -c 3M /dev/zero", max_output_bytes=1000, timeout=60)
            assert own.truncated and len(own.stdout) == 1000 and own.exit_code == 0
            p = sb.exec("head -c 3M /dev/zero >&2", background=True)
            with pytest.raises(InfraError) as e:
                p.wait(timeout=60)
            assert e.value.details["streams"] == ["stderr"]
            small = sb.exec("echo fits")  # the store is whole again once results are made
            assert small.stdout == "fits\n" and not small.truncated


def test_one_tenants_held_output_leaves_room_for_anothers():
    """One tenant's commands hold at most half of the output pool and of the spill share
    (outputmem.TENANT_SHARE). Alice's three background commands print 6 MiB each and are
    never waited for (18 MiB held, with an 8 MiB pool and an 8 MiB spill share); bob's
    5 MiB command still comes back whole. Without the share alice's held the whole store and
    bob's command was infra_error (output_store_full), masked for a flood not his."""
    from conftest import CGROUP_NAME, tenant_client, tenant_daemon

    tokens = {"alice": "alice-token-0123456789", "bob": "bob-token-0123456789"}
    with tenant_daemon("corral-test-outshare-", f"{CGROUP_NAME}-outshare", tokens,
                       CORRAL_OUTPUT_MEMORY_MB="8", CORRAL_OUTPUT_DISK_MB="8") as (_, base), \
            tenant_client(base, tokens["alice"], 120) as alice, \
            tenant_client(base, tokens["bob"], 120) as bob:
        held = []
        for _ in range(3):
            sid = alice.post("/v1/sandboxes", json={}).json()["id"]
            r = alice.post(f"/v1/sandboxes/{sid}/exec", json={
                "cmd": "head -c 6M /dev/zero", "background": True,
                "max_output_bytes": 8 * MIB})
            assert r.status_code == 200, r.text
            held.append((sid, r.json()["pid"]))
        for sid, pid in held:  # each has printed all it will
            deadline = time.monotonic() + 60
            while alice.get(f"/v1/sandboxes/{sid}/procs/{pid}").json()["running"]:
                assert time.monotonic() < deadline, "a 6 MiB print still runs"
                time.sleep(0.05)
        sid = bob.post("/v1/sandboxes", json={}).json()["id"]
        r = bob.post(f"/v1/sandboxes/{sid}/exec", json={
            "cmd": "head -c 5M /dev/zero; exit 3", "max_output_bytes": 8 * MIB})
        assert r.status_code == 200, r.text
        res = r.json()
        assert (res["exit_code"], res["truncated"], res["stdout_bytes"]) == \
            (3, False, 5 * MIB), {k: v for k, v in res.items() if k != "stdout"}
        assert len(res["stdout"]) == 5 * MIB
        # Alice's own flood is past her share: what she cannot keep is infra.
        sid, pid = held[-1]
        err = alice.post(f"/v1/sandboxes/{sid}/procs/{pid}/wait", json={}).json()["error"]
        assert (err["code"], err["details"]["cause"]) == ("infra_error", "output_store_full")
