"""An OOM kill is the sandbox's (category limit: ``oom_killed``, ``memory_exceeded``,
``sandbox_crashed`` cause ``oom``) only when the sandbox's own memory limit was hit; one made by
an OOM outside it (a host out of memory, an ancestor cgroup's limit: the daemon's slice, a
node's) is infra (``infra_error`` / ``sandbox_lost``, cause ``host_oom``), never the agent's
fault (docs/trajectory.md, "Masking").

The kernel counts an OOM kill in the victim's memory cgroup whichever OOM chose it, so a count
alone cannot tell. Here the "host" is a private daemon run under a parent cgroup of the test's
with a memory limit of its own (its usage now plus a little): a sandbox far below its own
``memory_mb`` allocates past what that ancestor allows, and the ancestor's OOM kills it. The
machine's own memory is never at stake: the limit holds only this daemon and its sandboxes.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import corral
from corral import Sandbox
from corral.daemon.cgroups.common import _mounts, _v2_controllers
from corral.errors import InfraError, SandboxCrashed, SandboxLost

from conftest import private_daemon, wait_until

TOP = f"corral-oomtest-{os.getpid()}"
NAME = f"{TOP}/d"  # the daemon's cgroup name: everything it makes is below TOP
# A hog that stops at 600 MiB: past the ancestor's room (HEADROOM_MB), far below its own limit.
HOG_PY = "b = []\nwhile len(b) < 600: b.append(bytearray(1 << 20))\nprint('done')"
HOG_ARGV = ["python3", "-c", HOG_PY]
OWN_MB = 1024     # the sandboxes' own limit in the ancestor's OOM
HEADROOM_MB = 128  # what the ancestor allows above its usage when the limit is set
SMALL_MB = 48     # a limit the hog hits itself


def _v2() -> bool:
    _, v2 = _mounts()
    return bool(v2) and {"memory", "pids", "cpu"} <= _v2_controllers(v2)


def _top_memcg() -> Path:
    v1, v2 = _mounts()
    return Path(v2 or "/sys/fs/cgroup", TOP) if _v2() else Path(v1["memory"], TOP)


@contextlib.contextmanager
def _ancestor_limit(headroom_mb: int = HEADROOM_MB) -> Iterator[None]:
    """TOP limited to its usage now plus ``headroom_mb``: the daemon's own slice, out of
    memory long before its sandboxes reach their own limits."""
    top = _top_memcg()
    usage = int((top / ("memory.current" if _v2() else "memory.usage_in_bytes")).read_text())
    knob = top / ("memory.max" if _v2() else "memory.limit_in_bytes")
    knob.write_text(str(usage + (headroom_mb << 20)))
    try:
        yield
    finally:
        knob.write_text("max" if _v2() else "-1")


def _infra(call: Callable[[], object]) -> InfraError:
    """The InfraError ``call`` raises; what it returned instead fails the test, shown."""
    try:
        got = call()
    except InfraError as e:
        return e
    pytest.fail(f"not an infra error: {got!r}")


@pytest.fixture(scope="module")
def oomd() -> Iterator[str]:
    """A private daemon whose every cgroup is below TOP (made here first, in every
    hierarchy the daemon uses, so that TOP can carry a limit); its socket."""
    top = _top_memcg()
    top.mkdir(exist_ok=True)
    if _v2():  # the controllers reach the daemon's cgroups through TOP
        (top / "cgroup.subtree_control").write_text("+memory +pids +cpu")
    try:
        with private_daemon("corral-test-oom-", NAME, CORRAL_POOL="off") as d:
            yield d.socket_path
    finally:
        for h in [Path("/sys/fs/cgroup")] + [p for p in Path("/sys/fs/cgroup").iterdir()
                                             if p.is_dir()]:
            with contextlib.suppress(FileNotFoundError):
                for sub in sorted((h / TOP).rglob("*"), key=lambda p: -len(p.parts)):
                    if sub.is_dir():
                        sub.rmdir()
                (h / TOP).rmdir()


def test_a_container_command_killed_by_an_ancestors_oom_is_infra(oomd):
    """A command far below its own memory_mb, killed by the OOM of the daemon's slice: the
    exec (foreground, and a background command's wait and status) is infra_error, cause
    host_oom, not an ``oom_killed`` result; the sandbox lives on. The same hog in a sandbox
    of 48 MiB is still ``oom_killed`` (limit), under the same ancestor limit."""
    with Sandbox(memory_mb=OWN_MB, timeout=300, endpoint=oomd) as sb, \
            Sandbox(memory_mb=SMALL_MB, timeout=300, endpoint=oomd) as small:
        assert sb.exec("true").exit_code == 0 and small.exec("true").exit_code == 0
        with _ancestor_limit():
            e = _infra(lambda: sb.exec(HOG_ARGV, timeout=120))
            assert (e.code, e.category, e.details["cause"]) == ("infra_error", "infra",
                                                                 "host_oom"), e
            assert e.details["signal"] == 9, e.details
            p = sb.exec(HOG_ARGV, background=True)
            e = _infra(lambda: p.wait(timeout=120))
            assert e.details["cause"] == "host_oom", e
            e = _infra(p.status)  # polled instead of waited for: the same answer
            assert e.details["cause"] == "host_oom", e
            own = small.exec(HOG_ARGV, timeout=120)
            assert (own.exit_code, own.signal, own.oom_killed) == (137, 9, True), own
        assert sb.exec("echo alive").stdout == "alive\n"
        # the log keeps the error, category infra
        execs = [x for x in sb.log() if x.op == "exec"]
        assert execs[1].error is not None, execs[1]
        logged = execs[1].error["error"]
        assert (logged["code"], logged["category"], logged["details"]["cause"]) == (
            "infra_error", "infra", "host_oom"), logged


def test_a_process_session_command_killed_by_an_ancestors_oom_is_infra(oomd):
    """The process substrate's sessions: the same two outcomes."""
    with Sandbox(substrate="process", memory_mb=OWN_MB, timeout=300, endpoint=oomd) as sb, \
            Sandbox(substrate="process", memory_mb=SMALL_MB, timeout=300,
                    endpoint=oomd) as small:
        with _ancestor_limit():
            e = _infra(lambda: sb.exec(HOG_ARGV, timeout=120))
            assert e.details["cause"] == "host_oom", e
            own = small.exec(HOG_ARGV, timeout=120)
            assert own.oom_killed and own.exit_code == 137, own
        assert sb.exec("echo alive").stdout == "alive\n"


def test_a_run_code_request_killed_by_an_ancestors_oom_is_infra(oomd):
    """run_code: a request far below its memory_mb killed by the ancestor's OOM is
    infra_error (cause host_oom), never ``memory_exceeded``; one past its own memory_mb is
    ``memory_exceeded``."""
    assert corral.run_code("print(1)", endpoint=oomd).status == "ok"  # the zygotes are up
    with _ancestor_limit():
        e = _infra(lambda: corral.run_code(HOG_PY, memory_mb=OWN_MB, timeout=120,
                                           endpoint=oomd))
        assert e.details["cause"] == "host_oom", e
        own = corral.run_code(HOG_PY, memory_mb=64, timeout=120, endpoint=oomd)
        assert own.status == "memory_exceeded", own
    assert corral.run_code("print(2)", endpoint=oomd).stdout == "2\n"


def _gvisor_served(endpoint: str) -> bool:
    from corral.sdk import admin

    return any(s.name == "gvisor" and s.available
               for s in admin.substrates(endpoint=endpoint))


def test_a_gvisor_sandbox_ended_by_an_ancestors_oom_is_lost(oomd):
    """gVisor: the sentry holds all of a sandbox's memory, so any OOM kill ends the whole
    sandbox. Ended by the ancestor's OOM it is sandbox_lost (infra, cause host_oom); ended
    at its own limit, sandbox_crashed (cause oom, limit). The sentry and gofer are given the
    OOM score of a sandbox process (they inherit the daemon's low one): the ancestor's OOM
    then picks them, not the daemon."""
    if not _gvisor_served(oomd):
        pytest.skip("gvisor is not served here (no working runsc)")
    top = _top_memcg()
    for mb in (OWN_MB, 128):
        sb = Sandbox(substrate="gvisor", memory_mb=mb, timeout=300, endpoint=oomd)
        try:
            for pid in (top / "d" / sb.id / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    Path(f"/proc/{pid}/oom_score_adj").write_text("500")
            if mb == OWN_MB:
                with _ancestor_limit():
                    try:
                        got: object = sb.exec(HOG_ARGV, timeout=120)
                    except SandboxLost as e:
                        got = e
                assert isinstance(got, SandboxLost), got
                assert got.details.get("cause") == "host_oom", got
                with pytest.raises(SandboxLost):  # and so it stays
                    sb.exec("true")
                continue
            # its own limit: the sentry's OOM kill is the sandbox's (or gVisor refuses the
            # memory inside and the command fails on its own): never infra
            with _ancestor_limit(512):
                try:
                    r = sb.exec(HOG_ARGV, timeout=120)
                except SandboxCrashed as e:
                    assert e.details.get("cause") == "oom" and not e.infra, e
                else:
                    assert "done" not in r.stdout, r
        finally:
            sb.kill()
        gone = top / "d" / sb.id
        assert wait_until(lambda: not gone.exists(), 15)  # noqa: B023 - called here
