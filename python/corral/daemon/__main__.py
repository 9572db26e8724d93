"""corrald: the corral daemon. ``python -m corral.daemon`` or ``corrald``.

Flags override the environment (see corral.config). SIGTERM or SIGINT stops it gracefully:
every sandbox is destroyed and the socket removed. One daemon per state dir, enforced by an
flock on ``<state_dir>/corrald.pid`` (released by the kernel even after kill -9).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import resource
import signal
import socket
import sys
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from corral import __version__, config
from corral.daemon import capacity, diskguard, kernel, logs
from corral.daemon.app import MAX_FIELD_SIZE, MAX_LINE_SIZE, create_app
from corral.daemon.engine import Engine
from corral.daemon.engine.quota import log_budget_from_env, parse_limit, snapshot_quota_from_env
from corral.daemon.locks import try_lock
from corral.daemon.protect import protect_daemon
from corral.daemon.tcpguard import TcpGuard
from corral.daemon.tenants import Tenants, TokensError
from corral.errors import InvalidRequest

log = logging.getLogger("corral.daemon")
PIDFILE = "corrald.pid"


class StartupError(Exception):
    """A reason not to start, told to the operator in one line."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="corrald", description="corral sandbox daemon")
    p.add_argument("--state-dir", help="state root (default $CORRAL_STATE_DIR or "
                                       "/var/lib/corral)")
    p.add_argument("--socket", help="unix socket path (default $CORRAL_SOCKET or "
                                    "/run/corral/corrald.sock)")
    p.add_argument("--tcp", help="also listen on HOST:PORT (requires --token)")
    p.add_argument("--token", help="the admin's bearer token on TCP (default $CORRAL_TOKEN)")
    p.add_argument("--tokens", help="tenants' tokens file, JSON name -> token (default "
                                    "$CORRAL_TOKENS; docs/daemon.md)")
    p.add_argument("--tenant-max-sandboxes",
                   help="live sandboxes a tenant may hold when its tokens file entry gives no "
                        "max_sandboxes: a count or a share of the admission limit (default "
                        "$CORRAL_TENANT_MAX_SANDBOXES or 50%%)")
    p.add_argument("--node-id", help="the cluster node this daemon serves (default "
                                     "$CORRAL_NODE_ID; none: standalone)")
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING, ERROR")
    p.add_argument("--log-file", help="log to this file, rotated by size (default "
                                      "$CORRAL_LOG_FILE; none: stderr)")
    p.add_argument("--version", action="version", version=f"corrald {__version__}")
    return p.parse_args(argv)


def build_config(args: argparse.Namespace) -> config.Config:
    over = {k: v for k, v in {"state_dir": args.state_dir, "socket_path": args.socket,
                              "tcp_listen": args.tcp, "token": args.token,
                              "tokens_file": args.tokens,
                              "tenant_max_sandboxes": args.tenant_max_sandboxes,
                              "log_level": args.log_level, "node_id": args.node_id,
                              "log_file": args.log_file}.items() if v is not None}
    cfg = dataclasses.replace(config.load(), **over)
    return dataclasses.replace(cfg, state_dir=os.path.abspath(cfg.state_dir),
                               socket_path=os.path.abspath(cfg.socket_path))


