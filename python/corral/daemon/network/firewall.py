"""The daemon's nftables table: fixed rules written once, per-sandbox state in sets keyed by
the sandbox's host-side interface, so attaching a sandbox is a few set elements in one
transaction, never a rule-set reload.

What a sandbox may send (chain ``from_sandbox``), in order: nothing but IPv4 from its own
address (spoofing and IPv6 are dropped); replies of flows already allowed; other sandboxes
only if both are in one network group; out of the uplink only (never another host
interface); never link-local/metadata (169.254.0.0/16) nor the daemon's own range; no new
connection past the per-sandbox cap; a policy's deny entries; its allow CIDRs; never the
private ranges; the DNS proxy's pins (which expire with the answer's TTL); everything else
only in mode "internet". To the host itself (chain ``to_host``): only DNS (UDP and TCP) to
the gateway address. Denied packets are rejected (TCP: a reset, which the kernel does not
rate-limit as it does ICMP errors; others: admin-prohibited) and counted per sandbox in the
dynamic set ``denied``, and per sandbox and destination address in ``denied_to4`` (entries
expire DENIED_TO_TIMEOUT after their last packet; DENIED_TO_SIZE in all)."""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Iterable

from corral import _core

from .nft import Nft, NftError
from .settings import NetSettings

PRIVATE4 = ("0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "172.16.0.0/12",
            "192.168.0.0/16", "224.0.0.0/3")
BLOCKED4 = ("169.254.0.0/16",)
PROTOS = ("tcp", "udp")
PROTO_NUMBERS = {"tcp": 6, "udp": 17}
INTERVAL_SETS = ("allow4", "deny4")
# The interval sets are sharded by sandbox slot: the kernel's pipapo set does a removal in
# time linear in the set's size, so one set for every sandbox made ending a sandbox with CIDR
# rules cost ~150 ms of kernel CPU at 1,000 sandboxes (5 ms with 256 shards); a vmap on the
# interface jumps to its shard's chain, whose sets hold 1/SHARDS of the elements (a lookup is
# a hash lookup more). Elements go in and out over netlink (corral._core), so the number of
# sets costs nothing per sandbox.
SHARDS = 256
# Denied destinations: one element per (sandbox, address), so a port scan of one host is one
# element; a sweep of many addresses fills the set, after which new destinations go
# unrecorded (still refused, still in the sandbox's total) until older ones expire.
DENIED_TO_SIZE = 65536
DENIED_TO_TIMEOUT = "10m"

Ports = tuple[tuple[int, int], ...]


def _port(p: tuple[int, int]) -> str:
    return str(p[0]) if p[0] == p[1] else f"{p[0]}-{p[1]}"


def _ifname(name: str) -> str:
    return '"' + name + '"'


