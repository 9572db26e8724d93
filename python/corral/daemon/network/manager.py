"""Networked sandboxes (modes "internet" and policies): plumbing pooled ahead of creates,
attached with a few nftables set elements, detached with the sandbox. Started on the first
networked create, so a daemon that never makes one touches no host networking."""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from corral import _core
from corral.daemon.locks import try_lock
from corral.errors import InvalidNetwork, InvalidRequest, Unsupported
from corral.models import NETWORK_MODES

from . import settings as settings_mod
from .firewall import Firewall
from .nft import NftError
from .policy import Policy, compile_policy
from .ranges import RangePins
from .settings import NetSettings

if TYPE_CHECKING:
    from .dns import DnsProxy
    from .expose import Exposer
    from .links import Links

log = logging.getLogger("corral.network")

Ports = tuple[tuple[int, int], ...]
REFILL_QUIET_S = 0.02
# A new link's own chatter (the multicast listener reports of its addresses, repeated within
# 10 ms: corral._core.veth_setup) is over well within this; the namespace's counters are then
# those of every quiet slot (``NetworkManager._settled_print``).
SETTLE_S = 0.1
DENIED_SHOWN = 50  # info()'s denied destinations: the most refused ones
FINAL_KEPT = 4096  # ended sandboxes' last counters waiting for the engine to take them
LINK_STATS = ("rx_bytes", "rx_packets", "tx_bytes", "tx_packets")


@dataclass
class Readopted:
    """A sandbox a killed daemon left running, as its record tells (NetworkManager.restore)."""
    sandbox_id: str
    network: Any
    group: str | None
    bandwidth_mbit: float | None
    state: dict[str, Any] | None   # NetworkManager.state_of when it was made
    init_pid: int


@dataclass
class Attachment:
    """One sandbox's network: its slot (interface, address), mode and policy."""
    sandbox_id: str
    index: int
    ifname: str
    address: ipaddress.IPv4Address
    address6: ipaddress.IPv6Address | None  # None: IPv4 only
    policy: Policy | None          # None: mode "internet"
    group: str | None
    label: Any                     # what the sandbox asked for (for info)
    mgr: NetworkManager
    elems: dict[str, list[str]] = field(default_factory=dict)  # its policy's, by set
    refused_names: collections.Counter = field(default_factory=collections.Counter)
    pins: dict[str, float] = field(default_factory=dict)  # pinned address -> expiry
    # Its pinned entries, what its cap of pins counts: (address, port range) -> expiry.
    entries: dict[tuple[str, tuple[int, int]], float] = field(default_factory=dict)
    # Its DNS pins in the kernel: (set, element without its timeout) -> expiry (time.time()).
    pinned: dict[tuple[str, str], float] = field(default_factory=dict)
    pins_refused: int = 0  # answers refused: they would have taken it past its cap of pins
    ranges: RangePins = field(default_factory=RangePins)  # its pins of port ranges
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Bumped by each policy change (under ``lock``, after ``policy`` is set): an answer looked
    # up under an older policy pins nothing (``pin``).
    generation: int = 0
    # Its slot may go back to the pool when it ends (``NetworkManager.recycle``): not a
    # shaped link (its qdiscs are the sandbox's), nor a re-adopted one (made by another daemon).
    recyclable: bool = False
    _prune_at: float = 0.0

    # ---- what the DNS proxy calls --------------------------------------------------------
    def pin(self, addrs: list[str], ports: Ports, ttl: int, generation: int | None = None,
            only: dict[str, Ports] | None = None) -> bool | None:
        """Pin ``addrs`` (an answer's) for ``ports`` (``only[addr]`` instead for the addresses
        it names) and ``ttl`` seconds. False, pinning nothing, if that would take the sandbox
        past its cap of live pinned entries (``NetSettings.max_pins``: an address counts once
        for each of its port entries); None, pinning nothing, if its policy changed since
        ``generation`` (the answer was looked up under a policy that no longer holds)."""
        with self.lock:
            if self.mgr.attachments.get(self.sandbox_id) is not self:
                return True  # detached meanwhile: pin nothing for a dead interface
            if generation is not None and generation != self.generation:
                return None
            only = only or {}
            want = {(a, p) for a in addrs for p in only.get(a, ports)}
            now = time.time()
            self._prune(now)
            cap = self.mgr.s.max_pins if self.mgr.s is not None else 0
            new = sum(1 for k in want if k not in self.entries)
            if len(self.entries) + new > cap:
                self._prune(now, force=True)
                new = sum(1 for k in want if k not in self.entries)
                if len(self.entries) + new > cap:
                    self.pins_refused += 1
                    return False
            by_set: dict[str, list[str]] = {}
            groups: dict[Ports, list[str]] = {}
            for a in addrs:
                groups.setdefault(only.get(a, ports), []).append(a)
            for p, group in groups.items():
                for name, elems in Firewall.pins(self.ifname, group, p, ttl).items():
                    by_set.setdefault(name, []).extend(elems)
            placed = None
            for name in ("allow4", "allow6"):
                if name in by_set:
                    by_set[name], placed = self.ranges.place(
                        by_set[name], self.elems.get(name, []), ttl, placed)
            self.mgr.fw.add_sets(self.ifname, {k: v for k, v in by_set.items() if v})
            if placed is not None:
                self.ranges.commit(placed)
            until = now + ttl
            for name, elems in by_set.items():
                for e in elems:
                    k = (name, e.split(" timeout ")[0])
                    self.pinned[k] = max(until, self.pinned.get(k, 0.0))
            for a in {a for a, _ in want}:
                self.pins[a] = max(until, self.pins.get(a, 0.0))
            for entry in want:
                self.entries[entry] = max(until, self.entries.get(entry, 0.0))
            return True

    def _prune(self, now: float, force: bool = False) -> None:
        """Forget pins past their expiry (the kernel has dropped them: ours is noted after
        its add, so later than the kernel's); at most once a second unless ``force``."""
        if not force and now < self._prune_at:
            return
        self._prune_at = now + 1.0
        self.pins = {a: t for a, t in self.pins.items() if t > now}
        self.entries = {k: t for k, t in self.entries.items() if t > now}
        self.pinned = {k: t for k, t in self.pinned.items() if t > now}
        self.ranges.prune(now)

    def current(self) -> dict[str, list[str]]:
        """Its elements in the kernel by set: its policy's and its live pins (lock held)."""
        self._prune(time.time(), force=True)
        out = {k: list(v) for k, v in self.elems.items()}
        for name, elem in self.pinned:
            out.setdefault(name, []).append(elem)
        return out

    def peer(self, name: str, version: int = 4) -> str | None:
        return self.mgr.peer_address(self, name, version)

    def refused(self, name: str) -> None:
        if len(self.refused_names) < 1000 or name in self.refused_names:
            self.refused_names[name] += 1


