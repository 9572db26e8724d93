"""The network scenario's own small internet, on this machine only, and its plain-netns peer.

``Uplink``: a network namespace joined to the host by a veth pair (the private daemon's
``CORRAL_UPLINK``), holding a DNS server (``CORRAL_DNS_UPSTREAM``), a TCP sink and a TCP echo
on 198.19.X.0/24 addresses (the benchmarking range), served by corral.bench.netsrv. Nothing
is routed anywhere else, so no packet leaves the machine.

``PlainNetns``: what a sandbox's network is without corral: a namespace with a veth pair
addressed and routed the way corral's are (docs/network.md "Plumbing": the host end holds the
gateway /32 and a /32 route to the namespace, whose eth0 holds its /32 and a default route via
the gateway), NATed out of the same uplink by a table of its own, and no other rule. Its
client runs in a cpu cgroup with the measured sandboxes' CFS quota."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from corral.bench.host import CGROUP_ROOT

SINK_PORT, ECHO_PORT = 8082, 8083
SINK_NAME = "sink.bench"
PYTHON = "/usr/bin/python3"  # the host image's python3 (the host's /usr): the same client


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(argv, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip() or r.returncode}")
    return r


def _x_free(prefix: str) -> int:
    """A third octet X with no host route into ``prefix``.X.0/24 yet."""
    routes = _sh("ip", "-4", "route", "show", "table", "all").stdout
    for _ in range(100):
        x = random.randint(1, 254)
        if f"{prefix}.{x}." not in routes:
            return x
    raise RuntimeError(f"no free {prefix}.X.0/24 for the bench's uplink")


@dataclass
class Uplink:
    tag: str
    ns: str
    ifname: str
    net: str                      # "198.19.X"
    proc: subprocess.Popen[str] | None = None

    @property
    def sink(self) -> str:
        return f"{self.net}.10"

    @property
    def dns(self) -> str:
        return f"{self.net}.53"

    @classmethod
    def start(cls) -> Uplink:
        tag = os.urandom(3).hex()
        up = cls(tag=tag, ns=f"cbench-{tag}", ifname=f"cbu{tag}", net=f"198.19.{_x_free('198.19')}")
        try:
            _sh("ip", "netns", "add", up.ns)
            _sh("ip", "link", "add", up.ifname, "type", "veth", "peer", "name", "up0",
                "netns", up.ns)
            _sh("ip", "addr", "add", f"{up.net}.1/24", "dev", up.ifname)
            _sh("ip", "link", "set", up.ifname, "up")
            nse = ["ip", "netns", "exec", up.ns]
            _sh(*nse, "ip", "link", "set", "lo", "up")
            _sh(*nse, "ip", "addr", "add", f"{up.net}.2/24", "dev", "up0")
            _sh(*nse, "ip", "link", "set", "up0", "up")
            for a in (up.sink, up.dns):
                _sh(*nse, "ip", "addr", "add", f"{a}/32", "dev", "lo")
            cfg = {"dns": up.dns, "zone": {SINK_NAME: up.sink}, "sink": SINK_PORT,
                   "echo": ECHO_PORT}
            up.proc = subprocess.Popen([*nse, sys.executable, "-m", "corral.bench.netsrv",
                                        json.dumps(cfg)], stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True)
            assert up.proc.stdout is not None
            line = up.proc.stdout.readline()  # "ready", or the error it died of
            if line.strip() != "ready":
                raise RuntimeError(f"the uplink's servers did not start: {line}"
                                   f"{up.proc.stdout.read()[-2000:]}")
            return up
        except BaseException:
            up.stop()
            raise

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            self.proc = None
        _sh("ip", "link", "del", self.ifname, check=False)
        _sh("ip", "netns", "del", self.ns, check=False)


@dataclass
class PlainNetns:
    tag: str
    ns: str
    ifname: str
    gateway: str
    addr: str
    table: str
    cgroup: Path | None = None
    made: list[str] = field(default_factory=list)

    @classmethod
    def start(cls, uplink: Uplink, cgroup_name: str, cpus: int) -> PlainNetns:
        x = _x_free("10.219")
        p = cls(tag=uplink.tag, ns=f"cbplain-{uplink.tag}", ifname=f"cbp{uplink.tag}",
                gateway=f"10.219.{x}.1", addr=f"10.219.{x}.2", table=f"cbench_{uplink.tag}")
        try:
            _sh("ip", "netns", "add", p.ns)
            _sh("ip", "link", "add", p.ifname, "type", "veth", "peer", "name", "eth0",
                "netns", p.ns)
            _sh("sysctl", "-qw", f"net.ipv6.conf.{p.ifname}.disable_ipv6=1", check=False)
            _sh("ip", "addr", "add", f"{p.gateway}/32", "dev", p.ifname)
            _sh("ip", "link", "set", p.ifname, "up")
            _sh("ip", "route", "add", f"{p.addr}/32", "dev", p.ifname)
            nse = ["ip", "netns", "exec", p.ns]
            _sh(*nse, "ip", "link", "set", "lo", "up")
            _sh(*nse, "ip", "addr", "add", f"{p.addr}/32", "dev", "eth0")
            _sh(*nse, "ip", "link", "set", "eth0", "up")
            _sh(*nse, "ip", "route", "add", f"{p.gateway}/32", "dev", "eth0")
            _sh(*nse, "ip", "route", "add", "default", "via", p.gateway, "dev", "eth0")
            nat = (f"table inet {p.table} {{ chain nat {{ type nat hook postrouting priority "
                   f"srcnat; policy accept; ip saddr {p.addr} oifname \"{uplink.ifname}\" "
                   "masquerade; }; }")
            subprocess.run(["nft", "-f", "-"], input=nat, text=True, check=True,
                           capture_output=True)
            p.cgroup = _cpu_cgroup(cgroup_name, cpus)
            return p
        except BaseException:
            p.stop()
            raise

    def run(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        """``argv`` in the namespace, in the cpu cgroup."""
        procs = str(self.cgroup / "cgroup.procs") if self.cgroup else None

        def enter() -> None:
            if procs:
                with open(procs, "w") as f:
                    f.write("0")

        return subprocess.run(["ip", "netns", "exec", self.ns, *argv], capture_output=True,
                              text=True, timeout=timeout, preexec_fn=enter)

    def stop(self) -> None:
        _sh("nft", "delete", "table", "inet", self.table, check=False)
        _sh("ip", "link", "del", self.ifname, check=False)
        _sh("ip", "netns", "del", self.ns, check=False)
        if self.cgroup is not None:
            try:
                self.cgroup.rmdir()
            except OSError:
                pass  # swept with the session's cgroups
            self.cgroup = None


def _cpu_cgroup(name: str, cpus: int) -> Path | None:
    """A top-level cpu cgroup with the measured sandboxes' CFS quota (``cpus`` cores)."""
    v1 = CGROUP_ROOT / "cpu"
    if (v1 / "cgroup.procs").exists():
        d = v1 / name
        d.mkdir(exist_ok=True)
        (d / "cpu.cfs_period_us").write_text("100000")
        (d / "cpu.cfs_quota_us").write_text(str(100000 * cpus))
        return d
    if "cpu" in (CGROUP_ROOT / "cgroup.subtree_control").read_text().split():
        d = CGROUP_ROOT / name
        d.mkdir(exist_ok=True)
        (d / "cpu.max").write_text(f"{100000 * cpus} 100000")
        return d
    return None


def leftovers(tag: str, ifprefixes: list[str], tables: list[str]) -> dict[str, list[str]]:
    """What is still on the host of the bench's uplink, its plain netns, its daemon's and the
    raw baseline's networks: namespaces, links, nftables tables."""
    ns = _sh("ip", "netns", "list", check=False).stdout.split()
    links = [ln.split(":")[1].strip().split("@")[0]
             for ln in _sh("ip", "-o", "link", check=False).stdout.splitlines()]
    listed = _sh("nft", "list", "tables", check=False).stdout.splitlines()
    out = {"netns": [n for n in ns if n.endswith(tag) and n.startswith(("cbench-", "cbplain-"))],
           "links": [n for n in links if n in (f"cbu{tag}", f"cbp{tag}")
                     or any(n.startswith(p) and n[len(p):].isdigit() for p in ifprefixes)],
           "nft_tables": [t for t in listed if t.split()[-1] in (*tables, f"cbench_{tag}")]}
    return {k: v for k, v in out.items() if v}
