"""The process substrate's sessions (``Sandbox(substrate="process")``) end to end through the
SDK (sync and async), the HTTP API and the CLI: exec, files, limits, lifetimes, what it does
not support, and attacks from inside (other sessions, host files, escapes)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_isolation import attack_madvise_to_swap

import corral
from corral.errors import (
    CorralError,
    InvalidRequest,
    SandboxExpired,
    SandboxNotRunning,
    Unsupported,
)
from corral.sdk import admin

from conftest import CGROUP_NAME, SOCKET, STATE_DIR, private_daemon, wait_until

TOP = f"{CGROUP_NAME}.process"


def session_cgroups(sid: str, name: str = TOP) -> list[str]:
    return [str(d) for d in Path("/sys/fs/cgroup").glob(f"*/{name}/{sid}")]


def host_pids_of_uid(uid: int) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            if p.stat().st_uid == uid:
                out.append(int(p.name))
        except OSError:
            continue
    return out


def uid_of(box: corral.Sandbox) -> int:
    return int(box.exec("id -u").stdout)


def traces(sid: str, uid: int) -> dict[str, list[str]]:
    return {"cgroups": session_cgroups(sid),
            "procs": [str(p) for p in host_pids_of_uid(uid)],
            "dirs": [str(p) for p in (Path(STATE_DIR, "sandboxes", sid),) if p.exists()]}


def gone(sid: str, uid: int) -> bool:
    return not any(traces(sid, uid).values())


@pytest.fixture(scope="module")
def sb():
    with corral.Sandbox(substrate="process", timeout=600, memory_mb=256) as box:
        yield box


# ---- what it is ------------------------------------------------------------------------------
def test_capability_table():
    row = {s.name: s for s in admin.substrates()}["process"]
    caps = row.capabilities
    assert row.available and caps.files and caps.oom_kills
    assert not caps.snapshot and not caps.restore and not caps.pause and not caps.warm_pool
    assert caps.networks == ["none"]
    assert row.operations == ["create", "exec", "kill", "files"]


def test_unsupported_operations_answer_unsupported(sb):
    for call in (lambda: sb.snapshot(), lambda: sb.fork(2), lambda: sb.pause(),
                 lambda: sb.resume(), lambda: sb.restore("nosuch")):
        with pytest.raises(Unsupported) as e:
            call()
        assert e.value.code == "unsupported"
    with pytest.raises(Unsupported):
        corral.Sandbox(substrate="process", network="disabled")
    assert sb.exec("echo still").stdout == "still\n"


# ---- exec -------------------------------------------------------------------------------------
def test_exec_python_bash_and_commands(sb):
    r = sb.exec("echo out; echo err >&2; exit 3")
    assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 3)
    assert sb.exec(["python3", "-c", "print(6 * 7)"]).stdout == "42\n"
    assert sb.exec(["bash", "-c", "echo $((2 ** 10))"]).stdout == "1024\n"
    assert sb.exec("cat", stdin="fed").stdout == "fed"
    assert sb.exec("echo $A-$B", env={"A": "1", "B": "two"}).stdout == "1-two\n"
    assert sb.exec(["printf", "%s|", "a b", "c"]).stdout == "a b|c|"
    assert sb.exec("pwd; echo $HOME").stdout == "/tmp\n/tmp\n"
    sb.files.mkdir("/tmp/sub")
    assert sb.exec("pwd", cwd="/tmp/sub").stdout == "/tmp/sub\n"
    assert sb.exec("no-such-command").exit_code == 127
    r = sb.exec("head -c 300000 /dev/zero", max_output_bytes=1000)
    assert r.truncated and r.stdout_bytes == 300000 and len(r.stdout) == 1000
    assert "CapEff:\t0000000000000000" in sb.exec("grep CapEff /proc/self/status").stdout
    assert sb.exec("kill -s KILL $$").exit_code == 137


def test_state_is_kept_between_commands(sb):
    sb.exec("echo kept > /tmp/state.txt")
    assert sb.exec(["python3", "-c", "print(open('/tmp/state.txt').read().strip())"]).stdout \
        == "kept\n"


def test_exec_timeout_kills_the_group(sb):
    t0 = time.monotonic()
    r = sb.exec("sleep 401 & sleep 402; echo never", timeout=1)
    assert r.timed_out and r.exit_code == 137 and "never" not in r.stdout
    assert time.monotonic() - t0 < 10
    assert wait_until(lambda: "sleep 40" not in sb.exec("ps -e -o args").stdout, 15)


def test_background_wait_stdin_and_kill(sb):
    p = sb.exec("read line; echo got $line", background=True)
    p.send_stdin("hello\n")
    res = p.wait(timeout=20)
    assert res.stdout == "got hello\n" and res.exit_code == 0
    q = sb.exec("sleep 403", background=True)
    assert q.status().running
    q.kill()
    assert q.wait(timeout=20).exit_code == 137


# ---- files ------------------------------------------------------------------------------------
def test_files_both_ways(sb):
    sb.files.write("/tmp/a.txt", "from the api")
    assert sb.exec("cat /tmp/a.txt").stdout == "from the api"
    # what the daemon wrote is the session's: its commands may change it
    sb.files.write("/tmp/new/deep/b.txt", "x")
    assert sb.exec("echo y >> /tmp/new/deep/b.txt && touch /tmp/new/deep/c && cat "
                   "/tmp/new/deep/b.txt").stdout == "xy\n"
    sb.exec("mkdir -p /tmp/d && echo inside > /tmp/d/b.txt")
    assert sb.files.read("/tmp/d/b.txt") == "inside\n"
    st = sb.files.stat("/tmp/d/b.txt")
    assert st.type == "file" and st.size == 7
    assert {e.name for e in sb.files.list("/tmp/d")} == {"b.txt"}
    sb.files.rename("/tmp/d/b.txt", "/tmp/d/c.txt")
    assert sb.exec("cat /tmp/d/c.txt").stdout == "inside\n"
    sb.files.remove("/tmp/d", recursive=True)
    assert sb.exec("test -e /tmp/d || echo none").stdout == "none\n"
    # the OS directories are the host's, read-only, for the API as for the session
    assert sb.files.read("/etc/passwd").startswith("root:")
    with pytest.raises(CorralError):
        sb.files.write("/usr/local/proc-marker", "x")
    assert not os.path.exists("/usr/local/proc-marker")
    with pytest.raises(InvalidRequest):
        sb.files.read("relative/path")


def test_tar_round_trip(sb, tmp_path):
    src = tmp_path / "src"
    (src / "deep").mkdir(parents=True)
    (src / "deep" / "f.txt").write_text("tarred")
    sb.files.upload(src, "/tmp/up")
    assert sb.exec("cat /tmp/up/deep/f.txt && echo more >> /tmp/up/deep/f.txt").stdout \
        == "tarred"
    out = tmp_path / "out"
    sb.files.download("/tmp/up", out)
    assert (out / "deep" / "f.txt").read_text() == "tarredmore\n"


def test_file_paths_stay_inside(sb):
    """Symlinks the session makes are resolved inside its root by the daemon's file
    operations: never the host's files, never its /proc or devices."""
    sb.exec("ln -sf /etc/shadow /tmp/shadow-link; ln -sf ../../../../../../etc /tmp/up-link; "
            "ln -sf /proc/1/environ /tmp/env-link; ln -sf /proc/self/root /tmp/root-link; "
            f"ln -sf {STATE_DIR} /tmp/state-link")
    host_shadow = Path("/etc/shadow").read_bytes() if Path("/etc/shadow").exists() else b""
    for p in ("/tmp/shadow-link", "/tmp/up-link/shadow", "/tmp/env-link",
              "/tmp/root-link/etc/shadow", "/proc/1/environ", "/proc/self/environ",
              "/tmp/state-link/corrald.pid", "/dev/mem"):
        try:
            data = sb.files.read_bytes(p)
        except CorralError:
            continue
        assert not host_shadow or data != host_shadow, p
        assert b"CORRAL" not in data, p
    with pytest.raises(CorralError):
        sb.files.write("/tmp/up-link/proc-escape", "x")  # the view's /etc: read-only
    assert not os.path.exists("/etc/proc-escape")
    with pytest.raises(CorralError):
        sb.files.write("/proc/sys/kernel/hostname", "pwned")


