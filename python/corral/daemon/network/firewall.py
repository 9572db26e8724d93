"""The daemon's nftables table: fixed rules written once, per-sandbox state in sets keyed by
the sandbox's host-side interface, so attaching a sandbox is a few set elements in one
transaction, never a rule-set reload. One table (family inet) for IPv4 and IPv6: each rule
below holds for both, with sets of each family (``src4``/``src6``, ``pin4``/``pin6``...).

What a sandbox may send (chain ``from_sandbox``), in order: nothing but from its own address
(spoofing is dropped; IPv6 is dropped if the daemon has no IPv6 range); replies of flows
already allowed; other sandboxes only if both are in one network group; out of the uplink only
(never another host interface); never link-local/metadata (169.254.0.0/16, fe80::/10,
fd00:ec2::254), multicast (ff00::/8) nor the daemon's own ranges; no new connection past the
per-sandbox rate (set ``conn_rate``) or cap (set ``conns``); a policy's deny entries; its allow
CIDRs; never the private ranges (10/8, fc00::/7...); the DNS proxy's pins (which expire with
the answer's TTL); everything else only in mode "internet". To the host itself (chains
``to_host``, ``to_host6``): only DNS (UDP and TCP) to the gateway address, a ping of the
gateways and, over IPv6, neighbour discovery on the link. DNS over UDP to the gateway is not
tracked (chains ``untracked_in``, ``untracked_out``: no host conntrack entry for each query's
source port); a DNS connection over TCP counts in the sandbox's cap of connections (``conns``)
as any other. A sandbox's packets to those services
(DNS over UDP, new DNS connections over TCP, pings) first pass a per-sandbox rate limit
(HOST_RATE, set ``host_rate``), ahead of conntrack's established flows: a flood is dropped by
the kernel (chain ``flood``), counted as denied, and never reaches the DNS proxy's Python.
Denied packets are rejected (TCP: a reset, which the kernel does not rate-limit as it does ICMP
errors; others: admin-prohibited) and counted per sandbox in the dynamic set ``denied``, and
per sandbox and destination address in ``denied_to4`` and ``denied_to6`` (entries expire
DENIED_TO_TIMEOUT after their last packet; DENIED_TO_SIZE in each)."""

from __future__ import annotations

import functools
import ipaddress
import json
from collections.abc import Iterable

from corral import _core

from .nft import Nft, NftError
from .policy import Policy
from .settings import LINK_GATEWAY6, NetSettings

PRIVATE4 = ("0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "172.16.0.0/12",
            "192.168.0.0/16", "224.0.0.0/3")
BLOCKED4 = ("169.254.0.0/16",)
# IPv6: unspecified/loopback/IPv4-compatible, IPv4-mapped, NAT64 (both prefixes), 6to4 (each of
# which can lead to an IPv4 private address through a translator), discard-only, unique
# local, site-local; link-local, the clouds' metadata addresses (AWS, GCP) and multicast
# always.
PRIVATE6 = ("::/96", "::ffff:0:0/96", "64:ff9b::/96", "64:ff9b:1::/48", "100::/64",
            "2002::/16", "fc00::/7", "fec0::/10")
