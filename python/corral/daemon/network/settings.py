"""The daemon's network settings: the uplink, the sandboxes' address ranges (IPv4 and IPv6),
the DNS upstream, and the named allowlists (a JSON file). Environment variables override the
file."""

from __future__ import annotations

import ipaddress
import json
import os
import re
from dataclasses import dataclass, field

DEFAULT_CONFIG = "/etc/corral/network.json"
NAME_RE = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
RESERVED = ("none", "disabled", "internet", "policy")
DEFAULT_RANGE6 = "fdc3:a1d2:213::/112"
# A sandbox's IPv6 gateway: this + its slot, a link-local address of its link's host end
# (corral.daemon.network.links.Links.gateway6).
LINK_GATEWAY6 = ipaddress.IPv6Address("fe80::c0:0:0")

# Shipped examples, overridden (or removed: an empty list) by the config file's "allowlists".
EXAMPLE_ALLOWLISTS: dict[str, list[str]] = {
    "pypi": ["pypi.org:443", "files.pythonhosted.org:443"],
    "debian": ["deb.debian.org:80", "deb.debian.org:443", "security.debian.org:80",
               "security.debian.org:443"],
    "github": ["github.com:443", "github.com:22", "*.github.com:443",
               "*.githubusercontent.com:443", "codeload.github.com:443"],
}


def default_uplink() -> str:
    """The interface of the host's IPv4 default route ("" if none)."""
    try:
        with open("/proc/net/route") as f:
            for line in f.read().splitlines()[1:]:
                cols = line.split()
                if len(cols) > 2 and cols[1] == "00000000":
                    return cols[0]
    except OSError:
        pass
    return ""


def default_upstream() -> str:
    """The host resolver's first IPv4 nameserver ("" if none)."""
    try:
        with open("/etc/resolv.conf") as f:
            for line in f:
                cols = line.split()
                if len(cols) >= 2 and cols[0] == "nameserver":
                    try:
                        if ipaddress.ip_address(cols[1]).version == 4:
                            return cols[1]
                    except ValueError:
                        continue
    except OSError:
        pass
    return ""


def ipv6_available() -> bool:
    """Whether the host has IPv6 at all (a kernel without it, or ipv6.disable=1)."""
    try:
        with open("/proc/sys/net/ipv6/conf/all/disable_ipv6") as f:
            return f.read().strip() == "0"
    except OSError:
        return False


def _host_port(value: str, default_port: int) -> tuple[str, int]:
    host, _, port = value.rpartition(":") if value.count(":") == 1 else (value, "", "")
    ipaddress.IPv4Address(host)
    return host, int(port) if port else default_port


@dataclass(frozen=True)
class NetSettings:
    uplink: str = ""
    # The sandboxes' addresses: the first is the gateway (and DNS proxy) every sandbox sees.
    range4: ipaddress.IPv4Network = ipaddress.IPv4Network("10.213.0.0/16")
    # The same for IPv6 (a ULA range; None: sandboxes have IPv4 only).
    range6: ipaddress.IPv6Network | None = ipaddress.IPv6Network(DEFAULT_RANGE6)
    dns_upstream: tuple[str, int] = ("", 53)
    # One nftables table (inet family) and one interface-name prefix per daemon.
    table: str = "corral"
    ifprefix: str = "crl"
    pool: int = 8
    # Connections a sandbox may hold at once (conntrack entries, every state).
    max_connections: int = 4096
    # New connections (conntrack entries) a sandbox may open a second, twice that in a burst;
    # 0: no limit. Bounds what its closed ones leave in the host's conntrack table (TIME_WAIT).
    new_conns_per_s: int = 200
    # Addresses a sandbox may have pinned by its DNS answers at once (live pins).
    max_pins: int = 4096
    allowlists: dict[str, list[str]] = field(default_factory=dict)
    # More addresses no sandbox may reach whatever its policy (as link-local ones): other
    # hosts of the same deployment, such as the other nodes of a Ray cluster.
    blocked: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()

    @property
    def gateway(self) -> ipaddress.IPv4Address:
        return self.range4.network_address + 1

    @property
    def base6(self) -> ipaddress.IPv6Address | None:
        """Sandbox slot i's IPv6 address is this + i (as IPv4's is the gateway's + i)."""
        return None if self.range6 is None else self.range6.network_address + 1