def raise_nofile() -> int:
    """Each sandbox holds a pidfd (and exec pipes come and go): lift the fd limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        with open("/proc/sys/fs/nr_open") as f:
            want = int(f.read())
    except (OSError, ValueError):
        want = hard
    for limit in (want, hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, max(limit, hard)))
            return limit
        except (ValueError, OSError):
            continue
    return soft


# Kernel limits a host full of sandboxes runs into, raised (never lowered) at start-up. Each
# sandbox is a process (its init) and six namespaces; a pooled netns is one more. The value is a
# floor: a host already configured higher keeps its setting. CORRAL_SYSCTL=0 turns this off.
INT_MAX = 2**31 - 1
LONG_MAX = 2**63 - 1
PID_MAX_LIMIT = 4 * 1024 * 1024  # kernel.pid_max's ceiling on 64-bit


def _sysctl_floors(max_sandboxes: int) -> dict[str, int]:
    ns = 2 * max_sandboxes + 4096          # sandboxes + pooled netns + headroom
    return {
        "kernel/pid_max": PID_MAX_LIMIT,                   # default 32768: ~30k sandboxes
        "fs/nr_open": 1 << 21,                             # RLIMIT_NOFILE's ceiling
        # Host-wide tables no capability exempts corral-init from (a full one fails every
        # sandbox's commands with capacity_exceeded, infra), which a sandbox fills within its
        # own limits: 4M open files are 400 processes at the commands' fd limit and ~1 GiB of
        # struct file; ~275k tasks (the default threads-max on 24 GiB) are ~500 sandboxes at
        # the default pids limit. Both are kernel memory charged to the sandbox's memory
        # cgroup, which bounds them; tasks are then bounded by pid_max, the kernel's ceiling.
        "kernel/threads-max": max(4 * max_sandboxes + 65536, PID_MAX_LIMIT),
        "fs/file-max": LONG_MAX,
        "vm/max_map_count": 1 << 18,
        "user/max_mnt_namespaces": ns,
        "user/max_pid_namespaces": ns,
        "user/max_net_namespaces": ns,
        "user/max_uts_namespaces": ns,
        "user/max_ipc_namespaces": ns,
        "user/max_cgroup_namespaces": ns,
        # Counted per user, and every container sandbox's processes are uid 0 on the host: at
        # the defaults (128 inotify instances) one sandbox could take them all from every
        # other sandbox, and exhausting epoll's would make the daemon's own epoll_ctl fail.
        # Each instance and watch is kernel memory charged to its sandbox's memory cgroup,
        # which bounds it; the per-user count then bounds nothing.
        "fs/inotify/max_user_instances": INT_MAX,
        "fs/inotify/max_user_watches": INT_MAX,
        "fs/epoll/max_user_watches": INT_MAX,
        # The same for fanotify groups (128) and marks, which need no capability since 5.13;
        # and for pipe buffers: past 16,384 pages of a user's pipes, every new pipe of every
        # sandbox got 2 pages (8 KiB, not 64) and F_SETPIPE_SZ failed. Groups, marks and pipe
        # pages are charged to the memory cgroup that makes them.
        "fs/fanotify/max_user_groups": INT_MAX,
        "fs/fanotify/max_user_marks": INT_MAX,
        "fs/pipe-user-pages-soft": INT_MAX,
        # Every sandbox's devpts draws on one pool of ptys (4,096 less the host's reserve of
        # 1,024); each sandbox's holds at most 256 (spawn.rs), so the pool is the kernel's
        # ceiling. A pty is kernel memory charged to the memory cgroup that opens it.
        "kernel/pty/max": 1 << 20,
        # Kernel AIO contexts' events, one count for the whole host (65,536): a sandbox's 16
        # io_setup calls of 4,096 took them all, from every sandbox and the host's own libaio
        # users. A context's ring is charged to the memory cgroup that makes it, the bound
        # that holds (a 64 MiB sandbox is OOM-killed at its limit first).
        "fs/aio-max-nr": LONG_MAX,
    }


def raise_kernel_limits(max_sandboxes: int) -> dict[str, tuple[int, int]]:
    """Raise each sysctl in ``_sysctl_floors`` to at least its floor; returns what changed
    as {name: (old, new)}. Best effort: a read-only /proc/sys (in a container) is logged."""
    changed: dict[str, tuple[int, int]] = {}
    if os.environ.get("CORRAL_SYSCTL", "1") in ("0", "false", "no"):
        return changed
    for name, floor in _sysctl_floors(max_sandboxes).items():
        path = "/proc/sys/" + name
        try:
            with open(path) as f:
                old = int(f.read().split()[0])
            if old >= floor:
                continue
            with open(path, "w") as f:
                f.write(str(floor))
            changed[name.replace("/", ".")] = (old, floor)
        except (OSError, ValueError, IndexError) as e:
            log.warning("cannot raise a kernel limit", extra={"sysctl": name, "error": str(e)})
    return changed


def admission_limit(cfg: config.Config) -> config.Config:
    """Raise the kernel's limits for the admission limit; when none is configured, derive it
    from the machine (memory first, then what the kernel still allows: daemon/capacity.py)."""
    configured = cfg.max_sandboxes > 0
    want = cfg.max_sandboxes if configured else capacity.bounds().get("memory", 1000)
    changed = raise_kernel_limits(want)
    if changed:
        log.info("raised kernel limits", extra={k: f"{a} -> {b}" for k, (a, b) in changed.items()})
    if configured:
        return cfg
    limit = capacity.derive()
    log.info("admission limit derived from the machine",
             extra={"max_sandboxes": limit.count, "bound_by": limit.bound_by})
    return dataclasses.replace(cfg, max_sandboxes=limit.count, capacity_bound_by=limit.bound_by)


def lock_pidfile(state_dir: str) -> int:
    path = os.path.join(state_dir, PIDFILE)
    fd = try_lock(path, 0o644)
    if fd is None:
        try:
            with open(path, "rb") as f:
                other = f.read(32).decode(errors="replace").strip()
        except OSError:
            other = ""
        raise StartupError(f"another corrald (pid {other or '?'}) runs on {state_dir}")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def lock_cgroup_name(name: str) -> int:
    """One daemon per cgroup name: at start-up a daemon removes every sandbox cgroup under its
    name that it does not know, so a second daemon on the same name would kill the first one's
    sandboxes. The lock lives in /run (per boot, like the cgroups themselves)."""
    d = "/run/corral/locks"
    os.makedirs(d, mode=0o700, exist_ok=True)
    fd = try_lock(os.path.join(d, f"cgroup-{name.replace('/', '_')}.lock"))
    if fd is None:
        raise StartupError(f"another corrald uses the cgroup name {name!r}; give this one "
                           "its own (CORRAL_CGROUP)")
    return fd


def bind_unix(path: str) -> socket.socket:
    """A root-only socket (0600) in a directory we make 0700."""
    d = os.path.dirname(path)
    if not os.path.isdir(d):
        os.makedirs(d, mode=0o700)
        os.chmod(d, 0o700)
    if os.path.lexists(path):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # stale: its daemon is gone
        else:
            raise StartupError(f"another daemon is listening on {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    return sock


def parse_hostport(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    try:
        return host.strip("[]") or "127.0.0.1", int(port)
    except ValueError:
        raise StartupError(f"--tcp must be HOST:PORT, got {value!r}") from None


def _tcp_share(cfg: config.Config) -> int:
    """CORRAL_TCP_MAX_CONNECTIONS_PER_TENANT as a count (corral.daemon.tcpguard)."""
    try:
        return parse_limit(cfg.tcp_max_connections_per_tenant, cfg.tcp_max_connections)
    except InvalidRequest as e:
        raise StartupError(f"CORRAL_TCP_MAX_CONNECTIONS_PER_TENANT: {e}") from None


def _set_tenant_quota(engine: Engine, tenants: Tenants, default: str) -> None:
    """Each tenant's quota: its tokens file entry's max_sandboxes, else ``default`` (a count
    or a share of the admission limit)."""
    try:
        fallback = parse_limit(default, engine.config.max_sandboxes)
    except InvalidRequest as e:
        raise StartupError(f"--tenant-max-sandboxes / CORRAL_TENANT_MAX_SANDBOXES: {e}") \
            from None

    def limit_of(tenant: str) -> int:
        own = tenants.max_sandboxes(tenant)
        return fallback if own is None else own

    engine.set_tenant_quota(limit_of)


def _set_tenant_budgets(engine: Engine, tenants: Tenants, snapshot_quota: tuple[int, int],
                        log_budget: int) -> None:
    """Each tenant's snapshot quota and log budget: its tokens file entry's, else the
    daemon's defaults (``snapshot_quota``: records, bytes; ``log_budget``: bytes)."""
    records, size = snapshot_quota

    def snapshots_of(tenant: str) -> tuple[int, int]:
        own_records = tenants.quota(tenant, "max_snapshots")
        own_mb = tenants.quota(tenant, "snapshot_mb")
        return (records if own_records is None else own_records,
                size if own_mb is None else own_mb << 20)

    def log_of(tenant: str) -> int:
        own = tenants.quota(tenant, "log_mb")
        return log_budget if own is None else own << 20

    engine.snapshot_quota = snapshots_of
    engine.trajlog.tenant_log_budget = log_of