BLOCKED6 = ("fe80::/10", "fd00:ec2::254/128", "fd20:ce::254/128", "ff00::/8")
PROTOS = ("tcp", "udp")
PROTO_NUMBERS = {"tcp": 6, "udp": 17}
INTERVAL_SETS = ("allow4", "deny4", "allow6", "deny6")
# The interval sets are sharded by sandbox slot: the kernel's pipapo set does a removal in
# time linear in the set's size, so one set for every sandbox made ending a sandbox with CIDR
# rules cost ~150 ms of kernel CPU at 1,000 sandboxes (5 ms with 256 shards); a vmap on the
# interface jumps to its shard's chain, whose sets hold 1/SHARDS of the elements (a lookup is
# a hash lookup more). Elements go in and out over netlink (corral._core). The kernel finds a
# set by name by walking the table's list of sets in the order they were made, so the
# ruleset makes the sets every sandbox touches (src4, internet, pin4, denied...) before the
# 1,024 shard sets: a read of one sandbox's denied counter took 30 us of kernel time behind
# them, 4 us ahead of them.
SHARDS = 256
# Denied destinations: one element per (sandbox, address), so a port scan of one host is one
# element; a sweep of many addresses fills the set, after which new destinations go
# unrecorded (still refused, still in the sandbox's total) until older ones expire.
DENIED_TO_SIZE = 65536
# Packets a sandbox may send to the host's services (the DNS proxy, the gateway's ping) a
# second, per sandbox: above the DNS proxy's own per-sandbox budget (dns.RATE_QPS queries a
# second, twice that in a burst), so the proxy stays the limit of an honest resolver, and
# low enough that a flood costs neither the daemon's CPU nor host conntrack entries beyond
# HOST_RATE x the UDP timeout per sandbox. Its state lives in the dynamic set ``host_rate``,
# an element per interface that expires a minute after its last packet.
HOST_RATE = "200/second burst 200 packets"
DENIED_TO_TIMEOUT = "10m"
DENIED_TO = ("denied_to4", "denied_to6")

Ports = tuple[tuple[int, int], ...]


def _port(p: tuple[int, int]) -> str:
    return str(p[0]) if p[0] == p[1] else f"{p[0]}-{p[1]}"


def _ifname(name: str) -> str:
    return '"' + name + '"'


