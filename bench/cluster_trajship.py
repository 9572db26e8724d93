"""What shipping the nodes' trajectory logs to the gateway costs a create + exec + destroy.

A two-raylet Ray cluster on loopback, corral deployed on it; N rounds of (Sandbox(...) through
the gateway, exec, kill()) in blocks of B rounds, shipping on and off in turn (ABBA) in the
same run, so both see the same machine load. Each round also logs its calls (create, exec,
kill: three entries), which the gateway then pulls in the background while shipping is on.

    python bench/cluster_trajship.py [N] [B]
"""

from __future__ import annotations

import statistics
import sys
import time

from twonodes import two_nodes  # first: before Ray is imported

import corral
import corral.cluster
from corral.sdk.endpoint import Endpoint


def round_trip(endpoint: Endpoint) -> float:
    t = time.perf_counter()
    sb = corral.Sandbox(image="host", memory_mb=64, endpoint=endpoint)
    sb.exec("echo a line of output")
    sb.kill()
    return time.perf_counter() - t


def main(n: int, block: int) -> None:
    import ray  # after twonodes: it keeps Ray off the network

    with two_nodes() as gw:
        actor = ray.get_actor(corral.cluster.GATEWAY, namespace=corral.cluster.NAMESPACE)
        for _ in range(3):
            round_trip(gw)
        times: dict[bool, list[float]] = {True: [], False: []}
        order = [True, False, False, True]
        i = 0
        while sum(map(len, times.values())) < 2 * n:
            on = order[i % 4]
            i += 1
            ray.get(actor.set_shipping.remote(on))
            times[on] += [round_trip(gw) for _ in range(block)]
        ray.get(actor.set_shipping.remote(True))
        st = corral.cluster.status()["trajlog"]
        on, off = statistics.median(times[True]) * 1e3, statistics.median(times[False]) * 1e3
        print(f"rounds={n} per mode, blocks of {block}: shipping on median {on:.2f} ms, off "
              f"median {off:.2f} ms, ratio {on / off:.3f}; means "
              f"{statistics.mean(times[True]) * 1e3:.2f} / "
              f"{statistics.mean(times[False]) * 1e3:.2f} ms")
        for node, s in st.items():
            print(f"  node {node[:12]}: copy at seq {s['seq']}, {s['rows']} rows in "
                  f"{s['calls']} calls")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 100,
         int(sys.argv[2]) if len(sys.argv) > 2 else 10)