# ---- async ------------------------------------------------------------------------------------
def test_async_session():
    async def go() -> None:
        async with await corral.AsyncSandbox.create(substrate="process", timeout=120) as box:
            r = await box.exec(["python3", "-c", "import sys; print(sys.version_info[0])"])
            assert r.stdout == "3\n"
            await box.files.write("/tmp/x.txt", "async")
            assert (await box.exec("cat /tmp/x.txt")).stdout == "async"
            assert await box.files.read("/tmp/x.txt") == "async"
            with pytest.raises(Unsupported):
                await box.snapshot()
    asyncio.run(go())


# ---- limits -----------------------------------------------------------------------------------
def test_memory_limit_kills_and_says_so():
    with corral.Sandbox(substrate="process", memory_mb=64, timeout=120) as box:
        r = box.exec("python3 -c 'b=[]\nwhile len(b) < 64: b.append(bytearray(16<<20))'",
                     timeout=60)
        assert r.exit_code != 0 and r.oom_killed, r
        assert box.exec("echo alive").stdout == "alive\n"


def test_disk_limit():
    with corral.Sandbox(substrate="process", disk_mb=16, timeout=120) as box:
        r = box.exec("dd if=/dev/zero of=/tmp/big bs=1M count=64 2>&1; echo rc=$?")
        assert "rc=0" not in r.stdout, r.stdout
        box.exec("rm -f /tmp/big")
        with pytest.raises(CorralError):
            box.files.write("/tmp/api-big", b"x" * (32 << 20))
        assert box.exec("echo ok > /tmp/small && cat /tmp/small").stdout == "ok\n"



