"""A sandbox's limits, visible and enforced like a real machine's: /proc/meminfo, cpuinfo, stat,
uptime, loadavg, swaps (lxcfs, corral.daemon.lxcfs), nproc and sched_getaffinity (a cpuset of
ceil(cpu) CPUs, corral.daemon.cpuplace), /sys/fs/cgroup (its own cgroups, read-only), and a
sandbox that thrashes at its memory limit OOM-killed (corral.daemon.thrash). Attacked from
inside: the host's totals through every path exposed, writes to the cgroup files, lxcfs killed
and stalled; and from outside: lxcfs killed or stalled while sandboxes run."""

from __future__ import annotations

import contextlib
import errno
import os
import select
import shutil
import signal
import time
import uuid

import pytest

from corral import Sandbox

from conftest import CGROUP_NAME, STATE_DIR, DaemonProcess, private_daemon, wait_until

NCPU = len(os.sched_getaffinity(0))
HOST_MEM_KB = int(open("/proc/meminfo").read().split()[1])


def ep(d: DaemonProcess) -> str:
    return f"unix://{d.socket_path}"


def lxcfs_pid(state_dir: str) -> int | None:
    try:
        with open(os.path.join(state_dir, "lxcfs", "lxcfs.pid")) as f:
            pid = int(f.read().strip())
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError):
        return None


def lxcfs_mounted(state_dir: str) -> bool:
    view = os.path.join(state_dir, "lxcfs", "view", "meminfo")
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == view for line in f)


def meminfo_total_kb(sb: Sandbox) -> int:
    r = sb.exec("head -1 /proc/meminfo", timeout=30)
    assert r.exit_code == 0, r.stderr
    return int(r.stdout.split()[1])


@pytest.fixture(scope="module")
def one_cpu():
    with Sandbox(image="host", memory_mb=96, cpu=0.5, timeout=600) as sb:
        sb.exec("true", timeout=30)  # its lazy cgroups made
        yield sb


# ---- what a sandbox sees ---------------------------------------------------------------------
def test_proc_and_tools_show_the_sandbox_limits(one_cpu):
    r = one_cpu.exec(
        "head -3 /proc/meminfo; free -k | sed -n 2p; nproc; grep -c ^processor /proc/cpuinfo; "
        "grep -c '^cpu[0-9]' /proc/stat; cut -d' ' -f1 /proc/uptime; "
        "python3 -c 'import os, multiprocessing as m; "
        "print(os.cpu_count(), len(os.sched_getaffinity(0)), m.cpu_count())'", timeout=30)
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split()[1] == str(96 * 1024), lines      # MemTotal
    assert int(lines[1].split()[1]) <= 96 * 1024              # MemFree
    assert lines[3].split()[1] == str(96 * 1024), lines      # free's total
    assert lines[4:7] == ["1", "1", "1"], lines               # nproc, cpuinfo, /proc/stat
    assert float(lines[7]) < 600, lines                       # uptime: the sandbox's own
    assert lines[8] == "1 1 1", lines                         # Python's three counts


def test_limits_show_whether_the_memory_cgroup_is_made_at_spawn_or_first_exec():
    """A sandbox joins a recycled memory cgroup at spawn when one is ready, else gets one at
    its first exec (lazy): lxcfs and /sys/fs/cgroup must show its limit either way, also for
    limits that differ from the recycled cgroup's previous tenant."""
    for mb in (40, 72, 40, 104, 56):
        with Sandbox(image="host", memory_mb=mb, cpu=1) as sb:
            r = sb.exec("head -1 /proc/meminfo; cat /sys/fs/cgroup/memory/memory.limit_in_bytes",
                        timeout=30)
            assert r.stdout.split()[1:] == [str(mb * 1024), "kB", str(mb << 20)], r


