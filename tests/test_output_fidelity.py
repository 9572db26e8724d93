"""A differential fuzz of what a trainer is told about a command's output (docs/trajectory.md):
what the client saw (the HTTP answer, the SDK's ExecResult), what a live and a late stream
delivered, what the trajectory log recorded and what a replay of the same idempotency key
returns, also after the daemon was kill -9ed, must agree: byte for byte where the log keeps
whole outputs, by the documented rule (``log_truncated``, sizes and hashes of the full
output) where it does not. Outputs are the sandbox's choice, so they are made adversarial by
a seeded generator: invalid UTF-8 split at read boundaries, encoded lone surrogates, NULs,
CR/LF mixes, long lines, sizes around every cap (the 64 KiB memory floor, the log's cap,
``max_output_bytes``), interleaved streams, a child writing after the command's exit, exit
codes and signals. The expected bytes are known from the plan, so the answers are also
checked against them (``stdout == expected[:cap].decode("utf-8", "replace")``,
``stdout_sha256 == sha256(expected)``)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from corral import Sandbox
from corral.daemon.outputmem import FLOOR
from corral.models import ProcessHandle
from corral.sdk.sandbox import Process

from apiclient import client
from conftest import private_daemon, wait_until

LOG_CAP = 70_000  # the private daemon's CORRAL_TRAJLOG_OUTPUT_CAP: past FLOOR, cheap to reach
SEEDS = range(int(os.environ.get("CORRAL_TEST_FIDELITY_SEEDS", "12")))  # more: a longer fuzz

# Run in the sandbox: the plan's writes, in order, each its own write(2); a pause between
# some of them, so the daemon reads them apart (a character split over two reads); then a
# child that writes after its parent's exit, and the exit (a code, or a signal of its own).
GEN = r"""
import json, os, signal, sys, time
plan = json.load(open(sys.argv[1]))
for i, (fd, hexdata, pause) in enumerate(plan["writes"] + [(1, "", 0)]):
    if i == plan.get("gate"):  # writes before it done (read by the daemon, if past a pipe)
        if plan.get("ready"):
            open(plan["ready"], "w").close()
        sys.stdin.readline()
    data = bytes.fromhex(hexdata)
    while data:
        data = data[os.write(fd, data):]
    if pause:
        time.sleep(pause / 1000)
if plan.get("late"):
    if os.fork() == 0:
        time.sleep(0.02)
        for fd, hexdata in plan["late"]:
            try:
                os.write(fd, bytes.fromhex(hexdata))
            except OSError:
                pass
        os._exit(0)
if plan.get("hang"):  # until its timeout kills it
    time.sleep(600)
if plan.get("signal"):
    os.kill(os.getpid(), plan["signal"])
os._exit(plan.get("exit", 0))
"""

_SPLIT = ["\u20ac".encode(), "\U0001F600".encode(), "\u00e9".encode(), "\u0800".encode()]
_PIECES: list[Callable[[random.Random], bytes]] = [
    lambda r: b"\xed\xa0\x80",                  # an encoded lone surrogate (U+D800)
    lambda r: b"\xed\xbf\xbf",                  # U+DFFF
    lambda r: b"\xed\xa0\xbd\xed\xb8\x80",      # a surrogate pair, CESU-8 style
    lambda r: b"\x00" * r.randint(1, 3),
    lambda r: r.choice([b"\r\n", b"\r", b"\n\r", b"\n"]),
    lambda r: r.choice(_SPLIT),                  # whole multibyte characters
    lambda r: r.choice(_SPLIT)[:r.randint(1, 2)],  # a character cut short
    lambda r: r.choice([b"\xc0\xaf", b"\xf4\x90\x80\x80", b"\xff", b"\x80", b"\xfe\xfe"]),
    lambda r: bytes(r.randrange(256) for _ in range(r.randint(1, 48))),
    lambda r: b"a" * r.randint(1, 300),
    lambda r: "\u2028\u2029\ufeff\ufffd".encode(),
]


def _stream_bytes(r: random.Random, size: int) -> bytes:
    """``size`` bytes of adversarial output: pieces, a long line of filler, cut to size (the
    cut may split a character)."""
    out = bytearray()
    while len(out) < min(size, 4096):
        out += r.choice(_PIECES)(r)
    if len(out) < size:  # a very long line, then more pieces at the end
        tail = bytearray()
        while len(tail) < min(size, 512):
            tail += r.choice(_PIECES)(r)
        out += b"x" * max(0, size - len(out) - len(tail)) + tail
    return bytes(out[:size])


def _sizes(r: random.Random, cap: int) -> int:
    """A stream's size, around one of the boundaries."""
    edge = r.choice([0, 1, 4096, FLOOR, LOG_CAP, cap, 2 * LOG_CAP])
    return max(0, edge + r.randint(-3, 3))


