"""The supervisor: one Ray actor per node, owner of that node's corrald.

It starts corrald (through corral.cluster.keeper) with the node's own state dir, unix socket,
cgroup name and a TCP listener on the node's address guarded by the cluster's token, and
answers load reports. corrald lives exactly as long as the actor: when the actor stops, is
killed, or its raylet dies, the keeper's pipe closes and corrald destroys every sandbox of the
node (docs/cluster.md).
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import os
import select
import socket
import subprocess
import sys
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

from corral.cluster.trajsource import LogSource
from corral.sdk.sync_transport import UnixConnection

START_TIMEOUT_S = 60.0
# How often a supervisor looks for Ray nodes that came or went: its corrald keeps every node's
# address out of its sandboxes' reach, whatever their policy (docs/cluster.md, "Security").
PEERS_EVERY_S = 10.0

log = logging.getLogger("corral.cluster")


@dataclass(frozen=True)
class NodePaths:
    """Where one node's corrald keeps its things: distinct per node and per cluster, so
    several nodes (or clusters) on one machine never share a socket, lock or cgroup."""

    state_dir: str
    socket: str
    cgroup: str
    log_file: str

    @classmethod
    def of(cls, cluster: str, node_id: str, state_root: str, run_dir: str) -> NodePaths:
        # Short for paths and cgroup names, and unique: node ids that share a prefix (Ray's
        # fake multi-node provider numbers them after 51 f's) still get their own.
        short = node_id[:4] + hashlib.sha256(node_id.encode()).hexdigest()[:8]
        state = os.path.join(state_root, f"{cluster}-{short}")
        return cls(state_dir=state, socket=os.path.join(run_dir, f"{cluster}-{short}.sock"),
                   cgroup=f"corral-{cluster}-{short}",
                   log_file=os.path.join(state, "corrald.log"))


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _get(path: str, url: str, timeout: float = 5.0) -> dict[str, Any]:
    conn = UnixConnection(path)
    conn.timeout = timeout
    try:
        conn.request("GET", url)
        resp = conn.getresponse()
        body = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"corrald answered {resp.status} to {url}: {body[:200]!r}")
        return dict(json.loads(body))
    finally:
        conn.close()


def _put(path: str, url: str, doc: dict[str, Any], timeout: float = 5.0) -> None:
    conn = UnixConnection(path)
    conn.timeout = timeout
    try:
        conn.request("PUT", url, body=json.dumps(doc).encode(),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        body = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"corrald answered {resp.status} to {url}: {body[:200]!r}")
    finally:
        conn.close()


def cluster_addresses() -> list[str]:
    """The addresses of the Ray cluster's live nodes (Ray's own ports listen there)."""
    import ray

    out = set()
    for n in ray.nodes():
        addr = str(n.get("NodeManagerAddress") or "")
        if n.get("Alive") and addr:
            try:
                out.add(str(ipaddress.ip_address(addr)))
            except ValueError:
                continue  # a name, not an address: nothing the firewall can match
    return sorted(out)


def mem_available_mb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    return 0


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of the machine, from /proc/stat's first line."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
    total = sum(vals[:8])  # guest time is already counted in user
    return total - idle, total


class NodeSupervisor:
    """Wrapped by ``ray.remote`` in corral.cluster.deploy (Ray is imported only there)."""

    def __init__(self, cluster: str, node_id: str, host: str, token: str, state_root: str,
                 run_dir: str, max_sandboxes: int = 0,
                 labels: dict[str, str] | None = None, tokens_file: str = "") -> None:
        self.node_id = node_id
        self.cluster, self.token, self.tokens_file = cluster, token, tokens_file
        self.labels = dict(labels or {})
        self.paths = NodePaths.of(cluster, node_id, state_root, run_dir)
        self.trajlog = LogSource(self.paths.state_dir)
        os.makedirs(self.paths.state_dir, mode=0o700, exist_ok=True)
        os.makedirs(run_dir, mode=0o700, exist_ok=True)
        port = free_port(host)
        self.endpoint = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        env = dict(os.environ, CORRAL_CGROUP=self.paths.cgroup, CORRAL_TOKEN=token,
                   CORRAL_MAX_SANDBOXES=str(max_sandboxes))
        env.pop("CORRAL_URL", None)
        if tokens_file:  # tenants (docs/cluster.md): the gateway's file, at the same path
            env["CORRAL_TOKENS"] = tokens_file
        # No sandbox reaches a node of the cluster (Ray's ports take commands from anyone who
        # connects): the nodes known now as settings, later ones live (_refresh_peers).
        try:
            self._peers = cluster_addresses()
        except Exception:  # noqa: BLE001 - the next report tries again (_refresh_peers)
            log.warning("could not read the cluster's node addresses", exc_info=True)
            self._peers = []
        self._peers_at = time.monotonic()
        env["CORRAL_NET_BLOCKED"] = ",".join(self._peers)
        # The token goes in the environment, not argv (which /proc shows to everyone).
        launcher = subprocess.Popen(
            [sys.executable, "-m", "corral.cluster.keeper", "--detach", "--state-dir",
             self.paths.state_dir, "--socket", self.paths.socket, "--tcp", f"{host}:{port}",
             "--node-id", node_id, "--log-file", self.paths.log_file],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        assert launcher.stdin is not None and launcher.stdout is not None
        self.pipe = launcher.stdin  # its other end: the keeper's stdin
        self.keeper_pid = int(launcher.stdout.readline() or b"0")
        launcher.stdout.close()
        launcher.wait()
        if not self.keeper_pid:
            raise RuntimeError(f"the keeper of node {node_id} did not start")
        self.keeper_fd = os.pidfd_open(self.keeper_pid)
        self._cpu = cpu_times()
        self._wait_started()

    def _wait_started(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self._keeper_gone(0):
                raise RuntimeError(f"corrald of node {self.node_id} exited; see "
                                   f"{self.paths.log_file}")
            try:
                _get(self.paths.socket, "/v1/health", timeout=1.0)
                return
            except (OSError, RuntimeError, ValueError):
                if time.monotonic() > deadline:
                    self._stop()
                    raise RuntimeError(f"corrald of node {self.node_id} did not start within "
                                       f"{START_TIMEOUT_S:.0f} s; see {self.paths.log_file}"
                                       ) from None
            time.sleep(0.05)

    def describe(self) -> dict[str, Any]:
        return {"node": self.node_id, "endpoint": self.endpoint, "labels": self.labels,
                "state_dir": self.paths.state_dir, "socket": self.paths.socket,
                "cgroup": self.paths.cgroup, "keeper_pid": self.keeper_pid}

    def report(self) -> dict[str, Any]:
        """The node's load: live sandboxes and its count of creates, admission capacity, free
        memory, CPU use since the last report, the images and snapshots it has."""
        self._refresh_peers()
        st = _get(self.paths.socket, "/v1/status")
        busy, total = cpu_times()
        (busy0, total0), self._cpu = self._cpu, (busy, total)
        return {"node": self.node_id, "endpoint": self.endpoint, "labels": self.labels,
                "live": int(st["sandboxes"]), "created": int(st.get("created", 0)),
                "capacity": int(st["capacity"]),
                "mem_free_mb": mem_available_mb(), "pid": int(st["pid"]),
                "cpu_busy": round((busy - busy0) / (total - total0), 3) if total > total0
                else 0.0,
                "images": self._listed("images", "name"),
                "snapshots": self._listed("snapshots", "id")}

    def _refresh_peers(self) -> None:
        """The cluster's node addresses in corrald's live blocked list, written when they
        differ (nodes came or went, corrald started again): checked at most every
        PEERS_EVERY_S, at a load report. Entries an admin added are kept: only the addresses
        of nodes that left are taken out."""
        now = time.monotonic()
        if now - self._peers_at < PEERS_EVERY_S:
            return
        self._peers_at = now
        try:
            peers = cluster_addresses()
            live = set(_get(self.paths.socket, "/v1/network/blocked")["live"])
            want = (live - {_cidr(p) for p in self._peers}) | {_cidr(p) for p in peers}
            if want != live:
                _put(self.paths.socket, "/v1/network/blocked", {"blocked": sorted(want)})
            self._peers = peers
        except Exception:  # noqa: BLE001 - tried again at the next report; never fails one
            log.warning("could not update the blocked cluster addresses", exc_info=True)

    def _listed(self, what: str, key: str) -> list[str]:
        """``key`` of every item of ``/v1/{what}`` (images by name, snapshots by id), all
        pages: placement prefers the node with a create's image, and looks for a create's
        snapshot on the nodes that hold it first."""
        out: list[str] = []
        after: str | None = None
        while True:
            page = _get(self.paths.socket, f"/v1/{what}" + (
                f"?{urllib.parse.urlencode({'after': after})}" if after else ""))
            out += [str(i[key]) for i in page[what]]
            after = page.get("next")
            if not after:
                return out

    def ship(self, after: int, recheck: list[int], sandboxes: list[str],
             max_bytes: int) -> dict[str, Any]:
        """The node's trajectory-log rows the gateway's copy lacks (corral.cluster.trajship):
        read from corrald's log database, off corrald's path."""
        return self.trajlog.since(after, recheck, sandboxes, max_bytes)

    def credentials(self) -> tuple[str, str, str]:
        """(cluster name, token, tenants' tokens file): a gateway started again takes over
        this node with them."""
        return self.cluster, self.token, self.tokens_file

    def stop(self) -> None:
        """Stop corrald (every sandbox of the node is destroyed); returns once it is gone."""
        self._stop()

    def _stop(self) -> None:
        if not self.pipe.closed:
            self.pipe.close()  # EOF: the keeper stops corrald
        self._keeper_gone(None)

    def _keeper_gone(self, timeout: float | None) -> bool:
        """Whether the keeper (not this process's child: it detached) has exited, waiting up
        to ``timeout`` seconds (None: until it has)."""
        p = select.poll()
        p.register(self.keeper_fd, select.POLLIN)
        return bool(p.poll(None if timeout is None else int(timeout * 1000)))


def running_supervisor(node_id: str) -> Any:
    """The supervisor actor already running on Ray node ``node_id``, or None."""
    import ray

    try:
        return ray.get_actor(f"supervisor:{node_id}", namespace="corral")
    except ValueError:
        return None


def running_credentials() -> tuple[str, str, str] | None:
    """(cluster name, token, tokens file) of the corral cluster whose supervisors run on this
    Ray cluster with no gateway (it died): a new gateway takes their nodes over with them.
    None if none runs."""
    import ray

    for a in ray.util.list_named_actors(all_namespaces=True):
        if a.get("namespace") == "corral" and str(a.get("name", "")).startswith("supervisor:"):
            try:
                sup = ray.get_actor(a["name"], namespace="corral")
                cluster, token, tokens = ray.get(sup.credentials.remote(), timeout=30)
                return str(cluster), str(token), str(tokens)
            except (ValueError, ray.exceptions.RayError):
                continue
    return None


def start_supervisor(cluster: str, token: str, node: dict[str, Any], deploy: dict[str, Any],
                     labels: dict[str, str] | None) -> Any:
    """A detached supervisor actor pinned to Ray node ``node`` (an entry of ``ray.nodes()``);
    ``deploy``: state_root, run_dir, max_sandboxes (corral.cluster.start)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nid = node["NodeID"]
    return ray.remote(NodeSupervisor).options(
        name=f"supervisor:{nid}", namespace="corral", lifetime="detached", num_cpus=0,
        max_restarts=0, max_concurrency=2,  # a log shipment never holds up a load report
        scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False),
    ).remote(cluster, nid, node["NodeManagerAddress"], token, deploy["state_root"],
             deploy["run_dir"], deploy.get("max_sandboxes", 0), labels,
             deploy.get("tokens_file") or "")


def _cidr(address: str) -> str:
    """An address as corrald's blocked list shows it."""
    return f"{address}/{32 if ':' not in address else 128}"
