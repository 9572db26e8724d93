"""The exec boundary, attacked from inside a sandbox on every exec path.

No process that shares memory, fds or credentials with corrald may ever be visible to,
signalable by or traceable from sandbox code: a watcher in the sandbox (root there) polls /proc
for every new process while the daemon starts commands, stops each one it catches (SIGSTOP),
and tries its environment, its memory (/proc/PID/mem, process_vm_readv), its fds and its
command line. corrald runs with a secret in its environment that must never show up. Paths:
the init's (a small command, a >64 KiB one) and the daemon's own (CORRAL_INIT_EXEC=0).
Also: stopped processes in four sandboxes never stall other sandboxes' creates and execs, and
corrald is not dumpable.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import time

import pytest

from corral import Sandbox

from conftest import (
    CGROUP_NAME,
    DaemonProcess,
    private_daemon,
)

SECRET = "corral-boundary-" + secrets.token_hex(12)

# Runs as root in the sandbox until /tmp/stop exists; prints one JSON summary.
WATCHER = r"""
import ctypes, json, os, signal, sys
secret = sys.argv[1].encode()
keep_stopped = sys.argv[2] == "1"
libc = ctypes.CDLL(None, use_errno=True)
class iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
me, seen = os.getpid(), set()
out = {"new": 0, "stopped": 0, "leaks": [], "environ": 0, "mem": 0, "vm": 0, "fds": 0,
       "foreign_fds": []}
with open("/proc/self/status") as f:
    out["self_status"] = [l for l in f if l.startswith("NSpid")][0].split()[1:]
open("/tmp/ready", "w").close()
def check(pid, what, data):
    if secret in data:
        out["leaks"].append([pid, what])
while not os.path.exists("/tmp/stop"):
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        pid = int(d)
        if pid in seen or pid in (1, me):
            continue
        seen.add(pid)
        out["new"] += 1
        try:
            os.kill(pid, signal.SIGSTOP)
            out["stopped"] += 1
        except OSError:
            pass
        base = f"/proc/{pid}"
        for name in ("environ", "cmdline"):
            try:
                with open(f"{base}/{name}", "rb") as f:
                    data = f.read()
                check(pid, name, data)
                if name == "environ":
                    out["environ"] += 1
            except OSError:
                pass
        try:
            with open(f"{base}/maps") as f:
                lines = f.read().splitlines()
            with open(f"{base}/mem", "rb") as mem:
                for l in lines:
                    lo, hi = (int(x, 16) for x in l.split()[0].split("-"))
                    if "r" not in l.split()[1]:
                        continue
                    try:
                        mem.seek(lo)
                        check(pid, "mem", mem.read(min(hi - lo, 1 << 20)))
                        out["mem"] += 1
                    except OSError:
                        pass
        except OSError:
            pass
        buf = ctypes.create_string_buffer(4096)
        local = iovec(ctypes.cast(buf, ctypes.c_void_p), 4096)
        remote = iovec(0x400000, 4096)
        if libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) > 0:
            out["vm"] += 1
            check(pid, "process_vm_readv", buf.raw)
        try:
            for n in os.listdir(f"{base}/fd"):
                try:
                    target = os.readlink(f"{base}/fd/{n}")
                    fd = os.open(f"{base}/fd/{n}", os.O_RDONLY | os.O_NONBLOCK)
                    os.close(fd)
                except OSError:
                    continue
                out["fds"] += 1
                # what only corrald holds: pidfds, its epoll, sockets, cgroup and state files,
                # the pipe a command's pid is reported on (commands here hold stdio only)
                if (target.startswith(("anon_inode:", "socket:", "/sys/", "/proc/"))
                        or "corral" in target or (target.startswith("pipe:") and int(n) > 2)):
                    out["foreign_fds"].append([pid, n, target])
        except OSError:
            pass
        if not keep_stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError:
                pass
