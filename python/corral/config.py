"""Paths and defaults, each overridable by an environment variable."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


@dataclass(frozen=True)
class Config:
    state_dir: str = field(default_factory=lambda: _env("CORRAL_STATE_DIR", "/var/lib/corral"))
    socket_path: str = field(
        default_factory=lambda: _env("CORRAL_SOCKET", "/run/corral/corrald.sock"))
    # "host:port" to also listen on TCP (requires a token); empty disables TCP.
    tcp_listen: str = field(default_factory=lambda: _env("CORRAL_TCP", ""))
    token: str = field(default_factory=lambda: _env("CORRAL_TOKEN", ""))
    # Name of the cgroup directory under each hierarchy; tests use a private one.
    cgroup_name: str = field(default_factory=lambda: _env("CORRAL_CGROUP", "corral"))
    max_sandboxes: int = field(
        default_factory=lambda: int(_env("CORRAL_MAX_SANDBOXES", "20000")))
    reaper_interval_s: float = field(
        default_factory=lambda: float(_env("CORRAL_REAPER_INTERVAL", "0.5")))
    log_level: str = field(default_factory=lambda: _env("CORRAL_LOG_LEVEL", "INFO"))


def load() -> Config:
    return Config()