@pytest.mark.skipif(NCPU < 2, reason="needs two CPUs")
def test_cpu_count_is_ceil_of_cpu_and_sandboxes_spread():
    with Sandbox(image="host", cpu=1.5, memory_mb=128) as two, \
            Sandbox(image="host", cpu=1, memory_mb=128) as a, \
            Sandbox(image="host", cpu=1, memory_mb=128) as b:
        assert two.exec("nproc", timeout=30).stdout.strip() == "2"
        cpus = [sb.exec("python3 -c 'import os; print(sorted(os.sched_getaffinity(0)))'",
                        timeout=30).stdout.strip() for sb in (a, b)]
        assert cpus[0] != cpus[1], cpus  # least assigned first: not both on one CPU


def test_host_totals_are_not_readable_through_any_exposed_path(one_cpu):
    """Every place the host's memory size or CPU count could show: none does."""
    probe = r"""
import os, re, glob
host_kb, ncpu = int(os.environ["HOST_KB"]), int(os.environ["NCPU"])
bad = []
for p in ["/proc/meminfo", "/proc/swaps", "/proc/stat", "/proc/cpuinfo", "/proc/uptime",
          "/proc/loadavg"] + glob.glob("/sys/**", recursive=True):
    if not os.path.isfile(p):
        continue
    try:
        text = open(p).read(1 << 20)
    except OSError:
        continue
    for n in re.findall(r"\d+", text):
        if abs(int(n) - host_kb) < 64 or abs(int(n) - host_kb * 1024) < 65536:
            bad.append((p, n))
print("bad", bad)
print("sys", sorted(os.listdir("/sys")), sorted(os.listdir("/sys/fs/cgroup")))
print("up", sorted(os.listdir("/sys/fs/cgroup/memory/..")))
print("cpus", len(re.findall(r"^cpu\d", open("/proc/stat").read(), re.M)))
print("exists", [p for p in ("/sys/devices/system/cpu", "/sys/devices/system/node",
                             "/proc/zoneinfo") if os.path.exists(p) and os.path.getsize(p)])
"""
    one_cpu.files.write("/opt/host_totals.py", probe)
    r = one_cpu.exec(["python3", "/opt/host_totals.py"], timeout=60,
                     env={"HOST_KB": str(HOST_MEM_KB), "NCPU": str(NCPU)})
    assert r.exit_code == 0, r.stderr
    out = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert out["bad"] == "[]", out["bad"]
    assert out["sys"] == "['fs'] ['cpu', 'cpuset', 'freezer', 'memory', 'pids']", out
    # the parent of a cgroup mount is the read-only skeleton, not the host's hierarchy
    assert out["up"] == "['cpu', 'cpuset', 'freezer', 'memory', 'pids']", out
    assert out["cpus"] == "1"
    assert out["exists"] == "[]"


def test_sys_fs_cgroup_is_the_sandbox_own_and_read_only(one_cpu):
    r = one_cpu.exec(
        "cat /sys/fs/cgroup/memory/memory.limit_in_bytes /sys/fs/cgroup/pids/pids.max "
        "/sys/fs/cgroup/cpu/cpu.cfs_quota_us /sys/fs/cgroup/cpuset/cpuset.cpus; "
        "find /sys/fs/cgroup -mindepth 2 -type d | wc -l", timeout=30)
    assert r.exit_code == 0, r.stderr
    lim, pids, quota, cpus, subdirs = r.stdout.split()
    assert int(lim) == 96 << 20 and int(pids) > 0 and int(quota) == 50_000
    assert len(cpus.replace("-", ",").split(",")) == 1 and subdirs == "0"


WRITES = [
    ("memory/memory.limit_in_bytes", "-1"), ("memory/memory.memsw.limit_in_bytes", "-1"),
    ("memory/memory.oom_control", "1"), ("memory/cgroup.procs", "1"),
    ("memory/tasks", "1"), ("memory/memory.force_empty", "0"),
    ("cpu/cpu.cfs_quota_us", "-1"), ("cpu/cpu.cfs_period_us", "1000"),
    ("cpuset/cpuset.cpus", "0-63"), ("cpuset/cpuset.sched_load_balance", "1"),
    ("pids/pids.max", "max"), ("freezer/freezer.state", "FROZEN"),
]


