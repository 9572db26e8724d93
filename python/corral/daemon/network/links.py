"""Links and addresses of networked sandboxes, over netlink (pyroute2): a veth pair per
sandbox, its host end holding the gateway address (the same on every host end) and a /32
route to the sandbox, its sandbox end "eth0" with the sandbox's /32 address and a default
route via the gateway. Routed, not bridged: every packet a sandbox sends crosses the host's
IP stack, where the firewall sees it. The sandbox end is configured through a netlink socket
made inside its namespace (corral._core.netns_socket): no process is started."""

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

from .settings import NetSettings

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

    def capacity(self) -> int:
        return self.s.range4.num_addresses - 3  # network, gateway, broadcast

    def make(self, index: int, netns_fd: int) -> None:
        """The veth pair of sandbox slot ``index`` into ``netns_fd``, addressed and up."""
        self._call(self._make, index, netns_fd)

    def _make(self, index: int, netns_fd: int) -> None:
        host, addr, gw = self.ifname(index), self.address(index), str(self.s.gateway)
        try:
            self._ipr.link("add", ifname=host, kind="veth",
                           peer={"ifname": GUEST_IF, "net_ns_fd": netns_fd})
        except NetlinkError as e:
            if e.code != errno.EEXIST:
                raise
            self._ipr.link("del", ifname=host)  # a stale one (a killed daemon's)
            self._ipr.link("add", ifname=host, kind="veth",
                           peer={"ifname": GUEST_IF, "net_ns_fd": netns_fd})
        try:
            idx = self._ipr.link_lookup(ifname=host)[0]
            _sysctl(f"/proc/sys/net/ipv6/conf/{host}/disable_ipv6", "1")
            self._ipr.addr("add", index=idx, address=gw, prefixlen=32)
            self._ipr.link("set", index=idx, state="up")
            self._ipr.route("add", dst=f"{addr}/32", oif=idx, scope=253)
        except BaseException:
            self._remove(index)
            raise
        # SOCK_DGRAM: pyroute2 hands the socket to asyncio, which takes datagram sockets only
        fd = _core.netns_socket(netns_fd, socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_ROUTE)
        guest = IPRoute(fileno=fd)
        try:
            gidx = guest.link_lookup(ifname=GUEST_IF)[0]
            guest.addr("add", index=gidx, address=str(addr), prefixlen=32)
            guest.link("set", index=gidx, state="up")
            guest.route("add", dst=f"{gw}/32", oif=gidx, scope=253)
            guest.route("add", dst="0.0.0.0/0", gateway=gw, oif=gidx)
        except BaseException:
            self._remove(index)
            raise
        finally:
            guest.close()

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


def _sysctl(path: str, value: str) -> None:
    try:
        fd = os.open(path, os.O_WRONLY)
    except FileNotFoundError:
        return  # no IPv6 on this host
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)