def test_a_sessions_home_starts_empty_wherever_the_daemon_is_installed():
    """A session's /tmp is its home: nothing of the host's in it. The daemon's own environment
    (its venv, which a checkout under /tmp puts under /tmp) is not in the session's view: the
    session's commands run the host's programs."""
    venv = os.path.realpath(sys.prefix)
    assert venv != os.path.realpath(sys.base_prefix)  # the suite runs from its venv
    with corral.Sandbox(substrate="process", timeout=120) as box:
        r = box.exec(f"ls -A /tmp; du -sk /tmp | cut -f1; test -e {venv} || echo no-venv; "
                     f"rm -rf /tmp/* && echo removed")
        assert r.stdout.split() == ["0", "no-venv", "removed"], r.stdout


def test_the_file_apis_writes_stay_within_the_memory_limit():
    """/tmp is a tmpfs: its pages are memory, and those the daemon writes for the file API are
    charged to the daemon's memory cgroup, not the session's. With /tmp sized by disk_mb
    alone (10 GiB by default), 1 GiB written through the API into a 64 MiB session held 1 GiB
    of the host's memory that no limit of the session counted. /tmp is at most memory_mb:
    what the API writes past it is too_large."""
    with corral.Sandbox(substrate="process", memory_mb=64, timeout=120) as box:
        chunk = b"x" * (16 << 20)
        with pytest.raises(CorralError) as e:
            for i in range(16):  # 256 MiB
                box.files.write(f"/tmp/api-{i}", chunk)
        assert e.value.code == "too_large", e.value
        held = int(box.exec("du -sm /tmp").stdout.split()[0])
        assert held <= 64, held
        assert box.exec("echo alive").stdout == "alive\n"

_SPIN = ("python3 -c 'import time, threading\n"
         "def spin():\n"
         "    t = time.monotonic() + 2\n"
         "    while time.monotonic() < t: pass\n"
         "ts = [threading.Thread(target=spin) for _ in range(2)]\n"
         "w = time.monotonic(); c = time.process_time()\n"
         "[t.start() for t in ts]; [t.join() for t in ts]\n"
         "print((time.process_time() - c) / (time.monotonic() - w))'")