def test_the_sandbox_cannot_raise_its_own_limits():
    """As root inside: every write to a cgroup file, a mkdir, a remount, a new cgroup mount,
    a wider affinity: all refused, and the limit still holds."""
    with Sandbox(image="host", memory_mb=48, cpu=1, timeout=300) as sb:
        script = "".join(
            f"echo {v} > /sys/fs/cgroup/{f} 2>/dev/null && echo WROTE {f}; " for f, v in WRITES)
        script += (
            "mkdir /sys/fs/cgroup/memory/x 2>/dev/null && echo MKDIR; "
            "mount -o remount,rw /sys/fs/cgroup/memory 2>/dev/null && echo REMOUNT; "
            "mount -o remount,rw /sys 2>/dev/null && echo REMOUNT_SYS; "
            "umount /sys/fs/cgroup/memory 2>/dev/null && echo UMOUNT; "
            "mount -t cgroup -o memory cgroup /mnt 2>/dev/null && echo NEWMOUNT; "
            "mount -t tmpfs t /sys/fs/cgroup/memory 2>/dev/null && echo OVERMOUNT; "
            "echo 0 > /proc/meminfo 2>/dev/null && echo PROCWRITE; "
            # the kernel takes a wider mask but keeps it within the cpuset
            "python3 -c 'import os; os.sched_setaffinity(0, range(64)); "
            "n = len(os.sched_getaffinity(0)); print(\"AFFINITY\", n) if n > 1 else 0'; "
            "cat /sys/fs/cgroup/memory/memory.limit_in_bytes")
        r = sb.exec(script, timeout=60)
        assert r.stdout.splitlines() == [str(48 << 20)], r.stdout
        if NCPU > 1:
            assert sb.exec("nproc", timeout=30).stdout.strip() == "1"
        hog = sb.exec(["python3", "-c", "b = bytearray(200 << 20)\nb[::4096] = b'x' * 51200"],
                      timeout=60)
        assert hog.oom_killed, hog


def test_lxcfs_is_out_of_reach_from_inside(daemon):
    pid = lxcfs_pid(STATE_DIR)
    assert pid is not None, "the session daemon runs no lxcfs"
    with Sandbox(image="host", memory_mb=64) as sb:
        r = sb.exec("grep -l lxcfs /proc/[0-9]*/comm 2>/dev/null | wc -l; "
                    f"kill -9 {pid}; kill -STOP {pid}; echo done", timeout=30)
        assert r.stdout.splitlines() == ["0", "done"], r
        sb.exec("kill -9 -1", timeout=30)  # everything it can signal: its own processes
        for _ in range(200):  # lxcfs busy with reads from inside: still answers others
            sb.exec("cat /proc/meminfo /proc/stat /proc/cpuinfo >/dev/null &", timeout=30)
        with Sandbox(image="host", memory_mb=64) as sb2:
            assert meminfo_total_kb(sb2) == 64 * 1024
    assert lxcfs_pid(STATE_DIR) == pid
    with open(f"/proc/{pid}/stat") as f:
        assert f.read().split(") ")[1].split()[0] in ("S", "R"), "lxcfs was stopped"


# ---- lxcfs killed or stalled (a private daemon each: the session's lxcfs stays) ---------------
@contextlib.contextmanager
def lxcfs_daemon(tag: str):
    with private_daemon("corral-test-lx-", f"{CGROUP_NAME}-lx{tag}") as d:
        assert wait_until(lambda: lxcfs_pid(d.state_dir) is not None, 20), d.tail()
        yield d