print(json.dumps(out))
"""


def boundary_daemon(tag: str, **env: str) -> contextlib.AbstractContextManager[DaemonProcess]:
    """A corrald of its own with SECRET in its environment."""
    return private_daemon("corral-test-eb-", f"{CGROUP_NAME}-eb{tag}",
                          CORRAL_BOUNDARY_SECRET=SECRET, **env)


def ep(d: DaemonProcess) -> str:
    return f"unix://{d.socket_path}"


def daemon_pid(d: DaemonProcess) -> int:
    assert d.proc is not None
    return d.proc.pid


def start_watcher(sb: Sandbox, keep_stopped: bool = False):
    sb.files.write("/tmp/watch.py", WATCHER.encode())
    proc = sb.exec(["python3", "/tmp/watch.py", SECRET, "1" if keep_stopped else "0"],
                   background=True)
    deadline = time.monotonic() + 30
    while not sb.files.exists("/tmp/ready"):
        assert time.monotonic() < deadline, "the watcher did not start"
        time.sleep(0.02)
    return proc


def stop_watcher(sb: Sandbox, proc) -> dict:
    sb.files.write("/tmp/stop", b"")
    res = proc.wait(timeout=60)
    assert res.exit_code == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


CASES = {
    # path name -> (daemon env, the command each round runs)
    "init-small": ({"CORRAL_INIT_EXEC": "1"}, ["/bin/sh", "-c", "true"]),
    "init-big": ({"CORRAL_INIT_EXEC": "1"}, ["/bin/sh", "-c", "true", "x" * 70_000]),
    "daemon": ({"CORRAL_INIT_EXEC": "0"}, ["/bin/sh", "-c", "true"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_no_process_of_the_daemon_is_reachable_from_the_sandbox(case):
    env, argv = CASES[case]
    with boundary_daemon(case.replace("-", ""), **env) as d:
        # corrald blanks its environment block (the variables live on in its heap, which
        # only CAP_SYS_PTRACE can read): not even host root sees the secret there.
        with open(f"/proc/{daemon_pid(d)}/environ", "rb") as f:
            assert SECRET.encode() not in f.read()
        for user in ("root", "nobody"):
            with Sandbox(endpoint=ep(d), timeout=300) as sb:
                watcher = start_watcher(sb)
                t0 = time.monotonic()
                n = 0
                while n < 150 or time.monotonic() - t0 < 3:
                    r = sb.exec(argv, user=user, timeout=30)
                    assert r.exit_code == 0, r.stderr
                    n += 1
                seen = stop_watcher(sb, watcher)
                assert seen["leaks"] == [], seen
                # every fd it could open in a process it caught was a command's own stdio
                assert seen["foreign_fds"] == [], seen
                assert seen["new"] > 0, seen  # it saw commands come and go
                assert seen["stopped"] > 0, seen  # and stopped some: the attack ran
                # corrald's pid (and any host pid) is not in the sandbox's pid namespace
                code = sb.exec(f"test -e /proc/{daemon_pid(d)}/environ && cat "
                               f"/proc/{daemon_pid(d)}/environ").stdout
                assert SECRET not in code


HARDEN_PROBE = """
import ctypes, sys
from corral.daemon.__main__ import harden_self
harden_self()
libc = ctypes.CDLL(None)
with open("/proc/self/environ", "rb") as f:
    env = f.read()
with open("/proc/self/cmdline", "rb") as f:
    cmd = f.read()
secret = sys.argv[2].encode()
print(libc.prctl(3, 0, 0, 0, 0), secret in env, secret in cmd)
"""


def test_corrald_hardens_itself_at_start():
    """What corrald's start does (__main__.harden_self): not dumpable (PR_GET_DUMPABLE 0),
    the environment block blanked, a --token value blanked in the command line."""
    r = subprocess.run([sys.executable, "-c", HARDEN_PROBE, "--token", SECRET],
                       env=dict(os.environ, CORRAL_BOUNDARY_SECRET=SECRET),
                       capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["0", "False", "False"], r.stderr


def test_a_running_corrald_is_out_of_reach_of_root_without_cap_sys_ptrace():
    """Root without CAP_SYS_PTRACE (sandbox root never has it) cannot read corrald's memory,
    take its fds or find the secret in its environment file."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    with boundary_daemon("dump") as d:
        pid = daemon_pid(d)
        no_ptrace = ["setpriv", "--bounding-set=-sys_ptrace", "--inh-caps=-sys_ptrace"]
        for what in ("environ", "mem", "fd/0", "cmdline"):
            r = subprocess.run([*no_ptrace, "cat", f"/proc/{pid}/{what}"],
                               capture_output=True, timeout=30)
            assert SECRET.encode() not in r.stdout, what
            if what in ("mem", "fd/0"):
                assert r.returncode != 0, what


@pytest.mark.parametrize("init_exec", ["0", "1"])
def test_stopped_processes_in_four_sandboxes_never_stall_other_sandboxes(init_exec):
    """In four sandboxes a watcher stops every new process for good while commands keep
    being started there; creates and execs in other sandboxes complete within a bound."""
    with boundary_daemon(f"stall{init_exec}", CORRAL_INIT_EXEC=init_exec) as d:
        boxes = [Sandbox(endpoint=ep(d), timeout=300) for _ in range(4)]
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=16)
        try:
            watchers = [start_watcher(sb, keep_stopped=True) for sb in boxes]
            stuck = [pool.submit(sb.exec, ["/bin/sh", "-c", "true"], timeout=5)
                     for sb in boxes for _ in range(3)]
            # Each of the four sandboxes now holds stopped processes (the commands above, or
            # the init's children starting them).
            for _ in range(5):
                t0 = time.monotonic()
                with Sandbox(endpoint=ep(d), timeout=60) as other:
                    assert other.exec("echo fine").stdout == "fine\n"
                    big = other.exec(["/bin/sh", "-c", "echo ${#1}", "-", "y" * 70_000])
                    assert big.stdout == "70000\n"
                assert time.monotonic() - t0 < 10, "another sandbox stalled this one"
            for f in stuck:  # they time out or finish; none hangs the daemon
                with contextlib.suppress(Exception):
                    f.result(timeout=90)
            del watchers
        finally:
            for sb in boxes:
                sb.kill()
            pool.shutdown(wait=True)
