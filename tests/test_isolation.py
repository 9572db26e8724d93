"""Each isolation property the container substrate claims, attacked from inside a sandbox.

The commands here are what untrusted agent code would try. Every test asserts that the attack
fails AND, where it could have had an effect, that the host is unchanged.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import corral
from corral.sdk import admin

from conftest import CGROUP_NAME, SOCKET, STATE_DIR, wait_until

# Python run inside the sandbox; syscalls by number (x86_64) so no helper binary is needed.
SYSCALL_PROBE = r"""
import ctypes, errno, os, sys
libc = ctypes.CDLL(None, use_errno=True)
name, nr, *args = sys.argv[1:]
args = [int(a) for a in args]
r = libc.syscall(int(nr), *[ctypes.c_long(a) for a in args])
e = ctypes.get_errno()
print(name, r, errno.errorcode.get(e, e) if r == -1 else "OK")
"""


@pytest.fixture(scope="module")
def sb():
    with corral.Sandbox(image="host", timeout=600) as box:
        box.files.write("/opt/probe.py", SYSCALL_PROBE)
        yield box


def sh(box, cmd: str, **kw):
    return box.exec(cmd, timeout=kw.pop("timeout", 30), **kw)


# --- processes -----------------------------------------------------------------------------------
def test_pid_namespace_hides_host_and_other_sandboxes(sb):
    with corral.Sandbox(image="host") as other:
        other.exec("sleep 1000 >/dev/null 2>&1 &", timeout=10)
        r = sh(sb, "ls /proc | grep -E '^[0-9]+$' | wc -l; cat /proc/1/comm; ps -e -o comm=")
        assert r.exit_code == 0, r.stderr
        lines = r.stdout.split()
        assert int(lines[0]) <= 6, r.stdout  # init, sh, ls, grep, wc ... nothing of the host's
        assert lines[1] == "corral-init"
        assert "sleep" not in r.stdout and "corrald" not in r.stdout and "python" not in r.stdout


def test_cannot_signal_or_trace_host_processes(sb):
    daemon_pid = corral_daemon_pid()
    r = sh(sb, f"kill -9 {daemon_pid}; echo rc=$?")
    assert "rc=0" not in r.stdout
    r = sh(sb, f"python3 /opt/probe.py ptrace 101 16 {daemon_pid} 0 0")  # PTRACE_ATTACH
    assert "OK" not in r.stdout
    assert os.path.exists(f"/proc/{daemon_pid}")


def corral_daemon_pid() -> int:
    return int(Path(STATE_DIR, "corrald.pid").read_text().split()[0])


# --- filesystem ----------------------------------------------------------------------------------
def attack_writes_outside(box) -> None:
    """Write over the image's files (the host's, for the host image): the writes land in the
    sandbox's own layer, never on the host."""
    marker = "corral-isolation-marker"
    r = sh(box, f"echo {marker} > /usr/bin/{marker} && echo x >> /etc/hosts && "
                f"rm -f /usr/bin/true.bak && cat /usr/bin/{marker}")
    assert r.exit_code == 0 and marker in r.stdout, r.stderr
    assert not os.path.exists(f"/usr/bin/{marker}")
    assert not Path("/etc/hosts").read_text().rstrip().endswith("\nx")


def test_writes_stay_inside(sb):
    attack_writes_outside(sb)


# Lists the private dirs (os.listdir: no tool's stat flags in the way), looks for secrets.
SECRETS_PROBE = r"""
import os, sys
for d in ("/root", "/home", "/var", "/run", "/srv", "/mnt", "/tmp", "/", "/work"):
    try:
        print(d, " ".join(sorted(os.listdir(d))))
    except OSError as e:
        print(d, "ERR", e.errno)
for f in ("/etc/shadow", "/etc/gshadow"):
    if os.path.exists(f):
        print("SECRET", f)
keys = [n for n in (os.listdir("/etc/ssh") if os.path.isdir("/etc/ssh") else [])
        if n.endswith("_key")]
print("keys", *keys)
for p in sys.argv[1:]:
    print("exists" if os.path.lexists(p) else "absent", p)
"""


def attack_host_secrets(box) -> None:
    """Look for the host's secrets, its users' dirs, the daemon's state and socket."""
    box.files.write("/opt/secrets_probe.py", SECRETS_PROBE)
    r = sh(box, f"python3 /opt/secrets_probe.py {STATE_DIR} {os.path.dirname(SOCKET)} "
                f"{SOCKET} /var/lib/corral")
    out = r.stdout
    assert r.exit_code == 0 and "SECRET" not in out, out + r.stderr
    assert "keys\n" in out, out
    for leaked in ("corrald", ".sock", "corral-test", ".cargo", ".pyenv", "main"):
        assert not any(leaked in line for line in out.splitlines()
                       if not line.startswith("absent")), (leaked, out)
    assert "exists" not in out, out


def test_host_secrets_and_private_dirs_not_visible(sb):
    attack_host_secrets(sb)


def test_cannot_reach_daemon_socket(sb):
    script = (
        "import socket,sys\n"
        "for p in sys.argv[1:]:\n"
        "  s=socket.socket(socket.AF_UNIX)\n"
        "  try: s.connect(p); print('CONNECTED', p)\n"
        "  except OSError as e: print('refused', p, e.errno)\n"
    )
    sb.files.write("/opt/unix_probe.py", script)
    r = sh(sb, f"python3 /opt/unix_probe.py {SOCKET} /run/corral/corrald.sock")
    assert "CONNECTED" not in r.stdout and r.stdout.count("refused") == 2, r.stdout + r.stderr


def test_sys_and_devices_minimal(sb):
    r = sh(sb, "ls /dev; ls -A /sys | wc -l; mknod /tmp/sda b 8 0; echo mknod=$?")
    devs = set(r.stdout.split())
    assert {"null", "zero", "full", "random", "urandom", "tty", "pts", "shm"} <= devs
    assert not devs & {"sda", "vda", "kvm", "mem", "kmsg", "nvme0"}
    assert "mknod=0" not in r.stdout


def test_masked_proc_dirs_are_empty_and_read_only(sb):
    """/proc/acpi (writable by uid 0 without a capability) is masked by one empty host
    directory, bound read-only into every sandbox: nothing can be written through it, and
    nothing one sandbox tries lands in the directory the others see."""
    if not os.path.isdir("/proc/acpi"):
        pytest.skip("no /proc/acpi on this kernel: nothing to mask")
    r = sh(sb, "ls -A /proc/acpi | wc -l; touch /proc/acpi/x; echo touch=$?; "
               "mkdir /proc/acpi/d; echo mkdir=$?; mount -o remount,rw /proc/acpi; "
               "echo remount=$?; chmod 777 /proc/acpi; echo chmod=$?")
    lines = r.stdout.split()
    assert lines[0] == "0", r.stdout
    for step in ("touch", "mkdir", "remount", "chmod"):
        assert f"{step}=0" not in lines, r.stdout
    mask = Path(STATE_DIR, "mask")
    assert mask.is_dir() and list(mask.iterdir()) == [] and mask.stat().st_mode & 0o777 == 0o555


def _scratch_has_quota() -> bool:
    sandboxes = os.path.join(STATE_DIR, "sandboxes")
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == sandboxes and " - btrfs " in line for line in f)


def test_dev_shm_is_shared_memory_of_bounded_size(sb):
    """/dev/shm is the sandbox's own (a directory of its disk layer, on its quota; without a
    quota a 64 MiB tmpfs): every user may create files there (sticky), no more than the
    bound, and never in another sandbox's."""
    with corral.Sandbox(image="host", disk_mb=32) as small:
        sb.exec("echo other > /dev/shm/mine", timeout=10)
        r = sh(small, "stat -c %a /dev/shm; ls -A /dev/shm; head -c 80M /dev/zero > "
                      "/dev/shm/big; echo big=$?; du -m /dev/shm/big | cut -f1; "
                      "rm -f /dev/shm/big")
        lines = r.stdout.split()
        assert lines[0] == "1777" and "mine" not in lines, r.stdout
        assert "big=0" not in lines and int(lines[-1]) <= 64, r.stdout
    sb.exec("rm -f /dev/shm/mine", timeout=10)