def test_lxcfs_killed_is_restarted_and_sandboxes_keep_working():
    with lxcfs_daemon("k") as d:
        with Sandbox(endpoint=ep(d), memory_mb=64) as old:
            assert meminfo_total_kb(old) == 64 * 1024
            pid = lxcfs_pid(d.state_dir)
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            assert wait_until(lambda: lxcfs_pid(d.state_dir) not in (None, pid)
                              and lxcfs_mounted(d.state_dir), 30), d.tail()
            # the old sandbox keeps running commands, and gets the new server's files
            assert old.exec("echo alive", timeout=30).stdout.strip() == "alive"
            assert wait_until(lambda: old.exec("head -1 /proc/meminfo", timeout=30).stdout
                              .split()[1:2] == [str(64 * 1024)], 20), d.tail()
            r = old.exec("ps -e >/dev/null && free -m >/dev/null && nproc", timeout=30)
            assert r.exit_code == 0 and r.stdout.strip() == "1" or NCPU == 1, r
            with Sandbox(endpoint=ep(d), memory_mb=80) as new:
                assert meminfo_total_kb(new) == 80 * 1024


def test_lxcfs_outlives_a_daemon_crash_and_is_adopted():
    """kill -9 of the daemon: lxcfs keeps serving the sandboxes, and the restarted daemon
    keeps that lxcfs (no second one, no broken binds)."""
    with lxcfs_daemon("r") as d:
        sb = Sandbox(endpoint=ep(d), memory_mb=64)
        try:
            assert meminfo_total_kb(sb) == 64 * 1024
            pid = lxcfs_pid(d.state_dir)
            d.restart(kill9=True)
            assert lxcfs_pid(d.state_dir) == pid
            assert meminfo_total_kb(sb) == 64 * 1024
            with Sandbox(endpoint=ep(d), memory_mb=88) as new:
                assert meminfo_total_kb(new) == 88 * 1024
        finally:
            sb.kill()


def test_a_daemon_restarts_past_the_dead_mount_of_an_lxcfs_that_died_with_it():
    """kill -9 of the daemon, then of its lxcfs: the FUSE mount stays, dead (stat answers
    ENOTCONN). The next daemon detaches it and starts a new lxcfs."""
    with lxcfs_daemon("d") as d:
        sb = Sandbox(endpoint=ep(d), memory_mb=64)
        try:
            pid = lxcfs_pid(d.state_dir)
            assert pid is not None
            d.kill9()
            pidfd = os.pidfd_open(pid)
            os.kill(pid, signal.SIGKILL)
            select.select([pidfd], [], [], 10)
            os.close(pidfd)
            with pytest.raises(OSError) as dead:
                os.stat(os.path.join(d.state_dir, "lxcfs", "mnt"))
            assert dead.value.errno == errno.ENOTCONN
            d.start()
            assert wait_until(lambda: lxcfs_pid(d.state_dir) not in (None, pid)
                              and lxcfs_mounted(d.state_dir), 30), d.tail()
            assert sb.exec("echo alive", timeout=30).stdout.strip() == "alive"
            with Sandbox(endpoint=ep(d), memory_mb=72) as new:
                assert meminfo_total_kb(new) == 72 * 1024
        finally:
            sb.kill()


def test_a_stalled_lxcfs_stalls_neither_the_daemon_nor_spawns():
    """lxcfs stopped (SIGSTOP): creates and execs go on; a read of /proc/meminfo blocks only its
    reader (killed by its timeout); the supervisor's probe restarts lxcfs."""
    with lxcfs_daemon("s") as d:
        pid = lxcfs_pid(d.state_dir)
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with Sandbox(endpoint=ep(d), memory_mb=64) as sb:
                assert sb.exec("echo ok", timeout=30).stdout.strip() == "ok"
                assert time.monotonic() - t0 < 20
                hung = sb.exec("cat /proc/meminfo", timeout=2)
                assert hung.timed_out, hung
                assert sb.exec("echo still", timeout=30).stdout.strip() == "still"
            assert wait_until(lambda: lxcfs_pid(d.state_dir) not in (None, pid)
                              and lxcfs_mounted(d.state_dir), 40), d.tail()
            with Sandbox(endpoint=ep(d), memory_mb=72) as sb:
                assert meminfo_total_kb(sb) == 72 * 1024
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def test_the_daemons_own_exec_path_sees_the_same_limits():
    """Commands the daemon starts itself (not through the init) join the same cgroups,
    cpuset included, and see the same files."""
    with private_daemon("corral-test-lx-", f"{CGROUP_NAME}-lxd", CORRAL_INIT_EXEC="0") as d:
        with Sandbox(endpoint=ep(d), memory_mb=56, cpu=1) as sb:
            r = sb.exec("head -1 /proc/meminfo; nproc; "
                        "cat /sys/fs/cgroup/memory/memory.limit_in_bytes", timeout=30)
            assert r.stdout.split() == ["MemTotal:", str(56 * 1024), "kB",
                                        "1" if NCPU > 1 else str(NCPU), str(56 << 20)], r