class Firewall:
    def __init__(self, settings: NetSettings, blocked: tuple[AnyNet, ...] = ()) -> None:
        self.s = settings
        self.nft = Nft()
        self.t = f"inet {settings.table}"
        self.blocked = blocked  # set live (set_blocked), on top of the settings' own

    def _blocked(self, version: int) -> str:
        s = self.s
        fixed = ([*BLOCKED4, str(s.range4)] if version == 4
                 else [*BLOCKED6, *([str(s.range6)] if s.range6 else [])])
        more = [str(n) for n in (*s.blocked, *self.blocked) if n.version == version]
        return ", ".join(fixed + more)

    def set_blocked(self, blocked: tuple[AnyNet, ...]) -> None:
        """Replace the live blocked addresses: both sets rewritten in one transaction (a new
        connection is checked against them; flows already open run on)."""
        old, self.blocked = self.blocked, blocked
        cmds = "\n".join(f"flush set {self.t} {name}\n"
                         f"add element {self.t} {name} {{ {self._blocked(v)} }}"
                         for name, v in (("blocked4", 4), ("blocked6", 6)))
        try:
            self.nft.run(cmds)
        except NftError:
            self.blocked = old
            raise

    def ruleset(self) -> str:
        s, w = self.s, self.s.ifprefix + "*"
        blocked = self._blocked(4)
        private = ", ".join(PRIVATE4)
        blocked6 = self._blocked(6)
        private6 = ", ".join(PRIVATE6)
        key = "ifname . ipv4_addr . inet_proto . inet_service"
        key6 = "ifname . ipv6_addr . inet_proto . inet_service"
        shard_sets = "\n".join(
            f"  set allow4_{k} {{ type {key}; flags interval, timeout; }}\n"
            f"  set deny4_{k} {{ type {key}; flags interval; }}\n"
            f"  set allow6_{k} {{ type {key6}; flags interval, timeout; }}\n"
            f"  set deny6_{k} {{ type {key6}; flags interval; }}" for k in range(SHARDS))
        # A policy's deny entries, then its allow CIDRs (and DNS pins of port ranges).
        shard_chains = "\n".join(
            f"  chain p{k} {{\n"
            f"    iifname . ip daddr . meta l4proto . th dport @deny4_{k} goto deny\n"
            f"    iifname . ip daddr . meta l4proto . th dport @allow4_{k} accept\n"
            f"    iifname . ip6 daddr . meta l4proto . th dport @deny6_{k} goto deny\n"
            f"    iifname . ip6 daddr . meta l4proto . th dport @allow6_{k} accept\n  }}"
            for k in range(SHARDS))
        over = f"update @host_rate {{ iifname limit rate over {HOST_RATE} }}"
        # New connections a sandbox opens, per second (its closed ones stay in the host's
        # conntrack table for TIME_WAIT's 2 minutes, which ``ct count`` does not count).
        rate = s.new_conns_per_s
        conn_rate = (f"ct state new update @conn_rate {{ iifname limit rate over {rate}/second "
                     f"burst {2 * rate} packets }} goto deny" if rate else "")
        conns = f"add @conns {{ iifname ct count over {s.max_connections} }} goto deny"
        nd = "icmpv6 type { nd-neighbor-solicit, nd-neighbor-advert } ip6 hoplimit 255"
        if s.range6 is None:
            no6 = "meta nfproto ipv6 drop"
            to_host6 = "drop"
            nat6 = ""
        else:
            no6 = "meta nfproto ipv6 iifname . ip6 saddr != @src6 drop"
            # Neighbour discovery (from its link-local or own address, hop limit 255: on the
            # link only) and the sandbox kernel's own link chatter (MLD, router solicitations:
            # dropped, not counted); a ping of its gateway (the host end's link-local
            # address: links.LINK_GATEWAY6); nothing else from a link-local source, nothing
            # else to the host.
            to_host6 = (f"ip6 saddr fe80::/10 {nd} accept\n"
                        f"    iifname . ip6 saddr @src6 {nd} accept\n"
                        f"    ip6 daddr ff00::/8 drop\n"
                        f"    ip6 daddr {LINK_GATEWAY6}/96 icmpv6 type echo-request {over} "
                        f"goto flood\n"
                        f"    ip6 daddr {LINK_GATEWAY6}/96 icmpv6 type echo-request accept\n"
                        f"    ip6 saddr fe80::/10 goto deny\n"
                        f"    iifname . ip6 saddr != @src6 drop\n"
                        f"    ct state established,related accept\n"
                        f"    goto deny")
            nat6 = f'ip6 saddr {s.range6} oifname "{s.uplink}" masquerade'
        return f"""
table {self.t} {{
  set src4 {{ type ifname . ipv4_addr; }}
  set src6 {{ type ifname . ipv6_addr; }}
  set internet {{ type ifname; }}
  set peers {{ type ifname . ifname; }}
  map shard {{ type ifname : verdict; }}
  set pin4 {{ type ifname . ipv4_addr . inet_proto . inet_service; flags timeout; }}
  set pinall4 {{ type ifname . ipv4_addr; flags timeout; }}
  set pin6 {{ type ifname . ipv6_addr . inet_proto . inet_service; flags timeout; }}
  set pinall6 {{ type ifname . ipv6_addr; flags timeout; }}
  set blocked4 {{ type ipv4_addr; flags interval; auto-merge; elements = {{ {blocked} }}; }}
  set private4 {{ type ipv4_addr; flags interval; auto-merge; elements = {{ {private} }}; }}
  set blocked6 {{ type ipv6_addr; flags interval; auto-merge; elements = {{ {blocked6} }}; }}
  set private6 {{ type ipv6_addr; flags interval; auto-merge; elements = {{ {private6} }}; }}
  set denied {{ type ifname; flags dynamic; counter; size 1048576; }}
  set denied_to4 {{ type ifname . ipv4_addr; flags dynamic, timeout; counter;
    size {DENIED_TO_SIZE}; timeout {DENIED_TO_TIMEOUT}; }}
  set denied_to6 {{ type ifname . ipv6_addr; flags dynamic, timeout; counter;
    size {DENIED_TO_SIZE}; timeout {DENIED_TO_TIMEOUT}; }}
  set conns {{ type ifname; flags dynamic; size 1048576; }}
  set host_rate {{ type ifname; flags dynamic, timeout; timeout 1m; size 1048576; }}
  set conn_rate {{ type ifname; flags dynamic, timeout; timeout 1m; size 1048576; }}
{shard_sets}
  chain input {{ type filter hook input priority -10; policy accept;
    iifname "{w}" jump to_host
  }}
  chain forward {{ type filter hook forward priority -10; policy accept;
    iifname "{w}" jump from_sandbox
    oifname "{w}" jump to_sandbox
  }}
  chain untracked_in {{ type filter hook prerouting priority raw; policy accept;
    iifname "{w}" ip daddr {s.gateway} udp dport 53 notrack
  }}
  chain untracked_out {{ type filter hook output priority raw; policy accept;
    oifname "{w}" ip saddr {s.gateway} udp sport 53 notrack
  }}
  chain to_host {{
    meta nfproto ipv6 goto to_host6
    iifname . ip saddr != @src4 drop
    ip daddr {s.gateway} udp dport 53 {over} goto flood
    ip daddr {s.gateway} tcp dport 53 ct state new {over} goto flood
    ip daddr {s.gateway} icmp type echo-request {over} goto flood
    ip daddr {s.gateway} tcp dport 53 ct state new {conns}
    ct state established,related accept
    ip daddr {s.gateway} udp dport 53 accept
    ip daddr {s.gateway} tcp dport 53 accept
    ip daddr {s.gateway} icmp type echo-request accept
    goto deny
  }}
  chain to_host6 {{
    {to_host6}
  }}
  chain from_sandbox {{
    meta nfproto ipv4 iifname . ip saddr != @src4 drop
    {no6}
    oifname "{s.uplink}" ip daddr @blocked4 goto deny
    oifname "{s.uplink}" ip6 daddr @blocked6 goto deny
    ct state established,related accept
    oifname "{w}" iifname . oifname @peers accept
    oifname "{w}" goto deny
    oifname != "{s.uplink}" goto deny
    {conn_rate}
    ct state new {conns}
    iifname vmap @shard
    ip daddr @private4 goto deny
    ip6 daddr @private6 goto deny
    iifname . ip daddr . meta l4proto . th dport @pin4 accept
    iifname . ip daddr @pinall4 accept
    iifname . ip6 daddr . meta l4proto . th dport @pin6 accept
    iifname . ip6 daddr @pinall6 accept
    iifname @internet accept
    goto deny
  }}
  chain to_sandbox {{
    iifname "{s.uplink}" ip saddr @blocked4 drop
    iifname "{s.uplink}" ip6 saddr @blocked6 drop
    ct state established,related accept
    drop
  }}
{shard_chains}
  chain flood {{
    update @denied {{ iifname }}
    meta nfproto ipv4 update @denied_to4 {{ iifname . ip daddr }}
    meta nfproto ipv6 update @denied_to6 {{ iifname . ip6 daddr }}
    drop
  }}
  chain deny {{
    update @denied {{ iifname }}
    meta nfproto ipv4 update @denied_to4 {{ iifname . ip daddr }}
    meta nfproto ipv6 update @denied_to6 {{ iifname . ip6 daddr }}
    meta l4proto tcp reject with tcp reset
    reject with icmpx admin-prohibited
  }}
  chain nat {{ type nat hook postrouting priority srcnat; policy accept;
    ip saddr {s.range4} oifname "{s.uplink}" masquerade
    {nat6}
  }}
}}
"""

    def install(self, carried: str = "") -> None:
        """(Re)write the table, with ``carried`` (elements of re-adopted sandboxes) in the
        same transaction: a table left by a previous daemon is replaced whole, at once."""
        self.nft.run(f"add table {self.t}\ndelete table {self.t}\n{self.ruleset()}\n{carried}")

    def carried_state(self) -> dict[str, dict[str, list]]:
        """What a killed daemon's table holds that its sandboxes' records do not, by host
        interface: ``pins`` (set, element with its remaining timeout, seconds left) and
        ``denied`` (packets, bytes), ``denied_to`` ((set, address, packets, bytes), ...)."""
        try:
            doc = json.loads(self.nft.run(f"list table {self.t}", json_out=True))
        except (NftError, ValueError):
            return {}
        out: dict[str, dict[str, list]] = {}
        for item in doc.get("nftables", []):
            st = item.get("set")
            name = str((st or {}).get("name", ""))
            if name.rsplit("_", 1)[0] in INTERVAL_SETS:
                name = name.rsplit("_", 1)[0]  # allow4_<shard>
            if not st or name not in ("pin4", "pinall4", "allow4", "pin6", "pinall6", "allow6",
                                      "denied", *DENIED_TO):
                continue
            for e in st.get("elem", []):
                inner = e.get("elem") if isinstance(e, dict) and "elem" in e else None
                val = inner["val"] if inner else e
                if name in DENIED_TO:
                    if inner and inner.get("counter") and isinstance(val, dict):
                        ifname, addr = (_json_part(x) for x in val.get("concat", ("", "")))
                        c = inner["counter"]
                        out.setdefault(ifname, {}).setdefault("denied_to", []).append(
                            (name, addr, int(c["packets"]), int(c["bytes"])))
                    continue
                if name == "denied":
                    if inner and isinstance(val, str) and inner.get("counter"):
                        c = inner["counter"]
                        out.setdefault(val, {})["denied"] = [int(c["packets"]),
                                                             int(c["bytes"])]
                    continue
                left = int(inner.get("expires", 0)) if inner else 0
                if left < 1 or not isinstance(val, dict) or "concat" not in val:
                    continue  # a policy's own element (no timeout) or about to expire
                parts = [_json_part(x) for x in val["concat"]]
                elem = " . ".join([_ifname(parts[0]), *parts[1:]]) + f" timeout {left}s"
                out.setdefault(parts[0], {}).setdefault("pins", []).append(
                    (name, elem, left))
        return out

    def exists(self) -> bool:
        try:  # the names only: listing the table would print every element
            out = self.nft.run("list tables inet")
        except NftError:
            return False
        return f"table {self.t}\n" in out + "\n"

    def remove(self) -> None:
        try:
            self.nft.run(f"delete table {self.t}")
        except NftError:
            pass
        self.nft.close()

    # ---- per sandbox ---------------------------------------------------------------------
    @staticmethod
    def pins(ifname: str, addrs: list[str], ports: Ports, ttl: int) -> dict[str, list[str]]:
        """DNS pins by set: hash sets for an exact port or every port (their removal does not
        grow with the number of sandboxes, unlike the interval set's), the interval set only
        for a port range."""
        i, to = _ifname(ifname), f" timeout {ttl}s"
        out: dict[str, list[str]] = {}
        for a in addrs:
            v = ipaddress.ip_address(a).version
            for p in ports:
                if p == (0, 65535):
                    out.setdefault(f"pinall{v}", []).append(f"{i} . {a}{to}")
                elif p[0] == p[1]:
                    out.setdefault(f"pin{v}", []).extend(
                        f"{i} . {a} . {proto} . {p[0]}{to}" for proto in PROTOS)
                else:
                    out.setdefault(f"allow{v}", []).extend(
                        f"{i} . {a} . {proto} . {_port(p)}{to}" for proto in PROTOS)
        return out

    @staticmethod
    def policy_elems(ifname: str, policy: Policy | None) -> dict[str, list[str]]:
        """A policy's CIDR rules as elements of the interval sets, by set (allow4, deny6...)."""
        out: dict[str, list[str]] = {n: [] for n in INTERVAL_SETS}
        if policy is None:
            return out
        for kind, rules in (("allow", policy.allow), ("deny", policy.deny)):
            cidrs = policy.cidrs(rules)
            for v in (4, 6):
                boxes = _disjoint([(n, p) for n, p in cidrs if n.version == v])
                out[f"{kind}{v}"] = Firewall.rules(ifname, [(n, (p,)) for n, p in boxes])
        return out

    @staticmethod
    def rules(ifname: str, nets: Iterable[tuple[ipaddress.IPv4Network | ipaddress.IPv6Network
                                                | str, Ports]],
               timeout_s: int | None = None) -> list[str]:
        to = f" timeout {timeout_s}s" if timeout_s else ""
        return [f"{_ifname(ifname)} . {net} . {proto} . {_port(p)}{to}"
                for net, ports in nets for p in ports for proto in PROTOS]

    def shard(self, ifname: str) -> int:
        return int(ifname[len(self.s.ifprefix):]) % SHARDS

    def _physical(self, ifname: str, by_set: dict[str, list[str]]) -> dict[str, list[str]]:
        """Set names as callers know them (allow4, deny4) -> the sandbox's shard's."""
        k = self.shard(ifname)
        return {(f"{n}_{k}" if n in INTERVAL_SETS else n): v for n, v in by_set.items()}

    def attach_cmds_for(self, ifname: str, addr: ipaddress.IPv4Address,
                        addr6: ipaddress.IPv6Address | None, internet: bool,
                        elems: dict[str, list[str]]) -> str:
        """A sandbox's elements: its sources, its shard, its mode, and ``elems`` by set."""
        t, i = self.t, _ifname(ifname)
        cmds = [f"add element {t} src4 {{ {i} . {addr} }}",
                f"add element {t} shard {{ {i} : jump p{self.shard(ifname)} }}"]
        if addr6 is not None:
            cmds.append(f"add element {t} src6 {{ {i} . {addr6} }}")
        if internet:
            cmds.append(f"add element {t} internet {{ {i} }}")
        cmds += [f"add element {t} {name} {{ {', '.join(items)} }}"
                 for name, items in self._physical(ifname, elems).items() if items]
        return "\n".join(cmds)

    def peers_cmd(self, pairs: list[tuple[str, str]]) -> str:
        items = [f"{_ifname(a)} . {_ifname(b)}" for a, b in pairs]
        return f"add element {self.t} peers {{ {', '.join(items)} }}"

    def run(self, cmds: str) -> None:
        self.nft.run(cmds)

    def attach(self, ifname: str, addr: ipaddress.IPv4Address,
               addr6: ipaddress.IPv6Address | None, internet: bool,
               elems: dict[str, list[str]]) -> None:
        """A sandbox's elements (attach_cmds_for's), one transaction."""
        i = _ifname(ifname)
        sets = {"src4": [f"{i} . {addr}"], "shard": [f"{i} : jump p{self.shard(ifname)}"],
                "src6": [f"{i} . {addr6}"] if addr6 is not None else [],
                "internet": [i] if internet else []}
        self.add({**sets, **self._physical(ifname, elems)})

    def add_sets(self, ifname: str, by_set: dict[str, list[str]]) -> None:
        """Elements of one sandbox into several sets, one transaction."""
        self.add(self._physical(ifname, by_set))

    def add(self, sets: dict[str, list[str]]) -> None:
        """Add elements (our own text form) in one transaction straight over netlink
        (corral._core.nft_add_elements): libnftables reads every set's definition of the
        table first, which costs more the more sets (shards) it has."""
        batch = _new_batch(sets)
        if batch:
            _core.nft_add_elements(self.s.table, batch)

    def detach(self, ifname: str, addr: ipaddress.IPv4Address,
               addr6: ipaddress.IPv6Address | None, elems: dict[str, list[str]],
               denied: int | None = None) -> None:
        """Remove every element of this sandbox (those that expired meanwhile too): one
        transaction if it fits one send, else several (corral._core), the first of which
        takes its source addresses (``src4``, ``src6``: the sandbox sends nothing from then
        on). ``denied``: its denied count, when the caller has just read it."""
        i = _ifname(ifname)
        sets = {"src4": [f"{i} . {addr}"],
                "src6": [f"{i} . {addr6}"] if addr6 is not None else [],
                "internet": [i], "denied": [i], "conns": [i], "host_rate": [i],
                "conn_rate": [i], "shard": [i]}
        for k, v in self._physical(ifname, elems).items():
            sets.setdefault(k, []).extend(v)
        # Its denied destinations too (the interface name is used again by a later
        # sandbox); a sandbox never refused has none, so no dump of the set for it.
        if self.denied_count(ifname) if denied is None else denied:
            for a in self.denied_destinations(ifname):
                sets.setdefault("denied_to6" if ":" in a else "denied_to4", []).append(
                    f"{i} . {a}")
        self.destroy(sets)

    def destroy(self, sets: dict[str, list[str]]) -> None:
        """Remove elements (our own text form) in one transaction straight over netlink
        (corral._core.nft_destroy_elements): libnftables reads the whole set before a
        delete, which costs O(elements in the set) per call."""
        batch = _gone_batch(sets)
        if batch:
            _core.nft_destroy_elements(self.s.table, batch)

    def swap(self, ifname: str, old: dict[str, list[str]], new: dict[str, list[str]]) -> None:
        """Replace a sandbox's policy elements (``old`` -> ``new``) in one transaction that
        removes only what ``new`` lacks and adds only what ``old`` lacked: an element both
        hold is never touched, so what both policies allow is never refused meanwhile (a
        set's delete and re-add of one element, even in one transaction, leaves an instant
        where the kernel's lookup sees neither)."""
        was, will = self._physical(ifname, old), self._physical(ifname, new)
        gone = {k: _minus(v, will.get(k, ())) for k, v in was.items()}
        added = {k: _minus(v, was.get(k, ())) for k, v in will.items()}
        gone_batch, added_batch = _gone_batch(gone), _new_batch(added)
        if gone_batch or added_batch:
            _core.nft_swap_elements(self.s.table, gone_batch, added_batch)

    def peers(self, pairs: list[tuple[str, str]], add: bool) -> None:
        if not pairs:
            return
        items = [f"{_ifname(a)} . {_ifname(b)}" for a, b in pairs]
        if add:
            self.add({"peers": items})
        else:
            self.destroy({"peers": items})

    def denied_total(self) -> int:
        """Packets rejected so far, over every live sandbox: one netlink dump of the set
        (libnftables would read every set and chain of the table first)."""
        try:
            return sum(packets for _, packets, _ in
                       _core.nft_dump_counters(self.s.table, "denied", b""))
        except OSError:
            return 0

    def denied_count(self, ifname: str) -> int:
        """Packets of this sandbox rejected so far (0 before the first), read over netlink
        (libnftables' get reads every set and chain of the table first)."""
        try:
            got = _core.nft_get_counter(self.s.table, "denied",
                                        element_key(_ifname(ifname), False)[0])
        except OSError:
            return 0
        return got[0] if got else 0


    def denied_destinations(self, ifname: str) -> dict[str, int]:
        """Packets of this sandbox rejected so far, by destination address (those refused
        in the last DENIED_TO_TIMEOUT), over netlink: one dump of the set."""
        out: dict[str, int] = {}
        for name in DENIED_TO:
            try:
                got = _core.nft_dump_counters(self.s.table, name,
                                              element_key(_ifname(ifname), False)[0])
            except OSError:
                continue
            out.update({str(ipaddress.ip_address(key[16:])): packets
                        for key, packets, _ in got})
        return out