# Run as root in a sandbox: every way of changing the /dev all sandboxes share.
DEV_ATTACKS = {
    "create": "touch /dev/x",
    "mknod": "mknod /dev/sda b 8 0",
    "mknod_shm": "mknod /dev/shm/sda b 8 0",
    "mkfifo": "mkfifo /dev/fifo",
    "remove": "rm -f /dev/zero",
    "rename": "mv /dev/full /dev/full2",
    "chmod": "chmod 777 /dev/random",
    "chown": "chown 1000 /dev/urandom",
    "symlink": "ln -s /proc/1/root /dev/hostroot",
    "mkdir": "mkdir /dev/d",
    "remount_rw": "mount -o remount,rw /dev",
    "unmount_pts": "umount /dev/pts",
    "unmount_shm": "umount -l /dev/shm",
    "truncate_link": "rm -f /dev/ptmx",
    "xattr": "python3 -c \"import os; os.setxattr('/dev/null', 'user.x', b'1')\"",
    "utimes": "touch -d 2000-01-01 /dev/tty",
}


@pytest.mark.parametrize("name", sorted(DEV_ATTACKS))
def test_shared_dev_cannot_be_changed(sb, name):
    """/dev is one host directory bound read-only (nosuid, noexec) into every sandbox: no
    sandbox can add, remove or change a node the others see, nor uncover what lies below its
    own devpts and /dev/shm."""
    before = sorted((e.name, e.stat(follow_symlinks=False).st_mode,
                     e.stat(follow_symlinks=False).st_rdev, e.stat(follow_symlinks=False).st_uid)
                    for e in os.scandir(os.path.join(STATE_DIR, "dev")))
    r = sh(sb, f"{DEV_ATTACKS[name]}; echo rc=$?")
    assert "rc=0" not in r.stdout, (name, r.stdout, r.stderr)
    after = sorted((e.name, e.stat(follow_symlinks=False).st_mode,
                    e.stat(follow_symlinks=False).st_rdev, e.stat(follow_symlinks=False).st_uid)
                   for e in os.scandir(os.path.join(STATE_DIR, "dev")))
    assert after == before
    r = sh(sb, "ls -A /dev | sort | tr '\\n' ' '; head -c 4 /dev/zero | wc -c; "
               "echo x > /dev/null; echo null=$?; grep -c ' /dev/pts \\| /dev/shm ' "
               "/proc/self/mountinfo")
    assert r.stdout.split() == ["fd", "full", "null", "ptmx", "pts", "random", "shm",
                                "stderr", "stdin", "stdout", "tty", "urandom", "zero", "4",
                                "null=0", "2"], r.stdout


def test_shared_dev_is_read_only_nosuid_noexec(sb):
    r = sh(sb, "grep ' /dev ' /proc/self/mountinfo | cut -d' ' -f6")
    opts = set(r.stdout.strip().split(","))
    assert {"ro", "nosuid", "noexec"} <= opts and "nodev" not in opts, r.stdout
    r = sh(sb, "grep ' /dev/shm ' /proc/self/mountinfo | cut -d' ' -f6")
    opts = set(r.stdout.strip().split(","))
    assert {"rw", "nosuid", "nodev", "noexec"} <= opts, r.stdout


PTY_HOLDER = ("python3 -c \"import os, pty, time; m, s = pty.openpty(); "
              "open('/tmp/pty', 'w').write(os.ttyname(s)); time.sleep(120)\" "
              ">/dev/null 2>&1 &")


def test_dev_pts_is_per_sandbox(sb):
    """Each sandbox's ptys are in a devpts instance of its own: another sandbox's terminals
    are neither listed nor openable, whatever number they have."""
    with corral.Sandbox(image="host") as other:
        other.exec(PTY_HOLDER, timeout=10)
        assert wait_until(lambda: other.exec("cat /tmp/pty", timeout=10).stdout.strip(),
                          timeout=20)
        name = other.exec("cat /tmp/pty", timeout=10).stdout.strip()
        assert name.startswith("/dev/pts/"), name
        r = sh(sb, f"ls -A /dev/pts; cat {name} </dev/null; echo open=$?; "
                   "python3 -c 'import os, pty; m, s = pty.openpty(); print(os.ttyname(s))'")
        lines = r.stdout.split()
        assert lines[0] == "ptmx" and "open=0" not in lines, r.stdout
        assert lines[-1].startswith("/dev/pts/"), r.stdout + r.stderr
        r = other.exec("ls -A /dev/pts", timeout=10)
        assert name.rsplit("/", 1)[1] in r.stdout.split(), r.stdout


def test_each_sandbox_mounts_few_superblocks(sb):
    """Superblocks per sandbox: each one costs every memory cgroup on the host a shrinker
    slot for as long as the host runs (docs/daemon.md, "Recycled memory cgroups"): overlay
    root, overlay /usr (host image), devpts, proc; without a disk quota also a tmpfs on /tmp
    and one on /dev/shm. Masks and /dev are binds of host directories; superblocks the host
    already has are shared, not the sandbox's: the masks', /dev's and /sys's host directory,
    the daemon's one lxcfs, the host's cgroup hierarchies (mounted at /sys/fs/cgroup)."""
    r = sh(sb, "cut -d' ' -f3,5,9 /proc/self/mountinfo")
    devs = {line.split()[0]: line.split()[2] for line in r.stdout.splitlines()}
    dev_sb = next(line.split()[0] for line in r.stdout.splitlines() if line.split()[1] == "/dev")
    with open("/proc/self/mountinfo") as f:
        host = {line.split()[2] for line in f}
    assert dev_sb in host, r.stdout  # /dev: the host's superblock, not one of the sandbox's
    own = {d: t for d, t in devs.items() if d not in host}
    assert len(own) <= (4 if _scratch_has_quota() else 6), r.stdout


# --- privileges ----------------------------------------------------------------------------------
def test_privileges_dropped(sb):
    r = sh(sb, "grep -E '^(CapEff|CapBnd|NoNewPrivs|Seccomp):' /proc/self/status")
    fields = dict(line.split(":\t") for line in r.stdout.strip().splitlines())
    cap_eff = int(fields["CapEff"], 16)
    for cap in (21, 18, 16, 19, 27, 13, 12):  # SYS_ADMIN SYS_CHROOT SYS_MODULE PTRACE MKNOD ...
        assert not cap_eff & (1 << cap), f"capability {cap} still held"
    assert int(fields["CapBnd"], 16) & (1 << 21) == 0
    assert fields["NoNewPrivs"].strip() == "1"
    assert fields["Seccomp"].strip() == "2"


INIT_PROBE = r"""
import ctypes, errno, os, signal
libc = ctypes.CDLL(None, use_errno=True)
def sys(nr, *a):
    r = libc.syscall(nr, *[ctypes.c_long(x) for x in a])
    return "OK" if r >= 0 else errno.errorcode[ctypes.get_errno()]
for what in ("/proc/1/fd/3", "/proc/1/fd/4", "/proc/1/environ", "/proc/1/mem", "/proc/1/maps"):
    try:
        os.readlink(what) if "/fd/" in what else open(what, "rb").read(1)
        print(what, "OK")
    except OSError as e:
        print(what, errno.errorcode[e.errno])
pidfd = libc.syscall(434, 1, 0)                          # pidfd_open(1)
print("pidfd_open", "OK" if pidfd >= 0 else "denied")
for fd in (3, 4):                                         # the exec channel's two ends
    print("pidfd_getfd", fd, sys(438, pidfd, fd, 0))
buf = ctypes.create_string_buffer(64)
local = (ctypes.c_size_t * 2)(ctypes.addressof(buf), 64)
remote = (ctypes.c_size_t * 2)(0x401000, 64)            # the init's text (static, not PIE)
print("process_vm_readv", sys(310, 1, ctypes.addressof(local), 1, ctypes.addressof(remote), 1, 0))
print("ptrace", sys(101, 16, 1, 0, 0))                  # PTRACE_ATTACH
os.kill(1, 40); os.kill(1, signal.SIGIO)                 # the channel's wake-up signals
"""


