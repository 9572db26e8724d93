"""A private corrald for the benchmark: own state dir, socket and cgroup name, so a run never
touches (or is disturbed by) a user's daemon and everything it made can be checked afterwards."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from http.client import HTTPException
from pathlib import Path

from corral.bench import host
from corral.sdk.sync_transport import UnixConnection


class PrivateDaemon:
    def __init__(self, root: Path, cgroup_name: str, max_sandboxes: int,
                 env: dict[str, str] | None = None, own_memcg: str | None = None) -> None:
        self.state_dir = root / "state"
        self.socket = self.state_dir / "run" / "corrald.sock"
        self.cgroup_name = cgroup_name
        self.log_path = root / "corrald.log"
        self.max_sandboxes = max_sandboxes
        self.extra_env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None
        # The daemon runs in a memory cgroup of its own, so everything it allocates (its RSS,
        # clone-time kernel objects of each init, pooled netns) is counted by name.
        self.own_memcg = own_memcg

    @property
    def endpoint(self) -> str:
        return f"unix://{self.socket}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self, timeout: float = 60.0) -> None:
        from corral.daemon.launcher import daemon_alive

        self.state_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, CORRAL_STATE_DIR=str(self.state_dir),
                   CORRAL_SOCKET=str(self.socket), CORRAL_CGROUP=self.cgroup_name,
                   CORRAL_MAX_SANDBOXES=str(self.max_sandboxes), **self.extra_env)
        env.pop("CORRAL_URL", None)
        env.pop("CORRAL_TCP", None)
        procs = host.make_memcg(self.own_memcg) if self.own_memcg else None
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "corral.daemon", "--state-dir", str(self.state_dir),
                 "--socket", str(self.socket)],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                preexec_fn=(lambda: host.join_cgroup(procs)) if procs else None)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"corrald exited {self.proc.returncode}: {self.tail()}")
            if daemon_alive(str(self.socket), timeout=1.0):
                return
            time.sleep(0.05)
        raise RuntimeError(f"corrald did not answer within {timeout}s: {self.tail()}")

    def stop(self, timeout: float = 120.0) -> None:
        """SIGTERM: the daemon destroys its sandboxes; SIGKILL if it does not exit in time."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def metrics(self) -> dict[str, float]:
        """GET /metrics, Prometheus text -> {name: value} (labels summed)."""
        conn = UnixConnection(str(self.socket))
        conn.timeout = 10
        try:
            conn.request("GET", "/metrics")
            text = conn.getresponse().read().decode()
        except (OSError, HTTPException):
            return {}
        finally:
            conn.close()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name, _, value = line.rpartition(" ")
            name = name.split("{", 1)[0]
            try:
                out[name] = out.get(name, 0.0) + float(value)
            except ValueError:
                continue
        return out

    def pool_counts(self) -> tuple[float, float]:
        """(hits, misses) of the warm pools so far."""
        m = self.metrics()
        return m.get("corral_pool_hits_total", 0.0), m.get("corral_pool_misses_total", 0.0)

    def rss_kib(self) -> int | None:
        return host.rss_kib(self.pid) if self.pid else None

    def host_rootfs(self) -> Path:
        return self.state_dir / "images" / "host" / "rootfs"

    def host_overlays(self) -> list[tuple[str, list[str]]]:
        """The overlays the `host` image mounts (mirrors corral.daemon.images): the skeleton
        as "/", the host's /usr, and bin/lib/... where they are real dirs, not links."""
        ov: list[tuple[str, list[str]]] = [("/", [str(self.host_rootfs())]), ("/usr", ["/usr"])]
        for n in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            p = "/" + n
            if os.path.isdir(p) and not os.path.islink(p):
                ov.append((p, [p]))
        return ov

    def sandbox_pids(self) -> set[int]:
        """Processes under the daemon's cgroup name but the daemon itself (it runs in its own
        ``.daemon`` cgroup there: docs/daemon.md, "Memory protection")."""
        return host.cgroup_pids(self.cgroup_name, exact=True) - {self.pid}

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""