async def serve(cfg: config.Config) -> None:
    if cfg.tcp_listen and not (cfg.token or cfg.tokens_file):
        raise StartupError("refusing to listen on TCP without a token (--token or "
                           "CORRAL_TOKEN, or a tokens file: --tokens or CORRAL_TOKENS)")
    try:
        tenants = Tenants(cfg.tokens_file) if cfg.tokens_file else None
    except TokensError as e:
        raise StartupError(str(e)) from None
    os.makedirs(cfg.state_dir, mode=0o700, exist_ok=True)
    try:  # what the daemon keeps free on the state dir's disk for its own state, and what
        # each tenant's snapshots may take of it
        reserve = diskguard.reserve_from_env()
        snapshot_quota = snapshot_quota_from_env(cfg.state_dir)
        log_budget = log_budget_from_env(cfg.state_dir)
    except ValueError as e:
        raise StartupError(str(e)) from None
    lock_fd = lock_pidfile(cfg.state_dir)
    cgroup_lock_fd = lock_cgroup_name(cfg.cgroup_name)
    sock = bind_unix(cfg.socket_path)
    # Destroys (waiting for a pid namespace to die, cgroup removal) and big file operations
    # run in threads and mostly wait in the kernel: more workers than the default few, so a
    # wave of TTL expiries does not queue everyone's tar uploads behind it.
    asyncio.get_running_loop().set_default_executor(
        ThreadPoolExecutor(max_workers=32, thread_name_prefix="corral-io"))
    engine = Engine(cfg)
    engine.disk = diskguard.DiskGuard(cfg.state_dir, reserve, engine.output_memory)
    if tenants is not None:
        _set_tenant_quota(engine, tenants, cfg.tenant_max_sandboxes)
        _set_tenant_budgets(engine, tenants, snapshot_quota, log_budget)
    runner: web.AppRunner | None = None
    tcp: asyncio.Server | None = None
    serving = False
    try:
        await engine.start()
        cgroups = engine.shared.get("cgroups")  # made by the container substrate
        protected = protect_daemon(cgroups, cfg.daemon_memory_mb) if cgroups is not None else {}
        app = create_app(engine, cfg.token or None, tenants)
        guard = TcpGuard(cfg.tcp_max_connections, send_timeout_s=cfg.tcp_send_timeout_s,
                         per_tenant=_tcp_share(cfg))
        if cfg.tcp_listen:  # after the token check: a request refused leaves it watched
            app.middlewares.append(guard.middleware())
        # Bodies as sent: app_errors refuses an encoded one (charged by its compressed size).
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=5.0,
                               max_line_size=MAX_LINE_SIZE, max_field_size=MAX_FIELD_SIZE,
                               auto_decompress=False)
        await runner.setup()
        await web.SockSite(runner, sock, backlog=4096).start()
        if cfg.tcp_listen:
            host, port = parse_hostport(cfg.tcp_listen)
            assert runner.server is not None
            tcp = await asyncio.get_running_loop().create_server(
                guard.protocol_factory(runner.server, access_log=None,
                                       max_line_size=MAX_LINE_SIZE,
                                       max_field_size=MAX_FIELD_SIZE, auto_decompress=False),
                host, port, backlog=4096, reuse_address=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        serving = True
        log.info("corrald started", extra={"version": __version__, "pid": os.getpid(),
                                           "socket": cfg.socket_path, "tcp": cfg.tcp_listen,
                                           "state_dir": cfg.state_dir,
                                           "sandboxes": len(engine.sandboxes),
                                           **protected})
        await stop.wait()
        log.info("stopping")
    finally:
        # Stop taking connections first, then destroy everything, then let handlers finish.
        # A start-up that failed (a busy TCP port, say) destroys nothing: the sandboxes it
        # re-adopted wait for the next start.
        try:
            os.unlink(cfg.socket_path)
        except FileNotFoundError:
            pass
        if tcp is not None:
            tcp.close()
        if serving:
            await engine.shutdown()
        else:
            engine.close()
        if runner is not None:
            await runner.cleanup()
        engine.trajlog.close()  # after the handlers: what they logged is committed
        if engine.snaps is not None:
            engine.snaps.close()  # likewise; and its spare layer dirs go
        if engine.images is not None:
            engine.images.close()  # the layer mounts: live sandboxes hold their own copies
        sock.close()
        try:
            os.unlink(os.path.join(cfg.state_dir, PIDFILE))
        finally:
            os.close(lock_fd)
            os.close(cgroup_lock_fd)
        log.info("corrald stopped")


def harden_self() -> None:
    """Before anything else: not dumpable, so code in a sandbox (root there, never with
    CAP_SYS_PTRACE) cannot ptrace corrald or read its memory, environment (the TCP token) or
    fds through /proc or process_vm_readv, nor those of anything it forks; and the token's
    value blanked in the command line, which /proc/PID/cmdline shows to anyone."""
    from corral import _core

    _core.harden_daemon(["--token"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = build_config(args)
    level = cfg.log_level.upper()
    logs.setup(level if level in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL") else "INFO",
               cfg.log_file, cfg.log_max_bytes, cfg.log_backups)
    if os.geteuid() != 0:
        log.error("corrald must run as root (it makes namespaces, mounts and cgroups)")
        return 1
    harden_self()
    kernel.fix_mmap_threshold()
    cfg = admission_limit(cfg)
    nofile = raise_nofile()
    log.debug("fd limit", extra={"nofile": nofile})
    try:
        asyncio.run(serve(cfg))
    except StartupError as e:
        log.error(str(e))
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception:  # noqa: BLE001 - one JSON line with the traceback, then a clean exit
        log.exception("corrald failed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