def test_cpu_is_a_quota_and_weighs_less_than_the_daemon():
    """A session's ``cpu`` is a CFS quota (two spinning threads get half a CPU of cpu=0.5;
    load can only lower that), in a cpu cgroup of the session's own: its commands cannot
    starve the daemon."""
    with corral.Sandbox(substrate="process", cpu=0.5, timeout=120) as box:
        used = float(box.exec(_SPIN, timeout=60).stdout)
        assert used < 0.75, used
        quotas = [q for d in session_cgroups(box.id)
                  for q in Path(d).glob("s0/cpu.cfs_quota_us")]  # v1
        assert quotas and all(q.read_text().strip() == "50000" for q in quotas), quotas


def test_pids_limit_stops_a_fork_bomb():
    with corral.Sandbox(substrate="process", pids=64, timeout=120) as box:
        uid = uid_of(box)
        box.exec("i=0; while [ $i -lt 400 ]; do sleep 300 & i=$((i+1)); done 2>/dev/null; "
                 "echo started", timeout=60)
        n = len(host_pids_of_uid(uid))
        assert 0 < n <= 64, n


# ---- lifetimes --------------------------------------------------------------------------------
def test_a_command_whose_set_up_failed_is_infra_never_its_exit_code():
    """Each command is a fresh fork of the session's zygote that sets itself up (its cgroups,
    session, stdio, uid, limits) and then execs. A set-up the host made fail (here the
    session's pids cgroup removed from under it, so the join is refused) ran none of the
    command: infra, where it was exit code 126 with "could not start" (the command's own
    failure to a trainer). A command that is not there is still its own (127)."""
    with corral.Sandbox(substrate="process", timeout=120) as box:
        assert box.exec("true").exit_code == 0
        # the commands' pids cgroup (s0; the zygote is in its own), empty between commands
        (slot,) = [Path(d, "s0") for d in session_cgroups(box.id)
                   if Path(d).parent.parent.name == "pids"]
        os.rmdir(slot)
        with pytest.raises(corral.InfraError) as e:
            box.exec("echo ran")
        assert "could not start" in e.value.message, e.value
    with corral.Sandbox(substrate="process", timeout=120) as box:
        r = box.exec("no-such-command-here")
        assert r.exit_code == 127, r


def test_kill_leaves_nothing():
    box = corral.Sandbox(substrate="process", timeout=120)
    sid, uid = box.id, uid_of(box)
    box.exec("sleep 1000 >/dev/null 2>&1 &")
    box.exec("setsid sh -c 'sleep 1001 & sleep 1002' >/dev/null 2>&1 &")
    assert wait_until(lambda: len(host_pids_of_uid(uid)) >= 3, 10)
    assert session_cgroups(sid)
    box.kill()
    assert wait_until(lambda: gone(sid, uid), 15), traces(sid, uid)
    with pytest.raises(SandboxNotRunning):
        box.exec("true")


def test_ttl_expiry_leaves_nothing():
    box = corral.Sandbox(substrate="process", timeout=2, labels={"pr": "ttl"})
    sid, uid = box.id, uid_of(box)
    assert box.info().labels == {"pr": "ttl"} and box.info().substrate == "process"
    assert [b.id for b in corral.Sandbox.list(labels={"pr": "ttl"})] == [sid]
    assert wait_until(lambda: gone(sid, uid), 20), traces(sid, uid)
    with pytest.raises(SandboxExpired):
        box.exec("true")


