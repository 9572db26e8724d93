"""``corral bench fleet``: the cluster gateway against a simulated fleet.

The real gateway (corral.bench.fleetgw: ``corral.cluster.gateway.Gateway``, its HTTP endpoint,
placement, batch splitting and report poller, in a process of its own) in front of ``--nodes``
simulated node agents (corral.bench.fleetnodes, one process) that cost what a real node costs:
a real corrald (the session's daemon) is measured once at the start, a single create's latency
and a batch create's per-sandbox throughput. Clients (this process) create through the gateway,
single creates first (placed by the gateway, made by the node, as the SDK does), then
``create_many`` batches, until the fleet holds ``--live`` sandboxes. Measured: creations per
second (single, batch), the gateway's CPU seconds per creation (its own process, from /proc),
its idle CPU (the report poller) per node, its memory per node, placement evenness (max/min
live over the nodes), create latency through the gateway; and from those a projection of where
one gateway stops scaling.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

import aiohttp

from corral import placing
from corral.bench import host
from corral.bench.session import Session
from corral.bench.stats import median
from corral.sdk import placed

SINGLE_CLIENTS = 64        # single creates in flight
# create_many sizes: the gateway sends each node its share of a batch as one request, so its
# cost per creation falls as the shares grow (a batch of 1,000 over 200 nodes: 5 per node).
SMALL_BATCH, BIG_BATCH = 1000, 10_000   # the API's largest
BATCHES_IN_FLIGHT = 4
IDLE_WINDOW_S = 2.0        # the gateway measured with no create: its report poller alone
LIFETIME_S = 60.0          # the projection's sandbox lifetime (live = rate x lifetime)
TTL_S = 6 * 3600.0
MEASURE_SINGLES = 10       # real node: sequential single creates
MEASURE_BATCH = 30         # real node: one create_many of this many


# ---- the real node's costs ------------------------------------------------------------------
def node_cost(endpoint: str) -> dict[str, Any]:
    """A real corrald's create latency (median of sequential single creates), its batch
    throughput (sandboxes/s of one create_many), and a SandboxInfo's JSON (what a node
    answers per sandbox: the simulated nodes answer the same bytes)."""
    from corral.sdk import Sandbox

    lat: list[float] = []
    info = ""
    for _ in range(MEASURE_SINGLES):
        t = time.perf_counter()
        sb = Sandbox.create("host", endpoint=endpoint, timeout=TTL_S)
        lat.append((time.perf_counter() - t) * 1000)
        info = sb.info().model_dump_json()
        sb.kill()
    t = time.perf_counter()
    boxes = Sandbox.create_many(MEASURE_BATCH, "host", endpoint=endpoint, timeout=TTL_S)
    wall = time.perf_counter() - t
    Sandbox.kill_many(boxes, return_exceptions=True, endpoint=endpoint)
    return {"create_ms": round(median(lat) or 0.0, 2),
            "batch_per_s": round(MEASURE_BATCH / wall, 1), "info_bytes": len(info),
            "info": info}


# ---- processes ------------------------------------------------------------------------------
class Child:
    """A helper process fed its config on stdin, which it serves until stdin closes."""

    def __init__(self, module: str, cfg: dict[str, Any]) -> None:
        self.p = subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, start_new_session=True)
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.write(json.dumps(cfg).encode() + b"\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            self.stop()
            raise RuntimeError(f"{module} exited before it was ready ({self.p.returncode})")
        self.hello: dict[str, Any] = json.loads(line)

    @property
    def pid(self) -> int:
        return self.p.pid

    def stop(self) -> None:
        if self.p.stdin is not None and not self.p.stdin.closed:
            self.p.stdin.close()
        try:
            self.p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


def cpu_s(pid: int) -> float:
    u, s = host.proc_cpu_s(pid)
    return u + s


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


# ---- clients --------------------------------------------------------------------------------
def _spec() -> bytes:
    from corral.models import SandboxSpec

    return SandboxSpec(image="host", timeout=TTL_S).model_dump_json(exclude_unset=True).encode()


def _many(n: int) -> bytes:
    from corral.models import CreateManyRequest, SandboxSpec

    return CreateManyRequest(count=n, spec=SandboxSpec(image="host", timeout=TTL_S)) \
        .model_dump_json(exclude_unset=True).encode()


async def singles(http: aiohttp.ClientSession, url: str, n: int) -> dict[str, Any]:
    lat: list[float] = []
    errors: list[str] = []
    todo = iter(range(n))
    body = _spec()

    ask = {placing.HEADER: placing.format_request(ahead=placed.AHEAD)}

    async def worker() -> None:
        # As the SDK does: the gateway places (and places ahead: the next creates use those
        # while they are fresh), the node makes the sandbox.
        spares: list[tuple[float, dict[str, str]]] = []
        for _ in todo:
            t = time.perf_counter()
            while spares and time.monotonic() - spares[0][0] > placed.SPARE_TTL_S:
                spares.pop(0)
            if spares:
                where = spares.pop(0)[1]
            else:
                async with http.post(url + "/v1/sandboxes", data=body, headers=ask,
                                     allow_redirects=False) as r:
                    raw = await r.read()
                got = json.loads(raw) if r.status == placing.STATUS else {}
                if "placed" not in got:
                    errors.append(f"{r.status}: {raw[:200]!r}")
                    continue
                where = got["placed"]
                spares += [(time.monotonic(), a) for a in got.get("ahead") or ()]
            async with http.post(where["endpoint"] + "/v1/sandboxes", data=body) as r:
                raw = await r.read()
            if r.status != 201:
                errors.append(f"{r.status}: {raw[:200]!r}")
            else:
                lat.append((time.perf_counter() - t) * 1000)
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(SINGLE_CLIENTS, n))))
    return {"wall_s": time.perf_counter() - t0, "lat_ms": lat, "errors": errors}


async def batches(http: aiohttp.ClientSession, url: str, n: int, size: int) -> dict[str, Any]:
    lat: list[float] = []
    errors: list[str] = []
    sizes = [min(size, n - i) for i in range(0, n, size)]
    todo = iter(sizes)
    made = 0

    async def worker() -> None:
        nonlocal made
        for b in todo:
            t = time.perf_counter()
            async with http.post(url + "/v1/sandboxes/batch", data=_many(b),
                                 params={"stream": "ndjson"}) as r:
                raw = await r.read()
            last = json.loads(raw.strip().rsplit(b"\n", 1)[-1] or b"{}")
            got = last.get("sandboxes") if r.status == 201 else None
            if not isinstance(got, list) or len(got) != b or "error" in got[0]:
                errors.append(f"{r.status}: {raw[-200:]!r}")
            else:
                made += b
                lat.append((time.perf_counter() - t) * 1000)
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(BATCHES_IN_FLIGHT, len(sizes)))))
    return {"wall_s": time.perf_counter() - t0, "lat_ms": lat, "errors": errors, "made": made}


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(q * len(s)))], 2)


# ---- the run --------------------------------------------------------------------------------
async def drive(gw: Child, sim: Child, nodes: int, live: int, singles_n: int,
                token: str) -> dict[str, Any]:
    url = gw.hello["url"]
    hdr = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    out: dict[str, Any] = {}
    async with aiohttp.ClientSession(
            headers=hdr, connector=aiohttp.TCPConnector(limit=SINGLE_CLIENTS + BATCHES_IN_FLIGHT),
            timeout=aiohttp.ClientTimeout(total=None, sock_read=120)) as http:
        # The poller alone: the gateway's CPU with no create, per node.
        c0, t0 = cpu_s(gw.pid), time.monotonic()
        await asyncio.sleep(IDLE_WINDOW_S)
        idle = (cpu_s(gw.pid) - c0) / (time.monotonic() - t0)
        out["idle"] = {"gateway_cpu_s_per_s": round(idle, 4),
                       "poll_cpu_ms_per_node_per_s": round(idle * 1000 / nodes, 4),
                       "rss_kib": host.rss_kib(gw.pid),
                       "rss_kib_per_node": round(((host.rss_kib(gw.pid) or 0)
                                                  - gw.hello["rss_kib_before_nodes"]) / nodes,
                                                 2)}
        small_n = min((live - singles_n) // 5, 10 * SMALL_BATCH * BATCHES_IN_FLIGHT)
        for name, size, n in (("single", 1, singles_n), ("batch_small", SMALL_BATCH, small_n),
                              ("batch", BIG_BATCH, live - singles_n - small_n)):
            c0, s0, m0 = cpu_s(gw.pid), cpu_s(sim.pid), sum(host.self_cpu_s())
            r = await (singles(http, url, n) if size == 1 else batches(http, url, n, size))
            cpu = cpu_s(gw.pid) - c0
            made = n - len(r["errors"]) if name == "single" else r["made"]
            wall = r["wall_s"]
            net = max(0.0, cpu - idle * wall)  # less what the poller took meanwhile
            out[name] = {"n": n, "made": made, "errors": len(r["errors"]),
                         "first_error": r["errors"][0] if r["errors"] else None,
                         "wall_s": round(wall, 3),
                         "creates_per_s": round(made / wall, 1) if wall > 0 else None,
                         "gateway_cpu_s": round(cpu, 3),
                         "gateway_cpu_ms_per_create": round(cpu * 1000 / max(1, made), 4),
                         "gateway_cpu_ms_per_create_less_poll":
                             round(net * 1000 / max(1, made), 4),
                         "gateway_cores_busy": round(cpu / wall, 3) if wall > 0 else None,
                         # the other parties: is the gateway the one that limits?
                         "nodes_cores_busy": round((cpu_s(sim.pid) - s0) / wall, 3),
                         "clients_cores_busy": round((sum(host.self_cpu_s()) - m0) / wall, 3),
                         "latency_ms": {"p50": _pct(r["lat_ms"], 0.5),
                                        "p99": _pct(r["lat_ms"], 0.99),
                                        "max": _pct(r["lat_ms"], 1.0)}}
            if name != "single":
                out[name]["batch"] = size
                out[name]["in_flight"] = BATCHES_IN_FLIGHT
            else:
                out[name]["clients"] = SINGLE_CLIENTS
        # After the last create has had a report: what the gateway sees per node.
        deadline = time.monotonic() + 10
        while True:
            async with http.get(url + "/v1/cluster") as resp:
                st = await resp.json()
            lives = [n["live"] for n in st["nodes"]]
            if sum(lives) >= sum(out[k]["made"] for k in ("single", "batch_small", "batch")) \
                    or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        out["placement"] = {"nodes": len(lives), "live_total": sum(lives),
                            "live_max": max(lives), "live_min": min(lives),
                            "max/min": round(max(lives) / min(lives), 3) if min(lives) else None}
        out["rss_kib_end"] = host.rss_kib(gw.pid)
    return out


def projection(res: dict[str, Any], cost: dict[str, Any], nodes: int,
               live: int) -> dict[str, Any]:
    """Where one gateway (one core: it is one asyncio loop) stops scaling, from the measured
    costs: creations/s per core for each way of creating; the nodes whose report polling alone
    fills the core; for each way, the nodes at which the creations of every node (each at a
    real node's measured throughput) plus their polling fill it; the live sandboxes one core
    keeps up with when sandboxes live ``LIFETIME_S``; the memory per node."""
    p = res["idle"]["poll_cpu_ms_per_node_per_s"] / 1000
    rate = cost["batch_per_s"]
    per_core: dict[str, int | None] = {}
    bound: dict[str, int | None] = {}
    sustained: dict[str, int | None] = {}
    for name in ("single", "batch_small", "batch"):
        c = res[name]["gateway_cpu_ms_per_create_less_poll"] / 1000
        key = "single" if name == "single" else f"batch_{res[name]['batch']}"
        per_core[key] = round(1 / c) if c > 0 else None
        bound[key] = round(1 / (rate * c + p)) if c > 0 or p > 0 else None
        sustained[key] = round(LIFETIME_S / c) if c > 0 else None
    big = f"batch_{res['batch']['batch']}"
    c_big = res["batch"]["gateway_cpu_ms_per_create_less_poll"] / 1000
    kib = res["idle"]["rss_kib_per_node"]
    n_big = bound[big]
    return {"creates_per_s_per_core": per_core,
            "node_creates_per_s": rate,
            "nodes_whose_polling_fills_a_core": round(1 / p) if p > 0 else None,
            "nodes_at_gateway_bound": bound,
            "bound_by": ("cpu: creations" if rate * c_big > p else "cpu: report polling"),
            "live_per_node_in_run": round(live / nodes),
            f"live_sustained_at_{int(LIFETIME_S)}s_lifetime": sustained,
            "memory_mib_per_1000_nodes": round(kib * 1000 / 1024, 1),
            "memory_mib_at_bound": round(kib * n_big / 1024, 1) if n_big else None}


def run_fleet(nodes: int, live: int, cost: dict[str, Any], k: int = 2) -> dict[str, Any]:
    token = os.urandom(16).hex()
    capacity = 2 * -(-live // nodes) + 10  # room: placement, not capacity, spreads them
    singles_n = max(1, min(live // 10, 5000))
    sim = Child("corral.bench.fleetnodes", {
        "nodes": nodes, "capacity": capacity, "latency_ms": cost["create_ms"],
        "rate": cost["batch_per_s"], "info": _templated(cost["info"]), "token": token})
    gw: Child | None = None
    ports = [int(e.rsplit(":", 1)[1]) for e in sim.hello["endpoints"]]
    try:
        gw = Child("corral.bench.fleetgw", {"endpoints": sim.hello["endpoints"],
                                            "token": token, "k": k})
        ports.append(int(gw.hello["url"].rsplit(":", 1)[1]))
        res = asyncio.run(drive(gw, sim, nodes, live, singles_n, token))
    finally:
        pids = [c.pid for c in (gw, sim) if c is not None]
        for c in (gw, sim):
            if c is not None:
                c.stop()
    res["capacity_per_node"] = capacity
    res["pids"], res["ports"] = pids, ports
    res["left"] = {"processes": sum(os.path.exists(f"/proc/{p}") for p in pids),
                   "listening_ports": sum(listening(p) for p in ports)}
    return res


def _templated(info: str) -> str:
    d = json.loads(info)
    d["id"] = "@ID@"
    return json.dumps(d)


def fleet(s: Session) -> tuple[dict[str, Any], dict[str, Any]]:
    o = s.opts
    with s.ui.task("fleet: a real node's create cost", None):
        cost = node_cost(s.daemon.endpoint)
    if o.fleet_node_ms is not None:
        cost["create_ms"] = o.fleet_node_ms
    if o.fleet_node_rate is not None:
        cost["batch_per_s"] = o.fleet_node_rate
    with s.ui.task(f"fleet: {o.fleet_nodes} nodes to {o.fleet_live} live", None):
        res = run_fleet(o.fleet_nodes, o.fleet_live, cost)
    sec: dict[str, Any] = {"nodes": o.fleet_nodes, "live": o.fleet_live,
                           "node_cost": {k: v for k, v in cost.items() if k != "info"},
                           **res, "projection": projection(res, cost, o.fleet_nodes,
                                                           o.fleet_live)}
    return sec, {}
