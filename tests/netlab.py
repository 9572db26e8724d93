"""The tests' own small internet, on this machine only: a network namespace joined to the host
by a veth pair (the daemon's uplink), with a DNS server (A and AAAA) and TCP/UDP servers on
test addresses: IPv4 (198.18.0.0/15, the benchmarking range; a private address; the metadata
address) and IPv6 (a /48 of 2001:db8::/32, the documentation range; a unique local address;
the metadata address fd00:ec2::254; a NAT64 address). Host routes send those addresses into
it, so even a packet a broken rule let through never leaves the machine."""

from __future__ import annotations

import ipaddress
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
BULK = 2 << 20  # what the bulk port (8081) sends
SLOW_S = 1.5  # how long the lab's DNS server takes to answer slow.test (the proxy waits 3 s)
SILENT = "void.test"  # the lab's DNS server never answers a name under it (nor it)


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=check, capture_output=True, text=True)


@dataclass
class Lab:
    tag: str
    ns: str
    uplink: str
    net: str           # "198.18.X"
    private: str       # a private address served in the lab
    net6: str          # "2001:db8:X": the link is <net6>::/64, servers are in <net6>:1::/64
    private6: str      # a unique local address served in the lab
    log: str
    proc: subprocess.Popen | None = None
    routes: list[list[str]] = field(default_factory=list)

    @property
    def host_addr(self) -> str:
        return f"{self.net}.1"

    @property
    def dns(self) -> str:
        return f"{self.net}.53"

    def addr(self, last: int) -> str:
        return f"{self.net}.{last}"

    @property
    def host_addr6(self) -> str:
        return f"{self.net6}::1"

    def addr6(self, last: int) -> str:
        return f"{self.net6}:1::{last}"

    @property
    def nat64(self) -> str:
        """A NAT64 address (64:ff9b::/96) of a lab server: what a translator would carry to
        an IPv4 address."""
        return str(ipaddress.IPv6Address("64:ff9b::" + self.addr(10)))

    def entries(self, kind: str | None = None) -> list[dict]:
        try:
            with open(self.log) as f:
                rows = [json.loads(x) for x in f if x.strip()]
        except FileNotFoundError:
            return []
        return [r for r in rows if kind is None or r["kind"] == kind]


def start(tmp: str) -> Lab:
    tag = os.urandom(3).hex()
    x = random.randint(0, 255)
    lab = Lab(tag=tag, ns=f"ctn-{tag}", uplink=f"tu{tag}", net=f"198.18.{x}",
              private=f"10.77.{x}.10", net6=f"2001:db8:{x:x}", private6=f"fd7e:{x:x}::10",
              log=os.path.join(tmp, f"netlab-{tag}.log"))
    try:
        sh("ip", "netns", "add", lab.ns)
        sh("ip", "link", "add", lab.uplink, "type", "veth", "peer", "name", "up0", "netns", lab.ns)
        sh("ip", "addr", "add", f"{lab.net}.1/24", "dev", lab.uplink)
        sh("ip", "link", "set", lab.uplink, "up")
        nse = ["ip", "netns", "exec", lab.ns]
        sh(*nse, "ip", "link", "set", "lo", "up")
        sh(*nse, "ip", "addr", "add", f"{lab.net}.2/24", "dev", "up0")
        sh(*nse, "ip", "link", "set", "up0", "up")
        for a in (f"{lab.net}.10", f"{lab.net}.11", f"{lab.net}.12", f"{lab.net}.53",
                  f"{lab.net}.54", lab.private, "169.254.169.254"):
            sh(*nse, "ip", "addr", "add", f"{a}/32", "dev", "lo")
        # IPv6: the link, then the servers' addresses on the lab's loopback.
        sh("ip", "addr", "add", f"{lab.host_addr6}/64", "dev", lab.uplink, "nodad")
        sh(*nse, "ip", "addr", "add", f"{lab.net6}::2/64", "dev", "up0", "nodad")
        v6 = [lab.addr6(n) for n in (10, 11, 12, 13)] + [lab.private6, "fd00:ec2::254",
                                                         lab.nat64]
        for a in v6:
            sh(*nse, "ip", "addr", "add", f"{a}/128", "dev", "lo")
        sh(*nse, "ip", "-6", "route", "add", "default", "via", lab.host_addr6, "dev", "up0")
        metric = str(random.randint(1000, 60000))
        for dst in (f"{lab.private}/32", "169.254.169.254/32"):
            r = ["ip", "route", "add", dst, "via", f"{lab.net}.2", "dev", lab.uplink,
                 "metric", metric]
            sh(*r)
            lab.routes.append(r)
        for dst in (f"{lab.net6}:1::/64", f"{lab.private6}/128", "fd00:ec2::254/128",
                    f"{lab.nat64}/128"):
            r = ["ip", "-6", "route", "add", dst, "via", f"{lab.net6}::2", "dev", lab.uplink,
                 "metric", metric]
            sh(*r)
            lab.routes.append(r)
        # Each name: its IPv4 (A) and IPv6 (AAAA) addresses.
        zone = {"allowed.test": [f"{lab.net}.10", lab.addr6(10)],
                "denied.test": [f"{lab.net}.11", lab.addr6(11)],
                "other.test": [f"{lab.net}.12", lab.addr6(12)],
                "a.wild.test": [f"{lab.net}.12", lab.addr6(12)],
                "wild.test": [f"{lab.net}.10", lab.addr6(10)],
                "v6only.test": [lab.addr6(13)],
                "private.test": [lab.private, lab.private6],
                "slow.test": [f"{lab.net}.10", lab.addr6(10)],  # answered after SLOW_S
                "meta.test": ["169.254.169.254", "fd00:ec2::254"],
                # more addresses than a 512-byte UDP answer holds: asked again over TCP
                "big.test": [f"{lab.net}.10"] + [f"{lab.net}.{n}" for n in range(100, 140)],
                "extra.test": [f"{lab.net}.12"]}
        cfg = {"log": lab.log, "zone": zone, "dns": [f"{lab.net}.53", f"{lab.net}.54"],
               "tcp": [80, 8080], "udp": 9999, "ttl": 30, "bulk": BULK,
               "delay": {"slow.test": SLOW_S}, "silent": [SILENT],
               # aliases: one of a denied name, one (a CDN's way) of an allowed one; and an
               # answer that carries a record of another name
               "cname": {"alias.test": "denied.test", "cdn.test": "edge.cdn.test",
                         "edge.cdn.test": "allowed.test"},
               "extra": {"extra.test": [["denied.test", f"{lab.net}.11"]]},
               "special": {"bulk": 8081, "sink": 8082, "hold": 8083}}
        lab.proc = subprocess.Popen([*nse, sys.executable, os.path.join(HERE, "netlab_server.py"),
                                     json.dumps(cfg)], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while not lab.entries("ready"):
            if lab.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the lab's servers did not start")
            time.sleep(0.02)
        return lab
    except BaseException:
        stop(lab)
        raise


def stop(lab: Lab) -> None:
    if lab.proc is not None:
        lab.proc.kill()
        lab.proc.wait()
    for r in lab.routes:
        i = r.index("add")
        sh(*(r[:i] + ["del"] + r[i + 1:]), check=False)
    sh("ip", "link", "del", lab.uplink, check=False)
    sh("ip", "netns", "del", lab.ns, check=False)