def test_the_init_and_its_exec_channel_are_out_of_reach(sb):
    """The init starts commands from a socket on its fds 3 and 4 and holds the shell's
    capabilities: root in the sandbox (same uid) must not trace it, read its memory or fds, take
    the channel to forge requests, or disturb it with the channel's wake-up signals."""
    sb.files.write("/opt/init_probe.py", INIT_PROBE)
    r = sh(sb, "python3 /opt/init_probe.py")
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [x for x in lines if x.startswith("/proc/1/")] == [
        "/proc/1/fd/3 EACCES", "/proc/1/fd/4 EACCES", "/proc/1/environ EACCES",
        "/proc/1/mem EACCES", "/proc/1/maps EACCES"], r.stdout
    assert "pidfd_getfd 3 EPERM" in lines and "pidfd_getfd 4 EPERM" in lines, r.stdout
    assert "process_vm_readv EPERM" in lines, r.stdout
    assert "ptrace OK" not in lines, r.stdout
    after = sh(sb, "echo still; awk '/^PPid/{print $2}' /proc/$$/status; cat /proc/1/comm")
    assert after.stdout == "still\n1\ncorral-init\n"


def attack_mount_and_new_namespaces(box) -> None:
    r = sh(box, "mount -t tmpfs none /mnt; echo mount=$?; unshare -m true; echo unshare_m=$?; "
                "unshare -U true; echo unshare_u=$?; unshare -n true; echo unshare_n=$?")
    for probe in ("mount", "unshare_m", "unshare_u", "unshare_n"):
        assert f"{probe}=0" not in r.stdout, r.stdout


def test_mount_and_new_namespaces_denied(sb):
    attack_mount_and_new_namespaces(sb)


# The classic escape from a chroot-based root: chroot into a subdir, then walk up.
CHROOT_ESCAPE = """
import os
os.makedirs('/tmp/jail', exist_ok=True)
try:
    os.chroot('/tmp/jail')
    for _ in range(64): os.chdir('..')
    os.chroot('.')
    print('ESCAPED', os.listdir('/'))
except OSError as e:
    print('denied', e.errno)
"""


def attack_chroot_escape(box) -> None:
    box.files.write("/opt/escape.py", CHROOT_ESCAPE)
    r = sh(box, "python3 /opt/escape.py")
    assert "ESCAPED" not in r.stdout and "denied" in r.stdout, r.stdout + r.stderr


def test_chroot_escape_denied(sb):
    attack_chroot_escape(sb)


# Refused syscalls, by number (x86_64), with arguments that would do something if allowed.
DANGEROUS_SYSCALLS = [
    ("init_module", 175, [0, 0, 0]),
    ("finit_module", 313, [0, 0, 0]),
    ("delete_module", 176, [0, 0]),
    ("kexec_load", 246, [0, 0, 0, 0]),
    ("bpf", 321, [0, 0, 0]),
    ("keyctl", 250, [0, 0, 0, 0, 0]),
    ("add_key", 248, [0, 0, 0, 0, 0]),
    ("perf_event_open", 298, [0, 0, 0, 0, 0]),
    ("userfaultfd", 323, [0]),
    ("memfd_secret", 447, [0]),
    ("modify_ldt", 154, [1, 0, 0]),
    ("open_by_handle_at", 304, [0, 0, 0]),
    ("setns", 308, [0, 0]),
    ("unshare_user", 272, [0x10000000]),
    ("swapon", 167, [0, 0]),
    ("reboot", 169, [0xFEE1DEAD, 672274793, 0x4321FEDC, 0]),
    ("io_uring_setup", 425, [1, 0]),
    ("pivot_root", 155, [0, 0]),
    ("process_vm_readv", 310, [1, 0, 0, 0, 0, 0]),
    ("process_vm_writev", 311, [1, 0, 0, 0, 0, 0]),
    ("process_madvise", 440, [0, 0, 0, 0, 0]),
    ("pidfd_getfd", 438, [0, 0, 0]),
    ("kcmp", 312, [1, 1, 0, 0, 0]),
    ("statmount", 457, [0, 0, 0, 0]),
    ("listmount", 458, [0, 0, 0, 0]),
    ("open_tree_attr", 467, [-100, 0, 0, 0, 0]),
    # a mark on an inode sandboxes share (the daemon's /dev) would report others' opens
    ("fanotify_mark", 301, [0, 1, 0x20, -100, 0]),
    # pid 1, the sandbox's init: no queued signal of the sandbox's making, no rlimits
    ("rt_sigqueueinfo_init", 129, [1, 15, 0]),
    ("rt_tgsigqueueinfo_init", 297, [1, 1, 15, 0]),
    ("prlimit64_init", 302, [1, 0, 0, 0]),
    ("sched_setscheduler_init", 144, [1, 5, 0]),
    ("sched_setattr_init", 314, [1, 0, 0]),
    ("sched_setparam_init", 142, [1, 0]),
]


def attack_syscall(box, name: str, nr: int, args: list[int]) -> None:
    """One of DANGEROUS_SYSCALLS, by number (SYSCALL_PROBE at /opt/probe.py): refused."""
    r = sh(box, f"python3 /opt/probe.py {name} {nr} {' '.join(map(str, args))}")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.startswith(name) and "OK" not in r.stdout, r.stdout
    assert "EPERM" in r.stdout or "ENOSYS" in r.stdout, r.stdout


@pytest.mark.parametrize("name,nr,args", DANGEROUS_SYSCALLS)
def test_dangerous_syscalls_blocked(sb, name, nr, args):
    attack_syscall(sb, name, nr, args)


# madvise of the caller's own anonymous pages, by advice; each line "<name> <errno name|OK>".
# After MADV_DONTNEED the page reads back as zero (the advice took effect).
MADVISE_PROBE = r"""
import ctypes, errno, mmap
libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
size = 64 * mmap.PAGESIZE
buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
for name, advice in [("cold", 20), ("pageout", 21), ("dontneed", 4), ("free", 8),
                     ("willneed", 3), ("hugepage", 14)]:
    buf[:] = b"x" * size
    r = libc.madvise(addr, size, advice)
    e = ctypes.get_errno()
    print(name, "OK" if r == 0 else errno.errorcode.get(e, e))
    if name == "dontneed" and r == 0:
        print("dontneed_zeroed", buf[:mmap.PAGESIZE] == bytes(mmap.PAGESIZE))
"""


def attack_madvise_to_swap(box) -> None:
    """MADV_COLD and MADV_PAGEOUT on the sandbox's own pages (which would push them to swap
    whatever its swappiness, filling the v1 memory+swap page that makes its own OOM show:
    docs/trajectory.md, "Whose OOM") are refused with EINVAL; the other advice still works."""
    box.files.write("/tmp/madvise_probe.py", MADVISE_PROBE)
    r = sh(box, "python3 /tmp/madvise_probe.py")
    assert r.exit_code == 0, r.stderr
    check_madvise_probe(r.stdout)


def check_madvise_probe(out: str) -> None:
    """MADVISE_PROBE's output ``out``: COLD and PAGEOUT refused with EINVAL, the rest done."""
    got = dict(ln.split(" ", 1) for ln in out.splitlines())
    assert got["cold"] == "EINVAL" and got["pageout"] == "EINVAL", out
    for ok in ("dontneed", "free", "willneed"):
        assert got[ok] == "OK", (ok, out)
    assert got["dontneed_zeroed"] == "True", out


def test_madvise_cannot_push_own_pages_to_swap(sb):
    attack_madvise_to_swap(sb)


# --- network -------------------------------------------------------------------------------------
FAMILY_PROBE = r"""
import errno, socket
for name, fam, typ, proto in [("alg", 38, socket.SOCK_SEQPACKET, 0),
                              ("vsock", 40, socket.SOCK_STREAM, 0),
                              ("nl_generic", 16, socket.SOCK_RAW, 16),
                              ("nl_audit", 16, socket.SOCK_RAW, 9),
                              ("nl_uevent", 16, socket.SOCK_RAW, 15),
                              ("nl_netfilter", 16, socket.SOCK_RAW, 12),
                              ("nl_xfrm", 16, socket.SOCK_RAW, 6),
                              ("nl_route", 16, socket.SOCK_RAW, 0),
                              ("nl_sock_diag", 16, socket.SOCK_RAW, 4),
                              ("inet", 2, socket.SOCK_STREAM, 0)]:
    try:
        socket.socket(fam, typ, proto).close()
        print(name, "OK")
    except OSError as e:
        print(name, errno.errorcode.get(e.errno, e.errno))
print("ifaces", [n for _, n in socket.if_nameindex()])
"""