AnyNet = ipaddress.IPv4Network | ipaddress.IPv6Network


def _disjoint(rules: list[tuple[AnyNet, Ports]]) -> list[tuple[AnyNet, tuple[int, int]]]:
    """CIDR rules of one family as (network, port range) boxes that do not overlap (the
    kernel's interval set refuses an element whose start or end lies in another's). Rules
    whose networks overlap are taken together: their ports cut where any of their ranges
    starts or ends, the networks covering each piece collapsed, neighbouring pieces with the
    same networks joined again; a rule overlapping no other keeps its own elements."""
    groups: list[list[tuple[AnyNet, Ports]]] = []
    for rule in rules:
        hit = [g for g in groups if any(rule[0].overlaps(n) for n, _ in g)]
        groups = [g for g in groups if all(g is not h for h in hit)]
        groups.append([rule, *(r for g in hit for r in g)])
    out: list[tuple[AnyNet, tuple[int, int]]] = []
    for group in groups:
        cuts = sorted({lo for _, ps in group for lo, _ in ps} |
                      {hi + 1 for _, ps in group for _, hi in ps})
        pieces: list[tuple[list[AnyNet], int, int]] = []
        for lo, end in zip(cuts, cuts[1:], strict=False):
            nets = [n for n, ps in group if any(a <= lo and end - 1 <= b for a, b in ps)]
            merged: list[AnyNet] = list(ipaddress.collapse_addresses(nets))  # type: ignore[type-var]
            if not merged:
                continue
            if pieces and pieces[-1][0] == merged and pieces[-1][2] == lo - 1:
                pieces[-1] = (merged, pieces[-1][1], end - 1)
            else:
                pieces.append((merged, lo, end - 1))
        out += [(n, (lo, hi)) for nets, lo, hi in pieces for n in nets]
    return out


