"""The ``network`` scenario: what corral's network costs against a plain namespace doing the
same routing, in one run, with nothing leaving the machine.

A private daemon whose uplink, DNS upstream, nftables table and interface prefix are the
bench's own (corral.bench.netlab: a namespace behind a veth pair with a DNS server, a TCP sink
and a TCP echo on 198.19.X.0/24). Three systems run the same client program (python3 from the
host image, ``CLIENT`` below): ``plain``, a namespace with a veth pair routed and NATed like a
sandbox's and no other rule; ``corral-internet``
(``network="internet"``); ``corral-allowlist`` (``Network(allow=["sink.bench:8082,8083"])``:
the name resolved through the daemon's DNS proxy, which pins its address). The measured
sandboxes get every CPU (``cpu`` = the host's count) and the plain client the same CFS quota.

Per run: bulk TCP transfers to the sink (MB/s) and connect + a 64-byte request/response to
the echo (us), the systems taking turns; create p50 of network none (the daemon's warm pools
on), none cold (never pooled: an explicit hostname), internet and the allowlist, round robin;
churn (create -> exec -> destroy, ``--concurrency`` in flight) with none, internet and the
allowlist, each against the raw baseline doing its kernel work: raw +netns for none, raw
``--veth`` (the same plus a veth pair routed as corral's and the sandbox's nftables elements
in a table written with corral's ruleset) for internet and the allowlist, corral's cycles
in two halves around its baseline's (``_churn``). Once per
scenario, the scale curve: the same transfer, connect latency and refused-connect latency
with 0, 100, 1,000, 3,000, 10,000 ... up to ``--scale-to`` (default ``--count``) live
networked sandboxes, half of them ``internet``, half with an allowlist of their own (a CIDR
and port no other sandbox has), so the table holds their elements while the measured
sandboxes' packets are looked up; at each point what the host spent on the live ones
(memory, slab, per-CPU memory, links, conntrack entries).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import random
import shutil
import time
from typing import Any

from corral.bench import host, netlab, sdk_runs
from corral.bench.daemon import PrivateDaemon
from corral.bench.interleave import stop_and_check
from corral.bench.netlab import ECHO_PORT, SINK_NAME, SINK_PORT, PlainNetns, Uplink
from corral.bench.raw import Veth
from corral.bench.results import OpResult
from corral.bench.session import Session
from corral.bench.stats import median, median_tree, ratio, summary
from corral.daemon.network.firewall import Firewall
from corral.daemon.network.links import enable_ipv4_forwarding
from corral.daemon.network.settings import NetSettings, ipv6_available
from corral.errors import CorralError
from corral.models import Network
from corral.sdk import AsyncSandbox, Sandbox

SYSTEMS = ("plain", "corral-internet", "corral-allowlist")
# A refused connect, per system: plain's reaches the uplink's closed port (its RST);
# internet's goes to the metadata address (always denied: reset by the daemon's rules);
# the allowlist's to its allowed name on a port it does not allow (reset by its rules, after
# the lookups of its pins and its shard's interval sets).
DENY_PORT = 8089
METADATA = "169.254.169.254"
FILLER_HOST = "fill"  # the scale curve's fillers: an explicit hostname is never pooled
SCALE_STEPS = (100, 1000, 3000, 10000, 30000, 100000)
TARGETS = {"churn": 0.8, "bulk": 0.8, "added_us": 100.0, "create_allowlist/none": 1.5,
           "scale_growth_us": 20.0}
# Each corral churn row -> the raw baseline doing its kernel work (raw.c --veth for the
# networked ones: netns + veth pair + the same nft elements in a table with corral's rules).
MATCHING = {"corral": "raw-netns", "corral-internet": "raw-veth-internet",
            "corral-allowlist": "raw-veth-allowlist"}
CPUS = os.cpu_count() or 1
# Transfers per system, and blocks its connects are timed in, the systems taking turns block
# by block: small blocks, so the machine's swings over seconds fall on every system alike.
ROUNDS = 10
WARMUP = 20  # connects before the timed ones (ARP, conntrack, the interpreter's caches)

# The client, the same program in every system: "bulk HOST PORT MB" sends MB MiB to the sink
# and prints the seconds to its answer (the byte count, after EOF); "rr HOST PORT N W" times N
# connects (after W untimed), each with a 64-byte request and its echo, in microseconds;
# "deny HOST PORT N W" times N connects that must be refused (ECONNREFUSED).
CLIENT = r"""
import json, socket, sys, time
mode, host, port, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
addr = socket.gethostbyname(host)
if mode == "bulk":
    buf = bytes(1 << 20)
    s = socket.create_connection((addr, port), timeout=60)
    t0 = time.perf_counter()
    for _ in range(n):
        s.sendall(buf)
    s.shutdown(socket.SHUT_WR)
    got = b""
    while chunk := s.recv(64):
        got += chunk
    dt = time.perf_counter() - t0
    s.close()
    print(json.dumps({"bytes": int(got), "s": dt}))
