"""The gateway: the cluster's control plane, one named Ray actor (namespace ``corral``).

It knows the supervisors, polls their load reports, places each create by power-of-k choices
(corral.cluster.placement) and serves a small HTTP endpoint that the unchanged SDK talks to
(``CORRAL_URL``): ``POST /v1/sandboxes`` is placed and sent to the chosen node, and the answer
names the node and its endpoint, which the SDK uses for every later call of that sandbox. So
the gateway carries creates only, never exec output or files (docs/cluster.md).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import hmac
import json
import logging
import os
import sqlite3
import threading
import time
from typing import Any

import aiohttp
from aiohttp import web

from corral import placing
from corral.cluster import (
    batch,
    broadcast,
    drainmove,
    forks,
    images,
    reads,
    snapshots,
    trajship,
)
from corral.cluster.placement import REPORT_MAX_AGE_S, NodeLoad, choose
from corral.cluster.rates import WINDOW_S
from corral.cluster.scaling import AutoscaleConfig, Autoscaler, request_resources
from corral.config import log_retention_from_env
from corral.daemon import batches, streams
from corral.daemon.app_errors import ACT_AS_HEADER
from corral.daemon.bodymem import BodyMemory, check_not_encoded
from corral.daemon.tcpguard import TcpGuard
from corral.daemon.tenants import Tenants
from corral.errors import (
    CapacityExceeded,
    CorralError,
    DaemonRestarted,
    Forbidden,
    InvalidRequest,
    NotFound,
    QuotaExceeded,
    SandboxLost,
    SandboxNotFound,
    Unauthorized,
)
from corral.models import CreateManyRequest
from corral.nodeselector import HEADER as SELECTOR_HEADER
from corral.nodeselector import parse_selector

log = logging.getLogger("corral.cluster")

# Logs streamed through the gateway at once: each holds a connection of the session every
# placement, read and batch shares (1,024) for as long as its client takes. In all, and for
# one tenant (a slow reader of many big logs must not hold the others' connections).
LOG_STREAMS = 64
LOG_STREAMS_PER_TENANT = 8
# A client that takes no piece of a streamed log for this long is cut.
LOG_WRITE_STALL_S = 60.0
REPORT_INTERVAL_S = 0.5
# Keyed creates whose node the gateway remembers: a retry of one (its answer lost, the same
# Idempotency-Key) goes to the node that has the first, which answers it from its log, rather
# than to wherever placement would put a new sandbox (a second sandbox for one trajectory).
KEYED_CREATES = 100_000
REPORT_TIMEOUT_S = 2.0
ADOPT_EVERY_S = 1.0   # autoscaling: how often the gateway looks for nodes Ray added
MAX_CREATE_BODY = 16 << 20
# Connections the gateway's listener holds at once (its trainers' SDK pools: up to 2048 an
# endpoint each); a quarter of them without a token yet (corral.daemon.tcpguard).
GATEWAY_MAX_CONNECTIONS = 8192
# Placements a tenant may take in a second to make the sandboxes itself (corral.placing): each
# counts on its node until that node's next report, though nothing is made yet, so a client
# asking for placements it never uses could make every node look full. Past this, the
# tenant's creates are made by the gateway (real sandboxes, under the nodes' own limits).
PLACEMENTS_PER_TENANT_S = 4096
# Nor may a tenant's placements of the last second be more than this share of the free room
# of the nodes' last reports (all tenants' together: twice that), however small the cluster:
# the rest of the room stays for the creates other tenants make.
PLACEMENT_ROOM_SHARE = 4
# The tenant the current request acts for (None: the admin), set by _authorized: a node call
# made for it carries it in X-Corral-Tenant, with the cluster token only the gateway holds.
_TENANT: contextvars.ContextVar[str | None] = contextvars.ContextVar("tenant", default=None)


async def _write_paced(out: web.StreamResponse, data: bytes) -> None:
    """Write ``data`` a slice at a time, each within LOG_WRITE_STALL_S: a client that takes
    nothing for that long is cut (asyncio.TimeoutError), a slow one that keeps taking is not."""
    view = memoryview(data)
    for i in range(0, len(view), 64 << 10):
        await asyncio.wait_for(out.write(view[i:i + (64 << 10)]), LOG_WRITE_STALL_S)


def _error(err: CorralError) -> web.Response:
    return web.json_response(err.to_payload(), status=err.status)


class Gateway:
    """Wrapped by ``ray.remote`` in corral.cluster.deploy; an async actor: one event loop
    serves Ray calls, the report poller and the HTTP endpoint."""

    def __init__(self, cluster: str, token: str, k: int = 2,
                 deploy: dict[str, Any] | None = None) -> None:
        self.cluster = cluster
        self.token = token
        self.k = k
        # How a node's supervisor is made (corral.cluster.start's arguments).
        self.deploy: dict[str, Any] = dict(deploy or {})
        # Tenants' tokens (corral.daemon.tenants): the same file on every node.
        tokens = self.deploy.get("tokens_file")
        self.tenants = Tenants(tokens) if tokens else None
        self.labels: dict[str, dict[str, str]] = {}
        self.nodes: dict[str, NodeLoad] = {}
        # Derived from ``nodes`` for placement (rebuilt by ``nodes_changed``): a create costs
        # the same with 5 nodes or 5,000 (placement.choose draws from these).
        self._pool: list[NodeLoad] | None = None
        self._by_image: dict[str, list[NodeLoad]] | None = None
        self._by_snapshot: dict[str, list[NodeLoad]] | None = None
        self.supervisors: dict[str, Any] = {}   # node id -> actor handle
        self.lost: dict[str, str] = {}          # node id -> why it left
        self.drained: dict[str, float] = {}     # node id -> when (wall clock) it was drained
        self.autoscaler: Autoscaler | None = None
        self.home = ""                          # the gateway's own node: never drained
        self._adopted_at = 0.0
        self._starting: set[str] = set()        # nodes whose supervisor is being started
        self._adopting: asyncio.Future[None] | None = None
        self._draining: set[asyncio.Future[None]] = set()
        # Drained nodes' snapshots on their way to live nodes (cluster.drainmove): a create
        # from a snapshot no live node has waits for them before answering not found.
        self.moving: set[asyncio.Future[int]] = set()
        self.placed = 0
        self.placement_limit = PLACEMENTS_PER_TENANT_S
        # tenant (None: the admin) -> when each of its placements of the last second was taken
        self._taken: dict[str | None, collections.deque[float]] = {}
        self._taken_all: collections.deque[float] = collections.deque()  # every tenant's
        self._room = (-1.0, 0)  # (when, free slots in the fresh nodes' last reports)
        self.url = ""
        self._keyed: collections.OrderedDict[tuple[str | None, str], str] = \
            collections.OrderedDict()  # (tenant, key) -> node id, KEYED_CREATES at most
        self._runner: web.AppRunner | None = None
        self._poller: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        # Snapshot copies under way: (snapshot id, target node) -> the copy (snapshots.copy_to)
        self.copies: dict[tuple[str, str], asyncio.Future[None]] = {}
        # The nodes' trajectory logs, shipped here as they are written (cluster.trajship):
        # in the gateway's state dir, made by serve() when the deployment names a state root.
        self.logs: trajship.LogCopies | None = None
        self.shipping = True
        self._shipper: asyncio.Task[None] | None = None
        self._sealing: set[asyncio.Future[Any]] = set()
        # Logs streamed through now: in all, and by tenant (None: the admin's).
        self._log_streams: collections.Counter[str | None] = collections.Counter()
        self.bodies = BodyMemory()  # request bodies held at once (_body_memory)
        self.guard = TcpGuard(GATEWAY_MAX_CONNECTIONS)  # the listener's connections (_guarded)
        self._listener: asyncio.base_events.Server | None = None

    # ---- Ray methods ----------------------------------------------------------------------
    async def serve(self, host: str, port: int) -> str:
        """Start the HTTP endpoint and the report poller; the endpoint's URL."""
        if self._runner is None:
            _normal_priority()
            app = web.Application(client_max_size=MAX_CREATE_BODY,
                                  middlewares=[self._guarded, self._body_memory])
            app.router.add_get("/v1/health", self._health)
            app.router.add_get("/v1/cluster", self._status)
            app.router.add_post("/v1/sandboxes", self._create)
            app.router.add_get("/v1/sandboxes", self._list)
            app.router.add_get("/v1/snapshots/{key}", self._snapshot)
            app.router.add_get("/v1/sandboxes/{id}", self._sandbox)
            app.router.add_get("/v1/trajectories/{tid}", self._trajectory)
            app.router.add_get("/v1/sandboxes/{id}/log", self._sandbox_log)
            app.router.add_post("/v1/sandboxes/batch", self._create_batch)
            app.router.add_post("/v1/sandboxes/batch/exec", self._id_batch)
            app.router.add_post("/v1/sandboxes/batch/destroy", self._id_batch)
            app.router.add_post("/v1/sandboxes/{id}/fork", self._fork)
            app.router.add_post(images.PATH, self._pull_image)
            app.router.add_route("*", "/{tail:.*}", self._elsewhere)
            self._runner = web.AppRunner(app, access_log=None, auto_decompress=False)
            await self._runner.setup()
            assert self._runner.server is not None
            # The listener's connections counted as corrald's are: no token is needed to
            # connect, and idle half-sent connections held every fd the gateway has.
            self._listener = await asyncio.get_running_loop().create_server(
                self.guard.protocol_factory(self._runner.server, access_log=None,
                                            auto_decompress=False),
                host, port, backlog=4096, reuse_address=True)
            self.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=1024),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0, sock_read=120.0))
            self._poller = asyncio.get_running_loop().create_task(self._poll())
            if self.deploy.get("state_root"):
                root = os.path.join(self.deploy["state_root"], f"{self.cluster}-gateway")
                self.logs = trajship.LogCopies(root, log_retention_from_env())
                self._shipper = asyncio.get_running_loop().create_task(self._ship())
        return self.url

    async def endpoint(self) -> tuple[str, str]:
        """(URL, token) for a client inside the Ray cluster (corral.cluster.connect)."""
        return self.url, self.token

    async def add_node(self, node: str, supervisor: Any, report: dict[str, Any]) -> None:
        self.supervisors[node] = supervisor
        self.lost.pop(node, None)
        self.drained.pop(node, None)
        self._take(report, time.monotonic())

    async def adopt(self, labels: dict[str, dict[str, str]] | None = None,
                    drained_too: bool = True) -> list[str]:
        """Start a supervisor on every live Ray node that has none (``labels``: node id ->
        its labels, kept for later nodes too); the nodes adopted. A drained node is adopted
        again only if ``drained_too``."""
        import ray

        from corral.cluster.supervisor import running_supervisor, start_supervisor

        self.labels.update(labels or {})
        if not self.home:
            self.home = ray.get_runtime_context().get_node_id()
        fresh = [n for n in await asyncio.to_thread(ray.nodes)
                 if n["Alive"] and n["NodeID"] not in self.supervisors
                 and n["NodeID"] not in self._starting
                 and (drained_too or n["NodeID"] not in self.drained)]
        self._starting.update(n["NodeID"] for n in fresh)
        try:
            # A node whose supervisor still runs (this gateway was started again) is taken
            # over as it is: its corrald and sandboxes live on.
            running = await asyncio.to_thread(
                lambda: {n["NodeID"]: running_supervisor(n["NodeID"]) for n in fresh})
            sups = {n["NodeID"]: running[n["NodeID"]] or start_supervisor(
                self.cluster, self.token, n, self.deploy, self.labels.get(n["NodeID"]))
                for n in fresh}
            adopted = []
            for nid, sup in sups.items():
                try:
                    await self.add_node(nid, sup, await sup.report.remote())
                    adopted.append(nid)
                except ray.exceptions.RayError as e:
                    ray.kill(sup, no_restart=True)  # frees its name for the next try
                    log.warning("node not adopted", extra={"node": nid, "error": str(e)})
            if self.logs is not None:  # copies of nodes that left while no gateway ran
                logs = self.logs
                known = await asyncio.get_running_loop().run_in_executor(logs.pool, logs.nodes)
                alive = {n["NodeID"] for n in await asyncio.to_thread(ray.nodes) if n["Alive"]}
                for nid in known:
                    if nid not in alive and nid not in logs.sealed:
                        self._seal(nid)
            return adopted
        finally:
            self._starting.difference_update(n["NodeID"] for n in fresh)

    async def set_autoscale(self, cfg: dict[str, Any] | None) -> dict[str, Any] | None:
        """Turn autoscaling on with ``cfg`` (corral.cluster.scaling.AutoscaleConfig) or
        off (None; a standing request is withdrawn)."""
        if cfg is None:
            if self.autoscaler is not None and self.autoscaler.asked:
                await asyncio.to_thread(request_resources, [])
            self.autoscaler = None
            return None
        self.autoscaler = Autoscaler(AutoscaleConfig.parse(cfg))
        return self.autoscaler.cfg.as_dict()

    async def node_ids(self) -> list[str]:
        return list(self.supervisors)

    async def supervisor_handles(self) -> dict[str, Any]:
        return dict(self.supervisors)

    async def status(self) -> dict[str, Any]:
        now = time.monotonic()
        nodes: list[dict[str, Any]] = []
        creates_total = ends_total = 0.0
        for n in self.nodes.values():
            creates, ends = n.rates.per_s()
            creates_total += creates
            ends_total += ends
            nodes.append({"node": n.node, "endpoint": n.endpoint, "live": n.live,
                          "placed_since_report": n.placed,
                          "capacity": n.capacity, "mem_free_mb": n.mem_free_mb,
                          "cpu_busy": n.cpu_busy, "images": sorted(n.images),
                          "snapshots": len(n.snapshots),
                          "creates_per_s": round(creates, 2), "ends_per_s": round(ends, 2),
                          "labels": n.labels, "report_age_s": round(now - n.reported_at, 3)})
        return {"cluster": self.cluster, "gateway": self.url, "home": self.home,
                "placed": self.placed, "k": self.k,
                "live": sum(n.live for n in self.nodes.values()),
                "capacity": sum(n.capacity for n in self.nodes.values()),
                "creates_per_s": round(creates_total, 2), "ends_per_s": round(ends_total, 2),
                "rate_window_s": WINDOW_S,
                "nodes": nodes,
                "lost": dict(self.lost), "drained": dict(self.drained),
                "trajlog": await self.trajlog_status(),
                "autoscale": None if self.autoscaler is None else {
                    **self.autoscaler.cfg.as_dict(), "asked_nodes": self.autoscaler.asked,
                    "unmet_creates": self.autoscaler.demand(now)}}

    async def reported_holders(self, snapshot_id: str) -> list[str]:
        """The nodes whose last load report lists snapshot ``snapshot_id``."""
        return [n.node for n in self.by_snapshot().get(snapshot_id, ())]

    async def place(self, selector: dict[str, str] | None = None,
                    image: str | None = None) -> dict[str, str]:
        n = choose(self.pool(), time.monotonic(), k=self.k, selector=selector,
                   image=image, by_image=self.by_image())
        n.finished.append(time.monotonic())  # counted until a report includes it
        self.placed += 1
        return {"node": n.node, "endpoint": n.endpoint}

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        if self._shipper is not None:
            self._shipper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._shipper
        if self.logs is not None:
            await asyncio.to_thread(self.logs.close)
        if self._session is not None:
            await self._session.close()
        if self._listener is not None:
            self._listener.close()
        if self._runner is not None:
            await self._runner.cleanup()

    # ---- autoscaling ----------------------------------------------------------------------
    def refused(self, err: CapacityExceeded, count: int) -> None:
        """Creates refused for want of room are demand (not those whose labels no node has:
        more nodes of the type Ray adds would not have them either)."""
        d = err.details or {}
        if self.autoscaler is not None and not (d.get("fresh") and not d.get("matching")):
            self.autoscaler.refused(time.monotonic(), count)

    async def _autoscale(self) -> None:
        a = self.autoscaler
        if a is None:
            return
        now = time.monotonic()
        if now - self._adopted_at >= ADOPT_EVERY_S and (
                self._adopting is None or self._adopting.done()):
            # In the background: a node's corrald takes seconds to start, and the poller
            # must keep the other nodes' reports fresh meanwhile.
            self._adopted_at = now
            self._adopting = asyncio.ensure_future(self._adopt_for(a))
        plan = a.plan(list(self.nodes.values()), now, keep={self.home})
        if plan.request is not None:
            await asyncio.to_thread(request_resources, plan.request)
            log.info("asked Ray's autoscaler", extra={"bundles": len(plan.request)})
        for node in plan.drain:  # in the background, as adoption
            n = self.nodes.pop(node, None)  # out of placement at once
            self.nodes_changed()
            self._starting.add(node)    # and not adopted again while it stops
            task = asyncio.ensure_future(self._drain(node, n))
            self._draining.add(task)
            task.add_done_callback(self._draining.discard)

    async def _adopt_for(self, a: Autoscaler) -> None:
        try:
            if await self.adopt(drained_too=a.demand(time.monotonic()) > 0):
                a.unmet.clear()  # the new room serves it; creates refused from now on count
        except Exception:  # noqa: BLE001 - tried again at the next tick
            log.exception("adopting new nodes failed")

    async def _drain(self, node: str, n: NodeLoad | None = None) -> None:
        """Out of placement, its snapshots moved to live nodes (cluster.drainmove), then its
        corrald stops (it holds no sandbox) and its supervisor goes, so that Ray sees the
        node idle and its autoscaler may release it. A node whose snapshots cannot all move
        is put back (drained at a later idle period)."""
        import ray

        sup = self.supervisors.pop(node, None)  # no more reports: not placed again meanwhile
        try:
            if n is not None and sup is not None:
                move = asyncio.ensure_future(drainmove.move_off(self, n))
                self.moving.add(move)
                try:
                    await move
                except Exception as e:  # noqa: BLE001 - the node stays, as it was
                    log.warning("drain called off: the node's snapshots did not all move",
                                extra={"node": node, "error": str(e)})
                    self.supervisors[node] = sup
                    self.nodes[node] = n
                    self.nodes_changed()
                    return
                finally:
                    self.moving.discard(move)
            if sup is not None:
                if self.logs is not None and self.shipping:  # its log's last rows, shipped
                    with contextlib.suppress(Exception):
                        await self._ship_node(node, sup)
                try:
                    await sup.stop.remote()
                except ray.exceptions.RayError as e:
                    log.warning("drained node's supervisor failed to stop",
                                extra={"error": str(e)})
                ray.kill(sup, no_restart=True)
            self.drained[node] = time.time()
            log.info("node drained", extra={"node": node})
        finally:
            self._starting.discard(node)

    async def set_placement_limit(self, per_s: int | None) -> int:
        """Placements a tenant may take in a second to make the sandboxes itself (None: the
        default, ``PLACEMENTS_PER_TENANT_S``)."""
        self.placement_limit = PLACEMENTS_PER_TENANT_S if per_s is None else max(0, per_s)
        self._taken.clear()
        self._taken_all.clear()
        return self.placement_limit

    # ---- the nodes' trajectory logs (cluster.trajship) ------------------------------------
    async def set_shipping(self, on: bool) -> bool:
        """Ship the nodes' trajectory logs here (the default), or stop (what a measurement
        of its cost compares)."""
        self.shipping = bool(on)
        return self.shipping

    async def trajlog_status(self) -> dict[str, Any]:
        """Per node whose log is copied here: the copy's highest entry number (``seq``),
        rows received past the cursor and again (rows held open), shipping calls."""
        logs = self.logs
        if logs is None:
            return {}
        loop = asyncio.get_running_loop()
        nodes = await loop.run_in_executor(logs.pool, logs.nodes)
        out: dict[str, Any] = {}
        for n in nodes:
            top = await loop.run_in_executor(logs.pool, logs.top, n)
            out[n] = dict(logs.stats.get(n, {"rows": 0, "again": 0, "calls": 0}), seq=top,
                          live=n in self.supervisors)
        return out

    async def _ship(self) -> None:
        """Every SHIP_INTERVAL_S, every node's new log rows into its copy, nodes at once;
        every PRUNE_EVERY_S, the copies pruned."""
        pruned = 0.0
        while True:
            if time.monotonic() - pruned >= trajship.PRUNE_EVERY_S:
                pruned = time.monotonic()
                try:
                    await self.prune_logs()
                except Exception:  # noqa: BLE001 - shipping must outlive a failed prune
                    log.exception("pruning the trajectory-log copies failed")
            if self.shipping:
                items = list(self.supervisors.items())
                got = await asyncio.gather(*(self._ship_node(n, s) for n, s in items),
                                           return_exceptions=True)
                for (node, _), r in zip(items, got, strict=True):
                    if isinstance(r, Exception) and not self.node_gone(r):
                        log.warning("trajectory log shipping failed",
                                    extra={"node": node, "error": str(r)})
            await asyncio.sleep(trajship.SHIP_INTERVAL_S)

    async def prune_logs(self, now: float | None = None) -> dict[str, int]:
        """Every copy pruned as its node prunes its own log (trajship.LogCopies.prune); per
        node, the sandboxes dropped."""
        logs = self.logs
        if logs is None:
            return {}
        loop = asyncio.get_running_loop()
        t = time.time() if now is None else now
        out = {}
        for node in await loop.run_in_executor(logs.pool, logs.nodes):
            out[node] = await loop.run_in_executor(logs.pool, logs.prune, node, t,
                                                   node in self.supervisors)
        return out

    async def _ship_node(self, node: str, sup: Any) -> None:
        logs = self.logs
        assert logs is not None
        loop = asyncio.get_running_loop()
        for _ in range(16):  # a backlog (a gateway started again): calls in a row
            if node in logs.sealed:
                return
            cur = await loop.run_in_executor(logs.pool, logs.cursor, node)
            got = await asyncio.wait_for(asyncio.wrap_future(sup.ship.remote(
                cur["after"], cur["recheck"], cur["sandboxes"],
                trajship.SHIP_MAX_BYTES).future()), 30.0)
            await loop.run_in_executor(logs.pool, logs.apply, node, cur["after"], got)
            if not got.get("more"):
                return

    def _seal(self, node: str) -> None:
        """A lost node's copy: its calls in flight interrupted, its sandboxes ended."""
        logs = self.logs
        if logs is None:
            return
        fut = asyncio.get_running_loop().run_in_executor(logs.pool, logs.seal, node)
        self._sealing.add(fut)
        fut.add_done_callback(self._sealing.discard)

    async def _log_from_nodes(self, request: web.Request, sid: str, node: str | None
                              ) -> web.StreamResponse | None:
        """Sandbox ``sid``'s log from the live node that has it (``node`` if known, else
        every node asked at once), streamed to the client as the node sends it (a log is as
        big as its sandbox made it: held whole, six reads of a 214 MB log took the gateway
        to 4 GB); None if no node has it. SandboxLost if none has it while some node did
        not answer."""
        nodes = [self.nodes[node]] if node in self.nodes else list(self.nodes.values())
        path = f"/v1/sandboxes/{reads.segment(sid, SandboxNotFound)}/log"
        # A node that stops sending for ASK_TIMEOUT_S is cut; a long log is not.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=reads.ASK_TIMEOUT_S,
                                        sock_read=reads.ASK_TIMEOUT_S)

        async def ask(n: Any) -> aiohttp.ClientResponse:
            return await self.session().get(n.endpoint + path, params=request.query,
                                            headers=self.node_headers(), timeout=timeout)

        asks = [asyncio.ensure_future(ask(n)) for n in nodes]
        try:
            got = await asyncio.gather(*asks, return_exceptions=True)
        except BaseException:  # cancelled: what has answered is let go
            for a in asks:
                if a.done() and not a.cancelled() and a.exception() is None:
                    a.result().release()
                else:
                    a.cancel()
            raise
        chosen: aiohttp.ClientResponse | None = None
        failed = False
        for r in got:
            if isinstance(r, BaseException):
                failed = True
            elif chosen is None and r.status != 404:
                chosen = r
            else:
                r.release()
        if chosen is None:
            if failed:
                raise SandboxLost(f"no answering node has sandbox {sid}'s log, and some node "
                                  "did not answer", details={"id": sid})
            return None
        try:
            return await streams.stream_out(
                request, chosen.content.iter_chunked(1 << 20), status=chosen.status,
                content_type=chosen.headers.get("Content-Type", "application/json"),
                cut_by=(aiohttp.ClientError, asyncio.TimeoutError, ConnectionError),
                write=_write_paced)
        finally:
            chosen.release()

    async def _sandbox_log(self, request: web.Request) -> web.StreamResponse:
        """A sandbox's trajectory log: from its node while the node lives, else from the
        node's copy here (a lost node's sandboxes: ``corral log``, ``corral replay``)."""
        if not self._authorized(request):
            return _error(Unauthorized("missing or wrong bearer token"))
        sid = request.match_info["id"]
        fmt = request.query.get("format", "json")
        try:
            if fmt not in ("json", "jsonl"):
                raise InvalidRequest("query parameter 'format' must be json or jsonl")
            logs = self.logs
            loop = asyncio.get_running_loop()
            node = None if logs is None else await loop.run_in_executor(logs.pool, logs.find,
                                                                         sid)
            if node is None or node in self.nodes:
                try:
                    got = await self._streaming(self._log_from_nodes(request, sid, node))
                except SandboxLost:
                    if node is None:
                        raise
                    got = None
                if got is not None:
                    return got
            if node is None or logs is None:
                raise SandboxNotFound(f"no node has sandbox {sid} or a trajectory log of it",
                                      details={"id": sid})
            has, owner = await loop.run_in_executor(logs.pool, logs.owner_of, node, sid)
            tenant = self.tenant()
            if not has or (tenant is not None and owner != tenant):
                raise SandboxNotFound(f"no sandbox {sid} and no trajectory log for it",
                                      details={"id": sid})
            return await self._streaming(self._log_from_copy(request, node, sid,
                                                             fmt == "jsonl"))
        except CorralError as e:
            return _error(e)

    async def _streaming(self, stream: Any) -> Any:
        """Run the coroutine ``stream`` (a log streamed to the client) within the gateway's
        caps on streams at once, in all and for the request's tenant."""
        tenant = self.tenant()
        held = self._log_streams
        mine = tenant is not None and held[tenant] >= LOG_STREAMS_PER_TENANT
        if sum(held.values()) >= LOG_STREAMS or mine:
            stream.close()
            if mine:
                raise QuotaExceeded(
                    f"tenant {tenant} has {held[tenant]} logs streaming through the gateway, "
                    "as many as a tenant may; retry when one is done",
                    details={"tenant": tenant, "resource": "log_streams",
                             "limit": LOG_STREAMS_PER_TENANT})
            raise CapacityExceeded(f"{sum(held.values())} logs are streaming through the "
                                   "gateway, as many as it takes at once; retry shortly",
                                   details={"resource": "log_streams", "limit": LOG_STREAMS})
        held[tenant] += 1
        try:
            return await stream
        finally:
            held[tenant] -= 1
            if not held[tenant]:
                del held[tenant]

    async def _log_from_copy(self, request: web.Request, node: str, sid: str,
                             jsonl: bool) -> web.StreamResponse:
        """A lost node's sandbox's log from its copy here, a page at a time (as a node
        streams its own)."""
        logs = self.logs
        assert logs is not None
        more = b',"node":' + json.dumps(node).encode() + b',"copy":true'
        pages = await asyncio.get_running_loop().run_in_executor(
            logs.pool, logs.stream, node, sid, jsonl, more)
        if pages is None:
            return _error(SandboxNotFound(f"no sandbox {sid} and no trajectory log for it",
                                          details={"id": sid}))
        def cut(e: BaseException) -> None:
            if isinstance(e, sqlite3.Error):  # a client gone is no error of ours
                log.error("reading a lost node's log copy failed mid-stream", exc_info=e)

        try:
            return await streams.stream_out(
                request, streams.pages_of(pages),
                content_type="application/x-ndjson" if jsonl else "application/json",
                cut_by=(sqlite3.Error, OSError, asyncio.TimeoutError), write=_write_paced,
                on_cut=cut)
        finally:
            with contextlib.suppress(ValueError):  # still running in its thread: let it go
                pages.close()

    # ---- placement's view of the nodes ----------------------------------------------------
    def nodes_changed(self) -> None:
        """A node joined or left, or its images changed."""
        self._pool = self._by_image = self._by_snapshot = None

    def pool(self) -> list[NodeLoad]:
        if self._pool is None:
            self._pool = list(self.nodes.values())
        return self._pool

    def by_image(self) -> dict[str, list[NodeLoad]]:
        if self._by_image is None:
            idx: dict[str, list[NodeLoad]] = {}
            for n in self.nodes.values():
                for image in n.images:
                    idx.setdefault(image, []).append(n)
            self._by_image = idx
        return self._by_image

    def by_snapshot(self) -> dict[str, list[NodeLoad]]:
        """Snapshot id -> the nodes whose last report holds it (cluster.snapshots asks those
        first)."""
        if self._by_snapshot is None:
            idx: dict[str, list[NodeLoad]] = {}
            for n in self.nodes.values():
                for snap in n.snapshots:
                    idx.setdefault(snap, []).append(n)
            self._by_snapshot = idx
        return self._by_snapshot

    # ---- load reports ---------------------------------------------------------------------
    def _take(self, r: dict[str, Any], asked_at: float) -> None:
        n = self.nodes.get(r["node"])
        if n is None:
            n = self.nodes[r["node"]] = NodeLoad(node=r["node"], endpoint=r["endpoint"])
            self.nodes_changed()
        n.live, n.capacity, n.mem_free_mb = r["live"], r["capacity"], r["mem_free_mb"]
        n.labels = dict(r.get("labels") or {})
        n.cpu_busy = float(r.get("cpu_busy") or 0.0)
        images = frozenset(r.get("images") or ())
        if images != n.images:
            n.images = images
            self._by_image = None
        snaps = frozenset(r.get("snapshots") or ())
        if snaps != n.snapshots:
            n.snapshots = snaps
            self._by_snapshot = None
        created = r.get("created")
        now = time.monotonic()
        n.took_report(asked_at, now, int(created) if isinstance(created, int) else None)
        if isinstance(created, int):
            n.rates.add(now, created, n.live)

    async def report_of(self, supervisor: Any) -> dict[str, Any]:
        """One node's load report: a call to its supervisor actor. (The seam a simulated
        fleet replaces: corral.bench.fleetgw asks simulated node agents over HTTP.)"""
        got: dict[str, Any] = await asyncio.wrap_future(supervisor.report.remote().future())
        return got

    def node_gone(self, err: BaseException) -> bool:
        """Whether a failed report means the node is gone (its supervisor died)."""
        import ray

        return isinstance(err, ray.exceptions.RayActorError)

    async def _poll(self) -> None:
        while True:
            asked_at = time.monotonic()
            items = list(self.supervisors.items())
            got = await asyncio.gather(
                *(asyncio.wait_for(self.report_of(s), REPORT_TIMEOUT_S) for _, s in items),
                return_exceptions=True)
            for (node, _), r in zip(items, got, strict=True):
                if isinstance(r, dict):
                    self._take(r, asked_at)
                elif isinstance(r, BaseException) and self.node_gone(r):
                    # The supervisor is dead: so is its corrald (the keeper saw to it).
                    self.supervisors.pop(node, None)
                    self.nodes.pop(node, None)
                    self.nodes_changed()
                    self.lost[node] = "supervisor died"
                    log.warning("node lost", extra={"node": node})
                    self._seal(node)
                # else: slow or failing corrald: its report ages out of placement
            try:
                await self._autoscale()
            except Exception:  # noqa: BLE001 - the poller must outlive a failed step
                log.exception("autoscaling step failed")
            await asyncio.sleep(REPORT_INTERVAL_S)

    # ---- calls to the nodes ---------------------------------------------------------------
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None
        return self._session

    def node_headers(self, admin: bool = False) -> dict[str, str]:
        """The cluster token, and (unless ``admin``) the tenant the current request acts
        for."""
        out = {"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"}
        if not admin and (tenant := _TENANT.get()) is not None:
            out[ACT_AS_HEADER] = tenant
        return out

    def tenant(self) -> str | None:
        """The tenant the current request acts for (None: the admin)."""
        return _TENANT.get()

    async def destroy_on(self, n: NodeLoad, ids: list[str]) -> None:
        """Destroy ``ids`` on node ``n`` (one batch); the node's own answer is not needed."""
        async with self.session().post(n.endpoint + "/v1/sandboxes/batch/destroy",
                                       json={"ids": ids}, headers=self.node_headers()) as r:
            await r.read()

    # ---- HTTP -----------------------------------------------------------------------------
    @web.middleware
    async def _guarded(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """The listener's guard (corral.daemon.tcpguard) learns that a connection asked, and
        whose it is: the cluster's or a tenant's token marks it authenticated, a tenant's
        counts against its share of the connections."""
        self.guard.started(request.transport)
        if self._authorized(request):
            self.guard.authenticate(request.transport)
            tenant = _TENANT.get()
            if tenant is not None and not self.guard.claim(request.transport, tenant):
                resp = _error(QuotaExceeded(
                    f"this tenant holds {self.guard.per_tenant} connections to the gateway, "
                    "the most one tenant may: reuse them (a smaller connection pool)",
                    details={"resource": "connections", "max": self.guard.per_tenant}))
                resp.force_close()
                return resp
        return await handler(request)

    @web.middleware
    async def _body_memory(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Every body the gateway takes is read whole (creates, batches, forks, pulls): an
        authorized request's body of 64 KiB or more holds its size from one pool while it is
        handled, or is refused capacity_exceeded at once (corral.daemon.bodymem)."""
        if not request.body_exists or not self._authorized(request):
            return await handler(request)  # nothing to hold, or the handler's 401
        n = request.content_length
        try:
            check_not_encoded(request.headers)
            held = self.bodies.take(MAX_CREATE_BODY if n is None else min(n, MAX_CREATE_BODY))
        except (CapacityExceeded, InvalidRequest) as e:
            return _error(e)
        try:
            return await handler(request)
        finally:
            self.bodies.give(held)

    def _authorized(self, request: web.Request) -> bool:
        """The cluster token or a tenant's; sets the tenant the request acts for (a client's
        own X-Corral-Tenant is never forwarded)."""
        got = request.headers.get("Authorization", "")
        _TENANT.set(None)
        if hmac.compare_digest(got.encode(), f"Bearer {self.token}".encode()):
            return True
        scheme, _, tok = got.strip().partition(" ")
        if self.tenants is None or scheme.lower() != "bearer":
            return False
        tenant = self.tenants.tenant(tok.strip())
        _TENANT.set(tenant)
        return tenant is not None

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "role": "gateway", "nodes": len(self.nodes)})

    async def _status(self, request: web.Request) -> web.Response:
        """The whole cluster's status: the admin's. It names every node, its labels, load
        and images, and what other tenants made; the SDK never asks for it (a tenant learns
        its sandboxes' nodes from their placements and reads)."""
        if not self._authorized(request):
            return _error(Unauthorized("missing or wrong bearer token"))
        if self.tenant() is not None:
            return _error(Forbidden("the cluster's status is the admin's"))
        return web.json_response(await self.status())

    async def _list(self, request: web.Request) -> web.Response:
        """Every node's sandboxes, one merged page (cluster.reads)."""
        if not self._authorized(request):
            return _error(Unauthorized("missing or wrong bearer token"))
        try:
            return web.json_response(await reads.list_sandboxes(self, request))
        except CorralError as e:
            return _error(e)

    async def _pull_image(self, request: web.Request) -> web.StreamResponse:
        """An image pulled on every node, or those the node selector names (cluster.images)."""
        if not self._authorized(request):
            return _error(Unauthorized("missing or wrong bearer token"))
        try:
            selector = parse_selector(request.headers.get(SELECTOR_HEADER, ""))
            return await images.pull(self, request, selector)
        except CorralError as e:
            return _error(e)

    async def _sandbox(self, request: web.Request) -> web.Response:
        """A sandbox's info from the node that has it (cluster.reads): connect() by id."""
        if not self._authorized(request):
            return _error(Unauthorized("missing or wrong bearer token"))
        try:
            return web.json_response(
                await reads.get_sandbox(self, request.match_info["id"]))
        except CorralError as e:
            return _error(e)

    async def _trajectory(self, request: web.Request) -> web.Response:
        """Where a trajectory stands, from the node whose log has it (cluster.reads):
        from_trajectory() resumes on the sandbox's node."""
        if not self._authorized(request):
            return _error(Unauthorized("missing or wrong bearer token"))
        tid = request.match_info["tid"]
        try:
            try:
                return web.json_response(await reads.get_trajectory(self, tid))
            except NotFound:
                if (got := await self._lost_trajectory(tid)) is None:
                    raise
                return web.json_response(got)
        except CorralError as e:
            return _error(e)

    async def _lost_trajectory(self, tid: str) -> dict[str, Any] | None:
        """Trajectory ``tid`` of a lost node, from its log's copy here: its sandbox ``dead``,
        still naming the node (a call on it answers sandbox_lost); for ``corral log`` and
        ``corral replay`` of it."""
        logs = self.logs
        if logs is None:
            return None
        loop = asyncio.get_running_loop()
        gone = [n for n in await loop.run_in_executor(logs.pool, logs.nodes)
                if n not in self.nodes]
        got = await loop.run_in_executor(logs.pool, logs.trajectory, gone, tid)
        if got is None:
            return None
        node = got.pop("node")
        has, owner = await loop.run_in_executor(logs.pool, logs.owner_of, node,
                                                got["sandbox_id"])
        tenant = self.tenant()
        if not has or (tenant is not None and owner != tenant):
            return None
        # No endpoint: a handle made from it calls the gateway, which answers sandbox_lost.
        got["sandbox"] = dict(got["sandbox"], node=node, endpoint=None)
        return dict(got, copy=True)

    async def _snapshot(self, request: web.Request) -> web.Response:
        """A snapshot by id or name, from the node that holds it (cluster.reads)."""
        if not self._authorized(request):
            return _error(Unauthorized("missing or wrong bearer token"))
        try:
            return web.json_response(
                await reads.get_snapshot(self, request.match_info["key"]))
        except CorralError as e:
            return _error(e)

    async def _elsewhere(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return _error(Unauthorized("missing or wrong bearer token"))
        parts = request.path.split("/")
        if len(parts) > 3 and parts[1:3] == ["v1", "sandboxes"] and self.logs is not None:
            # A call on a lost node's sandbox (a handle from its trajectory's copy): lost.
            logs, sid = self.logs, parts[3]
            loop = asyncio.get_running_loop()
            node = await loop.run_in_executor(logs.pool, logs.find, sid)
            if node is not None and node not in self.nodes:
                has, owner = await loop.run_in_executor(logs.pool, logs.owner_of, node, sid)
                tenant = self.tenant()
                if has and (tenant is None or owner == tenant):
                    return _error(SandboxLost(
                        f"sandbox {sid} was on cluster node {node}, which is gone, and the "
                        "sandbox with it", details={"id": sid, "node": node}))
        return _error(NotFound(
            f"the cluster gateway places sandboxes and answers the reads and batches of "
            f"docs/cluster.md; send {request.method} {request.path} to the node named in the "
            f"sandbox's info (its 'endpoint')", details={"path": request.path}))

    async def _create(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return _error(Unauthorized("missing or wrong bearer token"))
        assert self._session is not None
        try:
            selector = parse_selector(request.headers.get(SELECTOR_HEADER, ""))
            # The SDK asks only where to go, and makes the sandbox there itself.
            ask = placing.parse_request(request.headers.get(placing.HEADER, ""))
        except InvalidRequest as e:
            return _error(e)
        only_place = ask.node_only
        body = await request.read()
        image = _image_of(body)
        pool = self.pool()
        by_image: dict[str, list[NodeLoad]] | None = self.by_image()
        snap_id, held = "", list[NodeLoad]()
        if snap := snapshots.snapshot_of(body):  # made where the snapshot's layers are
            try:
                snap_id, held = await snapshots.holders(self, snap)
            except CorralError as e:
                return _error(e)
            pool, by_image = held, None
            only_place = False  # made here: a full holder's snapshot may have to move first
        headers = self.node_headers()
        headers["Content-Type"] = request.headers.get("Content-Type", "application/json")
        keyed: tuple[str | None, str] | None = None
        first: NodeLoad | None = None
        if key := request.headers.get("Idempotency-Key"):
            headers["Idempotency-Key"] = key
            keyed = (self.tenant(), key)
            if (where := self._keyed.get(keyed)) is not None:
                first = self.nodes.get(where)
                if first is None:
                    return _error(SandboxLost(
                        f"the node that took the first create with this key ({where}) is "
                        f"gone", details={"node": where}))
        tried: set[str] = set(ask.exclude)
        # A node's quota_exceeded (the tenant's quota there): another node may still take
        # it, but when none does, that is the answer, and it is not demand for more nodes.
        over_quota: bytes | None = None
        while True:
            try:
                if first is not None and first.node in tried:
                    return _error(SandboxLost(
                        f"the node that took the first create with this key ({first.node}) "
                        f"does not answer", details={"node": first.node}))
                n = first or choose(pool, time.monotonic(), k=self.k, selector=selector,
                                    image=image, by_image=by_image, exclude=tried)
            except CapacityExceeded as e:
                if over_quota is not None:
                    return web.Response(body=over_quota, status=QuotaExceeded.status,
                                        content_type="application/json")
                if pool is not held or not held:
                    self.refused(e, 1)
                    return _error(e)
                # The holders are full: the snapshot moves to a node with room.
                try:
                    n = await self._copy_for(snap_id, held, selector, image)
                except CorralError as e2:
                    if isinstance(e2, CapacityExceeded):
                        self.refused(e2, 1)
                    return _error(e2)
                pool, body = [n], snapshots.with_snapshot(body, snap_id)
            tried.add(n.node)
            if keyed is not None:
                self._keyed[keyed] = n.node
                self._keyed.move_to_end(keyed)
                if len(self._keyed) > KEYED_CREATES:
                    self._keyed.popitem(last=False)
            if only_place and self._may_take(1):  # else: made here, as without the ask
                self._placed(n)
                ahead = self._place_ahead(ask, pool, selector, image, by_image) \
                    if ask.ahead and keyed is None else []
                return web.json_response(placing.answer(n.node, n.endpoint, ahead),
                                         status=placing.STATUS,
                                         headers={"Location": n.endpoint + "/v1/sandboxes"})
            n.inflight += 1
            try:
                async with self._session.post(n.endpoint + "/v1/sandboxes", data=body,
                                              params=request.query, headers=headers) as r:
                    status, raw = r.status, await r.read()
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError):
                n.reported_at = 0.0  # unreachable: out of placement until it reports again
                continue  # nothing was created there: place elsewhere
            except aiohttp.ClientError as e:
                n.finished.append(time.monotonic())  # it may exist
                return _error(DaemonRestarted(f"node {n.node} dropped the create; its "
                                              f"outcome is unknown: {e}",
                                              details={"node": n.node}))
            finally:
                n.inflight -= 1
            if status == CapacityExceeded.status and first is None:
                if _code_of(raw) == QuotaExceeded.code:
                    over_quota = raw
                continue  # full before its report said so: another node, or a refusal here
            if status >= 300:
                return web.Response(body=raw, status=status, content_type="application/json")
            n.finished.append(time.monotonic())
            self.placed += 1
            info = json.loads(raw)
            info["node"], info["endpoint"] = n.node, n.endpoint
            return web.json_response(info, status=status)

    def _placed(self, n: NodeLoad) -> None:
        """A create placed on ``n`` and made by the client: counted as placed there until a
        report of ``n``'s asked for later, as a create made through the gateway would be."""
        n.finished.append(time.monotonic())
        self.placed += 1

    def _may_take(self, n: int) -> bool:
        """Whether the current tenant may take ``n`` more placements now (counted if so):
        at most ``placement_limit`` a second, and a tenant (not the admin, who runs the
        cluster) within its share of the free room."""
        now = time.monotonic()
        q = self._taken.get(tenant := self.tenant())
        if q is None:
            q = self._taken[tenant] = collections.deque()
        for d in (q, self._taken_all):
            while d and now - d[0] > 1.0:
                d.popleft()
        if len(q) + n > self.placement_limit:
            return False
        if tenant is not None:
            share = self._free_room(now) // PLACEMENT_ROOM_SHARE
            if len(q) + n > share or len(self._taken_all) + n > 2 * share:
                return False
            self._taken_all.extend([now] * n)  # every tenant's
        q.extend([now] * n)
        return True

    def _free_room(self, now: float) -> int:
        """Free slots in the fresh nodes' last reports, counted at most once a report
        interval (a count over every node)."""
        at, room = self._room
        if now - at >= REPORT_INTERVAL_S:
            room = sum(max(0, x.capacity - x.live) for x in self.nodes.values()
                       if now - x.reported_at <= REPORT_MAX_AGE_S)
            self._room = (now, room)
        return room

    def _place_ahead(self, ask: placing.Ask, pool: list[NodeLoad], selector: dict[str, str],
                     image: str | None, by_image: dict[str, list[NodeLoad]] | None
                     ) -> list[dict[str, str]]:
        """Up to ``ask.ahead`` more placements like this create's, each placed as a create
        would be (fewer when the cluster runs out of room)."""
        out = []
        for _ in range(ask.ahead):
            if not self._may_take(1):
                break
            try:
                m = choose(pool, time.monotonic(), k=self.k, selector=selector, image=image,
                           by_image=by_image, exclude=ask.exclude)
            except CapacityExceeded:
                break
            self._placed(m)
            out.append(placing.where(m.node, m.endpoint))
        return out

    async def _copy_for(self, snap_id: str, held: list[NodeLoad], selector: dict[str, str],
                        image: str | None) -> NodeLoad:
        """A node with room among those that lack the snapshot, with the snapshot copied to
        it (a slot held there meanwhile). CapacityExceeded if none has room,
        SnapshotCopyFailed if the copy fails."""
        have = {h.node for h in held}
        n = choose([x for x in self.nodes.values() if x.node not in have], time.monotonic(),
                   k=self.k, selector=selector, image=image)
        n.inflight += 1
        try:
            await snapshots.copy_to(self, snap_id, held, n)
        finally:
            n.inflight -= 1
        return n

    async def _create_batch(self, request: web.Request) -> web.StreamResponse:
        """``count`` sandboxes placed item by item and made by their nodes' batches
        (corral.cluster.batch); answers ``{"sandboxes": [...]}`` in the order asked."""
        if not self._authorized(request):
            return _error(Unauthorized("missing or wrong bearer token"))
        try:
            selector = parse_selector(request.headers.get(SELECTOR_HEADER, ""))
            batches.wants_stream(request)
            partial = batch.wants_partial(request.query)
            spread = batch.wants_spread(request.query)
            req = batch.parse_body(CreateManyRequest, await request.read())
            req, shares = await self.place_batch(req, selector, spread)
            run = batch.CreateBatch(self, req, shares, partial)
            return await batches.run(request, batches.Progress(req.count), run.run,
                                     lambda items: {"sandboxes": items}, 201,
                                     cancel_when_gone=True, undo=lambda _: run.undo())
        except CorralError as e:
            return _error(e)

    async def place_batch(self, req: CreateManyRequest, selector: dict[str, str],
                          spread: bool, held: list[NodeLoad] | None = None
                          ) -> tuple[CreateManyRequest, list[batch.Share]]:
        """Where each of a batch's sandboxes goes (corral.cluster.batch.split); a batch from
        a snapshot (held by ``held``, else found) gets it on every node of a share first.
        The request comes back with the snapshot's id. Raises CapacityExceeded (counted as
        demand) or the copy's error; nothing is held then."""
        pool, rest = self.pool(), list[NodeLoad]()
        by_image: dict[str, list[NodeLoad]] | None = self.by_image()
        if req.spec.snapshot:
            snap_id = req.spec.snapshot
            if held is None:
                snap_id, held = await snapshots.holders(self, req.spec.snapshot)
            if not spread:  # made where the snapshot's layers are, first
                pool, by_image = held, None
                have = {h.node for h in held}
                rest = [n for n in self.nodes.values() if n.node not in have]
            req = req.model_copy(update={"spec": req.spec.model_copy(
                update={"snapshot": snap_id})})
        try:
            shares = batch.split(pool, req.count, self.k, selector, req.spec.image, rest,
                                 by_image, spread)
        except CapacityExceeded as e:
            self.refused(e, req.count)
            raise
        if req.spec.snapshot:  # the nodes that lack it get the snapshot first
            assert held is not None
            await batch.copy_for(self, req.spec.snapshot, held, shares)
        return req, shares

    async def _fork(self, request: web.Request) -> web.StreamResponse:
        """A fork whose children the gateway places (corral.cluster.forks)."""
        if not self._authorized(request):
            return _error(Unauthorized("missing or wrong bearer token"))
        try:
            return await forks.fork(self, request)
        except CorralError as e:
            return _error(e)

    async def _id_batch(self, request: web.Request) -> web.StreamResponse:
        """An exec or destroy batch of plain ids: sent to every node (cluster.broadcast)."""
        if not self._authorized(request):
            return _error(Unauthorized("missing or wrong bearer token"))
        run = (broadcast.exec_batch if request.path.endswith("/exec")
               else broadcast.destroy_batch)
        try:
            batches.wants_stream(request)
            return await run(self, request, await request.read())
        except CorralError as e:
            return _error(e)


def _normal_priority() -> None:
    """The thread that serves the gateway's HTTP endpoint (this actor's event loop; threads it
    starts inherit) at the default priority: Ray starts its workers niced (15), and a niced
    gateway waits behind the busy nodes for every create it forwards."""
    try:
        tid = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, tid) > 0:
            os.setpriority(os.PRIO_PROCESS, tid, 0)
    except OSError:
        pass  # not permitted: it stays as Ray made it


def _code_of(raw: bytes) -> str | None:
    """The error code of a node's error body, if it is one."""
    try:
        code = json.loads(raw)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return code if isinstance(code, str) else None


def _image_of(body: bytes) -> str | None:
    """The image a create body asks for (placement prefers a node that has it); the node
    validates the body."""
    try:
        image = json.loads(body).get("image")
    except (ValueError, AttributeError):
        return None
    return image if isinstance(image, str) else None
