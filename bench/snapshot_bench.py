"""Snapshot / restore / fork latency through corral's own API (issue 4 targets).

    python bench/snapshot_bench.py [--runs 15] [--mb 10] [--fork 64]

Uses the daemon the SDK finds (CORRAL_SOCKET / CORRAL_URL, started on demand). Reports the
median and p90 of, end to end through the SDK:
  snapshot  a sandbox with --mb MB changed (one file written with dd)   target <= 10 ms
  restore   that sandbox back to the snapshot, in place                target <=  5 ms
  fork      --fork children from one snapshot (one call)               target <= 100 ms
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import corral


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--mb", type=int, default=10)
    ap.add_argument("--fork", type=int, default=64)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    snap_ms: list[float] = []
    restore_ms: list[float] = []
    fork_ms: list[float] = []
    with corral.Sandbox(timeout=3600, memory_mb=1024) as sb:
        sb.exec("true")
        for _ in range(a.runs):
            sb.exec(f"dd if=/dev/urandom of=/root/blob bs=1M count={a.mb} status=none && "
                    "sync -f /root/blob").check()
            t = time.perf_counter()
            snap = sb.snapshot()
            snap_ms.append((time.perf_counter() - t) * 1000)
            sb.exec("echo more > /root/more").check()
            t = time.perf_counter()
            sb.restore(snap)
            restore_ms.append((time.perf_counter() - t) * 1000)
            snap.delete()
        base = sb.snapshot()
        for _ in range(max(3, a.runs // 3)):
            t = time.perf_counter()
            kids = sb.fork(a.fork)
            fork_ms.append((time.perf_counter() - t) * 1000)
            corral_kill = [k.kill() for k in kids]
            assert all(corral_kill)
        base.delete()
    res = {}
    for name, xs, target in (("snapshot", snap_ms, 10.0), ("restore", restore_ms, 5.0),
                             (f"fork{a.fork}", fork_ms, 100.0)):
        res[name] = {"median_ms": round(statistics.median(xs), 2),
                     "p90_ms": round(pct(xs, 0.9), 2), "target_ms": target,
                     "runs": len(xs)}
    if a.json:
        print(json.dumps(res, indent=2))
    else:
        for name, r in res.items():
            ok = "ok" if r["median_ms"] <= r["target_ms"] else "MISSED"
            print(f"{name:10s} median {r['median_ms']:8.2f} ms  p90 {r['p90_ms']:8.2f} ms  "
                  f"target <= {r['target_ms']:.0f} ms  {ok}")


if __name__ == "__main__":
    main()
