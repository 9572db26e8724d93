"""A sandbox cannot end its own init, and when it ends because of what ran in it, the error
says so (``sandbox_crashed``, not infra); ``sandbox_lost`` (infra) only for causes outside it.

The attacks run as root inside the sandbox, in Python (ctypes, raw syscall numbers: x86_64),
as agent code would.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

import corral
from corral.daemon.protect import SANDBOX_OOM_SCORE_ADJ
from corral.errors import CorralError, SandboxCrashed, SandboxLost

from conftest import cgroup_dirs, session_metric, spare_cgroups

# Every way code inside can send pid 1 a signal, with a siginfo that claims to come from
# outside the pid namespace (si_pid 0) where the syscall lets the sender write one.
FORGE = r"""
import ctypes, errno, os, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
NR_kill, NR_tgkill, NR_rt_sigqueueinfo, NR_rt_tgsigqueueinfo = 62, 234, 129, 297
NR_pidfd_open, NR_pidfd_send_signal = 434, 424
SI_USER, SI_KERNEL, SI_QUEUE, SI_TKILL = 0, 0x80, -1, -6

def info(sig, code):
    # signo, errno, code, pad, si_pid = 0, si_uid = 0, then zeros: 128 bytes
    return ctypes.create_string_buffer(struct.pack("iiiiii", sig, 0, code, 0, 0, 0), 128)

def call(name, nr, *args):
    r = libc.syscall(nr, *args)
    e = ctypes.get_errno()
    print(name, "OK" if r >= 0 else errno.errorcode.get(e, e), flush=True)

pidfd = libc.syscall(NR_pidfd_open, 1, 0)
print("pidfd_open", "OK" if pidfd >= 0 else ctypes.get_errno(), flush=True)
for sig in [int(s) for s in sys.argv[1:]]:
    for code in (SI_USER, SI_KERNEL, SI_QUEUE, SI_TKILL, -60):
        call(f"rt_sigqueueinfo {sig} {code}", NR_rt_sigqueueinfo, 1, sig, info(sig, code))
        call(f"rt_tgsigqueueinfo {sig} {code}", NR_rt_tgsigqueueinfo, 1, 1, sig,
             info(sig, code))
        if pidfd >= 0:
            call(f"pidfd_send_signal {sig} {code}", NR_pidfd_send_signal, pidfd, sig,
                 info(sig, code), 0)
    if pidfd >= 0:
        call(f"pidfd_send_signal {sig} null", NR_pidfd_send_signal, pidfd, sig, None, 0)
    call(f"kill {sig}", NR_kill, 1, sig)
    call(f"tgkill {sig}", NR_tgkill, 1, 1, sig)
    if sig not in (9, 19):  # the kernel as the sender: SIGIO-style delivery (F_SETSIG)
        import fcntl
        r, w = os.pipe()
        fcntl.fcntl(r, fcntl.F_SETOWN, 1)
        fcntl.fcntl(r, 10, sig)  # F_SETSIG
        fcntl.fcntl(r, fcntl.F_SETFL, fcntl.fcntl(r, fcntl.F_GETFL) | os.O_ASYNC)
        os.write(w, b"x")
        os.close(r); os.close(w)
        print(f"sigio {sig} OK", flush=True)
print("done", flush=True)
"""

SIGNALS = [signal.SIGTERM, signal.SIGINT, signal.SIGKILL, signal.SIGHUP, signal.SIGQUIT,
           signal.SIGUSR1, signal.SIGSEGV, signal.SIGABRT, signal.SIGSTOP, signal.SIGXCPU,
           signal.SIGPIPE, signal.SIGALRM, 40, 64]


def _init_alive(box: corral.Sandbox) -> bool:
    pid = box.info().init_pid
    assert pid
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] not in "ZX"
    except FileNotFoundError:
        return False


def _wait_gone(box: corral.Sandbox, deadline_s: float = 20.0) -> CorralError:
    """Poll (exec) until the daemon reports the sandbox ended; the error it gives."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            box.exec("true", timeout=10)
        except CorralError as e:
            return e
        time.sleep(0.05)
    raise AssertionError("the sandbox was never reported as ended")


