"""A real Ray cluster on this machine's loopback with corral deployed on it, for the cluster
tests: ``ray.cluster_utils.Cluster`` raylets bound to 127.0.0.1, each node with its own
corrald (state dir, socket, cgroup name, port) under a private root."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any
from unittest import mock

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
# Ray's autoscaler with its fake multi-node provider: worker nodes it starts are raylets on
# this machine (what a cloud provider would boot), on loopback like the rest.
FAKE_HEAD_ID = "f" * 51 + "00000"
HEAD_TYPE = "ray.head.default"  # the names the fake provider gives its head node


def autoscaler_config(gcs_port: int, worker_types: dict[str, Any]) -> dict[str, Any]:
    """A cluster config for Ray's monitor (the autoscaler) on the fake multi-node provider,
    with worker node ``worker_types`` (Ray's available_node_types) and idle nodes released
    after 6 s."""
    head = {"resources": {"CPU": NODE_ARGS["num_cpus"]}, "node_config": {}, "max_workers": 0}
    return {"cluster_name": "corral-test", "max_workers": 4, "head_node_type": HEAD_TYPE,
            "available_node_types": {HEAD_TYPE: head, **worker_types},
            "provider": {"type": "fake_multinode", "gcs_address": f"127.0.0.1:{gcs_port}",
                         "use_node_id_as_ip": True, "disable_node_updaters": True,
                         "disable_launch_config_check": True},
            "upscaling_speed": 1.0, "idle_timeout_minutes": 0.1, "auth": {}, "docker": {},
            "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
            "worker_setup_commands": [], "head_start_ray_commands": [],
            "worker_start_ray_commands": [], "file_mounts": {}, "cluster_synced_files": [],
            "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": []}


def role_labels(head: str) -> dict[str, dict[str, str]]:
    """Labels for ``corral_on_ray(labels=...)``: ``role=head`` on the head node, ``role=worker``
    on the others, so a test places a sandbox on either with ``node_selector``."""
    return {n["NodeID"]: {"role": "head" if n["NodeID"] == head else "worker"}
            for n in ray.nodes() if n["Alive"]}


def _kill_matching(text: str) -> None:
    """SIGKILL every process whose command line contains ``text`` (a cluster's GCS address:
    the raylets and workers of that cluster only)."""
    import signal

    me = os.getpid()
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd and pid != me:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def corral_on_ray(workers: int, ray_autoscaler: dict[str, Any] | None = None,
                  **start: Any) -> Iterator[dict[str, Any]]:
    """A head and ``workers`` more raylets, corral started with ``start`` (plus a private
    name, state root and run dir). ``ray_autoscaler``: worker node types for Ray's own
    autoscaler, run on the head with the fake multi-node provider. Everything is stopped and
    removed on exit."""
    root = tempfile.mkdtemp(prefix="corral-cluster-", dir="/var/tmp")
    head_args: dict[str, Any] = dict(NODE_ARGS, include_dashboard=False,
                                     dashboard_host="127.0.0.1")
    env = {}
    if ray_autoscaler is not None:
        port = _free_port()
        cfg = os.path.join(root, "autoscaler.json")
        with open(cfg, "w") as f:
            json.dump(autoscaler_config(port, ray_autoscaler), f)
        head_args.update(gcs_server_port=port, autoscaling_config=cfg)
        # Read by the monitor Ray starts with the head (it inherits this environment).
        env = {"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1",
               "RAY_OVERRIDE_NODE_ID_FOR_TESTING": FAKE_HEAD_ID}
    with mock.patch.dict(os.environ, env):
        c = Cluster(initialize_head=True, head_node_args=head_args)
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
            if ray_autoscaler is not None:  # the nodes Ray's autoscaler started, if any left
                _kill_matching(f"127.0.0.1:{head_args['gcs_server_port']}")
            for cg in cgroups:
                _force_cleanup(cg)  # only if the graceful stop failed
            shutil.rmtree(root, ignore_errors=True)
