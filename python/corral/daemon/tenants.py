"""Tenants: many clients of one daemon, each reaching only the sandboxes it made.

A tokens file (``CORRAL_TOKENS``) maps a tenant name to its bearer token, or to the token's
SHA-256 (``"sha256:<hex>"``), so the file need not hold secrets::

    {"alice": "a-long-random-token", "bob": "sha256:5e88...42",
     "carol": {"token": "sha256:9f86...08", "max_sandboxes": 200}}

A tenant's entry is its token, or an object with the token and its own quotas, each in place of
the daemon's default for every tenant (corral.daemon.engine.quota counts them):
``max_sandboxes`` (live sandboxes, ``CORRAL_TENANT_MAX_SANDBOXES``), ``max_snapshots`` and
``snapshot_mb`` (``CORRAL_TENANT_MAX_SNAPSHOTS``, ``CORRAL_TENANT_SNAPSHOT_MB``), ``log_mb``
(its trajectory logs, ``CORRAL_TENANT_LOG_MB``).

The file is re-read when it changes (checked at most once a second, on a request): a token
removed from it stops working within a second. A file that cannot be read or parsed admits no
tenant (fail closed; the admin token and the unix socket still work) until it is fixed.

A presented token is hashed once and looked up in a dict keyed by the hashes: the lookup's
timing depends on the hash, never on how much of a real token a guess shares.

A sandbox records its tenant in the label ``corral.tenant`` (set by the daemon on every
tenant's create, whatever the request says); forks inherit it, snapshots record their
sandbox's. The admin (the unix socket or ``CORRAL_TOKEN``) sees everything.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from typing import Any

log = logging.getLogger("corral.tenants")

TENANT_LABEL = "corral.tenant"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
HASH_RE = re.compile(r"^sha256:([0-9a-f]{64})$")
MIN_TOKEN_LEN = 16
RECHECK_S = 1.0


class TokensError(ValueError):
    """The tokens file is not a map of tenant names to tokens."""


def token_hash(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


# The quotas a tenant's entry may set for itself (whole numbers >= 0).
QUOTA_KEYS = ("max_sandboxes", "max_snapshots", "snapshot_mb", "log_mb")


def _entry(name: str, value: Any) -> tuple[Any, dict[str, int]]:
    """A tenant's (token, its own quotas) from its entry: a token, or an object."""
    if not isinstance(value, dict):
        return value, {}
    unknown = set(value) - {"token", *QUOTA_KEYS}
    if unknown:
        raise TokensError(f"tenant {name!r}: unknown keys {sorted(unknown)} (token, "
                          f"{', '.join(QUOTA_KEYS)})")
    quotas: dict[str, int] = {}
    for key in QUOTA_KEYS:
        limit = value.get(key)
        if limit is None:
            continue
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise TokensError(f"tenant {name!r}: {key} must be a whole number >= 0")
        quotas[key] = limit
    return value.get("token"), quotas


def parse_table(text: str) -> tuple[dict[bytes, str], dict[str, dict[str, int]]]:
    """(token hash -> tenant name, tenant name -> the quotas its entry sets), from the
    file's JSON."""
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise TokensError(f"not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise TokensError("the tokens file must be a JSON object: tenant name -> token")
    out: dict[bytes, str] = {}
    limits: dict[str, dict[str, int]] = {}
    for name, value in obj.items():
        if not NAME_RE.match(name):
            raise TokensError(f"bad tenant name {name!r} (letters, digits, _ . -; 1-63)")
        tok, quotas = _entry(name, value)
        if quotas:
            limits[name] = quotas
        if not isinstance(tok, str):
            raise TokensError(f"tenant {name!r}: the token must be a string")
        m = HASH_RE.match(tok)
        if m is not None:
            digest = bytes.fromhex(m.group(1))
        elif len(tok) < MIN_TOKEN_LEN or tok != tok.strip():
            raise TokensError(f"tenant {name!r}: a token has at least {MIN_TOKEN_LEN} "
                              "characters and no surrounding spaces (or give sha256:<hex>)")
        else:
            digest = token_hash(tok)
        if digest in out:
            raise TokensError(f"tenants {out[digest]!r} and {name!r} share a token")
        out[digest] = name
    return out, limits


def parse(text: str) -> dict[bytes, str]:
    """Token hash -> tenant name, from the file's JSON."""
    return parse_table(text)[0]


class Tenants:
    """The tokens file, re-read when it changes."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._by_hash: dict[bytes, str] = {}
        self._limits: dict[str, dict[str, int]] = {}
        self._sig: tuple[int, int, int] | None = None
        self._checked = 0.0
        self.reload(strict=True)

    def reload(self, strict: bool = False) -> None:
        """Read the file if it changed; ``strict``: raise on a bad file (at startup)."""
        try:
            st = os.stat(self.path)
            sig = (st.st_ino, st.st_mtime_ns, st.st_size)
            if sig == self._sig:
                return
            with open(self.path, encoding="utf-8") as f:
                table, limits = parse_table(f.read())
        except (OSError, TokensError) as e:
            if strict:
                raise TokensError(f"tokens file {self.path}: {e}") from None
            if self._by_hash or self._sig is not None:
                log.error("tokens file unusable: no tenant is admitted until it is fixed",
                          extra={"path": self.path, "error": str(e)})
            self._by_hash, self._limits, self._sig = {}, {}, None
            return
        self._by_hash, self._limits, self._sig = table, limits, sig
        log.info("tokens file loaded", extra={"path": self.path, "tenants": len(table)})

    def tenant(self, token: str) -> str | None:
        """The tenant whose token this is, else None."""
        now = time.monotonic()
        if now - self._checked >= RECHECK_S:
            self._checked = now
            self.reload()
        return self._by_hash.get(token_hash(token))

    def names(self) -> list[str]:
        return sorted(set(self._by_hash.values()))

    def quota(self, name: str, key: str) -> int | None:
        """The tenant's own ``key`` quota (QUOTA_KEYS) from the file, None where it gives
        none. Read on the log's ingester thread too: the table is replaced whole."""
        return self._limits.get(name, {}).get(key)

    def max_sandboxes(self, name: str) -> int | None:
        return self.quota(name, "max_sandboxes")


def of_labels(labels: dict[str, Any] | None) -> str | None:
    return (labels or {}).get(TENANT_LABEL)