def test_forged_and_plain_signals_to_the_init_do_not_end_the_sandbox():
    with corral.Sandbox(image="host", timeout=300) as box:
        box.files.write("/opt/forge.py", FORGE)
        r = box.exec(f"python3 /opt/forge.py {' '.join(str(int(s)) for s in SIGNALS)}",
                     timeout=60)
        assert "done" in r.stdout, r.stdout + r.stderr
        lines = r.stdout.splitlines()
        # seccomp: no queued signal with a siginfo of the sandbox's making ever reaches pid 1
        queued = [ln for ln in lines if ln.startswith(("rt_sigqueueinfo", "rt_tgsigqueueinfo"))]
        assert queued and all(ln.endswith("EPERM") for ln in queued), queued
        # pidfd_send_signal cannot be filtered by target: the kernel and the init's own check
        # stop it (codes >= 0 are refused to another process; a negative code is ignored)
        for sig in (int(signal.SIGTERM), int(signal.SIGINT)):
            assert f"pidfd_send_signal {sig} 0 EPERM" in lines, r.stdout
            assert f"pidfd_send_signal {sig} 128 EPERM" in lines, r.stdout
        assert _init_alive(box)
        assert box.exec("echo alive", timeout=10).stdout.strip() == "alive"
        # the init still serves (exec through it) and reaps
        r = box.exec("sh -c 'sleep 0.1 & wait'; echo reaped", timeout=10)
        assert "reaped" in r.stdout
        assert box.info().state == "running"


def test_forged_stop_signal_as_a_non_root_user():
    with corral.Sandbox(image="host", timeout=300) as box:
        box.files.write("/opt/forge.py", FORGE)
        r = box.exec("python3 /opt/forge.py 15 2 9", user="nobody", timeout=60)
        assert "done" in r.stdout, r.stdout + r.stderr
        assert _init_alive(box)
        assert box.exec("echo alive", timeout=10).stdout.strip() == "alive"


PID1_LIMITS = r"""
import ctypes, errno, resource
libc = ctypes.CDLL(None, use_errno=True)
new = (ctypes.c_uint64 * 2)(0, 0)
for name, res in (("cpu", resource.RLIMIT_CPU), ("nofile", resource.RLIMIT_NOFILE),
                  ("as", resource.RLIMIT_AS), ("nproc", resource.RLIMIT_NPROC)):
    r = libc.syscall(302, 1, res, new, None)
    e = ctypes.get_errno()
    print("prlimit", name, "OK" if r == 0 else errno.errorcode.get(e, e))
try:
    resource.prlimit(1, resource.RLIMIT_CPU, (1, 1))
    print("resource.prlimit OK")
except OSError as e:
    print("resource.prlimit", errno.errorcode.get(e.errno, e.errno))
for path in ("/proc/1/oom_score_adj", "/proc/1/oom_adj", "/proc/1/task/1/oom_score_adj",
             "/proc/1/task/1/oom_adj"):
    try:
        with open(path, "w") as f:
            f.write("15" if path.endswith("oom_adj") else "1000")
        print(path, "WRITTEN")
    except OSError as e:
        print(path, errno.errorcode.get(e.errno, e.errno))
print("score", open("/proc/1/oom_score_adj").read().strip())
"""