def _writes(r: random.Random, fd: int, data: bytes) -> list[tuple[int, bytes]]:
    """``data`` cut into writes, some cuts inside a multibyte sequence."""
    cuts = set()
    for _ in range(r.randint(0, 8)):
        if data:
            cuts.add(r.randrange(len(data)))
    for i, b in enumerate(data[:20000]):  # lead bytes: cut just after one
        if b >= 0xC0 and r.random() < 0.05:
            cuts.add(i + 1)
    bounds = [0, *sorted(c for c in cuts if 0 < c < len(data)), len(data)]
    return [(fd, data[a:b]) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


def make_plan(seed: int) -> dict[str, Any]:
    r = random.Random(seed)
    cap = r.choice([4096, FLOOR - 1, FLOOR, LOG_CAP, LOG_CAP + 1, 90_000, 4 << 20])
    out = _stream_bytes(r, _sizes(r, cap))
    err = _stream_bytes(r, _sizes(r, cap))
    writes = _writes(r, 1, out) + _writes(r, 2, err)
    if r.random() < 0.7:  # interleaved: each stream's writes keep their order
        a, b = [w for w in writes if w[0] == 1], [w for w in writes if w[0] == 2]
        writes = []
        while a or b:
            src = a if (a and (not b or r.random() < 0.5)) else b
            writes.append(src.pop(0))
    plan: dict[str, Any] = {
        "writes": [(fd, d.hex(), r.choice([0, 0, 0, 2])) for fd, d in writes],
        "cap": cap, "out": out, "err": err,
    }
    end = r.random()
    if end < 0.07:
        plan["hang"] = True
    elif end < 0.2:
        plan["signal"] = r.choice([signal.SIGTERM, signal.SIGKILL, signal.SIGSEGV])
    else:
        plan["exit"] = r.choice([0, 1, 2, 7, 127, 255])
    if r.random() < 0.25:
        plan["late"] = [(r.choice([1, 2]), _stream_bytes(r, r.randint(1, 3000)).hex())]
    return plan


def _text(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _check_expected(res: dict[str, Any], plan: dict[str, Any], exact: bool) -> None:
    """A result against the plan's bytes. ``exact``: no child wrote after the exit, so the
    stream's bytes are known (else only what the late write cannot change)."""
    cap = plan["cap"]
    for name, data in (("stdout", plan["out"]), ("stderr", plan["err"])):
        if exact:
            assert res[f"{name}_bytes"] == len(data), (name, res[f"{name}_bytes"], len(data))
            assert res[name] == _text(data[:cap]), name
        else:  # what the command itself wrote comes first, whatever came after
            assert res[f"{name}_bytes"] >= len(data)
            assert res[name].startswith(_text(data[:cap])[:-1]), name
    if exact:
        assert res["truncated"] == (len(plan["out"]) > cap or len(plan["err"]) > cap)
    assert res["timed_out"] == ("hang" in plan)
    if "hang" in plan:
        assert res["signal"] == 9 and res["exit_code"] == 137
    elif "signal" in plan:
        assert res["signal"] == plan["signal"] and res["exit_code"] == 128 + plan["signal"]
    else:
        assert res["signal"] is None and res["exit_code"] == plan["exit"]


def _check_logged(logged: dict[str, Any], res: dict[str, Any], plan: dict[str, Any],
                  exact: bool) -> None:
    """A log entry's result against what the client got: the same fields, outputs cut to the
    log's cap (``log_truncated``), sizes and hashes of the whole output."""
    for k, v in res.items():
        if k in ("stdout", "stderr"):
            assert logged[k] == v[:LOG_CAP], k
        else:
            assert logged[k] == v, (k, logged[k], v)
    cut = len(res["stdout"]) > LOG_CAP or len(res["stderr"]) > LOG_CAP
    assert bool(logged.get("log_truncated")) == cut
    if exact:
        assert logged["stdout_sha256"] == _sha(plan["out"])
        assert logged["stderr_sha256"] == _sha(plan["err"])


def _replay_of(res: dict[str, Any]) -> dict[str, Any]:
    """What a fast-forward of ``res`` answers: the logged result."""
    cut = len(res["stdout"]) > LOG_CAP or len(res["stderr"]) > LOG_CAP
    return dict(res, stdout=res["stdout"][:LOG_CAP], stderr=res["stderr"][:LOG_CAP],
                truncated=res["truncated"] or cut)


def _ndjson(resp: httpx.Response, gaps: dict[str, list[Any]] | None = None
            ) -> tuple[dict[str, str], dict[str, Any]]:
    """A stream's text per stream name and its final line. ``gaps``: filled with each
    stream's [text before its gap, bytes skipped] (a gap fails the read without it)."""
    got = {"stdout": "", "stderr": ""}
    final: dict[str, Any] = {}
    for line in resp.iter_lines():
        obj = json.loads(line)
        if obj.get("skipped"):
            assert gaps is not None and obj["stream"] not in gaps, obj
            gaps[obj["stream"]] = [got[obj["stream"]], obj["skipped"]]
            got[obj["stream"]] = ""
        elif "stream" in obj:
            got[obj["stream"]] += obj["data"]
        else:
            final = obj
    return got, final


def _check_views(c: httpx.Client, sid: str, entries: list[dict[str, Any]], cut: int) -> None:
    """The log's other readings against the whole one: one entry a line (``jsonl``), the
    last entries (``tail``), and outputs cut to ``cut`` characters (``max_output``, in
    SQLite: NULs, non-BMP characters and U+FFFD counted as Python counts them)."""
    r = c.get(f"/v1/sandboxes/{sid}/log", params={"format": "jsonl"})
    assert [json.loads(line) for line in r.text.splitlines()] == entries
    r = c.get(f"/v1/sandboxes/{sid}/log", params={"tail": 3})
    assert r.json()["entries"] == entries[-3:]
    viewed = c.get(f"/v1/sandboxes/{sid}/log", params={"max_output": cut}).json()["entries"]
    assert len(viewed) == len(entries)
    for whole, view in zip(entries, viewed, strict=True):
        res = whole["result"]
        assert view == (dict(whole, result=_view_of(res, cut)) if isinstance(res, dict)
                        else whole), (whole["op"], cut)


def _view_of(res: dict[str, Any], cut: int) -> dict[str, Any]:
    """``max_output``'s rule: stdout, then stderr, cut to ``cut`` characters (and marked
    ``view_truncated``) while the result's JSON is longer than ``cut * 2 + 4096``."""
    out = dict(res)
    for k in ("stdout", "stderr"):
        if len(json.dumps(out, separators=(",", ":"))) <= cut * 2 + 4096:
            break
        if isinstance(out.get(k), str) and len(out[k]) > cut:
            out[k] = out[k][:cut]
            out["view_truncated"] = True
    return out


def _stream_opened_midway(c: httpx.Client, sb: Sandbox, seed: int, plan: dict[str, Any],
                          body: dict[str, Any]) -> None:
    """The command again in the background, held after some of its writes, a stream opened
    there: what it delivers is the whole output, or (a stream past its cap by then) the kept
    output, a gap of ``skipped`` bytes, and the decode of every byte after the gap."""
    r = random.Random(seed)
    ready = f"/tmp/ready{seed}"
    mid = dict(plan, gate=r.randrange(len(plan["writes"]) + 1), ready=ready)
    sb.files.write(f"/tmp/mplan{seed}", _plan_file(mid))
    h = c.post(f"/v1/sandboxes/{sb.id}/exec",
               json=dict(body, background=True, cmd=["python3", "/tmp/gen.py",
                                                     f"/tmp/mplan{seed}"]))
    assert h.status_code == 200, h.text
    purl = f"/v1/sandboxes/{sb.id}/procs/{h.json()['pid']}"
    assert wait_until(lambda: sb.files.exists(ready), 30)
    gaps: dict[str, list[Any]] = {}
    with c.stream("GET", purl + "/stream") as live:
        s = c.post(purl + "/stdin", json={"data": "go\n", "eof": True})
        assert s.status_code == 200, s.text
        streamed, _ = _ndjson(live, gaps)
    wres = c.post(purl + "/wait", json={"timeout": 60}).json()
    _check_expected(wres, plan, True)
    for name, data in (("stdout", plan["out"]), ("stderr", plan["err"])):
        if name not in gaps:
            assert streamed[name] == _text(data), (seed, name)
            continue
        before, skipped = gaps[name]
        assert before == wres[name], (seed, name)  # the kept output, as the result has it
        assert len(data) > plan["cap"]
        assert streamed[name] == _text(data[plan["cap"] + skipped:]), (seed, name, skipped)


@pytest.fixture(scope="module")
def own():
    # a pool of 1 MiB: the finished processes' kept output fills it, and later outputs are
    # kept in spill files, read back (and decoded) from there
    with private_daemon("corral-test-", "corral-test-fidelity",
                       CORRAL_TRAJLOG_OUTPUT_CAP=str(LOG_CAP),
                       CORRAL_OUTPUT_MEMORY_MB="1") as d:
        yield d


def _plan_file(plan: dict[str, Any]) -> bytes:
    return json.dumps({k: v for k, v in plan.items() if k not in ("out", "err", "cap")}).encode()


def test_outputs_agree_across_answer_stream_log_and_replay(own):
    """Each seed's command runs in the foreground (keyed) and in the background (keyed; a
    live stream opened before it writes, a wait, a late stream); the log is read and every
    key replayed, then the daemon is kill -9ed and restarted and the keys replayed and the
    log read again: every copy agrees with the others and with the plan's bytes."""
    sb = Sandbox(timeout=600, endpoint=own.socket_path)
    sid = sb.id
    sb.files.write("/tmp/gen.py", GEN)
    # a finished process's output held: the pool is full, later output past 64 KiB spills
    sb.exec("head -c 1200000 /dev/zero", background=True, max_output_bytes=2 << 20).wait()
    seen: list[tuple[int, str, dict[str, Any], dict[str, Any]]] = []  # seed, key, body, answer
    try:
        with client(own.socket_path) as c:
            for seed in SEEDS:
                plan = make_plan(seed)
                exact = "late" not in plan
                sb.files.write(f"/tmp/plan{seed}", _plan_file(plan))
                argv = ["python3", "/tmp/gen.py", f"/tmp/plan{seed}"]
                body = {"cmd": argv, "timeout": 3 if "hang" in plan else 60,
                        "max_output_bytes": plan["cap"]}
                url = f"/v1/sandboxes/{sid}/exec"

                # foreground, keyed: the answer, then its replay
                k = f"fg-{seed}"
                r = c.post(url, json=body, headers={"Idempotency-Key": k})
                assert r.status_code == 200, (seed, r.text[:300])
                res = r.json()
                _check_expected(res, plan, exact)
                again = c.post(url, json=body, headers={"Idempotency-Key": k})
                assert again.json() == _replay_of(res), seed
                seen.append((seed, k, body, res))

                # background, keyed: a stream from before the first write, a wait, a late
                # stream (what was kept), all of one run
                kb = f"bg-{seed}"
                bbody = dict(body, background=True)
                plan_gate = dict(plan, gate=0)
                sb.files.write(f"/tmp/gplan{seed}", _plan_file(plan_gate))
                bbody["cmd"] = ["python3", "/tmp/gen.py", f"/tmp/gplan{seed}"]
                h = c.post(url, json=bbody, headers={"Idempotency-Key": kb})
                assert h.status_code == 200, h.text
                pid = h.json()["pid"]
                purl = f"/v1/sandboxes/{sid}/procs/{pid}"
                with c.stream("GET", purl + "/stream") as live:
                    # headers received: the daemon follows the process from its first byte
                    s = c.post(purl + "/stdin", json={"data": "go\n", "eof": True})
                    assert s.status_code == 200, s.text
                    streamed, final = _ndjson(live)
                waited = c.post(purl + "/wait", json={"timeout": 60})
                assert waited.status_code == 200, waited.text
                wres = waited.json()
                _check_expected(wres, plan, exact)
                assert final == {"pid": pid, "running": False, "exit_code": wres["exit_code"],
                                 "timed_out": wres["timed_out"], "signal": wres["signal"],
                                 "oom_killed": False}, final
                for name, data in (("stdout", plan["out"]), ("stderr", plan["err"])):
                    # a live stream is not capped: every byte the command wrote
                    if exact:
                        assert streamed[name] == _text(data), (seed, name)
                    assert streamed[name].startswith(wres[name][:-1] if len(data) > plan["cap"]
                                                     else wres[name]), (seed, name)
                with c.stream("GET", purl + "/stream") as late:
                    kept, _ = _ndjson(late)
                assert kept == {"stdout": wres["stdout"], "stderr": wres["stderr"]}, seed
                # the SDK decodes the same answer and streams the same kept output
                proc = Process(sb._endpoint, ProcessHandle.model_validate(h.json()))
                assert proc.wait().model_dump() == wres, seed
                got = {"stdout": "", "stderr": ""}
                for chunk in proc.stream():
                    got[chunk.stream] += chunk.data
                assert got == kept, seed
                rb = c.post(url, json=bbody, headers={"Idempotency-Key": kb})
                assert rb.json()["pid"] == pid, rb.text
                if exact:
                    _stream_opened_midway(c, sb, seed, plan, body)
                    # a batch of one: its result is the plan's, its log entry the result
                    bat = c.post("/v1/sandboxes/batch/exec", json={
                        "ids": [sid], "exec": body})
                    assert bat.status_code == 200, bat.text[:300]
                    bres = bat.json()["results"][0]
                    _check_expected(bres, plan, True)
                    last = c.get(f"/v1/sandboxes/{sid}/log", params={"tail": 1}).json()
                    _check_logged(last["entries"][0]["result"], bres, plan, True)

                # the log: the foreground exec and the wait, as the client got them
                entries = c.get(f"/v1/sandboxes/{sid}/log").json()["entries"]
                fg = [e for e in entries if e["idempotency_key"] == k]
                assert len(fg) == 1
                _check_logged(fg[0]["result"], res, plan, exact)
                wait = [e for e in entries if e["op"] == "wait"
                        and e["request"]["pid"] == pid]
                assert len(wait) == 2  # ours and the SDK's
                for w in wait:
                    _check_logged(w["result"], wres, plan, exact)
                _check_views(c, sid, entries, random.Random(seed).choice([1, 3, 4096, 70_001]))
                # the SDK's log: the same entries, decoded
                sdk = {e.idempotency_key: e for e in sb.log() if e.idempotency_key}
                assert sdk[k].result == fg[0]["result"]

            # a kill -9, a restart: every key replays the same, the log reads the same; the
            # last few calls journaled and (most likely) not yet in the database
            before = c.get(f"/v1/sandboxes/{sid}/log").json()["entries"]
            for seed in list(SEEDS)[-3:]:
                _, _, body, _ = seen[seed]
                k = f"fresh-{seed}"
                r = c.post(f"/v1/sandboxes/{sid}/exec", json=body, headers={"Idempotency-Key": k})
                assert r.status_code == 200, r.text[:300]
                seen.append((seed, k, body, r.json()))
        own.restart(kill9=True)
        with client(own.socket_path) as c:
            for seed, k, body, res in seen:
                again = c.post(f"/v1/sandboxes/{sid}/exec", json=body,
                               headers={"Idempotency-Key": k})
                assert again.status_code == 200, again.text[:300]
                assert again.json() == _replay_of(res), seed
            after = c.get(f"/v1/sandboxes/{sid}/log").json()["entries"]
            assert [e["result"] for e in after[:len(before)]] == \
                [e["result"] for e in before]
            for seed, k, _, res in seen[len(SEEDS):]:  # recovered from the journal
                got = [e for e in after if e["idempotency_key"] == k]
                assert len(got) == 1 and got[0]["status"] == "done", k
                _check_logged(got[0]["result"], res, make_plan(seed), "late" not in
                              make_plan(seed))
    finally:
        sb.kill()


def test_a_stream_opened_past_the_cap_marks_the_bytes_it_missed(own):
    """A command with a cap of 4095 writes 4094 A, a euro sign (3 bytes: the cap cuts it
    after its first) and 200,000 A (more than a pipe holds: the daemon has read and dropped
    them before the write returns), then waits; a stream opened then, the command writes
    the euro sign's last two bytes and a B. The stream gives the kept output as the result
    has it, a gap line with the bytes dropped, then the rest decoded on its own. It gave the
    kept A, then a euro sign and B, as if contiguous: the kept first byte of the sign joined
    to bytes written 200,000 later, a character the command never wrote."""
    euro = "\u20ac".encode()
    first = b"A" * 4094 + euro + b"A" * 200_000
    last = euro[1:] + b"B"
    plan = {"writes": [(1, first.hex(), 0), (1, last.hex(), 0)], "gate": 1,
            "ready": "/tmp/ready-gap", "exit": 0}
    sb = Sandbox(timeout=120, endpoint=own.socket_path)
    try:
        sb.files.write("/tmp/gen.py", GEN)
        sb.files.write("/tmp/gap", json.dumps(plan))
        p = sb.exec(["python3", "/tmp/gen.py", "/tmp/gap"], background=True,
                    max_output_bytes=4095)
        assert wait_until(lambda: sb.files.exists("/tmp/ready-gap"), 30)
        with client(own.socket_path) as c:
            purl = f"/v1/sandboxes/{sb.id}/procs/{p.pid}"
            gaps: dict[str, list[Any]] = {}
            with c.stream("GET", purl + "/stream") as live:
                p.send_stdin("go\n", eof=True)
                streamed, final = _ndjson(live, gaps)
        res = p.wait()
        assert res.stdout == "A" * 4094 + "\ufffd" and res.stdout_bytes == len(first + last)
        assert gaps == {"stdout": [res.stdout, len(first) - 4095]}, \
            (gaps.get("stdout", [""])[0][-3:], gaps.get("stdout", [0, 0])[1])
        assert streamed == {"stdout": "\ufffd\ufffdB", "stderr": ""}
        assert {k: final[k] for k in ("running", "exit_code", "timed_out", "signal")} == {
            "running": False, "exit_code": 0, "timed_out": False, "signal": None}, final
        # the SDK: the kept output, then the live one; the gap counted, not spliced over
        sb.files.remove("/tmp/ready-gap")
        q = sb.exec(["python3", "/tmp/gen.py", "/tmp/gap"], background=True,
                    max_output_bytes=4095)
        assert wait_until(lambda: sb.files.exists("/tmp/ready-gap"), 30)
        chunks = q.stream()
        assert next(chunks) == ("stdout", res.stdout)  # the kept output comes first
        q.send_stdin("go\n", eof=True)
        assert "".join(d for _, d in chunks) == "\ufffd\ufffdB"
        assert q.skipped == {"stdout": len(first) - 4095, "stderr": 0}
        assert q.wait().stdout == res.stdout
        assert "".join(d for _, d in q.stream()) == res.stdout  # ended: what was kept
        assert q.skipped == {"stdout": 0, "stderr": 0}
    finally:
        sb.kill()


def test_a_log_view_cuts_output_with_a_nul(own):
    """``?max_output=N`` cuts each output to N characters in SQLite, whose json_extract ends
    a string at its first NUL: an output with a NUL early passed whole (one NUL and 200,000
    characters to a viewer asking for 100), where every other output is cut."""
    sb = Sandbox(timeout=120, endpoint=own.socket_path)
    try:
        plain = sb.exec("head -c 200000 /dev/zero | tr '\\0' x")
        nul = sb.exec("printf 'ab\\0'; head -c 200000 /dev/zero | tr '\\0' x; "
                      "printf 'e\\0' >&2; head -c 10000 /dev/zero | tr '\\0' y >&2")
        assert nul.stdout == "ab\0" + "x" * 200_000 and len(plain.stdout) == 200_000
        with client(own.socket_path) as c:
            got = c.get(f"/v1/sandboxes/{sb.id}/log", params={"max_output": 100})
            entries = [e for e in got.json()["entries"] if e["op"] == "exec"]
        assert [e["result"]["view_truncated"] for e in entries] == [True, True]
        assert entries[0]["result"]["stdout"] == "x" * 100
        assert entries[1]["result"]["stdout"] == "ab\0" + "x" * 97
        assert entries[1]["result"]["stderr"] == "e\0" + "y" * 98
        assert entries[1]["result"]["stdout_bytes"] == 200_003
    finally:
        sb.kill()


def test_run_code_outputs_are_what_the_program_wrote(own):
    """run_code's own output path (the process substrate's pipes and cap, not an exec's):
    for the same seeded plans, run as the request's program, each stream's text is the bytes
    written cut at ``max_output_bytes`` and decoded with replacement, ``truncated`` says
    whether either passed it, and the exit code, signal and status follow the plan (a
    hang: ``timeout``, its output up to then kept). Writes of a child after the program's
    exit are not the request's (its tree is killed with it), so plans here have none."""
    import corral

    code = GEN.replace("json.load(open(sys.argv[1]))", 'json.load(open("plan.json"))')
    ep = f"unix://{own.socket_path}"
    ran = 0
    for seed in range(40):
        plan = make_plan(seed)
        plan.pop("late", None)
        text = _plan_file(plan).decode()
        if len(text) > 15 << 20:  # past run_code's files limit (16 MiB)
            continue
        cap = plan["cap"]
        res = corral.run_code(code, files={"plan.json": text}, max_output_bytes=cap,
                              timeout=4 if plan.get("hang") else 60, memory_mb=512,
                              endpoint=ep)
        out, err = plan["out"], plan["err"]
        truncated = len(out) > cap or len(err) > cap
        assert res.stdout == _text(out[:cap]), (seed, len(res.stdout), len(out), cap)
        assert res.stderr == _text(err[:cap]), (seed, len(res.stderr), len(err), cap)
        assert res.truncated == truncated, (seed, res.truncated)
        if plan.get("hang"):
            assert (res.status, res.signal, res.exit_code) == ("timeout", 9, 137), (seed, res)
            continue
        sig = plan.get("signal")
        code_ = 128 + sig if sig else plan["exit"]
        assert (res.exit_code, res.signal) == (code_, sig), (seed, res.exit_code, res.signal)
        want = "output_truncated" if truncated else "ok" if code_ == 0 else "error"
        assert res.status == want, (seed, res.status, want)
        ran += 1
    assert ran >= 20, ran