elif mode == "deny":
    out = []
    for i in range(n + int(sys.argv[5])):
        s = socket.socket()
        s.settimeout(10)
        t0 = time.perf_counter_ns()
        try:
            s.connect((addr, port))
            raise SystemExit(f"{addr}:{port} was not refused")
        except ConnectionRefusedError:
            dt = time.perf_counter_ns() - t0
        finally:
            s.close()
        if i >= int(sys.argv[5]):
            out.append(dt / 1000)
    print(json.dumps({"us": out}))
else:
    msg, out = b"x" * 64, []
    for i in range(n + int(sys.argv[5])):
        t0 = time.perf_counter_ns()
        s = socket.create_connection((addr, port), timeout=10)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(msg)
        got = 0
        while got < len(msg):
            k = len(s.recv(4096))
            if not k:
                raise SystemExit("echo closed early")
            got += k
        dt = time.perf_counter_ns() - t0
        s.close()
        if i >= int(sys.argv[5]):
            out.append(dt / 1000)
    print(json.dumps({"us": out}))
"""


def _allowlist() -> Network:
    return Network(allow=[f"{SINK_NAME}:{SINK_PORT},{ECHO_PORT}"])


def _filler_spec(i: int) -> Any:
    """Filler i: even ones ``internet``, odd ones an allowlist no other sandbox has (a
    TEST-NET-2 address and a port: elements in the daemon's interval sets)."""
    if i % 2 == 0:
        return "internet"
    k = i // 2
    return Network(allow=[f"198.51.100.{k % 256}/32:{1024 + k // 256}", f"f{k}.fill.bench:443"])


class Net:
    """The scenario's world: the uplink, the plain namespace and the private daemon."""

    def __init__(self, s: Session, max_live: int) -> None:
        self.s = s
        self.uplink = Uplink.start()
        tag = self.uplink.tag
        self.ifprefix, self.table = f"b{tag[:4]}", f"cbench_d{tag}"
        self.plain: PlainNetns | None = None
        self.daemon: PrivateDaemon | None = None
        self.raw_fw: Firewall | None = None
        # raw --veth's own table (corral's ruleset), interface prefix and range
        self.raw_prefix, self.raw_table = f"r{tag[:4]}", f"cbench_r{tag}"
        y_daemon, y_raw = _free16(), _free16()
        while y_raw == y_daemon:
            y_raw = _free16()
        self.raw_net = f"10.{y_raw}.0.0"
        # Each its own IPv6 range: raw sets its sandboxes up dual-stack where the daemon does
        self.raw_net6 = f"fd5b:{tag[:4]}:{y_raw:x}::" if ipv6_available() else None
        try:
            self.plain = PlainNetns.start(self.uplink, f"{s.prefix}netplain", CPUS)
            env = {"CORRAL_UPLINK": self.uplink.ifname, "CORRAL_DNS_UPSTREAM": self.uplink.dns,
                   "CORRAL_NET_RANGE": f"10.{y_daemon}.0.0/16",
                   # its own IPv6 range too: another corrald on the host may hold the default
                   "CORRAL_NET_RANGE6": f"fd5b:{tag[:4]}:{y_daemon:x}::/112",
                   "CORRAL_NET_TABLE": self.table, "CORRAL_NET_IFPREFIX": self.ifprefix,
                   "CORRAL_NETWORK_CONFIG": str(s.root / "network-absent.json")}
            # Cgroup name under the session's prefix: its leak check and sweep cover it.
            self.daemon = PrivateDaemon(s.root / "network", f"{s.prefix}net",
                                        max_sandboxes=max_live + 1000, env=env)
            self.daemon.start()
            self.raw_fw = Firewall(NetSettings(
                uplink=self.uplink.ifname, range4=ipaddress.IPv4Network(f"{self.raw_net}/16"),
                range6=ipaddress.IPv6Network(f"{self.raw_net6}/112") if self.raw_net6 else None,
                table=self.raw_table, ifprefix=self.raw_prefix))
            self.raw_fw.install()
        except BaseException:
            self.close()
            raise

    @property
    def ep(self) -> str:
        assert self.daemon is not None
        return self.daemon.endpoint

    def client(self, system: str, sb: Sandbox | None, mode: str, n: int) -> dict[str, Any]:
        """Run the client once in ``system`` (``sb``: the sandbox for corral's)."""
        extra = [str(WARMUP)] if mode != "bulk" else []
        port = {"bulk": SINK_PORT, "rr": ECHO_PORT, "deny": DENY_PORT}[mode]
        host = SINK_NAME
        if mode == "deny" and system == "corral-internet":
            host, port = METADATA, 80
        if sb is None:
            assert self.plain is not None
            r = self.plain.run([netlab.PYTHON, "-c", CLIENT, mode, self.uplink.sink, str(port),
                                str(n), *extra], timeout=300)
            code, out, err = r.returncode, r.stdout, r.stderr
        else:
            x = sb.exec(["python3", "-c", CLIENT, mode, host, str(port), str(n), *extra],
                        timeout=300)
            code, out, err = x.exit_code, x.stdout, x.stderr
        if code != 0:
            raise RuntimeError(f"{system} {mode} client exited {code}: {err[-1000:]}")
        return dict(json.loads(out))

    def close(self) -> dict[str, Any]:
        leaks: dict[str, Any] = {}
        if self.daemon is not None:  # a graceful stop: its table and links go with it
            leaks.update(stop_and_check({"network": self.daemon})["leaks"])
            self.daemon = None
        if self.raw_fw is not None:
            self.raw_fw.remove()
            self.raw_fw = None
        # raw's links go with its sandboxes' namespaces, which the kernel frees in the
        # background: wait (with a deadline) for them to be gone
        deadline = time.monotonic() + 15
        while netlab.leftovers(self.uplink.tag, [self.raw_prefix], []).get("links") \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.plain is not None:
            self.plain.stop()
            self.plain = None
        self.uplink.stop()
        leaks.update(netlab.leftovers(self.uplink.tag, [self.ifprefix, self.raw_prefix],
                                      [self.table, self.raw_table]))
        return {"clean": not leaks, "leaks": leaks}

    def names(self) -> dict[str, Any]:
        """What the scenario made on the host, by name (for a cleanup check from outside)."""
        t = self.uplink.tag
        return {"netns": [f"cbench-{t}", f"cbplain-{t}"], "links": [f"cbu{t}", f"cbp{t}"],
                "link_prefixes": [self.ifprefix, self.raw_prefix],
                "nft_tables": [self.table, self.raw_table, f"cbench_{t}"]}

    def veth(self, internet: bool) -> Veth:
        return Veth(self.raw_prefix, self.raw_table, self.raw_net, internet, self.raw_net6)


def _free16() -> int:
    """A second octet Y of 10.Y.0.0/16 that no host route uses yet (the daemon's range)."""
    routes = netlab._sh("ip", "-4", "route", "show", "table", "all").stdout
    for _ in range(100):
        y = random.randint(220, 250)
        if f"10.{y}." not in routes:
            return y
    raise RuntimeError("no free 10.Y.0.0/16 for the bench daemon's sandboxes")


# ---- the data path: bulk transfer and connect latency ---------------------------------------
def _path(net: Net, boxes: dict[str, Sandbox | None], mb: int, n_rr: int, rounds: int,
          adv: sdk_runs.Advance) -> dict[str, dict[str, Any]]:
    """``rounds`` transfers of ``mb`` MiB, ``n_rr`` connects and ``n_rr`` refused connects (in
    ``rounds`` blocks each) per system, the systems taking turns in a rotating order. Against
    ``plain``, paired round by round (what the machine's load did in that round falls on
    both): ``added_us``, the median over rounds of (this system's p50 in the round -
    plain's), and ``bulk_vs_plain``, the median of the rounds' MB/s ratios."""
    mbs: dict[str, list[float]] = {k: [] for k in boxes}
    us: dict[str, list[float]] = {k: [] for k in boxes}
    blk: dict[str, list[float]] = {k: [] for k in boxes}
    deny: dict[str, list[float]] = {k: [] for k in boxes}
    names = list(boxes)
    block = max(1, n_rr // rounds)
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for k in order:
            sent = net.client(k, boxes[k], "bulk", mb)
            if sent["bytes"] != mb << 20:
                raise RuntimeError(f"{k}: the sink got {sent['bytes']} bytes of {mb << 20}")
            mbs[k].append(mb * 1.048576 / sent["s"])  # MB (10^6 bytes) per second
            adv(1)
        for k in order:
            got = net.client(k, boxes[k], "rr", block)["us"]
            us[k] += got
            blk[k].append(median(got) or 0.0)
            adv(1)
        for k in order:
            deny[k] += net.client(k, boxes[k], "deny", block)["us"]
            adv(1)
    out: dict[str, dict[str, Any]] = {
        k: {"bulk_mb_s": round(median(mbs[k]) or 0, 1),
            "bulk_mb_s_all": [round(x, 1) for x in mbs[k]],
            "connect_rr_us": summary(us[k]), "deny_us": summary(deny[k])} for k in boxes}
    for k in boxes:
        if k != "plain":
            out[k]["added_us"] = round(median(
                [a - b for a, b in zip(blk[k], blk["plain"], strict=True)]) or 0.0, 1)
            out[k]["bulk_vs_plain"] = median(
                [ratio(a, b) for a, b in zip(mbs[k], mbs["plain"], strict=True)])
    return out


def _measured(ep: str) -> dict[str, Sandbox | None]:
    """The measured sandboxes get every CPU (``cpu`` = the host's count: a cpuset of all of
    them), as the plain client has: the comparison is of the network path, not of pinning a
    one-core sandbox to one busy CPU."""
    cpu = float(CPUS)
    return {"plain": None,
            "corral-internet": Sandbox("host", endpoint=ep, network="internet", cpu=cpu),
            "corral-allowlist": Sandbox("host", endpoint=ep, network=_allowlist(), cpu=cpu)}


def _kill(boxes: dict[str, Sandbox | None]) -> None:
    for sb in boxes.values():
        if sb is not None:
            try:
                sb.kill()
            except CorralError:
                pass


# ---- create p50 and churn -------------------------------------------------------------------
CREATE_MODES: dict[str, dict[str, Any]] = {
    "none": {"network": "none"},
    "none-cold": {"network": "none", "hostname": "bench-cold"},  # never from a warm pool
    "internet": {"network": "internet"},
    "allowlist": {"network": None},  # _allowlist(), made per call
}


def _creates(ep: str, n: int, adv: sdk_runs.Advance) -> dict[str, list[float]]:
    """``n`` creates per mode, round robin, each sandbox killed before the next create. The
    order rotates round by round: a kill starts its pool's refill at once, which the next
    create runs beside, so each mode follows each other mode as often."""
    ts: dict[str, list[float]] = {k: [] for k in CREATE_MODES}
    names = list(CREATE_MODES)
    for r in range(n):
        for k in names[r % len(names):] + names[:r % len(names)]:
            kw = dict(CREATE_MODES[k])
            if kw["network"] is None:
                kw["network"] = _allowlist()
            t0 = time.perf_counter()
            sb = Sandbox("host", endpoint=ep, **kw)
            ts[k].append((time.perf_counter() - t0) * 1e3)
            sb.kill()
            adv(1)
    return ts


def _churn(s: Session, net: Net, n: int, conc: int, tag: str) -> dict[str, OpResult]:
    """Each corral mode against its raw baseline, corral's cycles in two halves around the
    raw run (C R C): a drift of the machine's speed over the pair falls on both alike. Raw
    runs whole, in one process, as it would alone (its cgroup spares are per process, so
    splitting it would add their making and removal to every part). A corral half ends when
    its daemon is idle again (its pools refilled): the work it leaves behind counts in it,
    not in the raw run after it."""
    assert s.raw is not None
    raw, daemon = s.raw, net.daemon
    assert daemon is not None and daemon.pid is not None
    res: dict[str, OpResult] = {}
    pairs: tuple[tuple[str, Any, str, bool | None], ...] = (
        ("corral", "none", "raw-netns", None),
        ("corral-internet", "internet", "raw-veth-internet", True),
        ("corral-allowlist", _allowlist(), "raw-veth-allowlist", False))
    for name, spec, raw_name, internet in pairs:
        veth = net.veth(internet) if internet is not None else None
        halves: list[OpResult] = []
        with s.ui.task(f"{tag} churn {name} around {raw_name}", 2 * n) as adv:
            for m in (n // 2, n - n // 2):
                t0 = time.perf_counter()
                r = sdk_runs.churn(net.ep, m, conc, adv, spec)
                _wait_idle(daemon.pid)
                r.wall_s = time.perf_counter() - t0
                halves.append(r)
                if len(halves) == 1:
                    res[raw_name] = raw.churn(n, conc, netns=True, system=raw_name, veth=veth)
                    adv(n)
        res[name] = _merged(halves)
    return res


IDLE_WINDOW_S = 0.01  # a daemon is idle after two such windows with under 10 % of a core


def _wait_idle(pid: int, limit_s: float = 5.0) -> None:
    """Until the process's CPU use falls quiet (its background work after a block done)."""
    deadline = time.monotonic() + limit_s
    quiet, last = 0, sum(host.proc_cpu_s(pid))
    while quiet < 2 and time.monotonic() < deadline:
        time.sleep(IDLE_WINDOW_S)
        now = sum(host.proc_cpu_s(pid))
        quiet = quiet + 1 if now - last < IDLE_WINDOW_S / 10 else 0
        last = now


def _merged(parts: list[OpResult]) -> OpResult:
    """One system's blocks as one result: their ops over their summed wall time."""
    phases: dict[str, list[float]] = {}
    for p in parts:
        for k, v in p.phases.items():
            phases.setdefault(k, []).extend(v)
    first = parts[0]
    return OpResult(first.system, sum(p.n for p in parts), sum(p.wall_s for p in parts),
                    sum(p.errors for p in parts), phases,
                    {**first.extra, "blocks": len(parts)})


# ---- scale: the data path with N live networked sandboxes -----------------------------------
async def _fill(ep: str, start: int, stop: int, conc: int, ids: list[str],
                adv: sdk_runs.Advance, deadline: float | None = None) -> list[str]:
    """Fillers ``start`` .. ``stop``: the ``internet`` ones in batches of up to 50 (one spec),
    the allowlists one create each (a spec each), ``conc`` calls in flight. Never from a warm
    pool (an explicit hostname): a pooled sandbox gets its memory cgroup ahead of its first
    exec, which an idle filler never runs, and on this host each memory cgroup costs ~7 MB
    of kernel memory (docs/benchmarks.md, "This host's kernel")."""
    errors: list[str] = []
    net = [i for i in range(start, stop) if _filler_spec(i) == "internet"]
    jobs: list[list[int]] = [net[k:k + 50] for k in range(0, len(net), 50)]
    jobs += [[i] for i in range(start, stop) if _filler_spec(i) != "internet"]
    todo = iter(jobs)

    async def worker() -> None:
        for job in todo:
            if deadline is not None and time.monotonic() > deadline:
                return  # out of the fill's time budget: the curve ends at what is live
            try:
                if len(job) > 1:
                    boxes = await AsyncSandbox.create_many(
                        len(job), "host", endpoint=ep, timeout=sdk_runs.TTL_S,
                        network="internet", hostname=FILLER_HOST)
                    ids.extend(b.id for b in boxes)
                else:
                    sb = await AsyncSandbox.create("host", endpoint=ep, timeout=sdk_runs.TTL_S,
                                                   network=_filler_spec(job[0]),
                                                   hostname=FILLER_HOST)
                    ids.append(sb.id)
            except CorralError as e:
                errors.append(f"{type(e).__name__}: {e}"[:300])
            adv(len(job))

    await asyncio.gather(*(worker() for _ in range(conc)))
    return errors


def _points(top: int) -> list[int]:
    """0, the steps of SCALE_STEPS below ``top``, and ``top`` (and ``top``/3 when that makes
    fewer than three points)."""
    pts = {0, top, *(p for p in SCALE_STEPS if p < top)}
    if len(pts) < 3:
        pts.add(top // 3)
    return sorted(pts)


def _host_cost() -> dict[str, Any]:
    """What the host holds at a point of the curve: memory (/proc/meminfo, KiB), network
    interfaces, conntrack entries, network namespaces."""
    from corral.bench import host

    host.settle(1.0)
    mem = host.meminfo()
    out: dict[str, Any] = {k: mem.get(k) for k in
                           ("MemAvailable", "Slab", "SUnreclaim", "Percpu", "KernelStack")}
    out["links"] = len(os.listdir("/sys/class/net"))
    try:
        with open("/proc/sys/net/netfilter/nf_conntrack_count") as f:
            out["conntrack"] = int(f.read())
    except (OSError, ValueError):
        out["conntrack"] = None
    try:
        out["netns"] = len(set(_netns_inodes()))
    except OSError:
        out["netns"] = None
    return out


def _netns_inodes() -> list[int]:
    """The network namespaces of the host's processes (by inode)."""
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                out.append(os.stat(f"/proc/{pid}/ns/net").st_ino)
            except OSError:
                pass
    return out


def _per_sandbox(first: dict[str, Any], last: dict[str, Any], n: int) -> dict[str, Any]:
    """The host's cost per live networked sandbox between two points (KiB, links)."""
    if n <= 0:
        return {}
    out: dict[str, Any] = {}
    for k in ("Slab", "SUnreclaim", "Percpu", "KernelStack"):
        if first.get(k) is not None and last.get(k) is not None:
            out[f"{k}_kib"] = round((last[k] - first[k]) / n, 1)
    if first.get("MemAvailable") is not None and last.get("MemAvailable") is not None:
        out["memory_kib"] = round((first["MemAvailable"] - last["MemAvailable"]) / n, 1)
    out["links"] = round((last["links"] - first["links"]) / n, 2)
    return out


def _scale(s: Session, net: Net, top: int, mb: int, n_rr: int) -> dict[str, Any]:
    """The curve: the data path measured at each point of ``_points(top)`` live fillers.
    A fill that fails (the host out of something) is measured at what it reached and ends
    the curve; so does one past the scenario's fill budget (``--scale-budget``, seconds of
    filling in all): what was reached, and why, is in ``stopped``."""
    ids: list[str] = []
    curve: list[dict[str, Any]] = []
    stopped: str | None = None
    budget = s.opts.scale_budget_s
    deadline = time.monotonic() + budget if budget else None
    try:
        for pt in _points(top):
            if deadline is not None and time.monotonic() > deadline and curve:
                stopped = (f"fill budget ({budget:.0f} s of filling) spent at {len(ids):,} "
                           f"live, before filling to {pt:,}")
                break
            with s.ui.task(f"network scale: fill to {pt:,}", pt - len(ids)) as adv:
                t0 = time.perf_counter()
                start = len(ids)
                errors = asyncio.run(_fill(net.ep, start, pt, s.opts.concurrency, ids, adv,
                                           deadline))
                fill_s = time.perf_counter() - t0
            if len(ids) < pt and deadline is not None and time.monotonic() > deadline:
                stopped = (f"fill budget ({budget:.0f} s of filling) spent at {len(ids):,} "
                           f"live of {pt:,}: the last {len(ids) - start:,} at "
                           f"{(len(ids) - start) / fill_s:.1f}/s")
            if errors:
                stopped = (f"{stopped}; " if stopped else "") + (
                    f"filling to {pt:,}: {len(errors)} creates failed, {len(ids):,} live: "
                    f"{errors[0]}")
                if not curve:
                    raise RuntimeError(stopped)
                if len(ids) <= curve[-1]["live"]:
                    break  # nothing new to measure
            cost = _host_cost()
            boxes = _measured(net.ep)
            try:
                with s.ui.task(f"network scale: {pt:,} live, measure", ROUNDS * 3 * 3) as adv:
                    path = _path(net, boxes, mb, n_rr, ROUNDS, adv)
            finally:
                _kill(boxes)
            prev = curve[-1]["live"] if curve else 0
            curve.append({"live": len(ids), "fill_s": round(fill_s, 2),
                          "fill_per_s": round((len(ids) - prev) / fill_s, 1)
                          if fill_s > 0 and len(ids) > prev else None,
                          "host": cost, **path})
            if stopped is not None:
                break
    finally:
        with s.ui.task("network scale: destroy", len(ids)) as adv:
            sdk_runs.destroy_all(net.ep, ids, 100, adv)
    out: dict[str, Any] = {"curve": curve, "stopped": stopped, "top": top}
    if len(curve) >= 2:
        out["per_sandbox"] = _per_sandbox(curve[0]["host"], curve[-1]["host"],
                                          curve[-1]["live"] - curve[0]["live"])
    return out


def _last_first(curve: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per system, the last point's figure over the first's: connect + echo p50, refused
    connect p50, bulk MB/s (1.0: no growth with the live count)."""
    if len(curve) < 2:
        return {}
    a, b = curve[0], curve[-1]
    return {c: {"connect_rr_p50": ratio(b[c]["connect_rr_us"]["p50"],
                                        a[c]["connect_rr_us"]["p50"]),
                "deny_p50": ratio(b[c]["deny_us"]["p50"], a[c]["deny_us"]["p50"]),
                "bulk": ratio(b[c]["bulk_mb_s"], a[c]["bulk_mb_s"])} for c in SYSTEMS}


# ---- the scenario ---------------------------------------------------------------------------
def network(s: Session) -> tuple[dict[str, Any], dict[str, Any]]:
    missing = [t for t in ("ip", "nft") if shutil.which(t) is None]
    if missing:
        return {"skipped": f"{', '.join(missing)} not installed"}, {}
    enable_ipv4_forwarding()  # as the daemon does: the plain netns is routed the same way
    count, R, conc = s.opts.n("network"), s.opts.runs, s.opts.concurrency
    top = s.opts.scale_to or count  # the scale curve's most live networked sandboxes
    n_rr, n_create, n_churn = min(count, 500), min(count, 50), min(count, 200)
    mb = 256 if count >= 100 else 8
    runs: list[dict[str, Any]] = []
    scale: dict[str, Any] = {"curve": []}
    with s.ui.task("network: uplink, plain netns, daemon", None):
        net = Net(s, max(count, top))
    try:
        with s.ui.task("network: warm-up", None):  # the table, the DNS proxy, the pools
            boxes = _measured(net.ep)
            try:
                for k, sb in boxes.items():
                    net.client(k, sb, "rr", 5)
            finally:
                _kill(boxes)
        for r in range(R):
            tag = f"network {r + 1}/{R}"
            boxes = _measured(net.ep)
            try:
                with s.ui.task(f"{tag} transfer and connect", ROUNDS * 3 * 3) as adv:
                    path = _path(net, boxes, mb, n_rr, ROUNDS, adv)
            finally:
                _kill(boxes)
            with s.ui.task(f"{tag} create", n_create * len(CREATE_MODES)) as adv:
                creates = _creates(net.ep, n_create, adv)
            churn = _churn(s, net, n_churn, conc, tag)
            runs.append({"path": path,
                         "create_ms": {k: summary(v) for k, v in creates.items()},
                         "churn": {k: v.to_json() for k, v in churn.items()}})
        scale = _scale(s, net, top, max(8, mb // 4), min(count, 300))
    finally:
        cleanup = net.close()
    curve = scale["curve"]
    sec = _section(runs, curve)
    sec.update(n_fill=top, points=_points(top), scale_stopped=scale.get("stopped"),
               scale_per_sandbox=scale.get("per_sandbox"), scale_last_first=_last_first(curve),
               mb=mb, n_rr=n_rr, n_create=n_create, n_churn=n_churn, concurrency=conc,
               matching=MATCHING, cleanup=cleanup, made=net.names())
    if not cleanup["clean"]:
        raise RuntimeError(f"network: left behind: {cleanup['leaks']}")
    return sec, {"curve": curve}


def _section(runs: list[dict[str, Any]], curve: list[dict[str, Any]]) -> dict[str, Any]:
    def per_run(f: Any) -> float | None:
        return median([f(x) for x in runs])

    ratios: dict[str, float] = {}
    added: dict[str, float] = {}
    for c in SYSTEMS[1:]:
        v = per_run(lambda x, c=c: x["path"][c]["bulk_vs_plain"])
        if v is not None:
            ratios[f"{c}/plain bulk MB/s"] = round(v, 3)
        d = per_run(lambda x, c=c: x["path"][c]["added_us"])
        if d is not None:
            added[c] = round(d, 1)
    for k in ("internet", "allowlist", "none-cold"):
        for base in ("none", "none-cold"):
            if k == base:
                continue
            v = per_run(lambda x, k=k, b=base: ratio(x["create_ms"][k]["p50"],
                                                     x["create_ms"][b]["p50"]))
            if v is not None:
                ratios[f"create {k}/{base} p50"] = round(v, 3)
    for c, b in MATCHING.items():
        v = per_run(lambda x, c=c, b=b: ratio(x["churn"][c]["ops_per_s"],
                                              x["churn"][b]["ops_per_s"]))
        if v is not None:
            ratios[f"churn {c}/{b}"] = round(v, 3)
    growth: dict[str, float] = {}
    if len(curve) >= 2:
        for c in SYSTEMS[1:]:
            growth[c] = round(curve[-1][c]["added_us"] - curve[0][c]["added_us"], 1)
    churn_r = [ratios.get(f"churn {c}/{b}") for c, b in MATCHING.items() if c != "corral"]
    worst_bulk = min((v for k, v in ratios.items() if k.endswith("bulk MB/s")), default=None)
    create_r = ratios.get("create allowlist/none-cold p50")
    create_w = ratios.get("create allowlist/none p50")
    met = {"churn internet and allowlist >= 0.8x raw with veth": all(
               r is not None and r >= TARGETS["churn"] for r in churn_r),
           "bulk >= 0.8x plain": worst_bulk is not None and worst_bulk >= TARGETS["bulk"],
           "added connect latency < 100 us": bool(added)
           and max(added.values()) < TARGETS["added_us"],
           "create allowlist <= 1.5x none, both unpooled": create_r is not None
           and create_r <= TARGETS["create_allowlist/none"],
           "create allowlist <= 1.5x none from a warm pool": create_w is not None
           and create_w <= TARGETS["create_allowlist/none"],
           f"added latency grows <= {TARGETS['scale_growth_us']:.0f} us from 0 to the "
           "most live": bool(growth) and max(growth.values()) <= TARGETS["scale_growth_us"]}
    return {"median": median_tree(runs), "runs": runs, "ratios": ratios, "added_us": added,
            "scale": curve, "scale_growth_us": growth, "met": met}
