"""Paths and defaults, each overridable by an environment variable."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


DEFAULT_SOCKET = "/run/corral/corrald.sock"


def socket_from_env() -> str:
    """The daemon's unix socket (``CORRAL_SOCKET``): read alone, on every SDK call that has no
    endpoint (a whole ``Config`` is ~30 environment reads)."""
    return _env("CORRAL_SOCKET", DEFAULT_SOCKET)


def log_retention_from_env() -> float:
    """How long an ended sandbox's trajectory log is kept (a node's, a gateway's copies)."""
    return float(_env("CORRAL_LOG_RETENTION_S", str(7 * 86400)))


@dataclass(frozen=True)
class Config:
    state_dir: str = field(default_factory=lambda: _env("CORRAL_STATE_DIR", "/var/lib/corral"))
    socket_path: str = field(default_factory=socket_from_env)
    # "host:port" to also listen on TCP (requires a token); empty disables TCP.
    tcp_listen: str = field(default_factory=lambda: _env("CORRAL_TCP", ""))
    # Connections the TCP listener holds at once (corral.daemon.tcpguard).
    tcp_max_connections: int = field(
        default_factory=lambda: int(_env("CORRAL_TCP_MAX_CONNECTIONS", "4096")))
    # Of those, the most one tenant's requests hold: a count, or a share ("50%": no tenant
    # takes the listener from the others).
    tcp_max_connections_per_tenant: str = field(
        default_factory=lambda: _env("CORRAL_TCP_MAX_CONNECTIONS_PER_TENANT", "50%"))
    # Seconds a TCP peer may take none of what the daemon sends before the connection is
    # dropped (corral.daemon.tcpguard: a client that stopped reading its answers).
    tcp_send_timeout_s: float = field(
        default_factory=lambda: float(_env("CORRAL_TCP_SEND_TIMEOUT", "120")))
    token: str = field(default_factory=lambda: _env("CORRAL_TOKEN", ""))
    # A JSON file of tenant name -> token (or "sha256:<hex>"): each tenant's TCP token reaches
    # only its own sandboxes (corral.daemon.tenants). Empty: no tenants.
    tokens_file: str = field(default_factory=lambda: _env("CORRAL_TOKENS", ""))
    # The most live sandboxes a tenant holds here when its tokens file entry gives no
    # max_sandboxes: a count, or a share of max_sandboxes ("50%": no tenant fills the daemon).
    tenant_max_sandboxes: str = field(
        default_factory=lambda: _env("CORRAL_TENANT_MAX_SANDBOXES", "50%"))
    # The cluster node this daemon serves (its Ray node id, set by the node's supervisor:
    # docs/cluster.md); every SandboxInfo names it. Empty: a standalone daemon.
    node_id: str = field(default_factory=lambda: _env("CORRAL_NODE_ID", ""))
    # Name of the cgroup directory under each hierarchy; tests use a private one.
    cgroup_name: str = field(default_factory=lambda: _env("CORRAL_CGROUP", "corral"))
    # The admission limit; 0 (the default): derived from the machine (daemon/capacity.py).
    max_sandboxes: int = field(
        default_factory=lambda: int(_env("CORRAL_MAX_SANDBOXES", "0")))
    capacity_bound_by: str = "config"  # what set max_sandboxes (set with it when derived)
    # Memory for commands' output past each stream's first 64 KiB, all commands together
    # (corral.daemon.outputmem); 0 (the default): a quarter of the host's memory. Past it
    # output goes to spill files in the state dir, at most output_disk_mb (0: a quarter of
    # the state dir's free space at start).
    output_memory_mb: int = field(
        default_factory=lambda: int(_env("CORRAL_OUTPUT_MEMORY_MB", "0")))
    output_disk_mb: int = field(
        default_factory=lambda: int(_env("CORRAL_OUTPUT_DISK_MB", "0")))
    reaper_interval_s: float = field(
        default_factory=lambda: float(_env("CORRAL_REAPER_INTERVAL", "0.5")))
    # Trajectory log (docs/trajectory.md): on/off, retention of ended sandboxes' logs, the
    # cap on each logged output, durability (normal: survives a daemon crash; full: fsync).
    trajlog: bool = field(default_factory=lambda: _env("CORRAL_TRAJLOG", "1") not in ("0", ""))
    log_retention_s: float = field(default_factory=log_retention_from_env)
    trajlog_output_cap: int = field(
        default_factory=lambda: int(_env("CORRAL_TRAJLOG_OUTPUT_CAP", str(1 << 20))))
    trajlog_sync: str = field(default_factory=lambda: _env("CORRAL_TRAJLOG_SYNC", "normal"))
    trajlog_flush_ms: float = field(
        default_factory=lambda: float(_env("CORRAL_TRAJLOG_FLUSH_MS", "100")))
    # How long a mutating call's "started" row is held back: a call ending sooner is one row.
    trajlog_start_ms: float = field(
        default_factory=lambda: float(_env("CORRAL_TRAJLOG_START_MS", "20")))
    # Bounds on what a sandbox's files can make the daemon store or stream (docs/daemon.md):
    # a snapshot's file content (apparent size, holes are kept as holes), its entries and
    # depth; an upload's decompressed bytes and members.
    snapshot_max_bytes: int = field(
        default_factory=lambda: int(_env("CORRAL_SNAPSHOT_MAX_BYTES", str(16 << 30))))
    snapshot_max_entries: int = field(
        default_factory=lambda: int(_env("CORRAL_SNAPSHOT_MAX_ENTRIES", "1000000")))
    upload_max_bytes: int = field(
        default_factory=lambda: int(_env("CORRAL_UPLOAD_MAX_BYTES", str(1 << 30))))
    # Memory reserved for the daemon's own cgroup (cgroup v2 memory.min; see docs/daemon.md).
    daemon_memory_mb: int = field(
        default_factory=lambda: int(_env("CORRAL_DAEMON_MEMORY_MB", "256")))
    log_level: str = field(default_factory=lambda: _env("CORRAL_LOG_LEVEL", "INFO"))
    # A host directory any client (TCP tokens too) may import images from; empty: none, only
    # the local unix socket (root-equivalent) names host paths.
    import_dir: str = field(default_factory=lambda: _env("CORRAL_IMPORT_DIR", ""))
    # The daemon's own log file (rotated at log_max_bytes, log_backups kept); empty: stderr.
    log_file: str = field(default_factory=lambda: _env("CORRAL_LOG_FILE", ""))
    log_max_bytes: int = field(
        default_factory=lambda: int(_env("CORRAL_LOG_MAX_BYTES", str(16 << 20))))
    log_backups: int = field(default_factory=lambda: int(_env("CORRAL_LOG_BACKUPS", "3")))
    # Images (docs/images.md): the bound on one image's unpacked bytes and files, and the
    # registries (host[:port], comma-separated) that may be reached over plain HTTP besides
    # those on 127.0.0.0/8.
    image_max_bytes: int = field(
        default_factory=lambda: int(_env("CORRAL_IMAGE_MAX_BYTES", str(16 << 30))))
    image_max_files: int = field(
        default_factory=lambda: int(_env("CORRAL_IMAGE_MAX_FILES", "1000000")))
    # If set (comma-separated host[:port]), the only registries pulls may reach; others are
    # forbidden (a remote client cannot make the daemon fetch from anywhere it likes). A
    # registry named here or in insecure_registries may be on a loopback, private or blocked
    # address; no other connection of a pull goes to one (oci.egress).
    registries: tuple[str, ...] = field(default_factory=lambda: tuple(
        r.strip() for r in _env("CORRAL_REGISTRIES", "").split(",") if r.strip()))
    # How image layers are stored: "auto" (EROFS where mkfs.erofs and the kernel allow,
    # plain directories otherwise) or "dir" (always directories: for comparison).
    image_layers: str = field(default_factory=lambda: _env("CORRAL_IMAGE_LAYERS", "auto"))
    insecure_registries: tuple[str, ...] = field(default_factory=lambda: tuple(
        r.strip() for r in _env("CORRAL_INSECURE_REGISTRIES", "").split(",") if r.strip()))


def load() -> Config:
    return Config()
