"""Guards at the daemon's edges: one daemon per cgroup name, validated create options,
background commands without a default timeout."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

import corral
from corral.daemon.engine import _effective_timeout
from corral.models import DEFAULT_EXEC_TIMEOUT_S, ExecRequest

from conftest import DaemonProcess


def test_second_daemon_on_same_cgroup_name_refuses_to_start():
    with corral.Sandbox() as sb:
        state = tempfile.mkdtemp(prefix="corral-test-dup-", dir="/var/tmp")
        other = DaemonProcess(state_dir=state, socket_path=os.path.join(state, "d.sock"))
        try:
            with pytest.raises(RuntimeError, match="cgroup name"):
                other.start(timeout=30)
        finally:
            other.stop()
            shutil.rmtree(state, ignore_errors=True)
        # The first daemon's sandbox was not touched by the refused one.
        assert sb.exec("echo still-here").stdout == "still-here\n"


def test_relative_cwd_is_refused_at_create():
    with pytest.raises(corral.InvalidRequest):
        corral.Sandbox(cwd="tmp")


def test_background_commands_have_no_default_timeout():
    assert _effective_timeout(ExecRequest(cmd="sleep 1", background=True)) is None
    assert _effective_timeout(ExecRequest(cmd="sleep 1", background=True, timeout=5)) == 5
    assert _effective_timeout(ExecRequest(cmd="sleep 1")) == DEFAULT_EXEC_TIMEOUT_S


def test_sdk_leaves_an_unchosen_timeout_to_the_daemon():
    import json

    from corral.sdk import api

    assert "timeout" not in json.loads(api.exec_("sb-x", "srv", background=True).body)
    assert json.loads(api.exec_("sb-x", "srv", background=True, timeout=5).body)["timeout"] == 5
    assert json.loads(api.exec_("sb-x", "srv", timeout=None).body)["timeout"] is None


def test_a_failed_start_with_nothing_to_keep_leaves_nothing(monkeypatch):
    """A daemon that fails to start (here: its trajectory log is not a database) after it
    mounted its scratch tmpfs and made its parent cgroups, with no sandbox to keep, takes
    them down again: no mount, no cgroup left on the host."""
    from conftest import CGROUP_NAME, cgroup_dirs, host_mounts_under

    state = tempfile.mkdtemp(prefix="corral-test-fail-", dir="/var/tmp")
    name = f"{CGROUP_NAME}-fail"
    monkeypatch.setenv("CORRAL_CGROUP", name)
    with open(os.path.join(state, "trajlog.db"), "wb") as f:
        f.write(b"this is not an SQLite database" * 100)
    d = DaemonProcess(state_dir=state, socket_path=os.path.join(state, "d.sock"))
    try:
        with pytest.raises(RuntimeError, match="corrald exited"):
            d.start(timeout=60)
        assert "corrald failed" in d.tail()
        assert host_mounts_under(state) == []
        assert cgroup_dirs(name) == []
    finally:
        d.stop()
        shutil.rmtree(state, ignore_errors=True)