def test_init_limits_and_oom_score_are_out_of_reach():
    """prlimit on pid 1 (RLIMIT_CPU 0 would get the init SIGKILLed by the kernel) and its
    oom_score_adj (1000 makes it the OOM killer's first choice) cannot be changed."""
    with corral.Sandbox(image="host", timeout=300) as box:
        box.files.write("/opt/limits.py", PID1_LIMITS)
        r = box.exec("python3 /opt/limits.py", timeout=30)
        assert r.exit_code == 0, r.stdout + r.stderr
        assert "prlimit" in r.stdout and " OK" not in r.stdout, r.stdout
        assert "WRITTEN" not in r.stdout, r.stdout
        assert f"score {SANDBOX_OOM_SCORE_ADJ}" in r.stdout, r.stdout  # the one it was given
        # its own processes keep theirs (a normal program may make itself the OOM killer's
        # first choice; the floor the daemon set stays: see tests/test_daemon_protect.py)
        r = box.exec("echo 800 > /proc/self/oom_score_adj && cat /proc/self/oom_score_adj",
                     timeout=10)
        assert r.stdout.strip() == "800", r.stdout + r.stderr
        assert _init_alive(box)


HOG = ("echo 1000 > /proc/1/oom_score_adj 2>/dev/null; "
       "python3 -c \"b = []\nwhile True: b.append(bytearray(1 << 20))\"")


def test_memory_blowup_is_never_infra():
    """Whatever happens to a sandbox that raises its init's OOM score and blows its memory
    limit, it is never reported as an infrastructure failure."""
    box = corral.Sandbox(image="host", memory_mb=48, timeout=300)
    try:
        try:
            r = box.exec(HOG, timeout=60)
        except CorralError as e:
            assert isinstance(e, SandboxCrashed) and not e.infra, repr(e)
            assert e.details.get("cause") == "oom", e.details
        else:
            assert r.exit_code != 0  # the hog was killed, the sandbox lives
            try:
                assert box.exec("echo alive", timeout=10).stdout.strip() == "alive"
            except CorralError as e:
                assert isinstance(e, SandboxCrashed) and not e.infra, repr(e)
    finally:
        box.kill()


def test_init_death_after_an_oom_in_the_sandbox_is_crashed_not_lost():
    """The init dies (here: SIGKILL) after the OOM killer has killed in the sandbox's memory
    cgroup: attributed to the sandbox (sandbox_crashed, cause oom), in the call that finds
    out and in every later one (info too)."""
    box = corral.Sandbox(image="host", memory_mb=48, timeout=300)
    try:
        r = box.exec("python3 -c \"b = []\nwhile True: b.append(bytearray(1 << 20))\"",
                     timeout=60)
        assert r.exit_code != 0
        pid = box.info().init_pid
        crashed, lost = session_metric("corral_crashed_total"), session_metric("corral_lost_total")
        os.kill(pid, signal.SIGKILL)
        err = _wait_gone(box)
        assert isinstance(err, SandboxCrashed), repr(err)
        assert session_metric("corral_crashed_total") == crashed + 1
        assert session_metric("corral_lost_total") == lost
        assert not err.infra and err.code == "sandbox_crashed"
        assert err.details["cause"] == "oom" and err.details["reason"] == "crashed"
        for call in (box.info, lambda: box.exec("true", timeout=10),
                     lambda: box.files.read("/etc/hostname")):
            with pytest.raises(SandboxCrashed) as ei:
                call()
            assert ei.value.details.get("cause") == "oom"
    finally:
        box.kill()


def test_host_sigkill_of_the_init_is_sandbox_lost():
    """The control: the host kills the init, nothing in the sandbox explains it."""
    box = corral.Sandbox(image="host", timeout=300)
    try:
        assert box.exec("echo hi", timeout=10).stdout.strip() == "hi"  # memcg made, no OOM
        lost = session_metric("corral_lost_total")
        os.kill(box.info().init_pid, signal.SIGKILL)
        err = _wait_gone(box)
        assert isinstance(err, SandboxLost) and err.infra, repr(err)
        assert session_metric("corral_lost_total") == lost + 1
        with pytest.raises(SandboxLost):
            box.info()
    finally:
        box.kill()


def test_host_sigterm_of_the_init_stops_it_as_lost():
    """SIGTERM from outside the sandbox (si_code SI_USER, si_pid 0 in its namespace) still
    stops the init: the stop request it honours."""
    box = corral.Sandbox(image="host", timeout=300)
    try:
        box.exec("true", timeout=10)
        os.kill(box.info().init_pid, signal.SIGTERM)
        err = _wait_gone(box)
        assert isinstance(err, SandboxLost) and err.infra, repr(err)
    finally:
        box.kill()