def attack_socket_families(box, then: str = "") -> tuple[dict[str, str], str]:
    """FAMILY_PROBE (then the shell commands ``then``): the refused families and netlink
    protocols are refused; (probe results by name, the whole output)."""
    box.files.write("/opt/family_probe.py", FAMILY_PROBE)
    r = sh(box, "python3 /opt/family_probe.py; " + then)
    got = dict(ln.split(" ", 1) for ln in r.stdout.splitlines() if " " in ln)
    assert got["alg"] == "EAFNOSUPPORT" and got["vsock"] == "EAFNOSUPPORT", r.stdout
    for p in ("nl_generic", "nl_audit", "nl_uevent", "nl_netfilter", "nl_xfrm"):
        assert got[p] == "EPROTONOSUPPORT", (p, r.stdout)
    assert got["nl_route"] == "OK" and got["inet"] == "OK", r.stdout
    assert "'lo'" in got["ifaces"], r.stdout
    return got, r.stdout


def test_socket_families_and_netlink_protocols(sb):
    """AF_ALG and AF_VSOCK are refused as if absent; netlink only for ROUTE (ip, getifaddrs)
    and SOCK_DIAG (ss); ordinary sockets and the tools that use those two keep working."""
    got, out = attack_socket_families(sb, "ip -br link; ss -ltn >/dev/null; echo ss=$?")
    assert got["nl_sock_diag"] == "OK", out
    assert "lo " in out and "ss=0" in out, out


def attack_host_loopback(box) -> str:
    """Connect from the sandbox to a server on the host's loopback (must fail), then use the
    sandbox's own loopback (must work); the probe's output."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    port = srv.getsockname()[1]
    accepted: list[object] = []

    def accept_loop():
        srv.settimeout(10)
        try:
            accepted.append(srv.accept())
        except OSError:
            pass

    t = threading.Thread(target=accept_loop, daemon=True)
    t.start()
    probe = (
        "import socket,sys\n"
        "s=socket.socket(); s.settimeout(3)\n"
        "try: s.connect(('127.0.0.1', int(sys.argv[1]))); print('CONNECTED')\n"
        "except OSError as e: print('blocked', e)\n"
        "srv=socket.socket(); srv.bind(('127.0.0.1',0)); srv.listen(1)\n"
        "c=socket.create_connection(srv.getsockname()); print('own-loopback-ok')\n"
        "print(open('/proc/net/dev').read())\n"
    )
    box.files.write("/opt/net_probe.py", probe)
    r = sh(box, f"python3 /opt/net_probe.py {port}")
    srv.close()
    t.join(2)
    assert "CONNECTED" not in r.stdout and not accepted, r.stdout
    assert "own-loopback-ok" in r.stdout, r.stdout + r.stderr
    return r.stdout


def test_host_loopback_unreachable_own_loopback_works(sb):
    out = attack_host_loopback(sb)
    ifaces = [ln.split(":")[0].strip() for ln in out.splitlines() if ":" in ln]
    assert ifaces == ["lo"], ifaces


def test_hostname_is_private(sb):
    r = sh(sb, "hostname; hostname evil; echo rc=$?")
    assert r.stdout.split()[0] != socket.gethostname()
    assert socket.gethostname() != "evil"


# --- file API ------------------------------------------------------------------------------------
def attack_file_api_through_links(sb) -> None:
    """Links the sandbox made, followed by the file API: they resolve inside its root."""
    host_target = Path(STATE_DIR, "escape-target")
    host_target.mkdir(exist_ok=True)
    r = sh(sb, f"ln -sfn / /tmp/rootlink; ln -sfn {host_target} /tmp/hostlink; "
               "ln -sfn ../../../../../../etc /tmp/dotdot; echo ok")
    assert "ok" in r.stdout
    # Reading through links resolves inside the sandbox root: the sandbox's /etc has no shadow.
    for p in ("/tmp/rootlink/etc/shadow", "/tmp/dotdot/shadow", "/../../../../etc/shadow"):
        with pytest.raises(corral.CorralError) as ei:
            sb.files.read(p)
        assert ei.value.code in ("file_not_found", "invalid_path"), (p, ei.value)
    # Writing through a link to a host path creates nothing on the host.
    try:
        sb.files.write("/tmp/hostlink/pwned", "x")
    except corral.CorralError:
        pass
    assert not (host_target / "pwned").exists()
    sb.files.write("/tmp/rootlink/tmp/inside.txt", "inside")
    assert sb.files.read("/tmp/inside.txt") == "inside"
    assert not Path("/tmp/inside.txt").exists() or Path("/tmp/inside.txt").read_text() != "inside"
    host_target.rmdir()


def test_file_api_symlinks_and_dotdot_stay_inside(sb):
    attack_file_api_through_links(sb)


# --- network "disabled": unix sockets only, one shared namespace ---------------------------------
# Run inside a sandbox: try every kind of socket; print "family OK" or "family ERRNAME".
SOCKET_PROBE = r"""
import errno, socket
tries = {
    "inet": (socket.AF_INET, socket.SOCK_STREAM, 0),
    "inet-dgram": (socket.AF_INET, socket.SOCK_DGRAM, 0),
    "inet6": (socket.AF_INET6, socket.SOCK_STREAM, 0),
    "netlink-route": (socket.AF_NETLINK, socket.SOCK_RAW, 0),
    "netlink-diag": (socket.AF_NETLINK, socket.SOCK_DGRAM, 4),  # NETLINK_SOCK_DIAG
    "packet": (socket.AF_PACKET, socket.SOCK_RAW, 0),
    "vsock": (40, socket.SOCK_STREAM, 0),
    "alg": (38, socket.SOCK_SEQPACKET, 0),
    "unix": (socket.AF_UNIX, socket.SOCK_STREAM, 0),
    "unix-dgram": (socket.AF_UNIX, socket.SOCK_DGRAM, 0),
}
for name, (fam, typ, proto) in tries.items():
    try:
        socket.socket(fam, typ, proto).close(); print(name, "OK")
    except OSError as e:
        print(name, errno.errorcode.get(e.errno, e.errno))
for name, fam in (("pair-unix", socket.AF_UNIX), ("pair-inet", socket.AF_INET)):
    try:
        a, b = socket.socketpair(fam, socket.SOCK_STREAM); print(name, "OK")
    except OSError as e:
        print(name, errno.errorcode.get(e.errno, e.errno))
"""

# Bind an abstract socket, then try to connect to another one: prints the outcome.
ABSTRACT_PROBE = r"""
import errno, socket, sys, time
mine, theirs = sys.argv[1], sys.argv[2]
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); srv.bind("\0" + mine); srv.listen(8)
c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); c.connect("\0" + mine)
print("self OK")
for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
    c = socket.socket(socket.AF_UNIX, kind)
    try:
        if kind == socket.SOCK_STREAM:
            c.connect("\0" + theirs)
        else:
            c.sendto(b"x", "\0" + theirs)
        print("other", kind, "CONNECTED")
    except OSError as e:
        print("other", kind, errno.errorcode.get(e.errno, e.errno))
