"""Create + exec + destroy through a cluster gateway vs straight to the node, same run.

A two-raylet Ray cluster on loopback (ray.cluster_utils.Cluster), corral deployed on it; then
N rounds of (Sandbox(...), exec("true"), kill()) through the gateway and N straight to a
node's corrald (its endpoint and token; each node in turn, as the gateway spreads them),
alternating so both see the same machine load. With
a batch size B: rounds of create_many(B) + exec_many("true") + kill_many, the gateway's split
over both nodes against one node's own batch.

The SDK's single creates through the gateway ask it for a placement and two more ahead, so
two creates in three skip the gateway (docs/cluster.md, "Using it"). With ``keyed``, every
create carries a trajectory id (an idempotency key): the gateway places each one itself (it
keeps the node of every key for the create's retries).

    python bench/cluster_gateway.py [N] [B] [keyed]
"""

from __future__ import annotations

import itertools
import os
import statistics
import sys
import time

from twonodes import two_nodes  # first: before Ray is imported

import corral
import corral.cluster
from corral.sdk.endpoint import Endpoint

_ids = itertools.count()


def round_trip(endpoint: Endpoint, keyed: bool) -> float:
    tid = f"bench-{os.getpid()}-{next(_ids)}" if keyed else None
    t = time.perf_counter()
    sb = corral.Sandbox(image="host", memory_mb=64, endpoint=endpoint, trajectory_id=tid)
    sb.exec("true")
    sb.kill()
    return time.perf_counter() - t


def batch_round(endpoint: Endpoint, b: int) -> float:
    t = time.perf_counter()
    boxes = corral.Sandbox.create_many(b, "host", memory_mb=64, endpoint=endpoint)
    corral.Sandbox.exec_many(boxes, "true")
    corral.Sandbox.kill_many(boxes)
    return time.perf_counter() - t


def main(n: int, batch: int = 0, keyed: bool = False) -> None:
    with two_nodes() as gw:
        # Straight to each node in turn: the gateway spreads its creates over both nodes, so
        # the direct path does too (the nodes' costs differ by up to a few percent).
        nodes = [gw.on_node(x["endpoint"], x["node"]) for x in corral.cluster.status()["nodes"]]
        def one(ep: Endpoint) -> float:
            return batch_round(ep, batch) if batch else round_trip(ep, keyed)
        for ep in (gw, *nodes):  # warm connections and pools
            one(ep)
        via, straight = [], []
        for i in range(n):
            via.append(one(gw))
            straight.append(one(nodes[i % len(nodes)] if not batch else nodes[0]))
        g, d = statistics.median(via) * 1e3, statistics.median(straight) * 1e3
        print(f"rounds={n} batch={batch} keyed={keyed} gateway median {g:.2f} ms, "
              f"direct median {d:.2f} ms, ratio {g / d:.2f}; means "
              f"{statistics.mean(via) * 1e3:.2f} / {statistics.mean(straight) * 1e3:.2f} ms")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200,
         int(sys.argv[2]) if len(sys.argv) > 2 else 0,
         len(sys.argv) > 3 and sys.argv[3] == "keyed")
