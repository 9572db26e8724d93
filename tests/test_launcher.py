"""The launcher the SDK and CLI use: start on demand (once, even when raced), find, stop."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from corral.daemon import launcher
from corral.errors import DaemonUnavailable

from conftest import CGROUP_NAME, leaked_sandbox_cgroups


@pytest.fixture
def private(monkeypatch):
    """A state dir, socket and cgroup name nobody else uses."""
    state = tempfile.mkdtemp(prefix="corral-rs-launch-", dir="/var/tmp")  # not swept by others
    sock = os.path.join(state, "run", "corrald.sock")
    cg = f"{CGROUP_NAME}-launch"
    monkeypatch.setenv("CORRAL_CGROUP", cg)
    yield state, sock
    launcher.stop_daemon(sock, state_dir=state)
    assert leaked_sandbox_cgroups(cg) == []
    shutil.rmtree(state, ignore_errors=True)


def test_ensure_alive_stop(private):
    state, sock = private
    assert not launcher.daemon_alive(sock)
    assert launcher.stop_daemon(sock, state_dir=state) is False
    errors: list[BaseException] = []

    def start() -> None:
        try:
            launcher.ensure_daemon(sock, state, timeout=60)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=start) for _ in range(3)]  # raced: one daemon wins
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert launcher.daemon_alive(sock)
    pid = int(open(os.path.join(state, "corrald.pid")).read())
    launcher.ensure_daemon(sock, state)  # already up: a no-op
    assert int(open(os.path.join(state, "corrald.pid")).read()) == pid
    assert os.path.getsize(os.path.join(state, "corrald.log")) > 0
    # Fully detached: not our child (no zombie here), and it ends when stopped.
    assert int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1]) != os.getpid()
    assert launcher.stop_daemon(sock, state_dir=state) is True
    deadline = time.monotonic() + 30  # generous: CI machines are loaded
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}")
    assert not launcher.daemon_alive(sock)
    assert not os.path.exists(sock)


def test_stop_finds_the_daemon_through_its_socket(private):
    state, sock = private
    launcher.ensure_daemon(sock, state, timeout=60)
    # No state_dir given (the default one is not this daemon's): the socket tells.
    assert launcher.stop_daemon(sock) is True
    assert not launcher.daemon_alive(sock)
    assert launcher.stop_daemon(sock) is False


def test_ensure_refuses_without_root(private):
    state, sock = private
    code = ("import sys; from corral.daemon import launcher\n"
            f"try: launcher.ensure_daemon({sock!r}, {state!r})\n"
            "except Exception as e: print(type(e).__name__, e); sys.exit(3)\n")
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                        sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    if "Permission denied" in r.stderr:
        pytest.skip("the interpreter is not readable by nobody here")
    assert r.returncode == 3, r.stderr
    assert DaemonUnavailable.__name__ in r.stdout and "root" in r.stdout
    assert not launcher.daemon_alive(sock)
