"""/proc in a sandbox: an allow list of top-level entries (corral.daemon.procpolicy), every
other one masked; no sysfs. Attacked from inside: every entry outside the allow list is
read, listed and written; the tools a normal program uses keep working."""

from __future__ import annotations

import os

import pytest

import corral
from corral.daemon import procpolicy
from corral.daemon.protect import SANDBOX_OOM_SCORE_ADJ

# Run inside: every top-level /proc entry that is not a process directory, with what reading
# (a file) or listing (a directory) it gives, and whether a write got through.
PROBE = r"""
import os, sys
allowed = set(sys.argv[1].split(","))
for name in sorted(os.listdir("/proc")):
    if name.isdigit() or name in allowed:
        continue
    p = "/proc/" + name
    if os.path.isdir(p) and not os.path.islink(p):
        try:
            got = "entries=%d" % len(os.listdir(p))
        except OSError as e:
            got = "error=%d" % e.errno
        try:
            open(p + "/x", "w").close()
            got += " created"
        except OSError:
            pass
    else:
        try:
            with open(p, "rb") as f:
                got = "bytes=%d" % len(f.read(1 << 16))
        except OSError as e:
            got = "error=%d" % e.errno
    print(name, got)
"""

HOST_LEAKS = ("cmdline", "cgroups", "kpageflags", "kpagecount", "kpagecgroup", "slabinfo",
              "timer_list", "kallsyms", "interrupts", "zoneinfo", "vmallocinfo", "iomem",
              "keys", "key-users", "buddyinfo", "pagetypeinfo", "diskstats", "partitions",
              "locks", "sched_debug", "devices")


@pytest.fixture(scope="module")
def sb():
    with corral.Sandbox(image="host", timeout=600) as box:
        yield box


def test_every_entry_outside_the_allow_list_gives_nothing(sb):
    sb.files.write("/opt/proc_probe.py", PROBE)
    r = sb.exec(["python3", "/opt/proc_probe.py", ",".join(sorted(procpolicy.PROC_ALLOWED))],
                timeout=60)
    assert r.exit_code == 0, r.stderr
    seen = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    # the host's own leaks are among them (those this kernel has)
    for name in HOST_LEAKS:
        if os.path.exists(f"/proc/{name}"):
            assert name in seen, (name, r.stdout)
    for name, got in seen.items():
        assert got in ("bytes=0", "entries=0") or got.startswith("error="), (name, got)
        assert "created" not in got, (name, got)


def test_writes_to_kernel_state_and_the_init_fail(sb):
    r = sb.exec("echo x > /proc/sys/kernel/hostname; echo sys=$?; "
                "echo 1000 > /proc/1/oom_score_adj; echo oom=$?; "
                "echo 1000 > /proc/1/task/1/oom_score_adj; echo oom_task=$?; "
                "echo 15 > /proc/1/oom_adj; echo oom_adj=$?; "
                "echo b > /proc/sysrq-trigger; echo sysrq=$?; cat /proc/1/oom_score_adj",
                timeout=10)
    for step in ("sys", "oom", "oom_task", "oom_adj", "sysrq"):
        assert f"{step}=0" not in r.stdout, r.stdout
    assert r.stdout.splitlines()[-1] == str(SANDBOX_OOM_SCORE_ADJ), r.stdout  # unchanged


def test_no_sysfs(sb):
    """/sys holds only the sandbox's own cgroups (fs/cgroup, tests/test_limits_visible.py):
    no sysfs, and none can be mounted."""
    r = sb.exec("ls -A /sys; mount -t sysfs sysfs /sys; echo mount=$?; "
                "grep -c ' sysfs ' /proc/self/mounts", timeout=10)
    lines = r.stdout.split()
    assert lines[0] == "fs" and "mount=0" not in lines and lines[-1] == "0", r.stdout


def test_normal_tools_work(sb):
    r = sb.exec(
        "set -e; ps -e -o pid,comm | grep -q corral-init; free -m | grep -q Mem; uptime; "
        "grep -q MemTotal /proc/meminfo; grep -q processor /proc/cpuinfo; nproc; "
        "cat /proc/loadavg /proc/version /proc/stat /proc/uptime >/dev/null; "
        "grep -q proc /proc/filesystems; grep -q ' / ' /proc/mounts; df / >/dev/null; "
        "cat /proc/sys/kernel/hostname; cat /proc/self/status | grep -q Pid; "
        "cat /proc/net/dev >/dev/null; cat /proc/vmstat /proc/swaps >/dev/null; "
        "python3 -c 'import os, platform, multiprocessing; "
        "print(os.cpu_count(), multiprocessing.cpu_count(), platform.platform(), "
        "os.getloadavg(), platform.libc_ver())'; echo ok", timeout=30)
    assert r.exit_code == 0 and r.stdout.rstrip().endswith("ok"), r.stdout + r.stderr


def test_policy_masks_by_type_and_allows_no_unknown_symlink():
    pol = procpolicy.compute()
    assert "kpageflags" in pol.mask_files and "slabinfo" in pol.mask_files
    assert not set(pol.mask_files) & procpolicy.PROC_ALLOWED
    for d in pol.mask_dirs:
        assert os.path.isdir(f"/proc/{d}") and not os.path.islink(f"/proc/{d}")
    assert "1/oom_score_adj" in pol.readonly and "sys" in pol.readonly