@pytest.mark.parametrize("how,want", [
    ("segv", {"cause": "init_exited", "status": "killed by SIGSEGV", "signal": 11}),
    ("exit3", {"cause": "init_exited", "status": "exit code 3", "exit_code": 3}),
    ("kill", None), ("exit0", None),
])
def test_end_cause_reads_the_init_status_without_reaping(how, want):
    """The substrate's attribution for a dead init of ours (a plain child stands in for it):
    a crash or a non-zero exit is the sandbox's; SIGKILL or exit 0 is the host's stop. The
    status is only peeked at (the destroy reaps it)."""
    import subprocess
    import types

    from corral.daemon.substrates.base import SandboxRuntime
    from corral.daemon.substrates.container import ContainerSubstrate
    from corral.daemon.substrates.types import OomCount

    code = {"segv": "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)",
            "exit3": "raise SystemExit(3)", "kill": "import os; os.kill(os.getpid(), 9)",
            "exit0": "pass"}[how]
    child = subprocess.Popen(["python3", "-c", code])
    try:
        rt = SandboxRuntime(sandbox_id="sb-endcause", init_pid=child.pid, init_starttime=0,
                            sandbox_dir="/nonexistent", cgroup_paths=[])
        fake = types.SimpleNamespace(cgroups=types.SimpleNamespace(oom_kills=lambda _sid: None))
        deadline = time.monotonic() + 20
        while os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert ContainerSubstrate.end_cause(fake, rt) == want  # type: ignore[arg-type]
        # still a zombie for destroy to reap
        assert os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG) is not None
        # an OOM kill counted since the baseline, at the sandbox's own limit, wins over any
        # status; one with no sign of its own limit hit is the host's (infra, host_oom)
        fake.cgroups.oom_kills = lambda _sid: OomCount(5, 7)
        rt.extra["oom_base"], rt.extra["oom_own_base"] = 4, 6
        assert ContainerSubstrate.end_cause(fake, rt) == {"cause": "oom", "oom_kills": 1}
        rt.extra["oom_own_base"] = 7
        assert ContainerSubstrate.end_cause(fake, rt) == {"cause": "host_oom", "oom_kills": 1}
        rt.extra["oom_base"] = 5
        assert ContainerSubstrate.end_cause(fake, rt) is None  # earlier tenants' kills
    finally:
        child.wait()


def _oom_kill_counts() -> list[int]:
    """oom_kill of every memory cgroup under our cgroup name (sandboxes' and spares')."""
    out = []
    for top in cgroup_dirs():
        for d in top.iterdir():
            for f in ("memory.oom_control", "memory.events"):
                try:
                    text = (d / f).read_text()
                except OSError:
                    continue
                out += [int(ln.split()[1]) for ln in text.splitlines()
                        if ln.startswith("oom_kill ")]
    return out


def test_a_memory_cgroup_with_an_oom_kill_is_never_handed_on():
    """An OOM kill count cannot be reset, and it is what tells a crash from a host kill: a
    cgroup that saw one is removed, not recycled for the next sandbox (v1 spares)."""
    box = corral.Sandbox(image="host", memory_mb=48, timeout=300)
    try:
        r = box.exec("python3 -c \"b = []\nwhile True: b.append(bytearray(1 << 20))\"",
                     timeout=60)
        assert r.exit_code != 0
    finally:
        box.kill()
    deadline = time.monotonic() + 20
    while any(_oom_kill_counts()):  # the dead sandbox's cgroup goes (drained off the path)
        assert time.monotonic() < deadline, (_oom_kill_counts(), spare_cgroups())
        time.sleep(0.05)
    with corral.Sandbox(image="host", memory_mb=48, timeout=300) as nxt:
        nxt.exec("true", timeout=10)
        assert not any(_oom_kill_counts())
