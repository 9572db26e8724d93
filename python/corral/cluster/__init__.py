"""corral on a Ray cluster: one supervisor actor per node (owning that node's corrald) and a
named gateway actor in the Ray namespace ``corral`` (docs/cluster.md).

    corral.cluster.start(address="auto")   # deploy (idempotent: adds missing nodes)
    corral.cluster.connect()               # from a Ray job: Sandbox(...) now goes through it
    corral.cluster.status(); corral.cluster.stop()

Ray is imported inside these functions: ``import corral`` does not need it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Iterator
from typing import Any

from corral.errors import DaemonUnavailable, InvalidRequest, NotFound
from corral.sdk.endpoint import Endpoint, set_token

NAMESPACE = "corral"
GATEWAY = "gateway"
DEFAULT_STATE_ROOT = "/var/lib/corral/cluster"
DEFAULT_RUN_DIR = "/run/corral/cluster"


class ClusterNotFound(NotFound):
    """No corral gateway on this Ray cluster."""


def _ray(address: str | None) -> Any:
    try:
        import ray
    except ImportError:
        raise InvalidRequest("corral's cluster mode needs Ray: pip install 'corral[cluster]'") \
            from None
    if not ray.is_initialized():
        try:
            ray.init(address=address or "auto", namespace=NAMESPACE, log_to_driver=False)
        except ConnectionError as e:
            raise DaemonUnavailable(f"no Ray cluster at {address or 'auto'}: {e}") from None
    return ray


def _gateway(ray: Any) -> Any:
    try:
        return ray.get_actor(GATEWAY, namespace=NAMESPACE)
    except ValueError:
        raise ClusterNotFound("no corral cluster runs on this Ray cluster (corral cluster "
                              "start)") from None


def start(address: str | None = "auto", *, name: str = "corral", k: int = 2,
          state_root: str = DEFAULT_STATE_ROOT, run_dir: str = DEFAULT_RUN_DIR,
          max_sandboxes: int = 0, labels: dict[str, dict[str, str]] | None = None,
          gateway_port: int = 0, autoscale: dict[str, Any] | None = None,
          tokens_file: str = "") -> dict[str, Any]:
    """Deploy corral on the Ray cluster at ``address`` (or the one this process is connected
    to): the gateway, then one supervisor per live node that has none yet. ``name`` keeps the
    nodes' state dirs, sockets and cgroups apart from another corral cluster's on the same
    machines; ``labels`` maps a Ray node id to the labels ``node_selector`` matches;
    ``autoscale`` turns on autoscaling through Ray's autoscaler (``autoscale()``);
    ``tokens_file``: the tenants' tokens (docs/daemon.md, Tenants), read by the gateway and
    every node's corrald at that path. Returns ``status()``."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from corral.cluster.gateway import Gateway
    from corral.cluster.supervisor import free_port, running_credentials

    ray = _ray(address)
    here = ray.get_runtime_context().get_node_id()
    host = ray.util.get_node_ip_address()
    try:
        gw = ray.get_actor(GATEWAY, namespace=NAMESPACE)
    except ValueError:
        # Supervisors without a gateway (it died): the new one takes them over, with their
        # cluster's name, token (their corrald know that token only) and tenants.
        name, token, tokens_file = running_credentials() or (
            name, secrets.token_urlsafe(32), tokens_file)
        deploy = {"state_root": state_root, "run_dir": run_dir, "max_sandboxes": max_sandboxes,
                  "tokens_file": tokens_file}
        gw = ray.remote(Gateway).options(
            name=GATEWAY, namespace=NAMESPACE, lifetime="detached", num_cpus=0,
            max_restarts=0, max_concurrency=1000,
            scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=True),
        ).remote(name, token, k, deploy)
        ray.get(gw.serve.remote(host, gateway_port or free_port(host)))
    ray.get(gw.adopt.remote(labels))
    if autoscale is not None:
        ray.get(gw.set_autoscale.remote(autoscale))
    return status()


def autoscale(settings: dict[str, Any] | None, address: str | None = None
              ) -> dict[str, Any] | None:
    """Autoscale through Ray's autoscaler (docs/cluster.md), or stop (None). ``settings``:
    ``node_shape`` (the Ray resources one node that holds sandboxes offers, e.g.
    ``{"CPU": 16}``), ``min_nodes`` (1), ``max_nodes`` (100), ``idle_s`` (300: a node with no
    sandbox this long is drained), ``demand_window_s`` (30: how long refused creates count
    as demand). The settings in force."""
    ray = _ray(address)
    got: dict[str, Any] | None = ray.get(_gateway(ray).set_autoscale.remote(settings))
    return got


def connect(address: str | None = None, *, token: str | None = None) -> Endpoint:
    """Point this process's SDK at the cluster's gateway (sets ``CORRAL_URL``; the token is
    kept in this process only), so ``Sandbox(...)`` works unchanged. Its endpoint.

    ``token``: a tenant's token (docs/daemon.md, Tenants): this process then acts as that
    tenant, at the gateway and at every node a handle reaches, and sees only the tenant's
    sandboxes, snapshots and trajectories. Without it, the cluster's own token (the admin's,
    which reaches everything): give a tenant's job its token, not a bare ``connect()``."""
    ray = _ray(address)
    url, cluster_token = ray.get(_gateway(ray).endpoint.remote())
    if token is not None and not token:
        raise InvalidRequest("connect(token=...): an empty token")
    set_token(url, token or cluster_token)
    os.environ["CORRAL_URL"] = url
    return Endpoint(url)


@contextlib.contextmanager
def deployed_for(address: str | None = None) -> Iterator[Endpoint]:
    """This process connected to the corral cluster on the Ray cluster at ``address``; one
    is deployed (``start``) if none runs there, and stopped again on exit."""
    ray = _ray(address)
    try:
        _gateway(ray)
        ours = False
    except ClusterNotFound:
        start(address)
        ours = True
    try:
        yield connect(address)
    finally:
        os.environ.pop("CORRAL_URL", None)
        if ours:
            stop(address)


def status(address: str | None = None) -> dict[str, Any]:
    """The gateway's view: nodes with live sandboxes, capacity, free memory, report age."""
    ray = _ray(address)
    return dict(ray.get(_gateway(ray).status.remote()))


def supervisors(address: str | None = None) -> dict[str, Any]:
    """Node id -> supervisor actor handle."""
    ray = _ray(address)
    return dict(ray.get(_gateway(ray).supervisor_handles.remote()))


def stop(address: str | None = None, *, timeout: float = 180.0) -> None:
    """Stop every node's corrald (destroying its sandboxes), then the actors."""
    ray = _ray(address)
    gw = _gateway(ray)
    sups = ray.get(gw.supervisor_handles.remote())
    done = [s.stop.remote() for s in sups.values()]
    deadline = time.monotonic() + timeout
    ray.wait(done, num_returns=len(done), timeout=timeout)
    for s in sups.values():
        ray.kill(s, no_restart=True)
    ray.get(gw.close.remote(), timeout=max(1.0, deadline - time.monotonic()))
    ray.kill(gw, no_restart=True)