def _json_part(x: object) -> str:
    """One field of an element as libnftables' JSON lists it, in this module's text form."""
    if isinstance(x, dict) and "prefix" in x:
        return f"{x['prefix']['addr']}/{x['prefix']['len']}"
    if isinstance(x, dict) and "range" in x:
        return f"{x['range'][0]}-{x['range'][1]}"
    return str(x)


def _minus(elems: list[str], other: Iterable[str]) -> list[str]:
    drop = set(other)
    return [e for e in elems if e not in drop]


def _new_batch(sets: dict[str, list[str]]) -> list[tuple[str, list[tuple[
        bytes, bytes | None, int | None, str | None]]]]:
    """Elements to add, by set, as corral._core takes them."""
    return [(name, [new_element(e, name.rsplit("_", 1)[0] in INTERVAL_SETS) for e in items])
            for name, items in sets.items() if items]


def _gone_batch(sets: dict[str, list[str]]) -> list[tuple[str, list[tuple[bytes,
                                                                          bytes | None]]]]:
    """Elements to remove, by set, as corral._core takes them."""
    return [(name, [element_key(e, name.rsplit("_", 1)[0] in INTERVAL_SETS) for e in items])
            for name, items in sets.items() if items]


# Elements repeat: a slot's interface name (and with it its elements) comes back with the next
# sandbox, a policy's with each sandbox that names it. Parsing one costs ~10 us of ipaddress.
@functools.lru_cache(maxsize=8192)
def new_element(elem: str, interval: bool) -> tuple[bytes, bytes | None, int | None,
                                                   str | None]:
    """An element in the text form this module writes (``key [timeout Ns]`` or, in the
    verdict map, ``key : jump chain``) as corral._core.nft_add_elements takes it."""
    key, _, jump = elem.partition(" : jump ")
    key, _, timeout = key.partition(" timeout ")
    k, end = element_key(key, interval)
    ms = int(timeout.strip().rstrip("s")) * 1000 if timeout else None
    return k, end, ms, (jump.strip() or None)


