"""Links and addresses of networked sandboxes: a veth pair per sandbox, its host end holding
the gateway address (the same on every host end) and a /32 route to the sandbox, its sandbox
end "eth0" with the sandbox's /32 address and a default route via the gateway; for IPv6 (when
the daemon has an IPv6 range) a /128 address and route, and as the gateway a link-local
address of the host end, its own per link (``Links.gateway6``). Routed, not
bridged: every packet a sandbox sends crosses the host's IP stack, where the firewall sees
it. The pair is made by the Rust core over rtnetlink (corral._core.veth_setup); the rarer
operations (tc, deleting stale links) go through pyroute2, the sandbox end through a netlink
socket made inside its namespace (corral._core.netns_socket). No process is started."""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from corral import _core

from .settings import LINK_GATEWAY6, NetSettings

NETLINK_ROUTE = 0
T = TypeVar("T")
GUEST_IF = "eth0"


class Links:
    """pyroute2's synchronous API runs an asyncio loop of its own, which cannot run in a
    thread whose loop is running (the daemon's): every call goes to one worker thread."""

    def __init__(self, settings: NetSettings) -> None:
        self.s = settings
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="corral-netlink")
        self._ipr = self._call(IPRoute)

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        return self._worker.submit(fn, *args).result()

    def ifname(self, index: int) -> str:
        return f"{self.s.ifprefix}{index}"

    def address(self, index: int) -> ipaddress.IPv4Address:
        return self.s.gateway + index

    def address6(self, index: int) -> ipaddress.IPv6Address | None:
        base = self.s.base6
        return None if base is None else base + index

    @staticmethod
    def gateway6(index: int) -> ipaddress.IPv6Address:
        """Sandbox slot i's IPv6 gateway: a link-local address of its link's host end, one
        per link (a route that many links share costs every new link a walk of them:
        corral._core.veth_setup)."""
        return LINK_GATEWAY6 + index

    def capacity(self) -> int:
        n = self.s.range4.num_addresses - 3  # network, gateway, broadcast
        if self.s.range6 is not None:
            n = min(n, self.s.range6.num_addresses - 2)
        return n

    def make(self, index: int, netns_fd: int, v6: bool = True) -> None:
        """The veth pair of sandbox slot ``index`` into ``netns_fd``, addressed and up (the
        Rust core, GIL released: ~1 ms of netlink, no process); with IPv6 if the daemon has
        a range for it and ``v6``."""
        host, addr, gw = self.ifname(index), str(self.address(index)), str(self.s.gateway)
        a6 = self.address6(index) if v6 else None
        six = (str(self.gateway6(index)), str(a6)) if a6 is not None else (None, None)
        try:
            _core.veth_setup(netns_fd, host, gw, addr, *six)
        except FileExistsError:
            self.remove(index)  # a stale one (a killed daemon's, or still draining)
            try:
                _core.veth_setup(netns_fd, host, gw, addr, *six)
            except BaseException:
                self.remove(index)
                raise
        except BaseException:
            self.remove(index)
            raise

    def shape(self, index: int, netns_fd: int, mbit: float) -> None:
        """A token bucket of ``mbit`` on both ends of slot ``index``'s link: the host end
        shapes what the sandbox receives, its eth0 what it sends (the sandbox has no
        CAP_NET_ADMIN over its namespace, so it cannot remove it)."""
        self._call(self._shape, index, netns_fd, mbit)

    def _shape(self, index: int, netns_fd: int, mbit: float) -> None:
        rate = int(mbit * 1_000_000)
        burst = max(16384, rate // 8 // 50)  # 20 ms worth, at least a few full frames
        kw = {"handle": 0x10000, "rate": f"{rate}bit", "burst": burst, "latency": "50ms"}
        self._ipr.tc("add", "tbf", index=self._ipr.link_lookup(ifname=self.ifname(index))[0],
                     **kw)
        fd = _core.netns_socket(netns_fd, socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_ROUTE)
        guest = IPRoute(fileno=fd)
        try:
            guest.tc("add", "tbf", index=guest.link_lookup(ifname=GUEST_IF)[0], **kw)
        finally:
            guest.close()

    def remove(self, index: int) -> None:
        """Delete the host end (the sandbox end goes with it); gone already is fine."""
        self._call(self._remove, index)

    def _remove(self, index: int) -> None:
        self._del(self.ifname(index))

    def _del(self, name: str) -> None:
        try:
            self._ipr.link("del", ifname=name)
        except NetlinkError as e:
            if e.code not in (errno.ENODEV, errno.ENOENT, errno.EINVAL):
                raise

    def stale(self) -> list[str]:
        """Host ends with this daemon's prefix (left by a daemon that was killed)."""
        names = self._call(lambda: [ln.get_attr("IFLA_IFNAME") for ln in self._ipr.get_links()])
        p = self.s.ifprefix
        return [n for n in names if n and n.startswith(p) and n[len(p):].isdigit()]

    def remove_name(self, name: str) -> None:
        self._call(self._del, name)

    def close(self) -> None:
        self._call(self._ipr.close)
        self._worker.shutdown(wait=True)


def enable_ipv4_forwarding() -> None:
    """net.ipv4.ip_forward on (the sandboxes' IPv4 is routed through the host, as a container
    runtime's is). The host's own traffic is unchanged; what may cross it between other
    interfaces is the host firewall's to decide."""
    with open("/proc/sys/net/ipv4/ip_forward") as f:
        if f.read().strip() == "1":
            return
    _sysctl("/proc/sys/net/ipv4/ip_forward", "1")


def enable_ipv6_forwarding() -> None:
    """net.ipv6.conf.all.forwarding on (the sandboxes' IPv6 is routed through the host). A
    router ignores router advertisements where accept_ra is 1: such interfaces (and the
    default for new ones) get 2 first, so the host keeps the addresses and routes it learns."""
    base = "/proc/sys/net/ipv6/conf"
    with open(f"{base}/all/forwarding") as f:
        if f.read().strip() == "1":
            return
    for name in os.listdir(base):
        if name == "all":
            continue
        try:
            with open(f"{base}/{name}/accept_ra") as f:
                if f.read().strip() != "1":
                    continue
        except OSError:
            continue
        _sysctl(f"{base}/{name}/accept_ra", "2")
    _sysctl(f"{base}/all/forwarding", "1")


def _sysctl(path: str, value: str) -> None:
    try:
        fd = os.open(path, os.O_WRONLY)
    except FileNotFoundError:
        return  # no IPv6 on this host
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)
