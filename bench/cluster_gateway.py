"""Create + exec + destroy through a cluster gateway vs straight to the node, same run.

A two-raylet Ray cluster on loopback (ray.cluster_utils.Cluster), corral deployed on it; then
N rounds of (Sandbox(...), exec("true"), kill()) through the gateway and N straight to one
node's corrald (its endpoint and token), alternating so both see the same machine load. With
a batch size B: rounds of create_many(B) + exec_many("true") + kill_many, the gateway's split
over both nodes against one node's own batch.

    python bench/cluster_gateway.py [N] [B]
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
    sb.exec("true")
    sb.kill()
    return time.perf_counter() - t


def batch_round(endpoint: Endpoint, b: int) -> float:
    t = time.perf_counter()
    boxes = corral.Sandbox.create_many(b, "host", memory_mb=64, endpoint=endpoint)
    corral.Sandbox.exec_many(boxes, "true")
    corral.Sandbox.kill_many(boxes)
    return time.perf_counter() - t


def main(n: int, batch: int = 0) -> None:
    with two_nodes() as gw:
        node = corral.cluster.status()["nodes"][0]
        direct = gw.on_node(node["endpoint"], node["node"])
        def one(ep: Endpoint) -> float:
            return batch_round(ep, batch) if batch else round_trip(ep)
        for ep in (gw, direct):  # warm connections and pools
            one(ep)
        via, straight = [], []
        for _ in range(n):
            via.append(one(gw))
            straight.append(one(direct))
        g, d = statistics.median(via) * 1e3, statistics.median(straight) * 1e3
        print(f"rounds={n} batch={batch} gateway median {g:.2f} ms, direct median {d:.2f} ms, "
              f"ratio {g / d:.2f}; means {statistics.mean(via) * 1e3:.2f} / "
              f"{statistics.mean(straight) * 1e3:.2f} ms")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200,
         int(sys.argv[2]) if len(sys.argv) > 2 else 0)
