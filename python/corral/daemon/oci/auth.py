"""Registry credentials, read at pull time (so a ``docker login`` made after the daemon
started counts) from ``$DOCKER_CONFIG/config.json`` or ``~/.docker/config.json``, and the
``WWW-Authenticate`` challenge of the distribution spec (Basic or Bearer)."""

from __future__ import annotations

import base64
import binascii
import json
import os
import re

from corral.daemon.oci.ref import DOCKER_HUB

_HUB_KEYS = ("https://index.docker.io/v1/", "index.docker.io", "docker.io",
             "registry-1.docker.io")
_PARAM = re.compile(r'([A-Za-z_]+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^\s,]+))')


def config_path() -> str:
    d = os.environ.get("DOCKER_CONFIG") or os.path.join(os.path.expanduser("~"), ".docker")
    return os.path.join(d, "config.json")


def _host_of(key: str) -> str:
    k = key
    for prefix in ("https://", "http://"):
        if k.startswith(prefix):
            k = k[len(prefix):]
    return k.split("/", 1)[0]


def credentials(registry: str, path: str | None = None) -> tuple[str, str] | None:
    """(username, password) for ``registry`` from the docker config, or None. Entries are
    matched by host[:port] (with or without a scheme or a path, as ``docker login`` writes
    them); Docker Hub under any of its names. Credential helpers are not run."""
    try:
        with open(path or config_path(), "rb") as f:
            cfg = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return None
    auths = cfg.get("auths") if isinstance(cfg, dict) else None
    if not isinstance(auths, dict):
        return None
    wanted = _HUB_KEYS if registry == DOCKER_HUB else (registry,)
    for key, entry in auths.items():
        if not isinstance(key, str) or not isinstance(entry, dict):
            continue
        if key not in wanted and _host_of(key) not in wanted:
            continue
        user, pw = entry.get("username"), entry.get("password")
        if isinstance(user, str) and isinstance(pw, str):
            return user, pw
        enc = entry.get("auth")
        if isinstance(enc, str) and enc:
            try:
                raw = base64.b64decode(enc, validate=True).decode()
            except (binascii.Error, UnicodeDecodeError):
                continue
            user, sep, pw = raw.partition(":")
            if sep:
                return user, pw
    return None


def challenge(header: str) -> tuple[str, dict[str, str]]:
    """``Bearer realm="...",service="..."`` -> ("bearer", {"realm": ..., ...})."""
    scheme, _, rest = header.strip().partition(" ")
    params = {m.group(1).lower(): (m.group(2) if m.group(2) is not None else m.group(3))
              for m in _PARAM.finditer(rest)}
    return scheme.lower(), params
