"""The cluster the bench/cluster_*.py scripts run on: a Ray head and one more raylet on this
machine's loopback (ray.cluster_utils.Cluster), corral deployed on them under a private state
root. Imported before Ray: it keeps Ray's usage reports and addresses off the network."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep Ray on 127.0.0.1

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

import corral.cluster  # noqa: E402
from corral.sdk.endpoint import Endpoint  # noqa: E402

NODE = {"num_cpus": 1, "object_store_memory": 80 << 20, "node_ip_address": "127.0.0.1"}


@contextlib.contextmanager
def two_nodes(**start: Any) -> Iterator[Endpoint]:
    """The gateway's endpoint (the SDK's default from here on); ``start``: more options of
    corral.cluster.start. Everything is stopped and removed on exit."""
    root = tempfile.mkdtemp(prefix="corral-cluster-bench-", dir="/var/tmp")
    c = Cluster(initialize_head=True, head_node_args=dict(NODE, include_dashboard=False))
    try:
        c.add_node(**NODE)
        ray.init(address=c.address, namespace=corral.cluster.NAMESPACE, log_to_driver=False)
        corral.cluster.start(name=f"b{os.getpid()}", state_root=root,
                             run_dir=os.path.join(root, "run"), **start)
        yield corral.cluster.connect()
    finally:
        try:
            if ray.is_initialized():
                corral.cluster.stop()
        finally:
            ray.shutdown()
            c.shutdown()
            shutil.rmtree(root, ignore_errors=True)