# ---- attacks from inside ----------------------------------------------------------------------
def test_sessions_cannot_see_each_other():
    with corral.Sandbox(substrate="process", timeout=120) as a, \
            corral.Sandbox(substrate="process", timeout=120) as b:
        ua, ub = uid_of(a), uid_of(b)
        assert ua != ub
        a.exec("echo a-secret > /tmp/secret; sleep 600 >/dev/null 2>&1 &")
        a_pid = int(a.exec("pgrep -n sleep").stdout)
        r = b.exec("ls -A /tmp; cat /tmp/secret 2>&1; ps -e -o pid,args")
        assert "a-secret" not in r.stdout and "sleep 600" not in r.stdout, r.stdout
        # A's host pid and its pid inside: not reachable from B
        host = [p for p in host_pids_of_uid(ua)]
        for pid in {a_pid, *host}:
            r = b.exec(f"kill -9 {pid} 2>&1; cat /proc/{pid}/environ 2>&1; "
                       f"ls /proc/{pid}/root/tmp 2>&1")
            assert "secret" not in r.stdout
        assert "sleep 600" in a.exec("ps -e -o args").stdout
        # the abstract unix socket namespace is not shared either
        a.exec("python3 -c \"import socket, time; s=socket.socket(socket.AF_UNIX); "
               "s.bind('\\0proc-sess'); s.listen(); time.sleep(30)\" >/dev/null 2>&1 &")
        r = b.exec("python3 -c \"import socket; s=socket.socket(socket.AF_UNIX); "
                   "s.connect('\\0proc-sess'); print('connected')\"")
        assert "connected" not in r.stdout


def test_cannot_see_host_processes_or_files(sb):
    out = sb.exec("ls /proc | grep -c '^[0-9]'").stdout
    assert int(out) < 20
    assert "corral.daemon" not in sb.exec("cat /proc/*/cmdline 2>/dev/null | tr '\\0' ' '")\
        .stdout
    marker = Path(STATE_DIR, "proc-host-secret")
    marker.write_text("host secret")
    try:
        for p in (str(marker), "/proc/1/root" + str(marker), f"{STATE_DIR}/corrald.pid",
                  "/etc/shadow", "/root/.bash_history", "/var/log/syslog", "/home",
                  "/sys/kernel", str(Path(__file__).resolve())):
            r = sb.exec(f"cat {p} 2>&1; ls {p} 2>&1")
            assert "host secret" not in r.stdout and "def test_" not in r.stdout, (p, r)
            assert not (p == "/etc/shadow" and r.exit_code == 0 and "root:" in r.stdout)
    finally:
        marker.unlink()


def test_cannot_reach_the_network_or_the_daemon(sb):
    r = sb.exec("cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' '")
    assert set(r.stdout.split()) <= {"lo"}, r.stdout
    for family in ("AF_INET", "AF_INET6", "AF_NETLINK", "AF_PACKET"):
        r = sb.exec(f"python3 -c \"import socket; socket.socket(socket.{family}); "
                    f"print('made')\"")
        assert "made" not in r.stdout, (family, r)
    r = sb.exec(f"python3 -c \"import socket; s=socket.socket(socket.AF_UNIX); "
                f"s.connect('{SOCKET}'); print('connected')\"")
    assert "connected" not in r.stdout and r.exit_code != 0


