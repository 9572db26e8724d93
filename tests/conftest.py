"""Test harness: one real corrald per test session, on a private state dir, socket and cgroup.

The environment variables are set at import time so every SDK client created by a test (and any
daemon the SDK would start) uses the private instance, never a user's /var/lib/corral. At the end
the daemon is stopped and the session fails if anything it made is left behind: a process, a
cgroup, a mount or a directory.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Every private dir this session makes is recorded: the end-of-session sweep removes only
# those, never another concurrent session's (same prefixes, same /var/tmp).
_MADE: list[str] = []
_mkdtemp = tempfile.mkdtemp


def _recording_mkdtemp(*args, **kwargs):  # type: ignore[no-untyped-def]
    d = _mkdtemp(*args, **kwargs)
    _MADE.append(os.path.realpath(d))
    return d


tempfile.mkdtemp = _recording_mkdtemp
STATE_DIR = tempfile.mkdtemp(prefix="corral-test-", dir="/var/tmp")


def _remove_if_empty(path: str) -> None:
    with contextlib.suppress(OSError):
        os.rmdir(path)


# A run that starts no daemon (--collect-only, nothing selected) leaves it empty.
atexit.register(_remove_if_empty, STATE_DIR)
SOCKET = os.path.join(STATE_DIR, "run", "corrald.sock")
CGROUP_NAME = f"corral-test-{os.getpid()}"
os.environ["CORRAL_STATE_DIR"] = STATE_DIR
os.environ["CORRAL_SOCKET"] = SOCKET
os.environ["CORRAL_CGROUP"] = CGROUP_NAME
# No warm pools in the session daemon (tests see exactly the sandboxes they made);
# tests/test_pools.py runs its own daemons with pools. CORRAL_TEST_POOL=auto runs the whole
# suite against pooled sandboxes instead.
os.environ["CORRAL_POOL"] = os.environ.get("CORRAL_TEST_POOL", "off")
os.environ.pop("CORRAL_URL", None)
# The session's daemon is this harness's to start and restart (tests kill it on purpose);
# tests of the SDK's autostart run their clients with it on, against daemons of their own.
os.environ["CORRAL_AUTOSTART"] = "0"
os.environ.pop("CORRAL_TCP", None)
# No packet leaves this machine: an image reference a test makes up is never pulled from a
# real registry (tests/test_images_oci.py names its own, on this machine).
os.environ["CORRAL_REGISTRIES"] = "registry.invalid"


HOOKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hooks")


def with_holds(**holds: str | os.PathLike[str]) -> dict[str, str]:
    """The environment for a daemon that waits at the named points while their files exist
    (tests/hooks/sitecustomize.py: ``entry``, ``ingest``, ``snapshot``, ``spawn_error``)."""
    env = {f"CORRAL_TEST_HOLD_{name.upper()}_FILE": str(path) for name, path in holds.items()}
    path = os.environ.get("PYTHONPATH")
    env["PYTHONPATH"] = HOOKS_DIR + (os.pathsep + path if path else "")
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a daemon or server to bind)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def session_metric(name: str) -> float:
    """One unlabelled sample of the session daemon's /metrics (0 when it is not there)."""
    import httpx

    t = httpx.HTTPTransport(uds=SOCKET)
    with httpx.Client(transport=t, base_url="http://corral", timeout=30) as c:
        for line in c.get("/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return 0.0


def wait_until(pred, timeout: float = 10.0, interval: float = 0.02) -> bool:  # type: ignore[no-untyped-def]
    """Poll ``pred`` until it holds or ``timeout`` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


def journal_started(state_dir: str, sid: str, op: str) -> bool:
    """A call ``op`` on ``sid`` has a started row in the trajectory log's journal: the daemon
    is running it (a mutating call is journaled as started once it has run 20 ms)."""
    needle = f'"{sid}","{op}",'.encode()
    for path in Path(state_dir).glob("trajlog.journal.*"):
        for line in path.read_bytes().rstrip(b"\0").splitlines():
            if needle in line and line.endswith(b',"started"]'):
                return True
    return False


def cgroup_dirs(name: str = CGROUP_NAME) -> list[Path]:
    """Every cgroup directory (v1 hierarchies and v2) under our private cgroup name."""
    out = []
    root = Path("/sys/fs/cgroup")
    candidates = [root / name] + [p / name for p in root.iterdir() if p.is_dir()]
    for c in candidates:
        if c.is_dir():
            out.append(c)
    return out


def leaked_sandbox_cgroups(name: str = CGROUP_NAME) -> list[str]:
    """Sandbox cgroups (not the daemon's recycled memory cgroups, ``.spare-*``/``.cooling-*``,
    a bounded cache it removes at a graceful stop: see spare_cgroups)."""
    return [str(d) for top in cgroup_dirs(name) for d in top.iterdir()
            if d.is_dir() and not d.name.startswith(".")]


def spare_cgroups(name: str = CGROUP_NAME) -> list[str]:
    return [str(d) for top in cgroup_dirs(name) for d in top.iterdir()
            if d.is_dir() and d.name.startswith(".")]


def pids_in_cgroups(name: str = CGROUP_NAME) -> set[int]:
    pids: set[int] = set()
    for top in cgroup_dirs(name):
        try:
            files = list(top.rglob("cgroup.procs"))
        except OSError:  # a cgroup removed while walking: walk again
            return pids_in_cgroups(name)
        for procs in files:
            try:
                pids.update(int(x) for x in procs.read_text().split())
            except OSError:
                pass
    return pids


def loops_left(*dirs: str, timeout: float = 30.0) -> list[str]:
    """Loop devices still backed by a file under ``dirs`` once the kernel has had ``timeout``
    seconds to detach them. An unmount of a scratch drops its loop device's last reference
    and the autoclear detach then runs on a kernel workqueue, after the umount returned (on
    a loaded machine, seconds after): polled for, not read once."""
    deadline = time.monotonic() + timeout
    while True:
        found = [lo for d in dirs for lo in loops_backed_under(d.rstrip("/") + "/")]
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(0.05)


def loops_backed_under(path: str) -> list[str]:
    """Loop devices whose backing file is under ``path`` (a daemon's btrfs scratch image)."""
    found = []
    for dev in Path("/sys/block").glob("loop*"):
        try:
            backing = (dev / "loop" / "backing_file").read_text().strip()
        except OSError:
            continue  # not attached
        if backing.startswith(path):
            found.append(f"/dev/{dev.name}: {backing}")
    return found


def host_mounts_under(path: str) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if line.split()[4].startswith(path)]


class DaemonProcess:
    """A corrald subprocess the tests can stop, kill -9 and restart."""

    def __init__(self, state_dir: str = STATE_DIR, socket_path: str = SOCKET,
                 python: str = sys.executable) -> None:
        self.state_dir = state_dir
        self.socket_path = socket_path
        self.python = python
        self.proc: subprocess.Popen | None = None
        self.log_path = os.path.join(state_dir, "corrald-test.log")

    def start(self, timeout: float = 60.0) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child
        env = dict(os.environ, CORRAL_STATE_DIR=self.state_dir, CORRAL_SOCKET=self.socket_path)
        self.proc = subprocess.Popen([self.python, "-m", "corral.daemon"], stdout=log,
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        import httpx

        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"corrald exited {self.proc.returncode}: {self.tail()}")
            try:
                t = httpx.HTTPTransport(uds=self.socket_path)
                with httpx.Client(transport=t, base_url="http://corral", timeout=2) as c:
                    if c.get("/v1/health").status_code == 200:
                        return
            except (httpx.HTTPError, OSError):
                pass
            time.sleep(0.05)
        raise RuntimeError(f"corrald did not answer in {timeout}s: {self.tail()}")

    def stop(self, timeout: float = 60.0) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill9(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def restart(self, kill9: bool = False) -> None:
        self.kill9() if kill9 else self.stop()
        self.start()

    def tail(self, n: int = 4000) -> str:
        try:
            return Path(self.log_path).read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""


_DAEMON = DaemonProcess()


def _thaw_all(name: str = CGROUP_NAME) -> None:
    """A daemon that died mid-snapshot (or a test) may leave cgroups frozen: frozen processes
    ignore SIGKILL until thawed (v1 freezer)."""
    for top in cgroup_dirs(name):
        try:
            files = list(top.rglob("freezer.state")) + list(top.rglob("cgroup.freeze"))
        except OSError:
            continue
        for f in files:
            try:
                f.write_text("THAWED" if f.name == "freezer.state" else "0")
            except OSError:
                pass


def _unmount_under(path: str) -> None:
    """A daemon killed (not stopped) keeps its scratch and its lxcfs for the next start: a
    test that will not start it again takes them down (lxcfs first: its mount namespace holds
    a copy of the scratch mount, which keeps the loop device attached; then the mounts,
    deepest first)."""
    _stop_lxcfs(path)
    for m in sorted(host_mounts_under(path), key=len, reverse=True):
        subprocess.run(["umount", "-l", m], check=False, capture_output=True)


def _stop_lxcfs(state_dir: str) -> None:
    """SIGKILL the lxcfs a daemon on ``state_dir`` left (its pid file names it)."""
    try:
        pid = int(Path(state_dir, "lxcfs", "lxcfs.pid").read_text().strip())
        if Path(f"/proc/{pid}/comm").read_text().strip() != "lxcfs":
            return
        fd = os.pidfd_open(pid)
    except (OSError, ValueError):
        return
    try:
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        select.select([fd], [], [], 5)  # readable once it has exited
    except OSError:
        pass
    finally:
        os.close(fd)


def _force_cleanup(name: str = CGROUP_NAME) -> None:
    _thaw_all(name)
    for pid in pids_in_cgroups(name):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for _ in range(100):
        left = []
        for top in cgroup_dirs(name):
            try:
                found = sorted(top.rglob("*"), key=lambda p: -len(p.parts))
            except OSError:  # removed while walking: again
                left.append(top)
                continue
            for d in found:
                if d.is_dir():
                    try:
                        d.rmdir()
                    except OSError:
                        left.append(d)
            try:
                top.rmdir()
            except OSError:
                left.append(top)
        if not left:
            return
        time.sleep(0.05)


# Private state dirs tests make under /var/tmp (tempfile prefixes). Each test removes its own;
# one whose test failed at a bad moment may stay, so the session's end sweeps what this
# session made (every daemon is stopped by then; sandbox mounts live in their own namespaces).
_PRIVATE_PREFIXES = ("corral-test-", "corral-img-", "corral-launch-", "corral-pool-",
                     "corral-core-test-", "corral-cs-test-", "corral-small-", "corral-notoken-")


def _sweep_private_state_dirs() -> None:
    for d in _MADE:
        p = Path(d)
        try:
            if (p.parent == Path("/var/tmp") and p.name.startswith(_PRIVATE_PREFIXES)
                    and p.is_dir() and not p.is_symlink()):
                _stop_lxcfs(d)  # a crashed daemon's, which no later start adopted
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


@pytest.fixture(scope="session", autouse=True)
def daemon():
    """The session's corrald. Tests may call .restart(kill9=True); it is running again after."""
    _DAEMON.start()
    yield _DAEMON
    _DAEMON.stop()
    leaks = {
        "cgroups": leaked_sandbox_cgroups(),
        "spare_cgroups": spare_cgroups(),
        "cgroup_parents": [str(d) for d in cgroup_dirs()],  # a graceful stop removes them
        "pids": sorted(pids_in_cgroups()),
        "mounts": host_mounts_under(STATE_DIR),
    }
    # A graceful stop unmounts the scratch, which detaches its loop device (autoclear) and
    # takes every subvolume with it; a scratch that still held a sandbox stays mounted.
    leaks["loop_devices"] = loops_left(STATE_DIR, *_MADE)
    sandboxes_dir = Path(STATE_DIR, "sandboxes")
    leaks["dirs"] = [str(p) for p in sandboxes_dir.iterdir()] if sandboxes_dir.is_dir() else []
    _force_cleanup()
    log = _DAEMON.tail()
    shutil.rmtree(STATE_DIR, ignore_errors=True)
    _sweep_private_state_dirs()
    if any(leaks.values()):
        pytest.fail(f"corral leaked resources after the session: {leaks}\n{log}")


@pytest.fixture
def no_leaks(daemon):
    """Use in a test to assert that it leaves no sandbox cgroups behind when it ends."""
    before = set(leaked_sandbox_cgroups())
    yield
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if set(leaked_sandbox_cgroups()) <= before:
            break
        time.sleep(0.05)
    assert set(leaked_sandbox_cgroups()) <= before


@contextlib.contextmanager
def private_daemon(prefix: str, cgroup: str, python: str = sys.executable,
                   **env: str) -> Iterator[DaemonProcess]:
    """A corrald of its own, run by ``python``: a state dir under /var/tmp named
    ``prefix...``, cgroup name ``cgroup`` and the environment ``env``, all set for the whole
    block (a restart gets the same settings, above all the same cgroup name, or it would clean
    up the session daemon's sandboxes). It must stop leaving nothing behind; after a failure it
    is killed and swept."""
    state = tempfile.mkdtemp(prefix=prefix, dir="/var/tmp")
    d = DaemonProcess(state, os.path.join(state, "run", "corrald.sock"), python)
    d.cgroup = cgroup  # type: ignore[attr-defined]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CORRAL_CGROUP", cgroup)
        for k, v in env.items():
            mp.setenv(k, v)
        try:
            d.start()
            try:
                yield d
            finally:
                try:
                    d.stop()
                finally:
                    if sys.exc_info()[0] is not None:  # a failed test: leave nothing behind
                        d.kill9()
                        _force_cleanup(cgroup)
                        _unmount_under(state)
            left = {"cgroups": leaked_sandbox_cgroups(cgroup),
                    "parents": [str(p) for p in cgroup_dirs(cgroup)],
                    "pids": sorted(pids_in_cgroups(cgroup)),
                    "dirs": os.listdir(os.path.join(state, "sandboxes")),
                    "mounts": host_mounts_under(state),
                    "loop_devices": loops_left(state)}
            assert not any(left.values()), f"private daemon left {left}\n{d.tail()}"
        finally:  # a failed test too: its state dir goes
            shutil.rmtree(state, ignore_errors=True)


TENANT_ADMIN = "admin-token-0123456789"


def tenant_client(base: str, token: str, timeout: float = 300) -> Any:
    """An httpx client of ``base`` presenting ``token``."""
    import httpx

    return httpx.Client(base_url=base, timeout=timeout,
                        headers={"Authorization": f"Bearer {token}"})


@contextlib.contextmanager
def tenant_daemon(prefix: str, cgroup: str, tokens: dict[str, Any],
                  **env: str) -> Iterator[tuple[DaemonProcess, str]]:
    """A private daemon on TCP with the tenants of ``tokens`` (a tokens file's content) and
    the admin token TENANT_ADMIN: (daemon, base URL). At the end every sandbox left is
    destroyed, then the daemon stops (private_daemon's checks)."""
    tokdir = tempfile.mkdtemp(prefix=prefix + "tok-", dir="/var/tmp")
    path = os.path.join(tokdir, "tokens.json")
    with open(path, "w") as f:
        json.dump(tokens, f)
    port = free_port()
    try:
        with private_daemon(prefix, cgroup, CORRAL_TCP=f"127.0.0.1:{port}",
                            CORRAL_TOKEN=TENANT_ADMIN, CORRAL_TOKENS=path, **env) as d:
            base = f"http://127.0.0.1:{port}"
            try:
                yield d, base
            finally:
                with tenant_client(base, TENANT_ADMIN) as admin:
                    for sb in admin.get("/v1/sandboxes").json()["sandboxes"]:
                        admin.delete(f"/v1/sandboxes/{sb['id']}")
    finally:
        os.unlink(path)
        os.rmdir(tokdir)
