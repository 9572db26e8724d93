"""An exec's result as the client gets it, as the trajectory log keeps it (whole, cut to the
log's cap, or compact for a tenant at half its budget: first and last 4096 characters) and
as a replay answers it, for seeded adversarial outputs around every boundary (the 64 KiB
memory floor, where a result's output turns from a str into an OutputText; the log's cap;
COMPACT_KEEP; BIG_ENTRY, where an entry is encoded a piece at a time). The rule checked is
docs/trajectory.md's: outputs cut to the cap (``log_truncated``), ``stdout_tail`` the last
COMPACT_KEEP characters, sizes and hashes of the whole output; a replay answers the logged
outputs with ``truncated`` set when they were cut. tests/test_output_fidelity.py checks the
same end to end against a daemon."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import types
from typing import Any

from corral.daemon import jsonbody
from corral.daemon.app import _exec_out
from corral.daemon.outputmem import FLOOR, Kept, OutputText
from corral.daemon.trajlog.keys import _dumps, encoded
from corral.daemon.trajlog.writer import COMPACT_KEEP, Writer

_PIECES = [b"\xed\xa0\x80", b"\x00", b"\r\n", b"\r", "\u20ac".encode(), "\u20ac".encode()[:2],
           "\U0001F600".encode(), "\U0001F600".encode()[:3], b"\xff", b"\x80", b"\xc0\xaf",
           b"a", b"\"\\", "\u2028".encode()]


def _output(r: random.Random, size: int) -> bytes:
    out = bytearray()
    while len(out) < size:
        out += r.choice(_PIECES) if r.random() < 0.7 else b"x" * r.randint(1, 5000)
    return bytes(out[:size])


def _as_result(data: bytes) -> str | OutputText:
    """What procs.Capture.text gives for a stream that kept ``data``."""
    kept = Kept(None)
    kept.add(data)
    return data.decode("utf-8", "replace") if len(data) <= FLOOR else OutputText(kept)


def test_logged_and_replayed_outputs_follow_the_documented_rule() -> None:
    for seed in range(40):
        r = random.Random(seed)
        edges = [0, 1, COMPACT_KEEP, FLOOR, 70_000, 1 << 18]
        out, err = (_output(r, max(0, r.choice(edges) + r.randint(-4, 4))) for _ in range(2))
        cap = r.choice([COMPACT_KEEP, 70_000, 1 << 20])
        compact = r.random() < 0.4
        res: dict[str, Any] = {
            "stdout": _as_result(out), "stderr": _as_result(err), "exit_code": 3,
            "duration_s": 0.5, "truncated": False, "timed_out": False,
            "stdout_bytes": len(out), "stderr_bytes": len(err), "signal": None,
            "oom_killed": False,
            "_sha": (hashlib.sha256(out).hexdigest(), hashlib.sha256(err).hexdigest())}
        writer = types.SimpleNamespace(output_cap=cap)
        answer = json.loads(b"".join(_drain(jsonbody.chunks(
            {k: v for k, v in res.items() if k != "_sha"}))))
        logged = Writer.exec_result(writer, dict(res), compact)  # type: ignore[arg-type]
        keep = COMPACT_KEEP if compact else cap
        for name, data in (("stdout", out), ("stderr", err)):
            text = data.decode("utf-8", "replace")
            assert answer[name] == text, (seed, name)
            assert logged[name] == text[:keep], (seed, name)
            assert logged[f"{name}_sha256"] == hashlib.sha256(data).hexdigest()
            assert logged[f"{name}_bytes"] == len(data)
            if compact and len(text) > keep:
                assert logged[f"{name}_tail"] == text[-COMPACT_KEEP:], (seed, name)
            else:
                assert f"{name}_tail" not in logged, (seed, name)
        cut = len(answer["stdout"]) > keep or len(answer["stderr"]) > keep
        assert bool(logged.get("log_truncated")) == cut, seed
        assert bool(logged.get("log_budget")) == (compact and cut), seed
        # the entry's JSON, a piece at a time or whole, is the same text
        text, line = asyncio.run(encoded(logged))
        assert text == _dumps(logged) and json.loads(json.loads(line)) == logged
        # a replay answers the logged outputs, truncated if they were cut
        replayed = _exec_out(json.loads(text))
        assert replayed == dict(answer, stdout=logged["stdout"], stderr=logged["stderr"],
                                truncated=answer["truncated"] or cut), seed


def _drain(chunks: Any) -> list[bytes]:
    async def go() -> list[bytes]:
        return [c async for c in chunks]

    return asyncio.run(go())
