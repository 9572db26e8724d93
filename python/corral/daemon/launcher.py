"""Start, find and stop the local corrald (used by the SDK's embedded default and the CLI).

Stdlib only, so importing the SDK stays cheap.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from corral import config
from corral.daemon.locks import try_lock
from corral.errors import DaemonUnavailable, Timeout

PIDFILE = "corrald.pid"
LOGFILE = "corrald.log"


def _paths(socket_path: str | None, state_dir: str | None) -> tuple[str, str]:
    cfg = config.load()
    return socket_path or cfg.socket_path, state_dir or cfg.state_dir


def daemon_alive(socket_path: str | None = None, timeout: float = 1.0) -> bool:
    """True if a corrald answers GET /v1/health on the unix socket."""
    path = socket_path or config.load().socket_path
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
        s.sendall(b"GET /v1/health HTTP/1.1\r\nHost: corral\r\nConnection: close\r\n\r\n")
        data = b""
        while len(data) < 12:
            chunk = s.recv(256)
            if not chunk:
                break
            data += chunk
        return data.startswith(b"HTTP/1.1 200")
    except OSError:
        return False
    finally:
        s.close()


def _tail(path: str, n: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def ensure_daemon(socket_path: str | None = None, state_dir: str | None = None,
                  timeout: float = 30.0) -> None:
    """Make sure a corrald answers on ``socket_path``; start one (detached, logging to
    ``<state_dir>/corrald.log``) if none does. Exactly one caller starts it, whatever the
    number of threads and processes racing: starters queue on an flock beside the socket
    (``<socket>.lock``), and each one that gets it looks again before starting."""
    socket_path, state_dir = _paths(socket_path, state_dir)
    if daemon_alive(socket_path):
        return
    if os.geteuid() != 0:
        raise DaemonUnavailable(
            f"no corrald answers on {socket_path} and only root can start one: run "
            f"`sudo corral up` (or start corrald as root), or point CORRAL_SOCKET at a running "
            f"daemon")
    deadline = time.monotonic() + timeout
    lock_fd = _starter_lock(socket_path, deadline)
    try:
        if daemon_alive(socket_path):  # started by whoever held the lock before us
            return
        _start(socket_path, state_dir, max(1.0, deadline - time.monotonic()))
    finally:
        os.close(lock_fd)


def _starter_lock(socket_path: str, deadline: float) -> int:
    """An fd holding the starters' flock of ``socket_path`` (the kernel drops it if we die)."""
    d = os.path.dirname(socket_path)
    if not os.path.isdir(d):
        os.makedirs(d, mode=0o700, exist_ok=True)
    path = socket_path + ".lock"
    while True:
        fd = try_lock(path)
        if fd is not None:
            return fd
        if time.monotonic() >= deadline:
            raise DaemonUnavailable(f"another process has been starting corrald on "
                                    f"{socket_path} for too long (lock {path})")
        time.sleep(0.02)


def _start(socket_path: str, state_dir: str, timeout: float) -> None:
    os.makedirs(state_dir, mode=0o700, exist_ok=True)
    log_path = os.path.join(state_dir, LOGFILE)
    env = dict(os.environ, CORRAL_STATE_DIR=state_dir, CORRAL_SOCKET=socket_path)
    # The daemon must import the same corral as this process, installed or not.
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(config.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_parent, env.get("PYTHONPATH")) if p)
    argv = [sys.executable, "-m", "corral.daemon", "--state-dir", state_dir,
            "--socket", socket_path, "--log-file", log_path]
    # Double fork through a tiny single-threaded helper: the daemon is not our child (no
    # zombie when it exits, no tie to this process's lifetime) and runs in its own session.
    out = subprocess.run([sys.executable, "-c", _DETACH, log_path, *argv], env=env, cwd="/",
                         stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout)
    try:
        pid = int(out.stdout)
    except ValueError:
        raise DaemonUnavailable(f"could not start corrald: {out.stderr.decode()[-2000:]}") \
            from None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if daemon_alive(socket_path, timeout=0.5):
            return
        if not os.path.exists(f"/proc/{pid}") and not _locked(state_dir):
            # Ours exited and no other daemon holds the state dir: it failed.
            raise DaemonUnavailable(f"corrald exited during start-up; log {log_path}:\n"
                                    f"{_tail(log_path)}")
        time.sleep(0.02)
    raise DaemonUnavailable(f"corrald did not answer on {socket_path} within {timeout} s; "
                            f"log {log_path}:\n{_tail(log_path)}")


_DETACH = """
import os, sys
log = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
pid = os.fork()
if pid:
    print(pid, flush=True)
    os._exit(0)
os.setsid()
null = os.open("/dev/null", os.O_RDONLY)
os.dup2(null, 0)
os.dup2(log, 1)
os.dup2(log, 2)
os.closerange(3, 256)
os.execv(sys.argv[2], sys.argv[2:])
"""


def _locked(state_dir: str) -> bool:
    """True if a daemon holds the state dir's lock."""
    import fcntl

    try:
        fd = os.open(os.path.join(state_dir, PIDFILE), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _daemon_pid(state_dir: str) -> int | None:
    try:
        with open(os.path.join(state_dir, PIDFILE)) as f:
            pid = int(f.read().strip())
    except (OSError, ValueError):
        return None
    try:  # guard against a recycled pid
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
    except OSError:
        return None
    return pid if b"corral.daemon" in cmd or b"corrald" in cmd else None


def _status(socket_path: str, timeout: float = 2.0) -> dict | None:
    """GET /v1/status over the unix socket; None if no daemon answers."""
    import json

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(socket_path)
        s.sendall(b"GET /v1/status HTTP/1.1\r\nHost: corral\r\nConnection: close\r\n\r\n")
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
        head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            return None
        status = json.loads(body)
        return status if isinstance(status, dict) else None
    except (OSError, ValueError):
        return None
    finally:
        s.close()


def stop_daemon(socket_path: str | None = None, timeout: float = 30.0,
                state_dir: str | None = None) -> bool:
    """SIGTERM the daemon (it destroys its sandboxes) and wait for it to exit. The daemon
    answering on ``socket_path`` says its pid and state dir. If none answers (hung), the
    pidfile of ``state_dir`` is used, but only when ``state_dir`` was given or neither was (a
    socket of its own says nothing about the default state dir's daemon). False if none was
    running; raises Timeout if it did not stop."""
    trust_pidfile = state_dir is not None or socket_path is None
    socket_path, default_state = _paths(socket_path, state_dir)
    status = _status(socket_path)
    if status is not None and isinstance(status.get("pid"), int):
        pid, state_dir = status["pid"], str(status.get("state_dir") or default_state)
    else:
        if not trust_pidfile:
            return False
        state_dir = default_state
        found = _daemon_pid(state_dir)
        if found is None or not _locked(state_dir):
            return False
        pid = found
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        # The kernel drops the daemon's flock when it exits (even before it is reaped).
        if not _locked(state_dir) or not os.path.exists(f"/proc/{pid}"):
            return True
        time.sleep(0.02)
    raise Timeout(f"corrald (pid {pid}) did not stop within {timeout} s")