"""


def netns_of(box) -> str:
    return box.exec("readlink /proc/self/ns/net", timeout=10).stdout.strip()


@pytest.fixture(scope="module")
def dis():
    with corral.Sandbox(image="host", timeout=600, network="disabled") as box:
        box.files.write("/opt/socket_probe.py", SOCKET_PROBE)
        box.files.write("/opt/abstract_probe.py", ABSTRACT_PROBE)
        yield box


def test_disabled_only_unix_sockets(dis, sb):
    r = sh(dis, "python3 /opt/socket_probe.py")
    got = dict(ln.split() for ln in r.stdout.splitlines())
    assert got.pop("unix") == got.pop("unix-dgram") == got.pop("pair-unix") == "OK", r.stdout
    assert got and all(v in ("EAFNOSUPPORT", "EPERM") for v in got.values()), r.stdout
    # the same probe under network "none" makes the IP sockets (the walls differ by mode)
    sb.files.write("/opt/socket_probe.py", SOCKET_PROBE)
    r = sh(sb, "python3 /opt/socket_probe.py")
    assert "inet OK" in r.stdout and "inet6 OK" in r.stdout, r.stdout


def test_disabled_no_interfaces_visible(dis):
    r = sh(dis, "cat /proc/net/dev; cat /proc/net/tcp /proc/net/udp /proc/net/tcp6")
    assert r.exit_code == 0, r.stderr
    # no interface but loopback; no IP socket anywhere in the shared namespace
    assert [ln.split(":")[0].strip() for ln in r.stdout.splitlines()
            if ":" in ln and "|" not in ln and "local_address" not in ln] == ["lo"], r.stdout


def test_disabled_sandboxes_share_one_namespace_none_never_gets_it(dis, sb):
    with corral.Sandbox(image="host", network="disabled") as other:
        shared = netns_of(dis)
        assert shared == netns_of(other) and shared.startswith("net:[")
    assert shared != netns_of(sb)
    assert shared != os.readlink("/proc/self/ns/net")
    # destroyed "disabled" sandboxes never hand the shared namespace to the netns pool
    for _ in range(3):
        with corral.Sandbox(image="host", network="disabled"):
            pass
    for _ in range(4):
        with corral.Sandbox(image="host") as box:
            assert netns_of(box) != shared


def test_disabled_abstract_sockets_do_not_cross_sandboxes(dis):
    with corral.Sandbox(image="host", network="disabled") as other:
        other.files.write("/opt/abstract_probe.py", ABSTRACT_PROBE)
        # the other sandbox listens on @victim (stream) and @victim-dgram, in the background
        other.exec("python3 -c \"import socket,time\n"
                   "s=socket.socket(socket.AF_UNIX); s.bind('\\0victim'); s.listen(8)\n"
                   "d=socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); d.bind('\\0victim')\n"
                   "open('/tmp/ready','w').close(); time.sleep(60)\" >/dev/null 2>&1 &",
                   timeout=10)
        other.exec("for i in $(seq 100); do [ -e /tmp/ready ] && break; sleep 0.1; done",
                   timeout=20)
        r = sh(dis, "python3 /opt/abstract_probe.py attacker victim")
        assert "self OK" in r.stdout, r.stdout + r.stderr
        assert "CONNECTED" not in r.stdout, r.stdout
        assert r.stdout.count("EPERM") == 2, r.stdout  # Landlock refuses, not "no such name"
        # the other way round too
        r = sh(other, "python3 /opt/abstract_probe.py victim2 attacker-gone")
        assert "CONNECTED" not in r.stdout, r.stdout


def test_disabled_abstract_socket_of_a_host_process_in_the_namespace(dis):
    """A process outside every sandbox, bound in the shared namespace (e.g. a debugging tool
    an operator ran there): the sandboxes still cannot reach it."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    ready = threading.Event()
    out: list[object] = []

    def host_side() -> None:
        fd = os.open(f"/proc/{dis.info().init_pid}/ns/net", os.O_RDONLY)
        try:
            assert libc.setns(fd, 0x40000000) == 0, ctypes.get_errno()  # this thread only
        finally:
            os.close(fd)
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind("\0corral-host-side")
        srv.listen(1)
        srv.settimeout(8)
        ready.set()
        try:
            out.append(srv.accept())
        except OSError:
            pass
        srv.close()

    t = threading.Thread(target=host_side, daemon=True)
    t.start()
    assert ready.wait(10)
    r = sh(dis, "python3 /opt/abstract_probe.py x corral-host-side")
    t.join(15)
    assert "CONNECTED" not in r.stdout and not out, r.stdout


def test_disabled_walls_survive_fork_and_restore():
    """Forked children and a sandbox restarted by restore keep network "disabled"."""
    probe = ("python3 -c \"import socket\ntry: socket.socket(); print('inet')\n"
             "except OSError: print('refused')\"; readlink /proc/self/ns/net")
    with corral.Sandbox(image="host", network="disabled") as box:
        shared = box.exec(probe, timeout=30).stdout.split()
        assert shared[0] == "refused", shared
        snap = box.snapshot()
        try:
            box.exec("touch /root/after", timeout=10)
            assert box.restore(snap).network == "disabled"
            assert box.exec(probe, timeout=30).stdout.split() == shared
            kids = box.fork(2)
            try:
                for k in kids:
                    assert k.info().network == "disabled"
                    assert k.exec(probe, timeout=30).stdout.split() == shared
            finally:
                corral.Sandbox.kill_many(kids)
        finally:
            snap.delete()


def test_disabled_unix_sockets_work_inside_a_sandbox(dis):
    # pathname sockets between two commands of the same sandbox; abstract ones within one
    # command (each exec is its own Landlock domain, docs/isolation.md)
    dis.exec("rm -f /tmp/s.sock; python3 -c \"import socket\n"
             "s=socket.socket(socket.AF_UNIX); s.bind('/tmp/s.sock'); s.listen(1)\n"
             "c,_=s.accept(); c.sendall(b'pong')\" >/dev/null 2>&1 &", timeout=10)
    r = sh(dis, "for i in $(seq 100); do [ -S /tmp/s.sock ] && break; sleep 0.1; done; "
                "python3 -c \"import socket\n"
                "c=socket.socket(socket.AF_UNIX); c.connect('/tmp/s.sock'); print(c.recv(4))\"")
    assert "b'pong'" in r.stdout, r.stdout + r.stderr
    r = sh(dis, "python3 /opt/abstract_probe.py same-exec nobody")
    assert "self OK" in r.stdout, r.stdout + r.stderr


def test_disabled_commands_see_and_signal_each_other(dis):
    """The Landlock domain per command confines sockets and ptrace-mode /proc reads, not the
    usual process tools: ps, pgrep and kill across commands work (docs/isolation.md)."""
    dis.exec("sleep 300 >/dev/null 2>&1 &", timeout=10)
    r = sh(dis, "p=$(pgrep -x sleep | head -1); ps -o comm= -p $p; "
                "cat /proc/$p/environ >/dev/null 2>&1; echo environ=$?; kill $p; echo kill=$?")
    assert "sleep" in r.stdout and "kill=0" in r.stdout, r.stdout + r.stderr
    assert "environ=1" in r.stdout, r.stdout  # another command's domain: no ptrace-mode read


def _listen_abstract(box: corral.Sandbox, name: str) -> None:
    """A process in ``box`` listening on the abstract unix socket ``@name`` (for 60 s)."""
    box.exec("python3 -c \"import socket,time\n"
             f"s=socket.socket(socket.AF_UNIX); s.bind('\\0{name}'); s.listen(1)\n"
             "open('/tmp/ready','w').close(); time.sleep(60)\" >/dev/null 2>&1 &", timeout=10)
    box.exec("for i in $(seq 100); do [ -e /tmp/ready ] && break; sleep 0.1; done", timeout=20)


@pytest.mark.xfail(strict=True, reason="residual, documented in docs/isolation.md: abstract "
                   "names are one namespace in the shared netns (first come, first served)")
def test_disabled_abstract_names_are_private(dis):
    with corral.Sandbox(image="host", network="disabled") as other:
        _listen_abstract(other, "squatted-4711")
        r = sh(dis, "python3 -c \"import socket\n"
                    "s=socket.socket(socket.AF_UNIX); s.bind('\\0squatted-4711'); print('bound')\"")
        assert "bound" in r.stdout, r.stdout + r.stderr


@pytest.mark.xfail(strict=True, reason="residual leak, documented in docs/isolation.md: "
                   "/proc/net/unix lists every unix socket of the shared namespace")
def test_disabled_proc_net_unix_hides_other_sandboxes(dis):
    with corral.Sandbox(image="host", network="disabled") as other:
        _listen_abstract(other, "secret-name-4711")
        r = sh(dis, "cat /proc/net/unix /proc/self/net/unix")
        assert "secret-name-4711" not in r.stdout


# --- resources -----------------------------------------------------------------------------------
def test_memory_limit_contains_a_hog():
    with corral.Sandbox(image="host", memory_mb=64) as box:
        r = box.exec("python3 -c \"b = bytearray(512 * 1024 * 1024); print('survived')\"",
                     timeout=60)
        assert "survived" not in r.stdout
        assert r.exit_code != 0
        assert box.exec("echo alive", timeout=10).stdout.strip() == "alive"


def test_pids_limit_contains_a_fork_bomb():
    with corral.Sandbox(image="host", pids=32) as box:
        spawn = (
            "import subprocess\n"
            "ps=[]\n"
            "try:\n"
            "    for i in range(200): ps.append(subprocess.Popen(['sleep','30']))\n"
            "except OSError as e: print('limited at', len(ps))\n"
            "for p in ps: p.kill()\n"
        )
        box.files.write("/tmp/spawn.py", spawn)
        r = box.exec("python3 /tmp/spawn.py", timeout=60)
        assert "limited at" in r.stdout, r.stdout + r.stderr
        assert int(r.stdout.split()[-1]) < 32
        box.exec("(bomb() { bomb | bomb & }; bomb) >/dev/null 2>&1; sleep 2", timeout=20)
        # The host is unaffected and the sandbox can be killed cleanly (the fixture checks
        # that no process or cgroup is left).
        assert os.path.exists("/proc/self")


