"""A real Ray cluster on this machine's loopback with corral deployed on it, for the cluster
tests: ``ray.cluster_utils.Cluster`` raylets bound to 127.0.0.1, each node with its own
corrald (state dir, socket, cgroup name, port) under a private root."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

# Ray reports usage to its makers unless told not to: no packet may leave the machine. And
# Ray turns 127.0.0.1 into the host's outward address unless cluster mode's address lookup is
# off: every raylet, the GCS and the drivers stay on loopback.
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

import corral.cluster  # noqa: E402

from conftest import _force_cleanup  # noqa: E402

NODE_ARGS = {"num_cpus": 1, "object_store_memory": 80 << 20, "node_ip_address": "127.0.0.1"}


@contextlib.contextmanager
def corral_on_ray(workers: int, **start: Any) -> Iterator[dict[str, Any]]:
    """A head and ``workers`` more raylets, corral started with ``start`` (plus a private
    name, state root and run dir). Everything is stopped and removed on exit."""
    root = tempfile.mkdtemp(prefix="corral-cluster-", dir="/var/tmp")
    c = Cluster(initialize_head=True, head_node_args=dict(
        NODE_ARGS, include_dashboard=False, dashboard_host="127.0.0.1"))
    name = f"t{os.getpid()}"
    cgroups: set[str] = set()
    try:
        for _ in range(workers):
            c.add_node(**NODE_ARGS)
        ray.init(address=c.address, namespace=corral.cluster.NAMESPACE, log_to_driver=False)
        c.wait_for_nodes()
        head = ray.get_runtime_context().get_node_id()
        labels = start.pop("labels", lambda head: None)(head)
        run_dir = os.path.join(root, "run")
        corral.cluster.start(name=name, state_root=root, run_dir=run_dir, labels=labels,
                             **start)

        def describe() -> dict[str, dict]:
            out = {nid: ray.get(s.describe.remote())
                   for nid, s in corral.cluster.supervisors().items()}
            cgroups.update(d["cgroup"] for d in out.values())
            return out
        yield {"name": name, "root": root, "nodes": describe(), "describe": describe,
               "supervisors": corral.cluster.supervisors(), "head": head, "ray": c,
               "run_dir": run_dir}
    finally:
        os.environ.pop("CORRAL_URL", None)
        try:
            if ray.is_initialized():
                corral.cluster.stop()
        finally:
            ray.shutdown()
            c.shutdown()
            for cg in cgroups:
                _force_cleanup(cg)  # only if the graceful stop failed
            shutil.rmtree(root, ignore_errors=True)