def load() -> NetSettings:
    """The settings from CORRAL_NETWORK_CONFIG (default /etc/corral/network.json; missing is
    fine) and CORRAL_UPLINK, CORRAL_DNS_UPSTREAM, CORRAL_NET_RANGE, CORRAL_NET_RANGE6
    ("none": no IPv6), CORRAL_NET_TABLE,
    CORRAL_NET_IFPREFIX, CORRAL_NET_POOL, CORRAL_NET_MAX_CONNECTIONS,
    CORRAL_NET_NEW_CONNS_PER_S, CORRAL_NET_MAX_PINS, CORRAL_NET_BLOCKED. Raises ValueError on
    a bad value."""
    path = os.environ.get("CORRAL_NETWORK_CONFIG", DEFAULT_CONFIG)
    doc: dict = {}
    if path and os.path.exists(path):
        with open(path) as f:
            doc = json.load(f)
        if not isinstance(doc, dict):
            raise ValueError(f"{path}: expected a JSON object")

    def pick(env: str, key: str, default: str) -> str:
        return os.environ.get(env) or str(doc.get(key) or "") or default

    uplink = pick("CORRAL_UPLINK", "uplink", "") or default_uplink()
    upstream = pick("CORRAL_DNS_UPSTREAM", "dns_upstream", "") or default_upstream()
    range4 = ipaddress.IPv4Network(pick("CORRAL_NET_RANGE", "range", "10.213.0.0/16"))
    if range4.prefixlen > 28:
        raise ValueError(f"network range {range4} is too small")
    r6 = pick("CORRAL_NET_RANGE6", "range6", DEFAULT_RANGE6)
    range6 = None if r6 == "none" or not ipv6_available() else ipaddress.IPv6Network(r6)
    if range6 is not None and (range6.prefixlen > 124
                               or not range6.subnet_of(ipaddress.IPv6Network("fc00::/7"))):
        raise ValueError(f"IPv6 range {range6}: a unique local range (fc00::/7), /124 or "
                         f"larger ('none': no IPv6)")
    table = pick("CORRAL_NET_TABLE", "table", "corral")
    ifprefix = pick("CORRAL_NET_IFPREFIX", "ifprefix", "crl")
    if not re.match(r"^[a-z][a-z0-9_]{0,31}$", table):
        raise ValueError(f"bad nftables table name {table!r}")
    if not re.match(r"^[a-z][a-z0-9]{0,5}$", ifprefix):
        raise ValueError(f"bad interface prefix {ifprefix!r} (1-6 of [a-z0-9])")
    if uplink.startswith(ifprefix):
        # The ruleset matches the sandboxes' links by the glob "<prefix>*": the uplink would
        # be taken for a sandbox's link (its traffic to the host refused, egress looping).
        raise ValueError(f"the uplink {uplink!r} is named like the sandboxes' links "
                         f"(interface prefix {ifprefix!r}: CORRAL_NET_IFPREFIX); give either "
                         f"another name")
    lists = dict(EXAMPLE_ALLOWLISTS)
    for name, rules in (doc.get("allowlists") or {}).items():
        if not NAME_RE.match(name) or name in RESERVED:
            raise ValueError(f"bad allowlist name {name!r}")
        if not isinstance(rules, list) or not all(isinstance(r, str) for r in rules):
            raise ValueError(f"allowlist {name!r}: expected a list of strings")
        if rules:
            lists[name] = list(rules)
        else:
            lists.pop(name, None)
    # Both: a cluster's supervisor names its nodes in the environment, an operator's file
    # may name more.
    blocked = parse_blocked([*os.environ.get("CORRAL_NET_BLOCKED", "").replace(",", " ").split(),
                             *_strings(doc.get("blocked") or [], "blocked")])
    return NetSettings(uplink=uplink, range4=range4, range6=range6,
                       dns_upstream=_host_port(upstream, 53) if upstream else ("", 53),
                       table=table, ifprefix=ifprefix,
                       pool=int(pick("CORRAL_NET_POOL", "pool", "8")),
                       max_connections=int(pick("CORRAL_NET_MAX_CONNECTIONS",
                                                "max_connections", "4096")),
                       new_conns_per_s=_count(pick("CORRAL_NET_NEW_CONNS_PER_S",
                                                   "new_conns_per_s", "200"), 0),
                       max_pins=_count(pick("CORRAL_NET_MAX_PINS", "max_pins", "4096"), 1),
                       allowlists=lists, blocked=blocked)


MAX_BLOCKED = 4096


def parse_blocked(items: object) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """Addresses or CIDRs (host bits ignored), at most MAX_BLOCKED. ValueError if not."""
    if not isinstance(items, (list, tuple)) or not all(isinstance(x, str) for x in items):
        raise ValueError("blocked: expected a list of addresses or CIDRs")
    if len(items) > MAX_BLOCKED:
        raise ValueError(f"blocked: at most {MAX_BLOCKED} entries")
    nets = tuple(ipaddress.ip_network(x, strict=False) for x in items)
    for x, net in zip(items, nets, strict=True):
        if isinstance(net, ipaddress.IPv6Network) and net.network_address.scope_id:
            raise ValueError(f"blocked: {x!r} names an interface (a scope): not a network")
    return nets


def _strings(value: object, key: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise ValueError(f"{key}: expected a list of strings")
    return value


def _count(value: str, least: int) -> int:
    n = int(value)
    if n < least:
        raise ValueError(f"expected a whole number of at least {least}, got {value!r}")
    return n