# Makes inotify instances until refused (or ``want``), says how many, and holds them.
_INOTIFY_HOG = """
import ctypes, sys, time
libc = ctypes.CDLL(None, use_errno=True)
fds = []
while len(fds) < int(sys.argv[1]):
    fd = libc.inotify_init1(0)
    if fd < 0:
        break
    fds.append(fd)
print(len(fds), flush=True)
time.sleep(600)
"""


def test_per_user_kernel_counters_are_not_one_sandboxs_to_take():
    """Every container sandbox's processes are uid 0 on the host, and inotify instances are
    counted per user (128 by default): one sandbox holding them left no other sandbox an
    inotify instance. The daemon lifts the per-user counts (each instance is kernel memory
    charged to its sandbox's memory cgroup, the bound that holds): a sandbox takes 400 and
    its neighbour still gets its own."""
    with corral.Sandbox(image="host") as hog, corral.Sandbox(image="host") as other:
        hog.files.write("/tmp/hog.py", _INOTIFY_HOG)
        p = hog.exec("ulimit -n 4096; exec python3 /tmp/hog.py 400", background=True)
        assert next(iter(p.stream()))[1] == "400\n"
        other.files.write("/tmp/hog.py", _INOTIFY_HOG)
        r = other.exec("timeout 5 python3 /tmp/hog.py 1", timeout=30)
        assert r.stdout == "1\n", r
        p.kill()


# Takes as much of one per-user kernel count as its limits let it (``what`` ``n``), says how
# much it got, and holds it; with ``n`` 1, takes one and says so (the neighbour's probe).
_PER_USER_HOG = r"""
import ctypes, fcntl, os, platform, signal, sys, time
libc = ctypes.CDLL(None, use_errno=True)
rt = ctypes.CDLL("librt.so.1", use_errno=True)
what, n = sys.argv[1], int(sys.argv[2])
held = []


class MqAttr(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_long), ("maxmsg", ctypes.c_long),
                ("msgsize", ctypes.c_long), ("cur", ctypes.c_long), ("pad", ctypes.c_long * 4)]


def one(i):
    if what == "fanotify":  # FAN_CLASS_NOTIF | FAN_REPORT_FID: no capability needed
        return libc.fanotify_init(0x200, 0) >= 0
    if what == "mqueue":  # 10 messages of 8 KiB: ~80 KiB of the user's RLIMIT_MSGQUEUE sum
        at = MqAttr(0, 10, 8192, 0)
        name = b"/hog%d-%d" % (os.getpid(), i)
        return rt.mq_open(name, os.O_CREAT | os.O_RDWR, 0o600, ctypes.byref(at)) >= 0
    if what == "pipe":  # 1 MiB of buffer pages counted against the user's pipe pages
        r, w = os.pipe()
        held.append((r, w))
        try:
            fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 1 << 20)
        except OSError:
            return False
        return fcntl.fcntl(w, fcntl.F_GETPIPE_SZ) == 1 << 20
    if what == "shmlock":  # 1 MiB SHM_LOCKed: the user's locked_shm against RLIMIT_MEMLOCK
        libc.shmget.restype = ctypes.c_int
        sid = libc.shmget(0, 1 << 20, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
        return sid >= 0 and libc.shmctl(sid, 11, None) == 0  # SHM_LOCK
    if what == "aio":  # io_setup of 4,096 events: one host-wide count (fs.aio-nr)
        ctx = ctypes.c_ulong(0)
        nr = {"x86_64": 206, "aarch64": 0}[platform.machine()]  # io_setup
        return libc.syscall(nr, 4096, ctypes.byref(ctx)) == 0
    if what == "sigqueue":  # queued real-time signals: the user's RLIMIT_SIGPENDING sum
        return signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGRTMIN]) is not None and \
            libc.sigqueue(os.getpid(), int(signal.SIGRTMIN), ctypes.c_void_p(0)) == 0
    raise SystemExit(what)


got = 0
while got < n and one(got):
    got += 1
print(got, flush=True)
if n > 1:
    time.sleep(600)
"""

# what, how many the hog takes: past each count's default bound (fanotify 128 groups; ~10
# queues in 800 KiB; 16,384 pipe pages; 8 MiB locked; ~96,000 signals here; 65,536 AIO
# events on the whole host)
_PER_USER = [("fanotify", 200), ("mqueue", 40), ("pipe", 80), ("shmlock", 16),
             ("sigqueue", 120_000), ("aio", 32)]
# The sums checked against the caller's rlimit, by its line in /proc/<pid>/limits
_BY_RLIMIT = {"mqueue": ("Max msgqueue size", "msgqueue"),
              "shmlock": ("Max locked memory", "memlock"),
              "sigqueue": ("Max pending signals", "sigpending")}


def _has_cap(bit: int) -> bool:
    """Whether this process (root, like the daemon it started) has capability ``bit``."""
    with open("/proc/self/status") as f:
        eff = next(ln for ln in f if ln.startswith("CapEff:")).split()[1]
    return bool(int(eff, 16) >> bit & 1)


@pytest.mark.parametrize("what,n", _PER_USER, ids=[w for w, _ in _PER_USER])
def test_per_user_kernel_sums_are_not_one_sandboxs_to_take(what: str, n: int):
    """Every container sandbox is uid 0 on the host, and the kernel keeps some counts as one
    sum per user, checked against a host-wide sysctl or the caller's own rlimit (AIO events:
    one sum for the whole host): at the host's defaults one sandbox holding fanotify groups,
    POSIX message queues, pipe buffer pages, SHM_LOCKed memory, queued real-time signals or
    AIO contexts left its neighbour none (or, for pipes, 8 KiB ones). The daemon lifts the
    sysctls and the sandboxes' rlimits; what each count holds is charged to the sandbox's
    memory cgroup, the bound that holds."""
    with corral.Sandbox(image="host") as hog, corral.Sandbox(image="host") as other:
        for sb in (hog, other):
            sb.files.write("/tmp/hog.py", _PER_USER_HOG)
        if what in _BY_RLIMIT:
            text, name = _BY_RLIMIT[what]
            line = other.exec(f"grep '{text}' /proc/self/limits").stdout
            shared = admin.status().shared_rlimits
            assert ("unlimited" not in line) == (name in shared), (line, shared)
            if name in shared:
                # a daemon without CAP_SYS_RESOURCE cannot give more than its own limits,
                # and says so (corral status)
                assert not _has_cap(24), line  # CAP_SYS_RESOURCE
                pytest.skip(f"the daemon cannot lift the rlimit here: {line.strip()}")
        p = hog.exec(f"ulimit -n 4096; exec python3 /tmp/hog.py {what} {n}", background=True)
        assert next(iter(p.stream()))[1] == f"{n}\n"
        r = other.exec(f"timeout 20 python3 /tmp/hog.py {what} 1", timeout=60)
        assert r.stdout == "1\n", r
        p.kill()


# Fills the send and receive buffers of ``n`` TCP connections (or the receive buffers of
# ``n`` UDP sockets) on the sandbox's loopback, reading nothing; prints the bytes its sockets
# then hold (the queues of /proc/net/tcp and udp: only its own network namespace's).
_SOCKET_HOG = r"""
import resource, socket, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (4096, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
kind, n = sys.argv[1], int(sys.argv[2])
keep = []
if kind == "tcp":
    srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(n)
    for _ in range(n):
        c = socket.create_connection(srv.getsockname()); a, _ = srv.accept()
        c.setblocking(False)
        try:
            while c.send(b"x" * 65536):
                pass
        except OSError:
            pass
        keep += [c, a]
else:
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); tx.setblocking(False)
    for _ in range(n):
        r = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); r.bind(("127.0.0.1", 0))
        r.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 30)
        keep.append(r)
        for _ in range(200):
            try:
                tx.sendto(b"x" * 60000, r.getsockname())
            except OSError:
                break
held = 0
for line in open("/proc/net/" + kind).read().splitlines()[1:]:
    tx_q, rx_q = line.split()[4].split(":")
    held += int(tx_q, 16) + int(rx_q, 16)
print(held)
"""


