"""Where the daemon is: a local unix socket (the default) or a remote http(s) URL.

An ``Endpoint`` is the only connection state a sandbox handle carries, so it is small, frozen,
hashable and picklable. The bearer token is deliberately *not* part of it: it is read from
``CORRAL_TOKEN`` in the process that makes the call (or from the tokens this process was given,
``set_token``: ``corral.cluster.connect()``), so pickled handles never carry secrets.

A cluster node's endpoint also names its node (``node``): a sandbox there whose node stops
answering is reported lost (``sandbox_lost``), not "daemon unavailable" (docs/cluster.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from corral import config
from corral.errors import InvalidRequest

UNIX_PREFIX = "unix://"

# Bearer tokens this process was handed for an endpoint URL (a cluster gateway and its nodes).
_tokens: dict[str, str] = {}
# A node's URL -> the gateway URL its token was taken from: a new token for that gateway
# (``connect(token=...)`` as another tenant) is the token for its nodes too.
_token_source: dict[str, str] = {}
# (CORRAL_URL, CORRAL_SOCKET, the Endpoint they name): Endpoint.from_env's last answer.
_from_env: tuple[str, str, Endpoint] | None = None


def set_token(url: str, token: str) -> None:
    """Use ``token`` for calls to ``url`` from this process (instead of ``CORRAL_TOKEN``),
    and for the cluster nodes this process reached through ``url``."""
    url = url.rstrip("/")
    _tokens[url] = token
    _token_source.pop(url, None)
    for node, source in _token_source.items():
        if source == url:
            _tokens[node] = token


@dataclass(frozen=True)
class Endpoint:
    """``unix:///path/to/corrald.sock`` or ``http(s)://host:port``."""

    url: str
    node: str | None = None  # the cluster node it serves (set from a gateway's answer)
    # The gateway that placed a sandbox on that node: a fork whose children the gateway
    # places goes there. Not part of its identity (a handle from an id has none).
    gateway: str | None = field(default=None, compare=False)

    @classmethod
    def from_env(cls) -> Endpoint:
        """``CORRAL_URL`` if set, else the unix socket ``CORRAL_SOCKET`` (or the default).
        Read on every call that names no endpoint; the Endpoint made for the same two values
        is reused (making one costs a call ~10 us: a frozen dataclass, then its hash)."""
        global _from_env
        url = os.environ.get("CORRAL_URL", "")
        sock = config.socket_from_env()
        hit = _from_env
        if hit is not None and hit[0] == url and hit[1] == sock:
            return hit[2]
        ep = cls.parse(url.strip()) if url.strip() else cls(UNIX_PREFIX + sock)
        _from_env = (url, sock, ep)
        return ep

    @classmethod
    def parse(cls, value: str | Endpoint | None) -> Endpoint:
        """Accepts an Endpoint, ``None`` (from the environment), a socket path or a URL."""
        if value is None:
            return cls.from_env()
        if isinstance(value, Endpoint):
            return value
        if value.startswith("/"):
            return cls(UNIX_PREFIX + value)
        if value.startswith(UNIX_PREFIX) and value[len(UNIX_PREFIX):].startswith("/"):
            return cls(value)
        if value.startswith(("http://", "https://")):
            return cls(value.rstrip("/"))
        raise InvalidRequest(f"bad corral endpoint {value!r}: use a socket path, "
                             f"unix:///path or http(s)://host:port")

    @property
    def unix_path(self) -> str | None:
        return self.url[len(UNIX_PREFIX):] if self.url.startswith(UNIX_PREFIX) else None

    @property
    def base_url(self) -> str:
        """The URL prefix requests are sent to (the host part is ignored on a unix socket)."""
        return "http://corral" if self.unix_path else self.url

    def auth_header(self) -> str | None:
        """``Bearer <CORRAL_TOKEN>`` for remote endpoints (the unix socket needs none)."""
        if self.url.startswith(UNIX_PREFIX):
            return None
        token = _tokens.get(self.url) or os.environ.get("CORRAL_TOKEN", "")
        return f"Bearer {token}" if token else None

    def on_node(self, url: str, node: str | None) -> Endpoint:
        """The endpoint of the cluster node a gateway placed a sandbox on: same token."""
        ep = Endpoint(url.rstrip("/"), node, self.gateway or self.url)
        source = _token_source.get(self.url, self.url)
        if source in _tokens and (ep.url not in _tokens or ep.url in _token_source):
            _tokens[ep.url] = _tokens[source]
            _token_source[ep.url] = source
        return ep

    def placed(self, info: object) -> Endpoint:
        """Where a sandbox just made through this endpoint lives: its node, when a cluster
        gateway placed it (``info.endpoint``), else here."""
        url = getattr(info, "endpoint", None)
        return self.on_node(url, getattr(info, "node", None)) if url else self

    def placing(self) -> Endpoint:
        """Where a create or fork is placed: the gateway that placed this node's sandbox,
        else here."""
        return Endpoint(self.gateway) if self.gateway else self

    def __str__(self) -> str:
        return self.url