def test_without_lxcfs_sandboxes_get_the_real_files():
    with private_daemon("corral-test-lx-", f"{CGROUP_NAME}-lxoff", CORRAL_LXCFS="0") as d:
        with Sandbox(endpoint=ep(d), memory_mb=64) as sb:
            assert meminfo_total_kb(sb) == HOST_MEM_KB


# ---- thrashing at the memory limit ----------------------------------------------------------
@pytest.fixture
def cold_python():
    """A copy of the interpreter on the host image's /usr, dropped from the page cache: the
    sandbox that runs it first has its text charged to its own memory cgroup (the case the
    kernel's OOM killer leaves thrashing)."""
    d = f"/usr/local/lib/corral-test-{uuid.uuid4().hex[:8]}"
    os.makedirs(d)
    try:
        path = os.path.join(d, "py")
        shutil.copy(os.path.realpath("/usr/bin/python3"), path)  # the image's, not a shim
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        yield path
    finally:
        shutil.rmtree(d, ignore_errors=True)


HOGS = ("for i in $(seq 20); do {py} -c 'b = []\nwhile True: b.append(bytearray(1 << 20))' & "
        "done; wait; echo done")


def test_twenty_hogs_in_32_mib_are_oom_killed_promptly(cold_python):
    with Sandbox(image="host", memory_mb=32, timeout=300) as sb:
        t0 = time.monotonic()
        r = sb.exec(HOGS.format(py=cold_python), timeout=120)
        took = time.monotonic() - t0
        assert not r.timed_out and r.stdout.strip() == "done", r
        assert took < 40, took  # without the watcher: the 120 s timeout
        assert r.oom_killed, r  # kernel or watcher: counted either way
        assert sb.exec("echo fine", timeout=30).stdout.strip() == "fine"


def test_a_single_thrashing_command_is_flagged_oom_killed(cold_python):
    """One process whose anonymous memory fits but whose text does not: only the watcher can
    end it, and the result says oom_killed (category limit), signal 9."""
    prog = ("import time\nb = bytearray(27 << 20)\nwhile True:\n"
            "    b[::4096] = b'x' * len(b[::4096])\n")
    with Sandbox(image="host", memory_mb=32, timeout=300) as sb:
        sb.files.write("/opt/fit.py", prog)
        t0 = time.monotonic()
        r = sb.exec([cold_python, "/opt/fit.py"], timeout=120)
        assert not r.timed_out and time.monotonic() - t0 < 40, r
        assert (r.exit_code, r.signal, r.oom_killed) == (137, 9, True), r


def test_reading_a_file_larger_than_the_limit_is_not_thrashing(no_leaks):
    """Page cache churn without mapped refaults (cat of a file 3x the limit, three times) is
    no reason to kill."""
    d = f"/usr/local/lib/corral-test-{uuid.uuid4().hex[:8]}"
    os.makedirs(d)
    try:
        with open(os.path.join(d, "big"), "wb") as f:
            f.write(os.urandom(1 << 20) * 96)
        with Sandbox(image="host", memory_mb=32, timeout=300) as sb:
            r = sb.exec(f"for i in 1 2 3; do cat {d}/big > /dev/null; done; echo ok", timeout=120)
            assert r.exit_code == 0 and r.stdout.strip() == "ok" and not r.oom_killed, r
    finally:
        shutil.rmtree(d, ignore_errors=True)