LOCK_DIR = "/run/corral/locks"


def lock_path(kind: str, key: str) -> str:
    """The ownership flock of one network setting: named by its kind too, so a table named
    like another daemon's interface prefix is no clash."""
    return os.path.join(LOCK_DIR, f"net-{kind}-{key.replace('/', '_').replace(':', '-')}.lock")


def _own_network(s: NetSettings) -> list[int]:
    """Flocks on this daemon's nftables table, address range and interface prefix, held
    while it networks sandboxes: a second daemon on any of them would sweep, rewrite or
    collide with the first one's table, links and DNS proxy. Unsupported, naming the
    owner, if another live daemon holds one."""
    os.makedirs(LOCK_DIR, mode=0o700, exist_ok=True)
    held: list[int] = []
    for what, kind, key, var in (
            ("nftables table", "table", s.table, "CORRAL_NET_TABLE"),
            ("address range", "range", str(s.range4), "CORRAL_NET_RANGE"),
            *([("IPv6 range", "range6", str(s.range6), "CORRAL_NET_RANGE6")]
              if s.range6 is not None else []),
            ("interface prefix", "ifprefix", s.ifprefix, "CORRAL_NET_IFPREFIX")):
        path = lock_path(kind, key)
        fd = try_lock(path)
        if fd is None:
            for h in held:
                os.close(h)
            try:
                with open(path, "rb") as f:
                    other = f.read(32).decode(errors="replace").strip()
            except OSError:
                other = ""
            raise Unsupported(
                f"the {what} {key!r} belongs to another running corrald (pid {other or '?'}); "
                f"give this daemon its own ({var}, and the other network settings with it)",
                details={"owner_pid": int(other) if other.isdigit() else None, what: key})
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        held.append(fd)
    return held


