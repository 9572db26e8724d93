"""A quota on live sandboxes per value of one label (the daemon's tenants: ``corral.tenant``).

The engine admits a create, a batch or a fork only if the label's value holds fewer than its
limit with the new ones counted; sandboxes without the label (the admin's) have no quota. The
count is kept as sandboxes enter and leave the engine's registry, so a check costs a dict
lookup whatever the number alive. Which label and what each value may hold is the caller's
policy (``limit_of``); this module only counts.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from corral.errors import InvalidRequest, QuotaExceeded


def parse_limit(value: str, capacity: int) -> int:
    """``CORRAL_TENANT_MAX_SANDBOXES``: a count ("200") or a share of the daemon's admission
    limit ("50%"), at least 1 for a share."""
    text = value.strip()
    try:
        if text.endswith("%"):
            share = float(text[:-1])
            if not 0 < share <= 100:
                raise ValueError
            return max(1, int(capacity * share / 100))
        count = int(text)
        if count < 0:
            raise ValueError
        return count
    except ValueError:
        raise InvalidRequest(f"a tenant's sandbox quota is a count (200) or a share of the "
                             f"daemon's limit (50%), not {value!r}") from None


def _whole(name: str, default: int) -> int:
    text = os.environ.get(name, "").strip()
    try:
        n = int(text) if text else default
    except ValueError:
        raise ValueError(f"{name} must be a whole number, not {text!r}") from None
    if n < 0:
        raise ValueError(f"{name} must be >= 0")
    return n


def _fs_mb(state_dir: str) -> int:
    st = os.statvfs(state_dir)
    return st.f_blocks * st.f_frsize >> 20


def snapshot_quota_from_env(state_dir: str) -> tuple[int, int]:
    """What each tenant's snapshots may hold: (``CORRAL_TENANT_MAX_SNAPSHOTS``, 1000;
    ``CORRAL_TENANT_SNAPSHOT_MB`` in bytes, by default a quarter of the state dir's
    filesystem, so no tenant's snapshots can take the disk every tenant shares)."""
    return (_whole("CORRAL_TENANT_MAX_SNAPSHOTS", 1000),
            _whole("CORRAL_TENANT_SNAPSHOT_MB", _fs_mb(state_dir) // 4) << 20)


def log_budget_from_env(state_dir: str) -> int:
    """What each tenant's sandboxes' trajectory logs may hold, in bytes:
    ``CORRAL_TENANT_LOG_MB``, by default an eighth of the state dir's filesystem (a tenant's
    logs and snapshots together then take at most three eighths of it)."""
    return _whole("CORRAL_TENANT_LOG_MB", _fs_mb(state_dir) // 8) << 20


class LabelQuota:
    """Live sandboxes by the value of ``label``; ``limit_of(value)`` is the most that value
    may hold (None: no limit)."""

    def __init__(self, label: str, limit_of: Callable[[str], int | None]) -> None:
        self.label = label
        self.limit_of = limit_of
        self.counts: dict[str, int] = {}

    def _value(self, labels: Mapping[str, Any] | None) -> str | None:
        value = (labels or {}).get(self.label)
        return value if isinstance(value, str) else None

    def admit(self, labels: Mapping[str, Any] | None, n: int) -> None:
        """Raise QuotaExceeded unless ``n`` more sandboxes with ``labels`` fit."""
        value = self._value(labels)
        if value is None:
            return
        limit = self.limit_of(value)
        if limit is None:
            return
        in_use = self.counts.get(value, 0)
        if in_use + n > limit:
            raise QuotaExceeded(
                f"quota exceeded: {self.label} {value!r} holds {in_use} of its {limit} live "
                f"sandboxes, {n} requested",
                details={"tenant": value, "in_use": in_use, "limit": limit, "requested": n})

    def add(self, labels: Mapping[str, Any] | None) -> None:
        value = self._value(labels)
        if value is not None:
            self.counts[value] = self.counts.get(value, 0) + 1

    def remove(self, labels: Mapping[str, Any] | None) -> None:
        value = self._value(labels)
        if value is None:
            return
        left = self.counts.get(value, 0) - 1
        if left > 0:
            self.counts[value] = left
        else:
            self.counts.pop(value, None)
