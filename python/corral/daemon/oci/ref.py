"""Image references the way every container tool reads them:
``[registry[:port]/]repo/path[:tag][@sha256:hex]``; no registry means Docker Hub
(``docker.io``, ``library/`` for one-component names), no tag means ``latest``."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from corral.errors import InvalidRequest

DOCKER_HUB = "docker.io"
DOCKER_HUB_API = "registry-1.docker.io"
_COMPONENT = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_HOST = re.compile(r"^(?:\[[0-9a-fA-F:]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?)"
                   r"(?::[0-9]{1,5})?$")


@dataclass(frozen=True)
class Reference:
    registry: str  # host[:port] as named (docker.io for Docker Hub)
    repo: str
    tag: str | None
    digest: str | None

    @property
    def api_host(self) -> str:
        return DOCKER_HUB_API if self.registry == DOCKER_HUB else self.registry

    @property
    def reference(self) -> str:
        """What the manifest is fetched by: the digest if pinned, else the tag."""
        return self.digest or self.tag or "latest"

    def __str__(self) -> str:
        s = f"{self.registry}/{self.repo}"
        if self.tag:
            s += f":{self.tag}"
        if self.digest:
            s += f"@{self.digest}"
        return s

    def loopback(self) -> bool:
        """A registry on 127.0.0.0/8 or ::1 (or named localhost): plain HTTP is allowed."""
        host = self.registry.rsplit(":", 1)[0] if not self.registry.startswith("[") \
            else self.registry[1:self.registry.index("]")]
        if host == "localhost":
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False


def looks_like_ref(name: str) -> bool:
    """True for a name only a registry reference can be (it has a ``/``, ``:`` or ``@``)."""
    return any(c in name for c in "/:@")


def parse(text: str) -> Reference:
    if not isinstance(text, str) or not text or len(text) > 512 or any(
            c.isspace() or c == "\0" for c in text):
        raise InvalidRequest(f"invalid image reference {text!r}", details={"reference": text})
    rest, digest = text, None
    if "@" in rest:
        rest, digest = rest.split("@", 1)
        if not _DIGEST.match(digest):
            raise InvalidRequest(f"invalid digest in image reference {text!r} (sha256:<64 hex>)",
                                 details={"reference": text})
    first, slash, remainder = rest.partition("/")
    # The first component is a registry if it looks like a host (a dot, a port, localhost,
    # an IPv6 literal) and is a valid one; else it is part of the repository.
    if slash and ("." in first or ":" in first or first == "localhost"
                  or first.startswith("[")) and _HOST.match(first):
        registry, path = first, remainder
    else:
        registry, path = DOCKER_HUB, rest
    tag = None
    if ":" in path.rsplit("/", 1)[-1]:
        path, tag = path.rsplit(":", 1)
        if not _TAG.match(tag):
            raise InvalidRequest(f"invalid tag {tag!r} in {text!r}", details={"reference": text})
    parts = path.split("/")
    if not path or not all(_COMPONENT.match(p) for p in parts):
        raise InvalidRequest(f"invalid repository {path!r} in {text!r}: lowercase letters, "
                             "digits and . _ - separators", details={"reference": text})
    if registry == DOCKER_HUB and len(parts) == 1:
        path = "library/" + path
    if tag is None and digest is None:
        tag = "latest"
    return Reference(registry, path, tag, digest)