@pytest.mark.parametrize("kind", ["tcp", "udp"])
def test_socket_buffers_are_charged_to_the_sandbox(kind: str):
    """A sandbox's socket buffers are its memory: on cgroup v1 they were charged nowhere
    (a sandbox of 256 MiB held 186 MiB of TCP and 398 MiB of UDP buffers while its memory
    cgroup showed 6 MiB, up to the host-wide tcp_mem and udp_mem: 2.2 and 4.4 GiB here). On
    v1 each sandbox's memory cgroup gets a socket limit (SOCKET_MEMORY_SHARE of its memory,
    at least 16 MiB); on v2 they count inside memory.max."""
    from corral.daemon.cgroups.common import socket_memory

    mb = 64
    with corral.Sandbox(image="host", memory_mb=mb) as sb:
        sb.files.write("/tmp/sock.py", _SOCKET_HOG)
        r = sb.exec(f"python3 /tmp/sock.py {kind} 50", timeout=120)
        if r.oom_killed:  # v2: the buffers filled memory.max, and the OOM killer chose it
            assert not os.path.exists("/sys/fs/cgroup/memory"), r
            return
        assert r.exit_code == 0, r
        held = int(r.stdout)
        bound = socket_memory(mb << 20) if os.path.isdir("/sys/fs/cgroup/memory") else mb << 20
        # the kernel lets each socket a page or two past its limit (a minimum buffer, what
        # was sent ahead); without the limit, 50 connections held ~186 MiB
        assert 0 < held <= 1.5 * bound, (held, bound)


_HELPER = """#!/bin/sh
echo "$1" >> {log}
cat > /dev/null
"""


def test_a_crash_in_a_sandbox_never_runs_the_hosts_core_helper(tmp_path):
    """Where kernel.core_pattern is a pipe (apport, systemd-coredump), the kernel runs that
    helper as root on the host for each crash, and RLIMIT_CORE 0 does not stop it (only the
    kernel's own guard, RLIMIT_CORE 1, does): a segfault in a sandbox ran the host's helper,
    outside every sandbox cgroup. Commands get RLIMIT_CORE 1: the container substrate, a
    process substrate session and run_code, each crashing under a pipe pattern of the test's
    own, leave the helper unrun; a host process crashing the same way runs it (the control)."""
    log = tmp_path / "cores.log"
    helper = tmp_path / "helper.sh"
    helper.write_text(_HELPER.format(log=log))
    helper.chmod(0o755)
    crash = "import ctypes; ctypes.string_at(0)"
    with open("/proc/sys/kernel/core_pattern") as f:
        before = f.read()
    try:
        with open("/proc/sys/kernel/core_pattern", "w") as f:
            f.write(f"|{helper} %e")
        with corral.Sandbox(image="host") as sb, corral.Sandbox(substrate="process") as ps:
            for box in (sb, ps):
                r = box.exec(["python3", "-c", crash])
                assert r.exit_code != 0 and r.signal == 11, r
            r = corral.run_code(crash)
            assert r.status != "ok", r
        # the control: a host process of the same program, RLIMIT_CORE 0, runs the helper
        subprocess.run([sys.executable, "-c", "import resource; resource.setrlimit("
                        "resource.RLIMIT_CORE, (0, 0)); " + crash], check=False)
        assert wait_until(log.exists, 10)
    finally:
        with open("/proc/sys/kernel/core_pattern", "w") as f:
            f.write(before)
    assert log.read_text().split() == [os.path.basename(sys.executable)[:15]], log.read_text()


_PTY_HOG = r"""
import os, resource, sys, time
resource.setrlimit(resource.RLIMIT_NOFILE, (4096, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
fds = []
try:
    while len(fds) < int(sys.argv[1]):
        m, s = os.openpty()
        os.close(s)
        fds.append(m)
except OSError as e:
    print(e.strerror, flush=True)
print(len(fds), flush=True)
if len(sys.argv) > 2:
    time.sleep(600)
"""


def test_one_sandbox_cannot_take_every_pty():
    """Every sandbox's devpts draws on one host-wide pool (kernel.pty.max less the host's
    reserve: 3,071 at the defaults): one sandbox opening ptys until refused took them all,
    and its neighbour's openpty failed with ENOSPC. A sandbox's devpts holds at most 256, and
    the daemon raises the pool to the kernel's ceiling."""
    with corral.Sandbox(image="host") as hog, corral.Sandbox(image="host") as other:
        for sb in (hog, other):
            sb.files.write("/tmp/pty.py", _PTY_HOG)
        p = hog.exec("exec python3 /tmp/pty.py 4000 hold", background=True)
        out = ""
        for _, data in p.stream():  # until it says how many it got (it then holds them)
            out += data
            if out.count("\n") == 2:
                break
        assert out.split() == ["No", "space", "left", "on", "device", "256"], out
        r = other.exec("python3 /tmp/pty.py 1", timeout=60)
        assert r.stdout == "1\n", r
        p.kill()


# --- recycled kernel objects: nothing of a previous sandbox is visible to the next one ---------
def _daemon_metrics() -> dict[str, float]:
    import re

    import httpx

    t = httpx.HTTPTransport(uds=SOCKET)
    with httpx.Client(transport=t, base_url="http://corral", timeout=10) as c:
        text = c.get("/metrics").text
    return {m[1]: float(m[2]) for m in re.finditer(r"^(corral_\w+) ([0-9.e+-]+)$", text, re.M)}


# Traffic on the sandbox's loopback that a later tenant of the same network namespace could
# see: lo's byte counters, the TCP MIB counters, and a socket left in TIME_WAIT (the side
# that closes first keeps it for 60 s after its process is gone).
NET_TRACE = r"""
import socket
srv = socket.socket(); srv.bind(("127.0.0.1", 47123)); srv.listen(4)
for _ in range(3):
    c = socket.create_connection(("127.0.0.1", 47123)); a, _ = srv.accept()
    for _ in range(64):  # 4 MiB in 64 KiB steps (a bigger send would wait for the reader)
        c.sendall(b"x" * 65536); got = 0
        while got < 65536:
            got += len(a.recv(65536))
    c.close(); a.close()
print("traced")
"""


# Everything a network namespace shows of its past, as JSON: counters verbatim, socket tables
# and memberships as entry counts (their lines carry per-socket inodes).
NET_VIEW = r"""
import json
def read(p):
    try:
        return open(p).read()
    except OSError:
        return None
view = {f: read("/proc/net/" + f) for f in ("dev", "snmp", "snmp6", "netstat")}
for f in ("tcp", "tcp6", "udp", "udp6", "udplite", "udplite6", "raw", "raw6", "icmp", "icmp6",
          "unix", "packet", "netlink", "igmp", "igmp6", "ip6_flowlabel"):
    t = read("/proc/net/" + f)
    view[f] = None if t is None else t.count("\n")
print(json.dumps(view, sort_keys=True))
"""

# A tenant that leaves every kind of trace a namespace keeps without CAP_NET_ADMIN: TCP
# traffic and TIME_WAIT (NET_TRACE), UDP to itself, a connect with no route (a MIB counter),
# a ping socket, an abstract unix socket, a lingering IPv6 flow label and a listener left to
# the kill.
NET_DIRTY = NET_TRACE + r"""
import os, socket, time
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.sendto(b"x" * 100, ("127.0.0.1", 9))
try:
    socket.create_connection(("192.0.2.1", 80), timeout=1)
except OSError:
    pass
try:
    p = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP)
    p.sendto(b"\x08\x00\x00\x00\x00\x01\x00\x01", ("127.0.0.1", 0))
except OSError:
    pass
un = socket.socket(socket.AF_UNIX); un.bind("\0corral-trace"); un.listen(1)
exec(open("/opt/flowlabel.py").read())
if os.fork() == 0:
    l = socket.socket(); l.bind(("127.0.0.1", 47999)); l.listen(1); time.sleep(3600)
print("dirty")
"""


# Its only trace: an IPv6 flow label shared with any process, lingering 150 s after its
# socket (no packet sent, no counter moved).
NET_FLOWLABEL = r"""
import socket
f6 = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
f6.setsockopt(socket.IPPROTO_IPV6, 32, socket.inet_pton(socket.AF_INET6, "::1")  # FLOWLABEL_MGR
              + (0x12345).to_bytes(4, "big") + bytes([0, 255]) + (1).to_bytes(2, "little")
              + (0).to_bytes(2, "little") + (150).to_bytes(2, "little") + bytes(4))
assert open("/proc/net/ip6_flowlabel").read().count("\n") == 2
print("labelled")
"""


