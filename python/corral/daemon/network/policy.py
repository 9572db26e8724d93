"""Network policies: rules parsed and expanded (named allowlists), checked once at create.

A rule is one of: ``name`` / ``name:ports`` (an exact domain), ``*.suffix[:ports]`` (any name
below ``suffix``, not ``suffix`` itself), ``a.b.c.d[/len][:ports]`` (an IPv4 address or CIDR),
``[v6addr[/len]][:ports]`` or a bare ``v6addr[/len]`` (every port) for IPv6, ``@list`` (a
named allowlist of the daemon's config; only in ``allow``). ``ports`` is ``443``,
``8000-8100`` or ``80,443``. No ports: every port."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field

from corral.errors import InvalidNetwork

ALL_PORTS: tuple[tuple[int, int], ...] = ((0, 65535),)
_LABEL = r"(?!-)[a-z0-9_-]{1,63}(?<!-)"
_DOMAIN_RE = re.compile(rf"^{_LABEL}(\.{_LABEL})*\.?$")
_PORTS_RE = re.compile(r"^\d{1,5}(-\d{1,5})?(,\d{1,5}(-\d{1,5})?)*$")
MAX_RULES = 256
# Distinct port entries (a port or a range) over a policy's name rules: a resolved name is
# pinned for each of its entries (and each address of the answer, TCP and UDP), so this bounds
# the elements one answer adds and the work of finding them. A policy of 256 rules each naming
# ~55 ports cost ~2 s of the daemon's CPU per DNS query and ~28,000 elements per address.
MAX_NAME_PORTS = 256


@dataclass(frozen=True)
class Rule:
    kind: str                      # "domain", "suffix" or "cidr"
    value: str                     # lower-case name without the trailing dot, or a CIDR (v4/v6)
    ports: tuple[tuple[int, int], ...] = ALL_PORTS

    def matches(self, name: str) -> bool:
        if self.kind == "domain":
            return name == self.value
        if self.kind == "suffix":
            return name.endswith("." + self.value)
        return False


@dataclass
class Policy:
    allow: list[Rule] = field(default_factory=list)
    deny: list[Rule] = field(default_factory=list)

    def denies(self, name: str) -> bool:
        """Whether a deny rule names ``name`` (whatever the allow rules say)."""
        name = name.lower().rstrip(".")
        return any(r.kind != "cidr" and r.matches(name) for r in self.deny)

    def name_ports(self, name: str) -> tuple[tuple[int, int], ...] | None:
        """The ports a resolved ``name`` opens (None: the name is refused). A deny rule on the
        name wins whatever its ports (it is refused at DNS)."""
        name = name.lower().rstrip(".")
        if any(r.matches(name) for r in self.deny):
            return None
        ports: dict[tuple[int, int], None] = {}
        for r in self.allow:
            if r.matches(name):
                ports.update(dict.fromkeys(r.ports))
        return tuple(ports) or None

    def address_ports(self, addr: str, ports: tuple[tuple[int, int], ...]
                      ) -> tuple[tuple[int, int], ...]:
        """The part of ``ports`` (a name's) the allow CIDR rules covering ``addr`` open: what
        a private address a name resolves to may be pinned for (empty: nothing; such an
        address is only reachable through an allow CIDR, and only on that rule's ports)."""
        ip = ipaddress.ip_address(addr)
        covered: list[tuple[int, int]] = []
        for r in self.allow:
            if r.kind == "cidr":
                net = ipaddress.ip_network(r.value)
                if net.version == ip.version and ip in net:
                    covered.extend(r.ports)
        return intersect(ports, covered)

    def cidrs(self, rules: list[Rule]) -> list[tuple[ipaddress.IPv4Network | ipaddress.IPv6Network,
                                                      tuple[tuple[int, int], ...]]]:
        return [(ipaddress.ip_network(r.value), r.ports) for r in rules if r.kind == "cidr"]


def intersect(a: tuple[tuple[int, int], ...], b: list[tuple[int, int]] | tuple[tuple[int, int], ...]
              ) -> tuple[tuple[int, int], ...]:
    """The ports in both ``a`` and ``b`` (lists of ranges), as ranges: each of ``a`` cut to
    the union of ``b``, in ``a``'s order."""
    merged: list[list[int]] = []
    for lo, hi in sorted(b):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    out: dict[tuple[int, int], None] = {}
    for lo, hi in a:
        for mlo, mhi in merged:
            x, y = max(lo, mlo), min(hi, mhi)
            if x <= y:
                out[(x, y)] = None
    return tuple(out)


def _ports(text: str, rule: str) -> tuple[tuple[int, int], ...]:
    if not _PORTS_RE.match(text):
        raise InvalidNetwork(f"bad ports in rule {rule!r}", details={"rule": rule})
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        a, b = int(lo), int(hi or lo)
        if not (1 <= a <= b <= 65535):
            raise InvalidNetwork(f"bad port range in rule {rule!r}", details={"rule": rule})
        out.append((a, b))
    return tuple(out)


def parse_rule(text: str) -> Rule:
    rule = text.strip().lower()
    if not rule or len(rule) > 300:
        raise InvalidNetwork(f"bad network rule {text!r}", details={"rule": text})
    if rule.startswith("[") or rule.count(":") > 1:
        return _rule6(rule, text)
    host, ports = rule, ALL_PORTS
    if ":" in rule:
        host, _, p = rule.rpartition(":")
        ports = _ports(p, text)
    if re.match(r"^[0-9./]+$", host):
        try:
            net = ipaddress.IPv4Network(host, strict=False)
        except ValueError:
            raise InvalidNetwork(f"bad address in rule {text!r}", details={"rule": text}) \
                from None
        return Rule("cidr", str(net), ports)
    kind = "domain"
    if host.startswith("*."):
        kind, host = "suffix", host[2:]
    host = host.rstrip(".")
    if not _DOMAIN_RE.match(host) or "*" in host:
        raise InvalidNetwork(f"bad domain in rule {text!r} (exact names and *.suffix only)",
                             details={"rule": text})
    return Rule(kind, host, ports)


def _rule6(rule: str, text: str) -> Rule:
    """``[addr[/len]][:ports]`` or a bare ``addr[/len]`` (every port): an IPv6 CIDR rule."""
    host, ports = rule, ALL_PORTS
    if rule.startswith("["):
        host, sep, rest = rule[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise InvalidNetwork(f"bad IPv6 rule {text!r} ([addr/len]:ports)",
                                 details={"rule": text})
        if rest:
            ports = _ports(rest[1:], text)
    try:
        net = ipaddress.IPv6Network(host, strict=False)
    except ValueError:
        raise InvalidNetwork(f"bad IPv6 address in rule {text!r}", details={"rule": text}) \
            from None
    return Rule("cidr", str(net), ports)


def compile_policy(allow: list[str], deny: list[str],
                   allowlists: dict[str, list[str]]) -> Policy:
    """Rules expanded (``@name`` from ``allowlists``) and parsed; InvalidNetwork otherwise."""
    pol = Policy()
    for text in allow:
        if text.startswith("@"):
            name = text[1:]
            if name not in allowlists:
                raise InvalidNetwork(f"unknown allowlist {text!r} (known: "
                                     f"{', '.join(sorted(allowlists)) or 'none'})",
                                     details={"allowlist": name,
                                              "known": sorted(allowlists)})
            pol.allow.extend(parse_rule(r) for r in allowlists[name])
        else:
            pol.allow.append(parse_rule(text))
    for text in deny:
        if text.startswith("@"):
            raise InvalidNetwork("named allowlists go in allow, not deny",
                                 details={"rule": text})
        pol.deny.append(parse_rule(text))
    if len(pol.allow) + len(pol.deny) > MAX_RULES:
        raise InvalidNetwork(f"too many network rules (at most {MAX_RULES})")
    name_ports = {p for r in pol.allow if r.kind != "cidr" for p in r.ports}
    if len(name_ports) > MAX_NAME_PORTS:
        raise InvalidNetwork(f"too many ports in the name rules: {len(name_ports)} distinct "
                             f"ports or ranges (at most {MAX_NAME_PORTS}; a range counts one)",
                             details={"limit": "name_ports", "max": MAX_NAME_PORTS})
    return pol