def _address_bounds(part: str) -> tuple[bytes, bytes]:
    """First and last address of ``a``, ``a/len`` or ``a-b`` (IPv4 or IPv6), packed."""
    if "-" in part:
        lo, _, hi = part.partition("-")
        return ipaddress.ip_address(lo).packed, ipaddress.ip_address(hi).packed
    net = ipaddress.ip_network(part)
    return net.network_address.packed, net.broadcast_address.packed


@functools.lru_cache(maxsize=8192)
def element_key(elem: str, interval: bool) -> tuple[bytes, bytes | None]:
    """The kernel's key (and, in an interval set, end key) of an element in the text form
    this module writes: fields joined by " . ", each an interface name in quotes (16 bytes),
    an IPv4 address, CIDR or range (4), an IPv6 one (16), tcp/udp (1, padded to 4), a port or
    port range (2 bytes big endian, padded to 4); a " timeout ..." suffix is ignored."""
    key, end = b"", b""
    for part in elem.split(" timeout ")[0].split(" . "):
        part = part.strip()
        if part.startswith('"'):
            name = part.strip('"').encode()
            k = e = name.ljust(16, b"\0")
        elif part in PROTO_NUMBERS:
            k = e = bytes([PROTO_NUMBERS[part], 0, 0, 0])
        elif ":" in part or "." in part:
            k, e = _address_bounds(part)
        else:
            lo, _, hi = part.partition("-")
            k = int(lo).to_bytes(2, "big") + b"\0\0"
            e = int(hi or lo).to_bytes(2, "big") + b"\0\0"
        key, end = key + k, end + e
    return key, (end if interval else None)
