"""What a fork spread over a cluster's nodes costs against the node's own fork.

A two-raylet Ray cluster on loopback, corral deployed on it; a parent sandbox (a few MB of
files written) placed through the gateway; N rounds alternating (ABBA) ``sb.fork(K)`` (the
node's own fork: every child on the parent's node) and ``sb.fork(K, spread=True)`` (through
the gateway: the spec read, the snapshot taken, copied to the other node, the children placed
over both), the children killed after each round. Prints medians, their ratio and where the
spread children landed.

    python bench/cluster_fork.py [N] [K]
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import Counter

from twonodes import two_nodes  # first: before Ray is imported

import corral
import corral.cluster


def one(parent: corral.Sandbox, k: int, spread: bool) -> tuple[float, Counter[str]]:
    t = time.perf_counter()
    kids = parent.fork(k, spread=spread)
    took = time.perf_counter() - t
    where = Counter(str(kid.last_info.node if kid.last_info else "?") for kid in kids)
    corral.Sandbox.kill_many(kids, return_exceptions=True)
    return took, where


def main(n: int, k: int) -> None:
    with two_nodes(max_sandboxes=4 * k + 8):
        parent = corral.Sandbox(image="host", memory_mb=128, timeout=3600)
        parent.exec("mkdir -p /work && head -c 4000000 /dev/urandom > /work/state.bin").check()
        for spread in (False, True):  # warm both paths
            one(parent, k, spread)
        times: dict[bool, list[float]] = {True: [], False: []}
        places: Counter[str] = Counter()
        for i in range(n):
            for spread in ((False, True) if i % 2 == 0 else (True, False)):
                took, where = one(parent, k, spread)
                times[spread].append(took)
                if spread:
                    places.update(where)
        node_ms = statistics.median(times[False]) * 1e3
        spread_ms = statistics.median(times[True]) * 1e3
        print(f"fork of {k}, {n} rounds each, parent on node {parent.info().node[:8]}:")
        print(f"  node's own fork      median {node_ms:.1f} ms")
        print(f"  spread (gateway)     median {spread_ms:.1f} ms  ({spread_ms / node_ms:.2f}x)")
        print("  spread children per node: "
              + ", ".join(f"{node[:8]} {c}" for node, c in places.most_common()))
        parent.kill()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20,
         int(sys.argv[2]) if len(sys.argv) > 2 else 8)
