"""Where the registry client may connect, checked at every connection (the reference's
registry, each redirect, a token realm, a push's upload location): a client names the
reference, and the registry it names steers the rest, so none of it may lead the daemon
(root, on the host's network) to what the client could not reach itself.

A host is resolved once, every address it resolves to is checked, and the connection goes
to a checked address (a second lookup could answer otherwise: DNS rebinding). Refused: the
ranges no sandbox reaches either (loopback, link-local and cloud metadata, private, CGNAT,
multicast, IPv4-mapped and NAT64 forms: corral.daemon.network.firewall), the blocked
addresses (CORRAL_NET_BLOCKED, the network file's, the live list of
``PUT /v1/network/blocked``) and any address of this host. A registry the operator named
(``CORRAL_REGISTRIES``, ``CORRAL_INSECURE_REGISTRIES``: ``host[:port]``, no port meaning
80 and 443) is reached wherever it is, on its own host and port only; where it redirects to
is checked like anything else.

Plain HTTP is allowed, at every hop, only to a loopback host (named, as above) or a
registry named insecure."""

from __future__ import annotations

import ipaddress
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any

import httpcore
import httpx

from corral.daemon.network.firewall import BLOCKED4, BLOCKED6, PRIVATE4, PRIVATE6
from corral.errors import Forbidden

Net = ipaddress.IPv4Network | ipaddress.IPv6Network
Addr = ipaddress.IPv4Address | ipaddress.IPv6Address
INTERNAL: tuple[Net, ...] = tuple(ipaddress.ip_network(n)
                                  for n in (*PRIVATE4, *BLOCKED4, *PRIVATE6, *BLOCKED6))
MAX_REDIRECTS = 10
SETTINGS = "CORRAL_REGISTRIES or CORRAL_INSECURE_REGISTRIES"


def netloc(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def loopback_host(host: str) -> bool:
    """``localhost`` or a loopback literal (127.0.0.0/8, ::1), brackets or not."""
    h = host.strip("[]").lower()
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def _is_local(ip: Addr) -> bool:
    """An address of one of this host's interfaces: it can be bound (a public address of the
    host reaches what loopback does: every service listening on all addresses)."""
    fam = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(fam, socket.SOCK_STREAM) as s:
            s.bind((str(ip), 0))
        return True
    except OSError:
        return False


class Egress:
    """The policy: ``named`` and ``insecure`` are ``host[:port]`` names; ``blocked`` gives
    the blocked addresses as strings (addresses or CIDRs), asked at each connection so a
    change holds at once."""

    def __init__(self, named: Iterable[str] = (), insecure: Iterable[str] = (),
                 blocked: Callable[[], Iterable[str]] | None = None) -> None:
        self.insecure = frozenset(x.lower() for x in insecure)
        self.named = frozenset(x.lower() for x in named) | self.insecure
        self.blocked_source = blocked
        self._blocked_key: tuple[str, ...] = ()
        self._blocked: tuple[Net, ...] = ()
        self._lock = threading.Lock()

    def _is_named(self, names: frozenset[str], host: str, port: int) -> bool:
        host = host.lower()
        return netloc(host, port) in names or (port in (80, 443) and (
            host in names or f"[{host}]" in names))

    def plain_ok(self, host: str, port: int) -> bool:
        """Plain HTTP to ``host:port``: a loopback host or a registry named insecure."""
        return loopback_host(host) or self._is_named(self.insecure, host, port)

    def blocked(self) -> tuple[Net, ...]:
        if self.blocked_source is None:
            return ()
        key = tuple(self.blocked_source())
        with self._lock:
            if key != self._blocked_key:
                nets = []
                for item in key:
                    try:
                        nets.append(ipaddress.ip_network(item, strict=False))
                    except ValueError:
                        continue
                self._blocked_key, self._blocked = key, tuple(nets)
            return self._blocked

    def why_refused(self, ip: Addr) -> str | None:
        """Why no client-chosen connection may go to ``ip`` (None: it may)."""
        if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id:
            ip = ipaddress.IPv6Address(str(ip).split("%")[0])
        if any(ip.version == n.version and ip in n for n in INTERNAL):
            return "an internal address (loopback, link-local, private or reserved)"
        if any(ip.version == n.version and ip in n for n in self.blocked()):
            return "a blocked address"
        if _is_local(ip):
            return "an address of this host"
        return None

    def resolve(self, host: str, port: int) -> list[str]:
        """The addresses to connect to for ``host:port``, every one checked; Forbidden if
        any is refused (a name answering with one internal address among public ones is
        refused whole), OSError if the name does not resolve."""
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        addrs = list(dict.fromkeys(str(i[4][0]) for i in infos))
        if self._is_named(self.named, host, port):
            return addrs
        for a in addrs:
            why = self.why_refused(ipaddress.ip_address(a))
            if why is not None:
                raise Forbidden(f"{netloc(host, port)} resolves to {why}: the daemon does not "
                                "connect there for a client; a registry there must be named "
                                f"by the operator ({SETTINGS})",
                                details={"host": netloc(host, port)})
        return addrs

    def check_request(self, request: httpx.Request) -> None:
        """Every request, each redirect included: plain HTTP only where allowed."""
        url = request.url
        if url.scheme == "http" and not self.plain_ok(url.host, url.port or 80):
            host = netloc(url.host, url.port or 80)
            raise Forbidden(f"plain HTTP to {host} ({url.copy_with(query=None)}): allowed only "
                            "for a registry on loopback or named in CORRAL_INSECURE_REGISTRIES",
                            details={"host": host})
        if url.scheme not in ("http", "https"):
            raise Forbidden(f"unsupported scheme in {url}", details={"host": url.host})

    def client(self, timeout: httpx.Timeout) -> httpx.Client:
        """An httpx client whose every connection and request goes through this policy (it
        follows no redirect: its user does, each hop a request of its own)."""
        # Accept-Encoding identity: httpx would decode gzip, deflate or zstd whole per
        # chunk read (64 KiB of zstd is GiBs); the registry client reads bodies raw.
        return httpx.Client(timeout=timeout, follow_redirects=False, trust_env=False,
                            headers={"Accept-Encoding": "identity"},
                            transport=_Transport(_Backend(self)),
                            event_hooks={"request": [self.check_request]})


class _Backend(httpcore.SyncBackend):
    """httpcore's socket backend, connecting only to addresses the policy checked."""

    def __init__(self, egress: Egress) -> None:
        self.egress = egress

    def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                    local_address: str | None = None,
                    socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        try:
            addrs = self.egress.resolve(host, port)
        except OSError as e:
            raise httpcore.ConnectError(f"cannot resolve {host}: {e}") from e
        last: Exception | None = None
        for a in addrs:
            try:
                # TLS still names ``host`` (SNI, certificate check): httpcore passes the
                # origin's host to start_tls, not this address.
                return super().connect_tcp(a, port, timeout, local_address, socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as e:
                last = e
        assert last is not None
        raise last


class _Transport(httpx.HTTPTransport):
    def __init__(self, backend: _Backend) -> None:
        super().__init__(trust_env=False)
        # httpx takes no network backend: the same pool as its own, with ours.
        self._pool = httpcore.ConnectionPool(
            ssl_context=httpx.create_ssl_context(trust_env=False), max_connections=10,
            keepalive_expiry=5.0, network_backend=backend)
