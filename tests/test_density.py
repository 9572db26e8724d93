"""What lets one daemon hold tens of thousands of sandboxes: no fd per sandbox in the daemon
(its RLIMIT_NOFILE may be 20,000 where it cannot raise its hard limit), and sandboxes lost
without one are still noticed at once."""

from __future__ import annotations

import os
import signal
import time

import pytest

from corral import Sandbox
from corral.errors import SandboxLost


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_daemon_fds_do_not_grow_with_sandboxes(daemon):
    pid = daemon.proc.pid
    boxes = Sandbox.create_many(100, timeout=300)
    try:
        res = Sandbox.exec_many(boxes, "true")
        assert all(r.exit_code == 0 for r in res)
        before = fds(pid)
        boxes += Sandbox.create_many(400, timeout=300)
        after = fds(pid)
        assert after - before < 50, (before, after)  # not one (or two) per sandbox
        # Used ones keep a root fd in a bounded cache (CORRAL_ROOT_FD_CACHE), no more.
        res = Sandbox.exec_many(boxes, "true")
        assert all(r.exit_code == 0 for r in res)
        assert fds(pid) - before < 1024 + 50
    finally:
        Sandbox.kill_many(boxes)


def test_a_dead_init_is_noticed_without_a_call():
    sb = Sandbox(timeout=300)
    try:
        os.kill(sb.info().init_pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                sb.info()
            except SandboxLost:
                break
            time.sleep(0.02)
        else:
            pytest.fail("the daemon never noticed the dead init")
    finally:
        sb.kill()
