"""Peers run the same way in the same run: bubblewrap, crun and runc, each doing one sandbox's
life (namespaces, root on the same skeleton + host /usr, /proc, /dev, /tmp, run ``true``, tear
down) per operation. None has a separate exec step, so an operation is create+exec+destroy.

crun and runc get a generated OCI bundle per worker slot (config.json rewritten per op with a
fresh cgroupsPath under ``<prefix>peers``); bwrap gets the equivalent flags (it makes no cgroup).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from corral.bench import host
from corral.bench.results import OpResult

PEERS = ("bwrap", "crun", "runc")
DEBIAN_PACKAGES = {"bwrap": "bubblewrap", "crun": "crun", "runc": "runc"}
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# corral's "normal shell" capability set for root in a sandbox.
SHELL_CAPS = ["CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL",
              "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
              "CAP_AUDIT_WRITE", "CAP_SETFCAP"]


def _version(name: str) -> str | None:
    try:
        r = subprocess.run([name, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (r.stdout or r.stderr).strip().splitlines()[0] if r.returncode == 0 else None


def ensure_installed(note: Callable[[str], None]) -> dict[str, str | None]:
    """The bench's setup: install missing peers from Debian (apt-get, root only). Returns
    name -> version line, None where the peer is unavailable."""
    missing = [n for n in PEERS if shutil.which(n) is None]
    if missing and os.geteuid() == 0 and shutil.which("apt-get"):
        pkgs = [DEBIAN_PACKAGES[n] for n in missing]
        note(f"installing {' '.join(pkgs)} with apt-get")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        cmd = ["apt-get", "install", "-y", "-q", *pkgs]
        r = subprocess.run(cmd, capture_output=True, env=env)
        if r.returncode != 0:  # stale package lists: refresh once
            subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env)
            subprocess.run(cmd, capture_output=True, env=env)
    return {n: _version(n) if shutil.which(n) else None for n in PEERS}


def oci_config(rootfs: Path, cgroups_path: str, hostname: str = "peer") -> dict[str, Any]:
    """The OCI runtime config of one corral-equivalent sandbox running ``true``."""
    caps = {k: SHELL_CAPS for k in ("bounding", "effective", "permitted")}
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False, "user": {"uid": 0, "gid": 0}, "args": ["true"],
            "env": [PATH_ENV, "HOME=/root", "LANG=C.UTF-8", "TERM=xterm"], "cwd": "/",
            "capabilities": caps, "noNewPrivileges": True,
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024},
                        {"type": "RLIMIT_CORE", "hard": 0, "soft": 0}],
        },
        "root": {"path": str(rootfs), "readonly": True},
        "hostname": hostname,
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=64k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620",
                         "gid=5"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "nodev", "mode=1777"]},
            {"destination": "/usr", "type": "bind", "source": "/usr", "options": ["rbind", "ro"]},
        ],
        "linux": {
            "cgroupsPath": cgroups_path,
            "resources": {"memory": {"limit": 512 * 2**20}, "pids": {"limit": 512},
                          "cpu": {"quota": 100000, "period": 100000}},
            "namespaces": [{"type": t} for t in
                           ("pid", "network", "ipc", "uts", "mount", "cgroup")],
            "maskedPaths": ["/proc/acpi", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
                            "/proc/timer_list", "/proc/sched_debug", "/sys/firmware"],
            "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys",
                              "/proc/sysrq-trigger"],
        },
    }


class Peers:
    def __init__(self, workdir: Path, rootfs: Path, cgroup_name: str) -> None:
        self.workdir = workdir
        self.rootfs = rootfs
        self.cgroup_name = cgroup_name  # top-level cgroup dir of every peer container
        self.state_root = workdir / "state"
        self._seq = 0
        self._lock = threading.Lock()
        self.notes: dict[str, str] = {}
        self._prefix: dict[str, list[str]] = {"crun": [], "runc": []}
        self._holder: subprocess.Popen[bytes] | None = None

    def _next_id(self) -> str:
        with self._lock:
            self._seq += 1
            return f"cbp{os.getpid()}-{self._seq}"

    def argv(self, peer: str, slot: int) -> list[str]:
        if peer == "bwrap":
            return ["bwrap", "--unshare-all", "--die-with-parent", "--new-session",
                    "--hostname", "peer", "--ro-bind", str(self.rootfs), "/",
                    "--ro-bind", "/usr", "/usr", "--proc", "/proc", "--dev", "/dev",
                    "--tmpfs", "/tmp", "true"]
        cid = self._next_id()
        bundle = self.workdir / f"bundle-{slot}"
        bundle.mkdir(parents=True, exist_ok=True)
        cfg = oci_config(self.rootfs, f"/{self.cgroup_name}/{cid}")
        (bundle / "config.json").write_text(json.dumps(cfg))
        return [*self._prefix[peer], peer, "--root", str(self.state_root / peer), "run",
                "--bundle", str(bundle), cid]

    def probe(self, peer: str) -> str | None:
        """Run once; adapt to the host or return why the peer cannot run here. crun 1.8 refuses
        a v1 host whose cgroup2 mount holds any controller ("hybrid mode"); it then runs via
        nsenter in a mount namespace without that cgroup2 mount (one more exec per op, which
        counts against crun), and the report says so."""
        err = self._once(peer)
        if err and peer == "crun" and "hybrid" in err:
            self._holder = self._hide_cgroup2()
            self._prefix["crun"] = ["nsenter", "-t", str(self._holder.pid), "-m", "--"]
            self.notes["crun"] = ("via nsenter into a mount ns without the cgroup2 mount: crun "
                                  "1.8 refuses this host's hybrid cgroup layout")
            err = self._once(peer)
        return err

    @staticmethod
    def _hide_cgroup2() -> subprocess.Popen[bytes]:
        with open("/proc/self/mountinfo") as f:
            v2 = [ln.split()[4] for ln in f if " - cgroup2 " in ln]
        script = "".join(f"umount {m} && " for m in v2) + "exec sleep infinity"
        p = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and p.poll() is None:  # until sleep runs, unmounted
            try:
                if Path(f"/proc/{p.pid}/comm").read_text().strip() == "sleep":
                    break
            except OSError:
                pass
            time.sleep(0.01)
        return p

    def _once(self, peer: str) -> str | None:
        r = subprocess.run(self.argv(peer, 0), stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=120)
        return None if r.returncode == 0 else r.stderr.decode(errors="replace").strip()[-300:]

    def churn(self, peer: str, n: int, conc: int,
              advance: Callable[..., None] = lambda k=1: None) -> OpResult:
        lat = [-1.0] * n
        errors: list[str] = []
        slots = list(range(conc))
        slot_lock = threading.Lock()

        def one(i: int) -> None:
            with slot_lock:
                slot = slots.pop()
            try:
                argv = self.argv(peer, slot)  # bundle writing counts: an engine does it too
                t0 = time.perf_counter()
                r = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, timeout=120)
                dt = time.perf_counter() - t0
                if r.returncode == 0:
                    lat[i] = dt * 1000
                else:
                    errors.append(r.stderr.decode(errors="replace")[-300:])
            finally:
                with slot_lock:
                    slots.append(slot)
                advance()

        t0 = time.perf_counter()
        with ThreadPoolExecutor(conc) as pool:
            list(pool.map(one, range(n)))
        wall = time.perf_counter() - t0
        extra: dict[str, Any] = {"concurrency": conc}
        if peer in self.notes:
            extra["note"] = self.notes[peer]
        if errors:
            extra["first_error"] = errors[0].strip()
        return OpResult(system=peer, n=n, wall_s=wall, errors=len(errors),
                        phases={"total": [x for x in lat if x >= 0]}, extra=extra)

    def cleanup(self) -> list[str]:
        """Delete leftover containers, sweep the peers' cgroups, remove the bundles."""
        for peer in ("crun", "runc"):
            root = self.state_root / peer
            if not root.is_dir() or shutil.which(peer) is None:
                continue
            r = subprocess.run([peer, "--root", str(root), "list", "-q"], capture_output=True,
                               text=True, timeout=60)
            for cid in r.stdout.split():
                subprocess.run([peer, "--root", str(root), "delete", "-f", cid],
                               capture_output=True, timeout=60)
        if self._holder is not None:
            self._holder.kill()
            self._holder.wait()
            self._holder = None
        left = host.sweep_cgroups(self.cgroup_name)
        shutil.rmtree(self.workdir, ignore_errors=True)
        return left