def test_cannot_gain_privileges_or_change_the_system(sb):
    attempts = {
        "mount": "mount -t tmpfs none /tmp/m",
        "unshare": "unshare -U -r true",
        "unshare-net": "unshare -n true",
        "chroot": "chroot / true",
        "su": "su -c true root </dev/null",
        "write-usr": "echo x > /usr/proc-escape",
        "write-root": "echo x > /proc-escape",
        "sysctl": "echo 1 > /proc/sys/kernel/sysrq",
        "hostname": "hostname evil",
        "ptrace-1": "python3 -c \"import ctypes; l=ctypes.CDLL(None); "
                    "import sys; sys.exit(0 if l.ptrace(16, 1, 0, 0) == 0 else 1)\"",
        "kill-1": "kill -9 1",
        "setuid-0": "python3 -c 'import os; os.setuid(0)'",
        "keyctl": "python3 -c \"import ctypes; l=ctypes.CDLL(None); "
                  "import sys; sys.exit(0 if l.syscall(250, 0, 0, 0, 0, 0) >= 0 else 1)\"",
        "bpf": "python3 -c \"import ctypes; l=ctypes.CDLL(None); "
               "import sys; sys.exit(0 if l.syscall(321, 0, 0, 0) >= 0 else 1)\"",
        "mknod": "mknod /tmp/null2 c 1 3",
        "setns-1": "nsenter -t 1 -m true",
    }
    # x86_64 numbers; each must be refused (EPERM: the seccomp filter, no capability), not
    # merely fail on its dummy arguments
    for name, nr, args in (("io_uring_setup", 425, "8, 0"),
                           ("perf_event_open", 298, "0, 0, -1, -1, 0"),
                           ("userfaultfd", 323, "0"), ("open_by_handle_at", 304, "3, 0, 0"),
                           ("init_module", 175, "0, 0, 0"), ("kexec_load", 246, "0, 0, 0, 0"),
                           ("add_key", 248, "0, 0, 0, 0, 0"), ("unshare-user", 272, "0x10000000"),
                           ("memfd_secret", 447, "0")):
        attempts[name] = (f"python3 -c \"import ctypes, sys; l=ctypes.CDLL(None, use_errno=True); "
                          f"r=l.syscall({nr}, {args}); "
                          f"sys.exit(1 if r < 0 and ctypes.get_errno() == 1 else 0)\"")
    for name, cmd in attempts.items():
        r = sb.exec(f"{cmd} >/dev/null 2>&1; echo rc=$?")
        assert r.stdout.strip() != "rc=0", (name, r)
    for target in ("/usr/proc-escape", "/proc-escape"):
        assert not os.path.exists(target)
    assert sb.exec("echo alive").stdout == "alive\n"
    assert sb.info().state == "running"


def test_madvise_cannot_push_own_pages_to_swap(sb):
    """The zygote's filter (inherited by every command) refuses MADV_COLD/MADV_PAGEOUT."""
    attack_madvise_to_swap(sb)


# ---- the daemon's lifetime ---------------------------------------------------------------------
def test_graceful_stop_and_kill9_leave_nothing():
    """A daemon stopped with sessions running destroys them; one killed with SIGKILL leaves
    sessions that end with it (their zygotes lose their socket) and the next start removes
    what they held."""
    name = f"{CGROUP_NAME}-prstop"
    with private_daemon("corral-test-prstop-", name) as d:
        ep = f"unix://{d.socket_path}"
        a = corral.Sandbox(substrate="process", endpoint=ep, timeout=600)
        ua = int(a.exec("id -u").stdout)
        a.exec("sleep 1000 >/dev/null 2>&1 &")
        d.kill9()
        assert wait_until(lambda: not host_pids_of_uid(ua), 15), host_pids_of_uid(ua)
        d.start()
        assert wait_until(lambda: not session_cgroups(a.id, f"{name}.process"), 15)
        with pytest.raises(CorralError):
            a.exec("true")
        b = corral.Sandbox(substrate="process", endpoint=ep, timeout=600)
        ub = int(b.exec("id -u").stdout)
        b.exec("sleep 1000 >/dev/null 2>&1 &")
    assert not host_pids_of_uid(ub)
    assert not list(Path("/sys/fs/cgroup").glob(f"*/{name}.process"))


# ---- CLI --------------------------------------------------------------------------------------
def test_cli_run_substrate_process():
    corral_bin = os.path.join(os.path.dirname(sys.executable), "corral")
    r = subprocess.run([corral_bin, "run", "--substrate", "process", "--",
                        "python3", "-c", "import os; print('uid', os.getuid() > 0)"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "uid True" in r.stdout
    st = subprocess.run([corral_bin, "status"], capture_output=True, text=True, timeout=60)
    assert "process" in st.stdout


def test_sessions_hold_no_daemon_fds(sb):
    """A command's open fds are its stdio only: nothing of the daemon or the zygote leaks."""
    r = sb.exec("ls /proc/self/fd")
    assert set(r.stdout.split()) <= {"0", "1", "2", "3"}, r.stdout
