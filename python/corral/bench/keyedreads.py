"""The ``keyedreads`` scenario: what an idempotency key adds to a read's round trip.

One daemon (the session's, trajectory log on), two sandboxes: one reached through a
trajectory handle (every ``files.read`` / ``stat`` / ``list`` carries a key, and its log
entry keeps what was read, so a replay returns it) and one through a plain handle (the same
calls, logged with size and hash only). Per op, ``N`` calls per variant, interleaved call by
call in ABBA order (keyed, unkeyed, unkeyed, keyed, ...): this machine's speed swings by
tens of percent over seconds, and pairs of neighbouring calls see the same swing. A run's
figure per op: each variant's median latency and their ratio, the median of the paired
differences (what the key costs, in microseconds) and the ratio it gives, unkeyed p50 /
(unkeyed p50 + cost): the keyed round trip's speed relative to the unkeyed one, measured
pair by pair, the figure the target (>= 0.95) is checked on. The ratio of the two medians
is shown too; it takes the swings of two separate samples and scatters more. The report
quotes medians over ``--runs``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from corral.bench import sdk_runs
from corral.bench.session import Session
from corral.bench.stats import median
from corral.errors import CorralError
from corral.sdk import Sandbox

TARGET = 0.95  # keyed / unkeyed: a key costs <= 5% of a read's round trip
OPS = ("read", "stat", "list")
READ_DIR = "/root/bench-reads"
READ_PATH = READ_DIR + "/f"
WARMUP = 20


def _calls(sb: Sandbox) -> dict[str, Callable[[], Any]]:
    return {"read": lambda: sb.files.read(READ_PATH),
            "stat": lambda: sb.files.stat(READ_PATH),
            "list": lambda: sb.files.list(READ_DIR)}


def one_run(endpoint: str, n: int, run: int, adv: Any) -> dict[str, Any]:
    """One run: per op, ``n`` keyed and ``n`` unkeyed calls interleaved ABBA."""
    tid = f"bench-keyedreads-{time.monotonic_ns()}-{run}"
    keyed = Sandbox("host", endpoint=endpoint, timeout=sdk_runs.TTL_S, trajectory_id=tid)
    plain = Sandbox("host", endpoint=endpoint, timeout=sdk_runs.TTL_S)
    out: dict[str, Any] = {}
    try:
        for sb in (keyed, plain):
            setup = Sandbox.from_id(sb.id, endpoint=endpoint)
            setup.files.write(READ_PATH, "x" * 100)
            for i in range(4):
                setup.files.write(f"{READ_DIR}/g{i}", "y")
        calls = {"keyed": _calls(keyed), "unkeyed": _calls(plain)}
        for op in OPS:
            for _ in range(WARMUP):
                calls["keyed"][op]()
                calls["unkeyed"][op]()
            lat: dict[str, list[float]] = {"keyed": [], "unkeyed": []}
            diffs: list[float] = []
            errors: list[str] = []
            for i in range(n):
                order = ("keyed", "unkeyed") if i % 4 in (0, 3) else ("unkeyed", "keyed")
                pair: dict[str, float] = {}
                for v in order:
                    t = time.perf_counter()
                    try:
                        calls[v][op]()
                    except CorralError as e:
                        errors.append(sdk_runs._err(e))
                        continue
                    pair[v] = (time.perf_counter() - t) * 1e6
                    lat[v].append(pair[v])
                if len(pair) == 2:
                    diffs.append(pair["keyed"] - pair["unkeyed"])
                adv(1)
            k, u = statistics.median(lat["keyed"]), statistics.median(lat["unkeyed"])
            cost = statistics.median(diffs)
            out[op] = {"n": n, "keyed_p50_us": round(k, 1), "unkeyed_p50_us": round(u, 1),
                       "p50_ratio": round(u / k, 4), "key_cost_us": round(cost, 1),
                       "ratio": round(u / (u + cost), 4),
                       "errors": len(errors), "first_errors": errors[:3]}
    finally:
        for sb in (keyed, plain):
            Sandbox.from_id(sb.id, endpoint=endpoint).kill()
    return out


def keyedreads(s: Session) -> tuple[dict[str, Any], dict[str, Any]]:
    n, R = s.opts.n("keyedreads"), s.opts.runs
    runs: list[dict[str, Any]] = []
    for r in range(R):
        with s.ui.task(f"keyedreads {r + 1}/{R}", n * len(OPS)) as adv:
            runs.append(one_run(s.daemon.endpoint, n, r, adv))
    med: dict[str, Any] = {}
    for op in OPS:
        med[op] = {k: median([x[op][k] for x in runs])
                   for k in ("keyed_p50_us", "unkeyed_p50_us", "p50_ratio", "key_cost_us",
                             "ratio")}
        med[op]["errors"] = sum(x[op]["errors"] for x in runs)
    sec = {"n": n, "target": f"keyed/unkeyed >= {TARGET}", "median": med, "runs": runs,
           "ratios": {f"{op} keyed/unkeyed": med[op]["ratio"] for op in OPS},
           "met": all((med[op]["ratio"] or 0) >= TARGET for op in OPS)}
    return sec, {}