class NetworkManager:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started = False
        self._error: str | None = None
        self.s: NetSettings | None = None
        try:
            self.s = settings_mod.load()
        except (ValueError, OSError) as e:
            self._error = f"network settings: {e}"
            log.error("%s (networked creates are refused)", self._error)
        self.fw: Firewall
        self.links: Links
        self.dns: DnsProxy | None = None
        self.attachments: dict[str, Attachment] = {}
        self._by_addr: dict[str, Attachment] = {}
        # The network groups' members, by group then sandbox id: the pairs in the firewall's
        # peers set are exactly those between two members of one group. Changed only under
        # _group_lock, each change with its pairs (_join, _leave): worked out from a registry
        # that changed meanwhile, a join racing a leave left a pair of slots linked, and the
        # next sandboxes given those slots (any tenant's) could reach each other.
        self._groups: dict[str, dict[str, Attachment]] = {}
        self._group_lock = threading.Lock()
        self._final: dict[str, dict[str, Any]] = {}  # network_final_state
        # Slots of ended sandboxes: reusable once the kernel has removed their veth, which
        # it does when their namespace goes (cleanup_net, off the daemon's path: deleting a
        # link ourselves costs ~20 ms of RCU grace periods).
        self._draining: collections.deque[int] = collections.deque()
        self._free: list[int] = []
        self._next = 1
        self._ready: collections.deque[tuple[int, int]] = collections.deque()
        self._held: dict[str, int] = {}  # ended sandboxes' slots, until ``recycle`` decides
        self._retired: set[int] = set()  # slots whose removal failed: never handed out again
        self._quiet_print: bytes | None = None  # what a quiet slot's namespace shows
        self._quiet_read = False
        self.recycled = 0      # slots of ended sandboxes reused
        self.not_recycled = 0  # dropped: a trace of their sandbox, or no room
        self._cv = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._closed = False
        self._last_take = 0.0
        self.exposer: Exposer | None = None
        self._carry_refused = False  # restore: the table was written without its elements
        self._owned: list[int] = []  # the ownership flocks (_own_network), once taken
        self._blocked: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()
        LIVE.add(self)

    def _take_ownership(self) -> None:
        """Unsupported if another live daemon networks on these settings (lock held)."""
        if not self._owned and self.s is not None:
            self._owned = _own_network(self.s)

    def _release_ownership(self) -> None:
        for fd in self._owned:
            os.close(fd)
        self._owned = []

    @staticmethod
    def _sweep(s: NetSettings) -> None:
        """A table and links left by a daemon that was killed: removed now, so nothing of
        them outlives it longer than its restart."""
        try:
            fw = Firewall(s)
        except Unsupported:
            return  # no libnftables: nothing of ours can be there
        try:
            if not fw.exists():
                return
            from .links import Links

            links = Links(s)
            try:
                for name in links.stale():
                    links.remove_name(name)
            finally:
                links.close()
            fw.remove()
        finally:
            fw.nft.close()

    # ---- names ---------------------------------------------------------------------------
    @property
    def allowlists(self) -> dict[str, list[str]]:
        return dict(self.s.allowlists) if self.s is not None else {}

    def blocked(self) -> dict[str, list[str]]:
        """Addresses no sandbox may reach beyond the fixed ones: the settings' and the live
        ones (``set_blocked``)."""
        return {"configured": [str(n) for n in self.s.blocked] if self.s is not None else [],
                "live": [str(n) for n in self._blocked]}

    def set_blocked(self, items: list[str]) -> dict[str, list[str]]:
        """Replace the live blocked addresses (a cluster's other nodes, as they come and go):
        in the kernel at once if the table is written, else when it is. InvalidRequest for
        a bad entry."""
        try:
            nets = settings_mod.parse_blocked(items)
        except ValueError as e:
            raise InvalidRequest(str(e), details={"blocked": "invalid"}) from None
        with self._lock:
            if self._started:
                self.fw.set_blocked(nets)
            self._blocked = nets
        return self.blocked()

    def check(self, network: Any) -> None:
        """InvalidNetwork (or Unsupported) now, before anything is made for a create."""
        self.resolve(network)

    def resolve(self, network: Any) -> tuple[Policy | None, Any]:
        """(policy, label) for a spec's network: "internet" -> no policy; an allowlist name
        or a policy object -> its compiled rules. InvalidNetwork for unknown names and bad
        rules (checked first: bad input is the caller's, whatever the host has)."""
        lists = self.s.allowlists if self.s is not None else {}
        if network == "internet":
            out: tuple[Policy | None, Any] = (None, "internet")
        elif isinstance(network, str):
            if network not in lists:
                raise InvalidNetwork(
                    f"unknown network {network!r}: a mode (none, disabled, internet) or a "
                    f"named allowlist ({', '.join(sorted(lists)) or 'none'})",
                    details={"network": network, "modes": list(NETWORK_MODES),
                             "allowlists": sorted(lists)})
            out = compile_policy([f"@{network}"], [], lists), network
        else:
            allow, deny = list(network.allow), list(network.deny)
            out = compile_policy(allow, deny, lists), {"allow": allow, "deny": deny}
        if self.s is None:
            raise Unsupported(self._error or "networking unavailable")
        return out

    # ---- start/stop ----------------------------------------------------------------------
    def _start(self, keep: frozenset[str] = frozenset(), carried: str = "") -> None:
        """The table, stale links removed, the DNS proxy, the pool (lock held). ``keep``:
        links of re-adopted sandboxes, left in place; ``carried``: their set elements,
        written in the transaction that writes the table."""
        if self._started:
            return
        if self.s is None:
            raise Unsupported(self._error or "networking unavailable")
        if not self.s.uplink:
            raise Unsupported("networked sandboxes need an uplink interface (CORRAL_UPLINK: "
                              "none given and the host has no default route)")
        self._take_ownership()
        # pyroute2 and dnslib load here: a daemon that never networks a sandbox pays nothing
        from .dns import DnsProxy
        from .links import Links, enable_ipv4_forwarding, enable_ipv6_forwarding

        try:
            enable_ipv4_forwarding()
        except OSError as e:
            raise Unsupported(f"cannot enable IPv4 forwarding (net.ipv4.ip_forward) for the "
                              f"sandboxes' network: {e}") from None
        if self.s.range6 is not None:
            try:
                enable_ipv6_forwarding()
            except OSError as e:
                raise Unsupported(f"cannot enable IPv6 forwarding for the sandboxes' IPv6 "
                                  f"({e}); CORRAL_NET_RANGE6=none gives them IPv4 only") \
                    from None
        self.fw = Firewall(self.s, self._blocked)
        self.links = Links(self.s)
        _warn_conntrack(self.s, self.links.capacity())
        for name in self.links.stale():
            if name not in keep:
                self.links.remove_name(name)
        self._carry_refused = False
        try:
            self.fw.install(carried)
        except NftError:
            if not carried:
                raise
            log.warning("network: the re-adopted sandboxes' elements were refused as a "
                        "whole; writing them one sandbox at a time", exc_info=True)
            self.fw.install()
            self._carry_refused = True
        try:
            self.dns = DnsProxy(str(self.s.gateway), self.s.dns_upstream, self._lookup)
        except OSError as e:
            self.fw.remove()
            raise Unsupported(f"cannot start the sandboxes' DNS proxy on "
                              f"{self.s.gateway}:53: {e.strerror or e}") from None
        self._started = True
        if self.s.pool > 0:
            self._thread = threading.Thread(target=self._refill, name="corral-net-pool",
                                            daemon=True)
            self._thread.start()

    def write_resolv_conf(self, root_upper: str) -> None:
        """/etc/resolv.conf in a sandbox's root upper dir: the gateway, where the proxy is."""
        etc = os.path.join(root_upper, "etc")
        if not os.path.isdir(etc):
            os.mkdir(etc, 0o755)
        path = os.path.join(etc, "resolv.conf")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        try:
            os.write(fd, f"nameserver {self.s.gateway if self.s else ''}\n"
                         "options attempts:2 timeout:2\n".encode())
        finally:
            os.close(fd)

    def close(self) -> None:
        LIVE.discard(self)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            started, self._started = self._started, False
            ready = list(self._ready)
            self._ready.clear()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if not started:
            self._release_ownership()
            return
        for _, fd in ready:
            os.close(fd)
        if self.dns is not None:
            self.dns.close()
        if self.exposer is not None:
            self.exposer.close()
        self.attachments.clear()
        self._by_addr.clear()
        for name in self.links.stale():
            self.links.remove_name(name)
        self.fw.remove()
        self.links.close()
        self._release_ownership()

    # ---- slots ---------------------------------------------------------------------------
    def _alloc(self) -> int:
        if self._free:
            return self._free.pop()
        if self._draining and not os.path.exists(
                f"/sys/class/net/{self.links.ifname(self._draining[0])}"):
            return self._draining.popleft()
        if self._next > self.links.capacity():
            raise Unsupported(f"no free address in {self.s.range4 if self.s else '?'}")
        self._next += 1
        return self._next - 1

    def _make_slot(self) -> tuple[int, int]:
        with self._lock:
            idx = self._alloc()
        try:
            fd = _core.netns_new()
        except BaseException:
            with self._lock:
                self._free.append(idx)
            raise
        try:
            self.links.make(idx, fd)
        except BaseException:
            os.close(fd)
            with self._lock:
                self._free.append(idx)
            raise
        return idx, fd

    def _refill(self) -> None:
        from corral.daemon.substrates.container.netns import background_priority

        background_priority()
        while True:
            with self._cv:
                while not self._closed and len(self._ready) >= (self.s.pool if self.s else 0):
                    self._cv.wait()
                # Not while a create that just took a slot is still spawning (~5 ms): a
                # veth pair costs kernel CPU that create would wait for on a busy host.
                while not self._closed and self._ready and \
                        time.monotonic() - self._last_take < REFILL_QUIET_S:
                    self._cv.wait(REFILL_QUIET_S)
                if self._closed:
                    return
            try:
                slot = self._make_slot()
                if not self._quiet_read:  # once: a link that never settles is not retried
                    self._quiet_read = True
                    self._quiet_print = self._settled_print(slot[1])
            except Exception:
                log.warning("network pool: cannot make a slot", exc_info=True)
                time.sleep(1.0)
                continue
            with self._cv:
                if not self._closed:
                    self._ready.appendleft(slot)
                    continue
            os.close(slot[1])  # its links go with the namespace

    @staticmethod
    def _settled_print(netns_fd: int) -> bytes | None:
        """The fingerprint of a fresh slot's namespace once its link's own chatter is over (the
        same for every slot: the counters of a link that sent and received only that), or None
        if it does not settle; ``recycle`` compares against it. Read once, off the create path,
        by the refill thread: the wait is for the kernel's report timers, nothing to poll."""
        last = None
        for _ in range(10):
            time.sleep(SETTLE_S)
            try:
                now = _core.netns_fingerprint(netns_fd)
            except OSError:
                log.warning("network pool: cannot read a slot's fingerprint; slots of ended "
                            "sandboxes are not reused", exc_info=True)
                return None
            if now == last:
                return now
            last = now
        log.warning("network pool: a new slot's counters do not settle; slots of ended "
                    "sandboxes are not reused")
        return None

    # ---- attach/detach -------------------------------------------------------------------
    def attach(self, sandbox_id: str, network: Any, group: str | None,
               bandwidth_mbit: float | None = None) -> int:
        """A network namespace (an fd the caller owns) plumbed and allowed for
        ``sandbox_id``."""
        policy, label = self.resolve(network)
        with self._cv:
            self._start()
            slot = self._ready.pop() if self._ready else None
            self._last_take = time.monotonic()
            self._cv.notify()
        if slot is None:
            slot = self._make_slot()
        idx, fd = slot
        att = Attachment(sandbox_id, idx, self.links.ifname(idx), self.links.address(idx),
                         self.links.address6(idx), policy, group, label, self,
                         recyclable=bandwidth_mbit is None)
        att.elems = Firewall.policy_elems(att.ifname, policy)
        try:
            if bandwidth_mbit is not None:
                self.links.shape(idx, fd, bandwidth_mbit)
            self.fw.attach(att.ifname, att.address, att.address6, policy is None, att.elems)
            self._join(att)
        except BaseException:
            os.close(fd)
            self._release(att)
            raise
        with self._lock:
            self.attachments[sandbox_id] = att
            self._by_addr[str(att.address)] = att
        return fd

    def state_of(self, sandbox_id: str) -> dict[str, Any] | None:
        """What a later daemon needs to take this sandbox's network over (kept in its
        runtime record): its slot, host interface and address."""
        att = self.attachments.get(sandbox_id)
        if att is None:
            return None
        out = {"slot": att.index, "ifname": att.ifname, "address": str(att.address)}
        if att.address6 is not None:
            out["address6"] = str(att.address6)
        return out

    # ---- after a daemon restart ------------------------------------------------------------
    def restore(self, items: list[Readopted]) -> dict[str, str]:
        """Take over the networks of sandboxes a killed daemon left running: their links are
        checked (or made again in their namespace), their policies compiled from their specs,
        and the table is written anew in one transaction holding every survivor's elements,
        its DNS pins (for what is left of their TTL) and its denied counter, so nothing of a
        sandbox that did not survive stays and nothing a survivor had is lost. Links of this
        prefix that belong to no survivor are removed. Returns ``{sandbox id: why}`` for
        those whose network cannot be restored (the caller ends them)."""
        if self.s is not None:
            try:
                self._take_ownership()
            except Unsupported as e:  # another live daemon's: neither swept nor taken over
                return {it.sandbox_id: str(e) for it in items}
        if self.s is None or not items:
            if self.s is not None:
                self._sweep(self.s)
                self._release_ownership()  # taken again by the first networked create
            return {sid: self._error or "networking unavailable" for sid in
                    (it.sandbox_id for it in items)}
        from .links import Links

        failed: dict[str, str] = {}
        probe = Firewall(self.s)  # reads the old table, writes the new one's commands
        try:
            old = probe.carried_state() if probe.exists() else {}
        finally:
            probe.nft.close()
        links = Links(self.s)
        ok: list[tuple[Readopted, Attachment]] = []
        try:
            for it in items:
                try:
                    ok.append((it, self._readopt_one(it, links)))
                except (Unsupported, InvalidNetwork, OSError, ValueError, KeyError) as e:
                    failed[it.sandbox_id] = str(e)
        finally:
            links.close()
        if not ok:
            self._sweep(self.s)
            self._release_ownership()
            return failed
        now = time.time()
        carried: dict[str, list[str]] = {}  # by sandbox: its pins, for what is left of their TTL
        for _, att in ok:
            pins: dict[str, list[str]] = {}
            for set_name, elem, left in old.get(att.ifname, {}).get("pins", []):
                pins.setdefault(set_name, []).append(elem)
                addr = elem.split(" . ")[1]
                att.pins[addr] = max(now + left, att.pins.get(addr, 0.0))
                entry = _entry(elem)
                att.entries[entry] = max(now + left, att.entries.get(entry, 0.0))
                att.pinned[(set_name, elem.split(" timeout ")[0])] = now + left
                if set_name.startswith("allow"):
                    att.ranges.note(elem, now + left)
            both = {k: att.elems.get(k, []) + pins.get(k, []) for k in {*att.elems, *pins}}
            cmds = [probe.attach_cmds_for(att.ifname, att.address, att.address6,
                                          att.policy is None, both)]
            denied = old.get(att.ifname, {}).get("denied")
            if denied:
                cmds.append(f'add element inet {self.s.table} denied {{ "{att.ifname}" '
                            f"counter packets {denied[0]} bytes {denied[1]} }}")
            cmds += [f'add element inet {self.s.table} {name} {{ "{att.ifname}" . {a} '
                     f"counter packets {n} bytes {b} }}"
                     for name, a, n, b in old.get(att.ifname, {}).get("denied_to", [])]
            carried[att.sandbox_id] = cmds
        with self._cv:
            for _, att in ok:
                self.attachments[att.sandbox_id] = att
                self._by_addr[str(att.address)] = att
            with self._group_lock:
                for _, att in ok:
                    if att.group is not None:
                        self._groups.setdefault(att.group, {})[att.sandbox_id] = att
                pairs = sorted({p for _, att in ok for p in self._group_pairs(att)})
            taken = {att.index for _, att in ok}
            self._next = max(taken) + 1
            self._free = [i for i in range(1, self._next) if i not in taken]
            every = [c for cmds in carried.values() for c in cmds]
            if pairs:
                every.append(probe.peers_cmd(pairs))
            try:
                self._start(keep=frozenset(att.ifname for _, att in ok),
                            carried="\n".join(every))
            except BaseException as e:
                for _, att in ok:
                    self.attachments.pop(att.sandbox_id, None)
                    self._by_addr.pop(str(att.address), None)
                    failed[att.sandbox_id] = f"cannot write the network's rules: {e}"
                with self._group_lock:
                    self._groups.clear()
                self._next, self._free = 1, []
                if not isinstance(e, Exception):
                    raise
                return failed
        if self._carry_refused:
            # The kernel refused the whole: the table was written empty; each sandbox on its
            # own now (without its pins if those are what it refuses), and peers last.
            for _, att in ok:
                try:
                    self.fw.run("\n".join(carried[att.sandbox_id]))
                    continue
                except NftError:
                    pass
                att.pins, att.pinned, att.entries = {}, {}, {}
                att.ranges.clear()
                try:
                    self.fw.attach(att.ifname, att.address, att.address6, att.policy is None,
                                   att.elems)
                except (NftError, OSError) as e:
                    failed[att.sandbox_id] = f"cannot write the network's rules: {e}"
                    self.detach(att.sandbox_id)
            with self._group_lock:  # the failed ones left their groups (detach)
                pairs = sorted({p for _, att in ok if att.sandbox_id not in failed
                                for p in self._group_pairs(att)})
            try:
                self.fw.peers(pairs, add=True)
            except (NftError, OSError):
                log.warning("network: cannot restore the network groups' pairs",
                            exc_info=True)
        return failed

    def _readopt_one(self, it: Readopted, links: Links) -> Attachment:
        """One survivor's attachment, its link checked or made again (no rules yet)."""
        st = it.state or {}
        if "slot" not in st:
            raise ValueError("its runtime record holds no network slot")
        idx = int(st["slot"])
        ifname, address = links.ifname(idx), links.address(idx)
        # A record without an IPv6 address (made without a range for it) stays IPv4 only.
        address6 = links.address6(idx) if "address6" in st else None
        if st.get("ifname") != ifname or st.get("address") != str(address) or \
                st.get("address6", "None") != str(address6):
            raise ValueError(f"the daemon's network settings changed (it had "
                             f"{st.get('ifname')} {st.get('address')} "
                             f"{st.get('address6', '')}, these settings give "
                             f"{ifname} {address} {address6 or ''})")
        policy, label = self.resolve(it.network)
        if not os.path.exists(f"/sys/class/net/{ifname}"):
            # Its link is gone (deleted by hand?) but its namespace lives: make it again.
            fd = os.open(f"/proc/{it.init_pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                links.make(idx, fd, v6=address6 is not None)
                if it.bandwidth_mbit is not None:
                    links.shape(idx, fd, it.bandwidth_mbit)
            finally:
                os.close(fd)
        att = Attachment(it.sandbox_id, idx, ifname, address, address6, policy, it.group, label,
                         self)
        att.elems = Firewall.policy_elems(ifname, policy)
        return att

    def _group_pairs(self, att: Attachment) -> list[tuple[str, str]]:
        """Both directions between ``att`` and every other member of its group (under
        _group_lock)."""
        if att.group is None:
            return []
        out = []
        for other in self._groups.get(att.group, {}).values():
            if other is not att:
                out += [(att.ifname, other.ifname), (other.ifname, att.ifname)]
        return out

    def _join(self, att: Attachment, registered: bool = False) -> None:
        """``att`` into its group, its pairs with the members into the firewall. With
        ``registered``, only while it is still the registered attachment of its sandbox (a
        pooled one's group comes after its registration: one detached meanwhile has left)."""
        if att.group is None:
            return
        with self._group_lock:
            if registered and self.attachments.get(att.sandbox_id) is not att:
                return
            members = self._groups.setdefault(att.group, {})
            if att.sandbox_id in members:
                return
            try:
                self.fw.peers(self._group_pairs(att), add=True)
            except BaseException:
                if not members:
                    del self._groups[att.group]
                raise
            members[att.sandbox_id] = att

    def _leave(self, att: Attachment) -> None:
        """``att`` out of its group and its pairs out of the firewall: every pair it has,
        whatever joined or left since it joined."""
        if att.group is None:
            return
        with self._group_lock:
            members = self._groups.get(att.group)
            if members is None or members.get(att.sandbox_id) is not att:
                return
            del members[att.sandbox_id]
            if not members:
                del self._groups[att.group]
            pairs = [p for other in members.values()
                     for p in ((att.ifname, other.ifname), (other.ifname, att.ifname))]
            self.fw.peers(pairs, add=False)

    def update(self, sandbox_id: str, network: Any) -> None:
        """Its policy replaced at once: the new rules in, the old ones and every DNS pin out
        (connections already open stay open; a new one needs the new policy)."""
        policy, label = self.resolve(network)
        att = self.attachments.get(sandbox_id)
        if att is None:
            raise Unsupported("only a networked sandbox's policy can change",
                              details={"operation": "network_update"})
        i = f'"{att.ifname}"'
        with att.lock:
            if self.attachments.get(sandbox_id) is not att:
                return  # detached meanwhile: its rules are gone, none is put back
            elems = Firewall.policy_elems(att.ifname, policy)
            old = {**att.current(), "internet": [i] if att.policy is None else []}
            new = {**elems, "internet": [i] if policy is None else []}
            self.fw.swap(att.ifname, old, new)
            att.policy, att.label, att.pins, att.pinned = policy, label, {}, {}
            att.entries = {}
            att.elems = elems
            att.ranges.clear()
            att.generation += 1  # after the policy: an answer in flight under the old pins nothing

    def claim(self, sandbox_id: str, network: Any, group: str | None) -> None:
        """A pooled sandbox's network (made with a policy that allows nothing) given the
        policy and group of the create that took it."""
        self.update(sandbox_id, network)
        att = self.attachments.get(sandbox_id)
        if group is not None and att is not None:
            with att.lock:
                att.group = group
            self._join(att, registered=True)

    async def expose(self, sandbox_id: str, port: int, host_port: int = 0) -> int:
        """127.0.0.1:<the returned port> on the host reaches ``port`` in the sandbox;
        ``host_port`` if it is free (a re-adopted sandbox's), else any."""
        from .expose import Exposer

        att = self.attachments.get(sandbox_id)
        if att is None:
            raise Unsupported("only a networked sandbox (internet or a policy) has ports to "
                              "expose", details={"operation": "expose"})
        if self.exposer is None:
            self.exposer = Exposer(asyncio.get_running_loop())
        return await self.exposer.expose(sandbox_id, str(att.address), port, host_port)

    def unexpose(self, sandbox_id: str, port: int) -> bool:
        return self.exposer is not None and self.exposer.unexpose(sandbox_id, port)

    def detach(self, sandbox_id: str, hold: bool = False) -> bool:
        """Remove a sandbox's rules and counters. With ``hold``, a slot that may be reused is
        kept aside rather than released, and True returned: the caller then owes one call of
        ``recycle`` for this sandbox, once every process of it is gone."""
        final = self.info(sandbox_id)  # its counters as it ends, for the trajectory log
        if final is not None:
            with self._lock:
                self._final[sandbox_id] = final
                while len(self._final) > FINAL_KEPT:
                    self._final.pop(next(iter(self._final)))
        if self.exposer is not None:
            self.exposer.drop(sandbox_id)
        with self._lock:
            att = self.attachments.pop(sandbox_id, None)
            if att is not None:
                self._by_addr.pop(str(att.address), None)
        if att is None:
            return False
        held = hold and att.recyclable and self.s is not None and self.s.pool > 0
        self._release(att, final["denied_packets"] if final is not None else None, held)
        return held

    def _release(self, att: Attachment, denied: int | None = None, held: bool = False) -> None:
        """``denied``: its denied count as just read (by ``info``), not read again; ``held``:
        the slot waits for ``recycle`` rather than for its link to go."""
        failed = False
        with att.lock:
            try:
                self._leave(att)
                self.fw.detach(att.ifname, att.address, att.address6, att.current(), denied)
            except Exception:
                log.warning("network: cannot remove the rules of %s; its slot %s (%s) is "
                            "retired", att.sandbox_id, att.index, att.ifname, exc_info=True)
                failed = True
        with self._lock:
            if failed:
                # Some of its elements may be left, keyed by the slot's interface and
                # addresses: a next sandbox there would inherit them. Never handed out again.
                self._retired.add(att.index)
            elif held:
                self._held[att.sandbox_id] = att.index
            else:
                self._draining.append(att.index)

    def recycle(self, sandbox_id: str, netns_fd: int | None) -> bool:
        """The held slot of an ended sandbox (``detach(hold=True)``), every process of it
        gone: back to the ready slots with its namespace ``netns_fd`` if that shows nothing of
        the sandbox, else released (the namespace closed, the link goes with it). This call
        owns ``netns_fd`` (None: not reusable, e.g. some process may have outlived the init).

        What a sandbox leaves in its namespace and cannot reset is the same as with network
        "none" (container/netns.py ``NetnsPool``): counters (now eth0's too) and sockets. A
        slot is reused only if its namespace's fingerprint equals a quiet fresh slot's: a
        sandbox that sent or received nothing and holds no socket. Its rules, pins, group and
        exposed ports went at ``detach``; its address and interface name stay the slot's, as
        they would for the next sandbox given a released slot."""
        with self._lock:
            idx = self._held.pop(sandbox_id, None)
        if idx is None:
            if netns_fd is not None:
                os.close(netns_fd)
            return False
        kept = False
        try:
            if netns_fd is not None and self._room():
                quiet = self._quiet_print
                kept = quiet is not None and _core.netns_fingerprint(netns_fd) == quiet
        except OSError:
            kept = False  # unreadable: not provably clean
        with self._cv:
            if kept and self._started and not self._closed and self._room():
                self._ready.append((idx, netns_fd))  # type: ignore[arg-type]
                self.recycled += 1
                return True
            self._draining.append(idx)
            self.not_recycled += 1
        if netns_fd is not None:
            os.close(netns_fd)
        return False

    def _room(self) -> bool:
        """Room among the ready slots for a recycled one: up to twice the pool's size (the
        refill makes new ones only below it)."""
        return self.s is not None and len(self._ready) < 2 * self.s.pool

    # ---- lookups -------------------------------------------------------------------------
    def _lookup(self, addr: str) -> Attachment | None:
        return self._by_addr.get(addr)

    def peer_address(self, att: Attachment, name: str, version: int = 4) -> str | None:
        """A sandbox of ``att``'s group by id: its address of that IP version ("" if it has
        none); None if ``name`` is no such sandbox."""
        if att.group is None:
            return None
        other = self.attachments.get(name)
        if other is None or other.group != att.group:
            return None
        if version == 6:
            return str(other.address6) if other.address6 is not None else ""
        return str(other.address)

    def info(self, sandbox_id: str) -> dict[str, Any] | None:
        att = self.attachments.get(sandbox_id)
        if att is None:
            return None
        stats = _link_stats(att.ifname)
        now = time.time()
        gw6 = self.links.gateway6(att.index) if att.address6 is not None else None
        denied = self.fw.denied_count(att.ifname)
        # Destinations are counted by the rule that counts ``denied``: none refused, none to
        # dump (two netlink dumps saved on every create's answer)
        dests = self.fw.denied_destinations(att.ifname) if denied else {}
        return {"address": str(att.address), "gateway": str(self.s.gateway) if self.s else None,
                "address6": str(att.address6) if att.address6 is not None else None,
                "gateway6": str(gw6) if gw6 is not None else None,
                "group": att.group, "policy": att.label,
                # the host end's rx is what the sandbox sent
                "tx_bytes": stats.get("rx_bytes", 0), "tx_packets": stats.get("rx_packets", 0),
                "rx_bytes": stats.get("tx_bytes", 0), "rx_packets": stats.get("tx_packets", 0),
                "denied_packets": denied,
                "denied_destinations": dict(sorted(
                    dests.items(), key=lambda kv: -kv[1])[:DENIED_SHOWN]),
                "refused_names": dict(att.refused_names.most_common(20)),
                "pinned": sorted(a for a, t in list(att.pins.items()) if t > now),
                "pins_refused": att.pins_refused,
                "exposed": {str(p): f"127.0.0.1:{hp}" for p, hp in
                            (self.exposer.ports(sandbox_id) if self.exposer else {}).items()}}

    def metrics(self) -> dict[str, int]:
        out = {"network_sandboxes": len(self.attachments), "network_pool_ready": len(self._ready),
               "network_slots_recycled": self.recycled,
               "network_slots_not_recycled": self.not_recycled,
               "network_slots_retired": len(self._retired)}
        if not self._started:
            return out
        tx, rx = _links_bytes({att.ifname for att in list(self.attachments.values())})
        out.update({"network_sent_bytes": tx, "network_received_bytes": rx,
                    "network_denied_packets": self.fw.denied_total()})
        if self.dns is not None:
            out.update({f"network_dns_{k}": v for k, v in self.dns.counts.items()})
        return out


LIVE: set[NetworkManager] = set()


def network_final_state(sandbox_id: str) -> dict[str, Any] | None:
    """A networked sandbox's counters as its network was removed (once: taken, not read)."""
    for mgr in list(LIVE):
        with mgr._lock:
            st = mgr._final.pop(sandbox_id, None)
        if st is not None:
            return st
    return None


def network_state(sandbox_id: str) -> dict[str, Any] | None:
    """A networked sandbox's address and counters (SandboxInfo.net), from whichever
    substrate's manager holds it."""
    for mgr in list(LIVE):
        st = mgr.info(sandbox_id)
        if st is not None:
            return st
    return None


def _entry(elem: str) -> tuple[str, tuple[int, int]]:
    """A pin's entry (address, port range) from its element (``"if" . addr [. proto .
    port]``)."""
    parts = elem.split(" timeout ")[0].split(" . ")
    addr = str(ipaddress.ip_address(parts[1].split("/")[0]))
    if len(parts) < 4:
        return addr, (0, 65535)
    lo, _, hi = parts[3].partition("-")
    return addr, (int(lo), int(hi or lo))


def _warn_conntrack(s: NetSettings, slots: int) -> None:
    """A warning if the sandboxes' connection caps together exceed the host's conntrack
    table: a full table drops every new flow on the host, the daemon's and others' too."""
    try:
        with open("/proc/sys/net/netfilter/nf_conntrack_max") as f:
            table = int(f.read())
    except (OSError, ValueError):
        return
    try:
        sandboxes = int(os.environ.get("CORRAL_MAX_SANDBOXES") or 0)
    except ValueError:
        sandboxes = 0
    if sandboxes <= 0:
        from corral.daemon.capacity import derive

        sandboxes = derive().count
    sandboxes = min(sandboxes, slots)
    if sandboxes * s.max_connections > table:
        log.warning("network: %d networked sandboxes x %d connections each "
                    "(CORRAL_NET_MAX_CONNECTIONS) exceed the host's conntrack table "
                    "(net.netfilter.nf_conntrack_max = %d): a few sandboxes can fill it",
                    sandboxes, s.max_connections, table)


def _links_bytes(names: set[str]) -> tuple[int, int]:
    """Bytes the links ``names`` received and sent on their host ends (what their sandboxes
    sent and received), from one read of /proc/net/dev: a scrape runs on the event loop, and
    the sysfs files cost 1.7x more at 6,000 links (5 opens per link)."""
    rx = tx = 0
    if not names:
        return rx, tx
    try:
        with open("/proc/net/dev", "rb") as f:
            lines = f.read().splitlines()[2:]
    except OSError:
        return rx, tx
    for line in lines:
        name, _, rest = line.partition(b":")
        if name.strip().decode(errors="replace") in names:
            fields = rest.split()
            rx, tx = rx + int(fields[0]), tx + int(fields[8])
    return rx, tx


def _link_stats(ifname: str) -> dict[str, int]:
    """The host end's counters from sysfs (os.open/os.read: a text-mode open() costs ~3x
    more, and info() runs on every create's answer, on the event loop)."""
    out = {}
    try:
        d = os.open(f"/sys/class/net/{ifname}/statistics",
                    os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return dict.fromkeys(LINK_STATS, 0)
    try:
        for k in LINK_STATS:
            try:
                fd = os.open(k, os.O_RDONLY | os.O_CLOEXEC, dir_fd=d)
                try:
                    out[k] = int(os.read(fd, 32))
                finally:
                    os.close(fd)
            except (OSError, ValueError):
                out[k] = 0
    finally:
        os.close(d)
    return out


__all__ = ["Attachment", "NetworkManager", "Readopted"]