class Firewall:
    def __init__(self, settings: NetSettings) -> None:
        self.s = settings
        self.nft = Nft()
        self.t = f"inet {settings.table}"

    def ruleset(self) -> str:
        s, w = self.s, self.s.ifprefix + "*"
        blocked = ", ".join((*BLOCKED4, str(s.range4)))
        private = ", ".join(PRIVATE4)
        key = "ifname . ipv4_addr . inet_proto . inet_service"
        shard_sets = "\n".join(
            f"  set allow4_{k} {{ type {key}; flags interval, timeout; }}\n"
            f"  set deny4_{k} {{ type {key}; flags interval; }}" for k in range(SHARDS))
        # A policy's deny entries, then its allow CIDRs (and DNS pins of port ranges).
        shard_chains = "\n".join(
            f"  chain p{k} {{\n"
            f"    iifname . ip daddr . meta l4proto . th dport @deny4_{k} goto deny\n"
            f"    iifname . ip daddr . meta l4proto . th dport @allow4_{k} accept\n  }}"
            for k in range(SHARDS))
        return f"""
table {self.t} {{
  set src4 {{ type ifname . ipv4_addr; }}
  set internet {{ type ifname; }}
  set peers {{ type ifname . ifname; }}
  map shard {{ type ifname : verdict; }}
{shard_sets}
  set pin4 {{ type ifname . ipv4_addr . inet_proto . inet_service; flags timeout; }}
  set pinall4 {{ type ifname . ipv4_addr; flags timeout; }}
  set blocked4 {{ type ipv4_addr; flags interval; elements = {{ {blocked} }}; }}
  set private4 {{ type ipv4_addr; flags interval; elements = {{ {private} }}; }}
  set denied {{ type ifname; flags dynamic; counter; size 1048576; }}
  set denied_to4 {{ type ifname . ipv4_addr; flags dynamic, timeout; counter;
    size {DENIED_TO_SIZE}; timeout {DENIED_TO_TIMEOUT}; }}
  set conns {{ type ifname; flags dynamic; size 1048576; }}
  chain input {{ type filter hook input priority -10; policy accept;
    iifname "{w}" jump to_host
  }}
  chain forward {{ type filter hook forward priority -10; policy accept;
    iifname "{w}" jump from_sandbox
    oifname "{w}" jump to_sandbox
  }}
  chain to_host {{
    meta nfproto != ipv4 drop
    iifname . ip saddr != @src4 drop
    ct state established,related accept
    ip daddr {s.gateway} udp dport 53 accept
    ip daddr {s.gateway} tcp dport 53 accept
    ip daddr {s.gateway} icmp type echo-request accept
    goto deny
  }}
  chain from_sandbox {{
    meta nfproto != ipv4 drop
    iifname . ip saddr != @src4 drop
    ct state established,related accept
    oifname "{w}" iifname . oifname @peers accept
    oifname "{w}" goto deny
    oifname != "{s.uplink}" goto deny
    ip daddr @blocked4 goto deny
    ct state new add @conns {{ iifname ct count over {s.max_connections} }} goto deny
    iifname vmap @shard
    ip daddr @private4 goto deny
    iifname . ip daddr . meta l4proto . th dport @pin4 accept
    iifname . ip daddr @pinall4 accept
    iifname @internet accept
    goto deny
  }}
  chain to_sandbox {{
    ct state established,related accept
    drop
  }}
{shard_chains}
  chain deny {{
    update @denied {{ iifname }}
    meta nfproto ipv4 update @denied_to4 {{ iifname . ip daddr }}
    meta l4proto tcp reject with tcp reset
    reject with icmpx admin-prohibited
  }}
  chain nat {{ type nat hook postrouting priority srcnat; policy accept;
    ip saddr {s.range4} oifname "{s.uplink}" masquerade
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
        ``denied`` (packets, bytes), ``denied_to`` ((address, packets, bytes), ...)."""
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
            if not st or name not in ("pin4", "pinall4", "allow4", "denied", "denied_to4"):
                continue
            for e in st.get("elem", []):
                inner = e.get("elem") if isinstance(e, dict) and "elem" in e else None
                val = inner["val"] if inner else e
                if name == "denied_to4":
                    if inner and inner.get("counter") and isinstance(val, dict):
                        ifname, addr = (_json_part(x) for x in val.get("concat", ("", "")))
                        c = inner["counter"]
                        out.setdefault(ifname, {}).setdefault("denied_to", []).append(
                            (addr, int(c["packets"]), int(c["bytes"])))
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
        out: dict[str, list[str]] = {"pin4": [], "pinall4": [], "allow4": []}
        for a in addrs:
            for p in ports:
                if p == (0, 65535):
                    out["pinall4"].append(f"{i} . {a}{to}")
                elif p[0] == p[1]:
                    out["pin4"] += [f"{i} . {a} . {proto} . {p[0]}{to}" for proto in PROTOS]
                else:
                    out["allow4"] += [f"{i} . {a} . {proto} . {_port(p)}{to}" for proto in PROTOS]
        return {k: v for k, v in out.items() if v}

    @staticmethod
    def rules(ifname: str, nets: Iterable[tuple[ipaddress.IPv4Network | str, Ports]],
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

    def attach_cmds_for(self, ifname: str, addr: ipaddress.IPv4Address, internet: bool,
                        elems: dict[str, list[str]]) -> str:
        """A sandbox's elements: its source, its shard, its mode, and ``elems`` by set."""
        t, i = self.t, _ifname(ifname)
        cmds = [f"add element {t} src4 {{ {i} . {addr} }}",
                f"add element {t} shard {{ {i} : jump p{self.shard(ifname)} }}"]
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

    def attach(self, ifname: str, addr: ipaddress.IPv4Address, internet: bool,
               elems: dict[str, list[str]]) -> None:
        """A sandbox's elements (attach_cmds_for's), one transaction."""
        i = _ifname(ifname)
        sets = {"src4": [f"{i} . {addr}"], "shard": [f"{i} : jump p{self.shard(ifname)}"],
                "internet": [i] if internet else []}
        self.add({**sets, **self._physical(ifname, elems)})

    def add_sets(self, ifname: str, by_set: dict[str, list[str]]) -> None:
        """Elements of one sandbox into several sets, one transaction."""
        self.add(self._physical(ifname, by_set))

    def add(self, sets: dict[str, list[str]]) -> None:
        """Add elements (our own text form) in one transaction straight over netlink
        (corral._core.nft_add_elements): libnftables reads every set's definition of the
        table first, which costs more the more sets (shards) it has."""
        batch = [(name, [new_element(e, name.rsplit("_", 1)[0] in INTERVAL_SETS)
                         for e in items])
                 for name, items in sets.items() if items]
        if batch:
            _core.nft_add_elements(self.s.table, batch)

    def detach(self, ifname: str, addr: ipaddress.IPv4Address, elems: dict[str, list[str]]
               ) -> None:
        """Remove every element of this sandbox (those that expired meanwhile too) in one
        transaction."""
        i = _ifname(ifname)
        sets = {"src4": [f"{i} . {addr}"], "internet": [i], "denied": [i], "conns": [i],
                "shard": [i]}
        for k, v in self._physical(ifname, elems).items():
            sets.setdefault(k, []).extend(v)
        # Its denied destinations too (the interface name is used again by a later
        # sandbox); a sandbox never refused has none, so no dump of the set for it.
        if self.denied_count(ifname):
            sets["denied_to4"] = [f"{i} . {a}" for a in self.denied_destinations(ifname)]
        self.destroy(sets)

    def destroy(self, sets: dict[str, list[str]]) -> None:
        """Remove elements (our own text form) in one transaction straight over netlink
        (corral._core.nft_destroy_elements): libnftables reads the whole set before a
        delete, which costs O(elements in the set) per call."""
        batch = [(name, [element_key(e, name.rsplit("_", 1)[0] in INTERVAL_SETS)
                         for e in items])
                 for name, items in sets.items() if items]
        if batch:
            _core.nft_destroy_elements(self.s.table, batch)

    def swap(self, ifname: str, old: dict[str, list[str]], new: dict[str, list[str]]) -> None:
        """Replace a sandbox's policy elements (``old`` -> ``new``): the old out, then the
        new in (in between, the sandbox's new connections are refused, never let through)."""
        self.destroy(self._physical(ifname, old))
        self.add(self._physical(ifname, new))

    def peers(self, pairs: list[tuple[str, str]], add: bool) -> None:
        if not pairs:
            return
        items = [f"{_ifname(a)} . {_ifname(b)}" for a, b in pairs]
        if add:
            self.add({"peers": items})
        else:
            self.destroy({"peers": items})

    def denied_total(self) -> int:
        """Packets rejected so far, over every live sandbox."""
        try:
            out = self.nft.run(f"list set {self.t} denied")
        except NftError:
            return 0
        return sum(int(n) for n in re.findall(r"counter packets (\d+)", out))

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
        try:
            got = _core.nft_dump_counters(self.s.table, "denied_to4",
                                          element_key(_ifname(ifname), False)[0])
        except OSError:
            return {}
        return {str(ipaddress.ip_address(key[16:])): packets for key, packets, _ in got}


def _json_part(x: object) -> str:
    """One field of an element as libnftables' JSON lists it, in this module's text form."""
    if isinstance(x, dict) and "prefix" in x:
        return f"{x['prefix']['addr']}/{x['prefix']['len']}"
    if isinstance(x, dict) and "range" in x:
        return f"{x['range'][0]}-{x['range'][1]}"
    return str(x)


def new_element(elem: str, interval: bool) -> tuple[bytes, bytes | None, int | None,
                                                   str | None]:
    """An element in the text form this module writes (``key [timeout Ns]`` or, in the
    verdict map, ``key : jump chain``) as corral._core.nft_add_elements takes it."""
    key, _, jump = elem.partition(" : jump ")
    key, _, timeout = key.partition(" timeout ")
    k, end = element_key(key, interval)
    ms = int(timeout.strip().rstrip("s")) * 1000 if timeout else None
    return k, end, ms, (jump.strip() or None)


def element_key(elem: str, interval: bool) -> tuple[bytes, bytes | None]:
    """The kernel's key (and, in an interval set, end key) of an element in the text form
    this module writes: fields joined by " . ", each an interface name in quotes (16 bytes),
    an IPv4 address or CIDR (4), tcp/udp (1, padded to 4), a port or port range (2 bytes big
    endian, padded to 4); a " timeout ..." suffix is ignored."""
    key, end = b"", b""
    for part in elem.split(" timeout ")[0].split(" . "):
        part = part.strip()
        if part.startswith('"'):
            name = part.strip('"').encode()
            k = e = name.ljust(16, b"\0")
        elif part in PROTO_NUMBERS:
            k = e = bytes([PROTO_NUMBERS[part], 0, 0, 0])
        elif "." in part:
            net = ipaddress.IPv4Network(part)
            k, e = net.network_address.packed, net.broadcast_address.packed
        else:
            lo, _, hi = part.partition("-")
            k = int(lo).to_bytes(2, "big") + b"\0\0"
            e = int(hi or lo).to_bytes(2, "big") + b"\0\0"
        key, end = key + k, end + e
    return key, (end if interval else None)