def _fresh_net_view(tmp: Path) -> dict:  # type: ignore[type-arg]
    """NET_VIEW in a namespace made right now on the host, loopback up."""
    script = tmp / "view.py"
    script.write_text(NET_VIEW)
    r = subprocess.run(["unshare", "-n", "sh", "-c",
                        f'ip link set lo up && exec "{sys.executable}" "{script}"'],
                       capture_output=True, text=True, timeout=60, check=True)
    return json.loads(r.stdout)


def test_network_namespace_never_shows_a_previous_sandbox(tmp_path):
    """Nothing of a dead sandbox's network namespace reaches a later sandbox: a later one sees
    exactly what a namespace made this instant shows (counters, sockets, memberships).
    Namespaces of destroyed sandboxes are reused only when nothing of their tenant shows
    (NetnsPool.recycle); this drives reuse with quiet tenants, among tenants that leave every
    trace they can, and checks the later ones against a fresh namespace."""
    fresh = _fresh_net_view(tmp_path)
    spec = {"image": "host", "memory_mb": 384, "pids": 96}  # served cold: a pool-free spec
    before = _daemon_metrics().get("corral_netns_recycled_total", 0)
    for _ in range(3):
        with corral.Sandbox(**spec) as quiet:  # nothing on the network: its netns is reused
            assert quiet.exec("true", timeout=30).exit_code == 0
        with corral.Sandbox(**spec) as a:
            a.files.write("/opt/flowlabel.py", NET_FLOWLABEL)
            a.files.write("/opt/dirty.py", NET_DIRTY)
            r = a.exec("python3 /opt/dirty.py", timeout=60)
            assert "traced" in r.stdout and "dirty" in r.stdout, r.stdout + r.stderr
        with corral.Sandbox(**spec) as f:
            f.files.write("/opt/flowlabel.py", NET_FLOWLABEL)
            assert f.exec("python3 /opt/flowlabel.py", timeout=30).stdout == "labelled\n"
        for _ in range(3):
            with corral.Sandbox(**spec) as b:
                b.files.write("/opt/view.py", NET_VIEW)
                r = b.exec("python3 /opt/view.py", timeout=30)
                assert json.loads(r.stdout) == fresh, r.stdout
    assert _daemon_metrics().get("corral_netns_recycled_total", 0) > before


def test_recycled_memory_cgroup_gets_the_new_limits():
    """A memory cgroup handed from one sandbox to the next (corral recycles them: creating one
    is costly) carries the new sandbox's limit both ways, and no charge, peak or failure count
    of the old tenant."""
    v1 = Path(f"/sys/fs/cgroup/memory/{CGROUP_NAME}")

    def memcg(box) -> Path | None:
        p = v1 / box.id
        return p if p.is_dir() else None

    before = _daemon_metrics().get("corral_memcg_spares_reused_total", 0)
    for _ in range(8):
        with corral.Sandbox(image="host", memory_mb=700) as big:  # peaks at ~300 MiB
            r = big.exec("python3 -c \"b = bytearray(300 << 20); print('big-ok')\"", timeout=60)
            assert "big-ok" in r.stdout, r.stdout + r.stderr
        with corral.Sandbox(image="host", memory_mb=64) as small:  # fails at its limit
            r = small.exec("python3 -c \"b = bytearray(300 << 20); print('survived')\"",
                           timeout=60)
            assert "survived" not in r.stdout and r.exit_code != 0
            if (m := memcg(small)) is not None:
                assert int((m / "memory.limit_in_bytes").read_text()) == 64 << 20
        with corral.Sandbox(image="host", memory_mb=128) as quiet:  # runs `true` only
            assert quiet.exec("true", timeout=30).exit_code == 0
            if (m := memcg(quiet)) is not None:
                assert int((m / "memory.limit_in_bytes").read_text()) == 128 << 20
                assert int((m / "memory.failcnt").read_text()) == 0
                assert int((m / "memory.max_usage_in_bytes").read_text()) < 48 << 20
                assert int((m / "memory.usage_in_bytes").read_text()) < 48 << 20
        with corral.Sandbox(image="host", memory_mb=700) as big:  # the limit went up again
            r = big.exec("python3 -c \"b = bytearray(300 << 20); print('big-ok')\"", timeout=60)
            assert "big-ok" in r.stdout, r.stdout + r.stderr
        if _daemon_metrics().get("corral_memcg_spares_reused_total", 0) >= before + 4:
            break
    if v1.is_dir():  # the recycling this test is about happened
        assert _daemon_metrics().get("corral_memcg_spares_reused_total", 0) > before


@pytest.mark.parametrize("abi", [5, 0, -95, -38])  # old ABI, none, EOPNOTSUPP, ENOSYS
def test_disabled_refused_without_landlock_scopes(monkeypatch, abi):
    """Without Landlock's abstract-socket scope the shared namespace would be a hole: the mode
    is refused with `unsupported`, never run with a weaker wall."""
    from corral.daemon.substrates import container

    monkeypatch.setattr(container._core, "landlock_abi", lambda: abi)
    shared = container.SharedNetns()
    with pytest.raises(corral.Unsupported) as ei:
        shared.fd()
    assert "Landlock" in ei.value.message and ei.value.details["landlock_abi"] == abi
    assert shared._fd == -1  # no namespace made


def _procs(sid: str) -> list[tuple[str, str]]:
    """(comm, state) of every process in sandbox ``sid``'s cgroups, read on the host."""
    pids: set[str] = set()
    root = Path("/sys/fs/cgroup")
    for top in (root, *(p for p in root.iterdir() if p.is_dir())):
        try:
            pids.update((top / CGROUP_NAME / sid / "cgroup.procs").read_text().split())
        except OSError:
            continue
    out = []
    for pid in pids:
        try:
            comm, rest = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)
        except OSError:
            continue
        out.append((comm.split("(", 1)[1], rest.split()[0]))
    return out


def test_a_sandbox_that_stops_new_processes_cannot_stall_the_daemon():
    """Code in a sandbox can stop (SIGSTOP, same uid) a command's child before it execs, and
    whoever waits for that exec waits until the sandbox is destroyed. Through the init that is
    the sandbox's own init; past 16 unanswered requests the daemon's own path takes over, in a
    worker thread, never on the event loop. The daemon keeps serving other sandboxes, and
    killing the attacker's sandbox ends every call still held in it."""
    async def go() -> None:
        bad = await corral.AsyncSandbox.create(timeout=300)
        good = await corral.AsyncSandbox.create(timeout=300)
        try:
            # The loop starts once this exec has returned: it must not stop this shell.
            await bad.exec("(sleep 0.3; while :; do kill -STOP -1; done) >/dev/null 2>&1 &",
                           timeout=10)
            # The loop runs: its sleep is over, the shell is still there.
            assert await asyncio.to_thread(
                wait_until, lambda: [c for c, _ in _procs(bad.id) if c == "sleep"] == []
                and any(c == "sh" for c, _ in _procs(bad.id)))
            # The attack races each command's fork-to-exec window: send commands, a round of
            # 8 at a time, until one is caught stopped before its exec and held.
            held: list[asyncio.Task] = []
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                round_ = [asyncio.create_task(bad.exec(["true"], timeout=120)) for _ in range(8)]
                held += round_
                _, pending = await asyncio.wait(round_, timeout=2)
                if pending and any(st == "T" for _, st in _procs(bad.id)):
                    break
            assert not all(t.done() for t in held), "the attack never landed"
            assert any(st == "T" for _, st in _procs(bad.id))
            t0 = time.monotonic()
            for i in range(10):
                r = await good.exec(f"echo {i}", timeout=10)
                assert r.stdout == f"{i}\n"
            assert time.monotonic() - t0 < 10
            await bad.kill()
            outcomes = await asyncio.wait_for(asyncio.gather(*held, return_exceptions=True), 60)
            for o in outcomes:  # ran before the attack landed, or ended with the sandbox
                assert not isinstance(o, BaseException) or isinstance(o, corral.CorralError), o
        finally:
            for box in (bad, good):
                try:
                    await box.kill()
                except corral.CorralError:
                    pass

    asyncio.run(go())
