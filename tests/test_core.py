"""corral._core, the Rust core, exercised directly: real namespaces, overlays, seccomp, no mocks.

Each sandbox here is made from a tiny host-style root (a skeleton lower layer with /usr of the
host stacked as a second overlay), under a private temporary state dir; fixtures kill, reap and
remove everything they made even when a test fails.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time

import pytest

_core = pytest.importorskip("corral._core")
from corral.daemon import procpolicy  # noqa: E402 - after the skip

from conftest import wait_until  # noqa: E402

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")

F_GET_SEALS = 1034
F_SEAL_SEAL, F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_WRITE = 1, 2, 4, 8


def _host_mounts() -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return f.read().splitlines()


PROC_POLICY = procpolicy.compute().spawn_config()


def spawn(cfg: dict) -> tuple[int, int]:
    """spawn_sandbox with a config written as a dict (overlays as dicts too)."""
    overlays = [_core.Overlay(**o) for o in cfg["overlays"]]
    return _core.spawn_sandbox(_core.SpawnConfig(**{**cfg, "overlays": overlays}))


def exec_in(**kw) -> int:  # type: ignore[no-untyped-def]
    return _core.exec_in(_core.ExecConfig(**kw))


@pytest.fixture(scope="module")
def init_fd():
    fd = _core.init_memfd()
    yield fd
    os.close(fd)


@pytest.fixture
def state():
    d = tempfile.mkdtemp(prefix="corral-core-test-", dir="/var/tmp")
    try:
        skel = os.path.join(d, "skel")
        for n in ("usr", "proc", "dev", "tmp", "etc", "root", "home", "work"):
            os.makedirs(os.path.join(skel, n))
        for n in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            if os.path.islink("/" + n):
                os.symlink(os.readlink("/" + n), os.path.join(skel, n))
        with open(os.path.join(skel, "etc/passwd"), "w") as f:
            f.write("root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/home:/bin/sh\n")
        with open(os.path.join(skel, "etc/group"), "w") as f:
            f.write("root:x:0:\nuser:x:1000:\n")
        # Something outside every sandbox root that no path may reach.
        with open(os.path.join(d, "host-secret"), "w") as f:
            f.write("host secret\n")
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


class Box:
    def __init__(self, state: str, name: str, init_fd: int, **extra) -> None:
        self.dir = os.path.join(state, name)
        self.root = os.path.join(self.dir, "root")
        for n in ("root", "upper/0", "work/0", "upper/1", "work/1"):
            os.makedirs(os.path.join(self.dir, n))
        self.cfg = {
            "init_fd": init_fd,
            "root": self.root,
            "hostname": name,
            "overlays": [
                {"target": "/", "lower": [os.path.join(state, "skel")],
                 "upper": self.dir + "/upper/0", "work": self.dir + "/work/0"},
                {"target": "/usr", "lower": ["/usr"], "upper": self.dir + "/upper/1",
                 "work": self.dir + "/work/1"},
            ],
            "cgroup_procs": [],
            "rlimits": {"nofile": 1024, "core": 0},
            **PROC_POLICY,
        }
        self.cfg.update(extra)
        self.pid = -1
        self.pidfd = -1
        self.rootfd = -1

    def start(self) -> Box:
        self.pid, self.pidfd = spawn(self.cfg)
        self.rootfd = _core.root_fd(self.pid)
        return self

    def run(self, argv, *, env=None, cwd="/", uid=0, gid=0, groups=(), stdin=b"",
            timeout=30, extra=None) -> tuple[int, str, str]:
        if isinstance(argv, str):
            argv = ["/bin/sh", "-c", argv]
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        in_r, in_w = os.pipe()
        cfg = {"init_pid": self.pid, "pidfd": self.pidfd, "argv": list(argv),
               "env": env if env is not None else ["PATH=/usr/local/bin:/usr/bin:/bin",
                                                   "HOME=/root"],
               "cwd": cwd, "uid": uid, "gid": gid, "groups": list(groups),
               "stdin": in_r, "stdout": out_w, "stderr": err_w, "cgroup_procs": [],
               "rlimits": {"nofile": 1024}}
        cfg.update(extra or {})
        try:
            pid = exec_in(**cfg)
        finally:
            for fd in (out_w, err_w, in_r):
                os.close(fd)
        try:
            os.write(in_w, stdin)
        except BrokenPipeError:
            pass
        os.close(in_w)
        out, err = _drain(out_r, err_r, timeout)
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status), out, err

    def stop(self) -> None:
        if self.rootfd >= 0:
            os.close(self.rootfd)
            self.rootfd = -1
        if self.pidfd >= 0:
            try:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                os.waitid(os.P_PIDFD, self.pidfd, os.WEXITED)
            except ChildProcessError:
                pass
            os.close(self.pidfd)
            self.pidfd = -1


def _drain(out_r: int, err_r: int, timeout: float) -> tuple[str, str]:
    import selectors

    sel = selectors.DefaultSelector()
    bufs = {out_r: b"", err_r: b""}
    for fd in bufs:
        sel.register(fd, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    try:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("command output did not end")
            for key, _ in sel.select(left):
                data = os.read(key.fd, 65536)
                if data:
                    bufs[key.fd] += data
                else:
                    sel.unregister(key.fd)
    finally:
        sel.close()
        os.close(out_r)
        os.close(err_r)
    return bufs[out_r].decode(errors="replace"), bufs[err_r].decode(errors="replace")


@pytest.fixture
def box(state, init_fd):
    b = Box(state, "box1", init_fd)
    try:
        yield b.start()
    finally:
        b.stop()


@pytest.fixture
def make_box(state, init_fd):
    made: list[Box] = []

    def make(name: str, **extra) -> Box:
        b = Box(state, name, init_fd, **extra)
        made.append(b)
        return b

    try:
        yield make
    finally:
        for b in made:
            b.stop()


# ---- init ------------------------------------------------------------------------------------
CAP_NUMBERS = {"CAP_CHOWN": 0, "CAP_DAC_OVERRIDE": 1, "CAP_FOWNER": 3, "CAP_FSETID": 4,
               "CAP_KILL": 5, "CAP_SETGID": 6, "CAP_SETUID": 7, "CAP_SETPCAP": 8,
               "CAP_NET_BIND_SERVICE": 10, "CAP_AUDIT_WRITE": 29, "CAP_SETFCAP": 31}


def test_init_memfd_is_sealed_and_cloexec(init_fd):
    seals = fcntl.fcntl(init_fd, F_GET_SEALS)
    assert seals & (F_SEAL_SEAL | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE) == 15
    assert fcntl.fcntl(init_fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
    with pytest.raises(PermissionError):
        os.pwrite(init_fd, b"x", 0)


def test_sandbox_init_is_tiny_pid1_with_the_shell_set(box):
    """The init holds what a root command gets (it forks the commands: exec through the init)
    and nothing more; that it cannot be traced from inside is tests/test_isolation.py's."""
    # The init names itself as its first act (exec names it after the memfd): give it a moment.
    deadline = time.monotonic() + 5
    while True:
        status = open(f"/proc/{box.pid}/status").read()
        fields = dict(line.split(":", 1) for line in status.splitlines())
        if fields["Name"].strip() == "corral-init" or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    shell = sum(1 << CAP_NUMBERS[name] for name in _core.shell_capabilities())
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd"):
        assert int(fields[cap].strip(), 16) == shell, cap
    assert int(fields["CapAmb"].strip(), 16) == 0
    assert fields["NoNewPrivs"].strip() == "1"
    assert fields["Seccomp"].strip() == "2"
    assert fields["NSpid"].split()[-1] == "1"
    assert fields["Name"].strip() == "corral-init"
    rss_kb = int(fields["VmRSS"].split()[0])
    assert rss_kb <= 64, f"init RSS {rss_kb} kB"
    for ns in ("mnt", "pid", "uts", "ipc", "net", "cgroup"):
        assert os.readlink(f"/proc/{box.pid}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}"), ns


def test_host_mount_table_does_not_grow(state, make_box):
    before = _host_mounts()
    make_box("m1").start()
    make_box("m2").start()
    assert _host_mounts() == before


def _pending_signals(pid: int) -> int:
    fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines())
    return int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)


def test_init_ignores_signals_from_inside_and_obeys_the_host(box):
    code, _, _ = box.run("kill -TERM 1; kill -INT 1; kill -KILL 1; true")
    assert code == 0
    # The init has taken the signals sent from inside (a host SIGTERM sent while one of them
    # is still pending would merge with it).
    assert wait_until(lambda: _pending_signals(box.pid) == 0, timeout=10)
    assert open(f"/proc/{box.pid}/stat").read().split()[2] in ("S", "R")
    signal.pidfd_send_signal(box.pidfd, signal.SIGTERM)
    os.waitid(os.P_PIDFD, box.pidfd, os.WEXITED)  # exits 0 on a SIGTERM from the host
    os.close(box.pidfd)
    box.pidfd = -1


def test_init_reaps_orphans(box):
    code, out, _ = box.run("for i in 1 2 3 4 5; do (sleep 0.05 &); done; sleep 0.5; ps -e -o stat=")
    assert code == 0
    assert "Z" not in out


# ---- exec_in ---------------------------------------------------------------------------------
def test_exec_basics(box):
    code, out, err = box.run("echo out; echo err >&2; hostname; echo $$; cat; exit 3",
                             stdin=b"from-stdin\n")
    assert code == 3
    lines = out.splitlines()
    assert lines[0] == "out" and lines[1] == "box1"
    assert int(lines[2]) < 50  # a pid inside the sandbox's pid namespace
    assert lines[3] == "from-stdin"
    assert err == "err\n"


def test_exec_child_is_direct_child_in_sandbox_namespaces(box):
    r, w = os.pipe()
    pid = exec_in(init_pid=box.pid, pidfd=box.pidfd, argv=["sleep", "5"],
                  env=["PATH=/usr/bin:/bin"], stdout=w)
    os.close(w)
    os.close(r)
    try:
        for ns in ("mnt", "pid", "uts", "ipc", "net", "cgroup"):
            assert os.readlink(f"/proc/{pid}/ns/{ns}") == os.readlink(f"/proc/{box.pid}/ns/{ns}")
        assert int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1]) == os.getpid()
        # its own session and process group, so a timeout can kill the whole group (the
        # command calls setsid itself, after exec_in has its pid)
        deadline = time.monotonic() + 10
        while os.getsid(pid) != pid and time.monotonic() < deadline:
            time.sleep(0.001)
        assert os.getsid(pid) == pid and os.getpgid(pid) == pid
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    # the calling thread's pid_for_children is the host's again
    assert os.readlink("/proc/thread-self/ns/pid_for_children") == \
        os.readlink("/proc/self/ns/pid")


def test_exec_env_cwd_and_path_search(box):
    code, out, _ = box.run(["env"], env=["A=1", "PATH=/nope:/usr/bin"], cwd="/tmp")
    assert code == 0 and sorted(out.split()) == ["A=1", "PATH=/nope:/usr/bin"]
    code, out, _ = box.run(["pwd"], cwd="/tmp")
    assert out.strip() == "/tmp"
    code, out, _ = box.run(["pwd"], cwd="/does/not/exist")
    assert code == 0 and out.strip() == "/"


def test_exec_failure_exit_codes(box):
    assert box.run(["no-such-command-xyz"])[0] == 127
    assert box.run(["/no/such/file"])[0] == 127
    box.run("printf 'hello' > /tmp/notexec; chmod 644 /tmp/notexec")
    assert box.run(["/tmp/notexec"])[0] == 126


def test_exec_root_has_the_shell_capability_set(box):
    code, out, _ = box.run("grep -E '^Cap(Eff|Bnd|Amb)|NoNewPrivs|Seccomp:' /proc/self/status")
    f = dict(line.split(":", 1) for line in out.splitlines())
    shell = 0
    for bit in (0, 1, 3, 4, 5, 6, 7, 8, 10, 29, 31):  # CHOWN DAC_OVERRIDE FOWNER FSETID KILL
        shell |= 1 << bit                             # SETGID SETUID SETPCAP NET_BIND_SERVICE
    assert int(f["CapEff"], 16) == shell               # AUDIT_WRITE SETFCAP
    assert int(f["CapBnd"], 16) == shell
    assert int(f["CapAmb"], 16) == 0
    assert f["NoNewPrivs"].strip() == "1" and f["Seccomp"].strip() == "2"
    assert "CAP_SYS_CHROOT" not in _core.shell_capabilities()


def test_exec_cwd_is_entered_as_the_user(box):
    box.run("mkdir -m 700 /tmp/private")
    assert box.run(["pwd"], cwd="/tmp/private")[1].strip() == "/tmp/private"
    assert box.run(["pwd"], cwd="/tmp/private", uid=1000, gid=1000)[1].strip() == "/"


def test_exec_as_user(box):
    code, out, _ = box.run("id -u; id -g; id -G; grep CapEff /proc/self/status", uid=1000,
                           gid=1000, groups=[1000, 20])
    lines = out.split("\n")
    assert lines[0] == "1000" and lines[1] == "1000"
    assert sorted(lines[2].split()) == ["1000", "20"]
    assert int(lines[3].split()[1], 16) == 0


def test_exec_rlimits_and_stdio_devnull(box):
    code, out, _ = box.run(["sh", "-c", "ulimit -n; ulimit -c; cat; echo done"],
                           extra={"rlimits": {"nofile": (64, 128), "core": 0}, "stdin": -1})
    assert out.split() == ["64", "0", "done"]


def test_exec_closes_other_fds(box):
    leak = os.open("/etc/hostname", os.O_RDONLY)  # not CLOEXEC
    os.set_inheritable(leak, True)
    try:
        code, out, _ = box.run("ls /proc/self/fd")
    finally:
        os.close(leak)
    assert sorted(int(x) for x in out.split()) == [0, 1, 2, 3]  # 3: ls's own dir fd


def test_exec_from_many_threads(box):
    results: list[int] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(10):
                results.append(box.run(["true"])[0])
            # forks made afterwards on this thread land in the host pid namespace
            p = subprocess.run(["readlink", "/proc/self/ns/pid"], capture_output=True,
                               text=True, check=True)
            assert p.stdout.strip() == os.readlink("/proc/self/ns/pid")
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert results == [0] * 40


def test_exec_joins_cgroup(box):
    base = "/sys/fs/cgroup/pids"
    if not os.path.isdir(base):
        base = "/sys/fs/cgroup"
    cg = os.path.join(base, f"corral-core-test-{os.getpid()}")
    os.mkdir(cg)
    try:
        code, out, _ = box.run("sleep 0.2; echo $$",
                               extra={"cgroup_procs": [os.path.join(cg, "cgroup.procs")]})
        assert code == 0
    finally:
        for _ in range(100):
            try:
                os.rmdir(cg)
                break
            except OSError:
                time.sleep(0.02)


def test_exec_into_a_frozen_cgroup_never_holds_the_calling_thread(box):
    """A daemon-path exec racing a pause: the sandbox's freezer cgroup is frozen when the
    command joins it. Only the trampoline (a process of its own, outside the daemon's memory)
    joins, so it is what freezes; exec_in times it out, kills it and returns an error, and
    the calling thread is free again. The helper that shares the daemon's memory never enters
    the sandbox's cgroups, so nothing the sandbox's limits do can hold the vfork."""
    base = "/sys/fs/cgroup/freezer"
    if not os.path.isdir(base):
        pytest.skip("no cgroup v1 freezer hierarchy on this host")
    cg = os.path.join(base, f"corral-core-frozen-{os.getpid()}")
    os.mkdir(cg)
    try:
        with open(os.path.join(cg, "freezer.state"), "w") as f:
            f.write("FROZEN")
        done: list[BaseException | int] = []

        def go() -> None:
            try:
                done.append(box.run("true", extra={"cgroup_procs": [f"{cg}/tasks"]})[0])
            except BaseException as e:  # noqa: BLE001 - handed to the test thread
                done.append(e)

        t = threading.Thread(target=go, daemon=True)
        t0 = time.monotonic()
        t.start()
        t.join(timeout=30)
        assert not t.is_alive(), "exec_in is held by a frozen cgroup"
        assert time.monotonic() - t0 < 25
        assert isinstance(done[0], OSError) and "join_fork" in str(done[0]), done
    finally:
        with open(os.path.join(cg, "freezer.state"), "w") as f:
            f.write("THAWED")
        assert wait_until(lambda: not open(f"{cg}/tasks").read().strip(), timeout=10)
        os.rmdir(cg)


def test_exec_into_dead_sandbox_is_an_oserror(box):
    signal.pidfd_send_signal(box.pidfd, signal.SIGKILL)
    os.waitid(os.P_PIDFD, box.pidfd, os.WEXITED)
    with pytest.raises(OSError) as ei:
        exec_in(init_pid=box.pid, pidfd=box.pidfd, argv=["true"])
    assert "exec_in" in str(ei.value)


def test_exec_bad_arguments(box):
    with pytest.raises(ValueError):
        exec_in(init_pid=box.pid, pidfd=box.pidfd, argv=[])
    with pytest.raises(ValueError):
        exec_in(init_pid=box.pid, pidfd=box.pidfd, argv=["a\0b"])
    with pytest.raises(TypeError):  # pidfd is required
        exec_in(init_pid=box.pid, argv=["true"])
    with pytest.raises(ValueError):
        exec_in(init_pid=box.pid, pidfd=box.pidfd, argv=["true"],
                rlimits={"bogus": 1})


# ---- isolation ----------------------------------------------------------------------------
def test_sandbox_cannot_make_namespaces_mount_or_chroot(box):
    script = r"""
    unshare -U true 2>/dev/null; echo unshare=$?
    unshare -m true 2>/dev/null; echo unshare_m=$?
    python3 - <<'EOF'
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def e(rc): return ctypes.get_errno() if rc != 0 else 0
print("mount", e(libc.mount(b"none", b"/tmp", b"tmpfs", 0, None)))
print("umount", e(libc.umount2(b"/proc", 2)))
print("chroot", e(libc.chroot(b"/tmp")))
print("setns", e(libc.setns(os.open("/proc/self/ns/net", os.O_RDONLY), 0)))
print("unshare_net", e(libc.unshare(0x40000000)))
print("clone_newuser", e(-1 if libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0) < 0 else 0))
print("clone3", e(-1 if libc.syscall(435, 0, 0) < 0 else 0))
print("ptrace", e(-1 if libc.ptrace(16, 1, 0, 0) < 0 else 0))
print("bpf", e(-1 if libc.syscall(321, 0, 0, 0) < 0 else 0))
print("x32_mount", e(-1 if libc.syscall(0x40000000 | 165, 0, 0, 0, 0, 0) < 0 else 0))
import socket
try:
    socket.socket(40, socket.SOCK_STREAM)  # AF_VSOCK: not confined by network namespaces
    print("vsock", 0)
except OSError as ex:
    print("vsock", ex.errno)
EOF
    """
    if not os.path.exists("/usr/bin/python3"):
        pytest.skip("needs python3 on the host /usr")
    code, out, err = box.run(script)
    res = dict(line.split("=", 1) if "=" in line else line.split() for line in out.splitlines())
    assert res["unshare"] != "0" and res["unshare_m"] != "0"
    eperm, enosys = str(errno.EPERM), str(errno.ENOSYS)
    for k in ("mount", "umount", "chroot", "setns", "unshare_net", "clone_newuser", "ptrace",
              "bpf"):
        assert res[k] == eperm, (k, out, err)
    assert res["clone3"] == enosys
    assert res["x32_mount"] == enosys
    assert res["vsock"] == str(errno.EAFNOSUPPORT)


def test_sandbox_proc_and_dev(box):
    code, out, _ = box.run(r"""
    ls /proc | grep -E '^[0-9]+$' | wc -l
    echo x > /proc/sys/kernel/hostname 2>/dev/null; echo sys=$?
    cat /proc/timer_list | wc -c
    ls /dev | tr '\n' ' '
    echo; stat -c '%a %t:%T' /dev/null /dev/zero
    ip -o link 2>/dev/null | awk '{print $2}' || cat /proc/net/dev
    """)
    lines = out.splitlines()
    assert int(lines[0]) <= 5  # only the sandbox's own processes
    assert lines[1] != "sys=0"  # read-only
    assert lines[2] == "0"
    for n in ("null", "zero", "full", "random", "urandom", "tty", "ptmx", "pts", "shm", "fd",
              "stdin", "stdout", "stderr"):
        assert n in lines[3].split()
    assert lines[4] == "666 1:3" and lines[5] == "666 1:5"
    assert "eth" not in out


def test_sandbox_cannot_reach_host_files(box, state):
    code, out, _ = box.run("cat /host-secret ../host-secret /../host-secret 2>&1; "
                           "ls / | tr '\\n' ' '")
    assert "host secret" not in out


def test_rlimits_of_init(box):
    limits = open(f"/proc/{box.pid}/limits").read()
    assert any(line.startswith("Max open files") and "1024" in line
               for line in limits.splitlines())


# ---- spawn errors ----------------------------------------------------------------------------
def test_spawn_reports_the_failing_step(state, make_box):
    b = make_box("bad")
    b.cfg["overlays"][0]["lower"] = ["/var/tmp/no-such-lower-dir-corral"]
    with pytest.raises(OSError) as ei:
        b.start()
    assert ei.value.errno == errno.ENOENT
    assert "mount_root_overlay" in str(ei.value)
    b2 = make_box("bad2")
    b2.cfg["cgroup_procs"] = ["/sys/fs/cgroup/no-such-cgroup/cgroup.procs"]
    with pytest.raises(OSError) as ei:
        b2.start()
    assert "cgroup" in str(ei.value)
    assert _host_mounts() == _host_mounts()


def test_spawn_rejects_bad_config(state, make_box):
    b = make_box("cfg")
    for mutate in (
        lambda c: c.update(overlays=[]),
        lambda c: c["overlays"][0].update(target="/usr"),
        lambda c: c["overlays"][1].update(target="/a/../b"),
        lambda c: c["overlays"][1].update(target="/proc/x"),
        lambda c: c["overlays"][1].update(target="/tmp"),
        lambda c: c["overlays"][0].update(lower=["/a,b"]),
        lambda c: c["overlays"][0].update(lower=["relative"]),
        lambda c: c["overlays"][0].update(options=["upperdir=/etc"]),
        lambda c: c["overlays"][0].update(options=["volatile,lowerdir=/"]),
        lambda c: c.update(hostname="x" * 65),
        lambda c: c.update(init_fd=-1),
        lambda c: c.update(rlimits={"nofile": (10, 5)}),
    ):
        cfg = {**b.cfg, "overlays": [dict(o) for o in b.cfg["overlays"]]}
        mutate(cfg)
        with pytest.raises(ValueError):
            spawn(cfg)
    cfg = {**b.cfg}
    del cfg["root"]
    with pytest.raises(TypeError):  # a required argument of the config class
        spawn(cfg)


def test_spawn_creates_missing_mountpoints_but_never_through_symlinks(state, make_box):
    """Mountpoints are corral's: missing ones are made; a symlink or a file where one belongs
    (a hostile image, or a snapshot of a sandbox's writes) is replaced by a directory in the
    sandbox's own upper layer, never followed onto a host path, never a failed start."""
    skel2 = os.path.join(state, "skel2")
    os.makedirs(os.path.join(skel2, "usr"))
    for n in ("bin", "lib", "lib64"):
        if os.path.islink("/" + n):
            os.symlink(os.readlink("/" + n), os.path.join(skel2, n))
    os.symlink("/etc", os.path.join(skel2, "opt"))  # a hostile lower layer
    b = make_box("mp")
    b.cfg["overlays"][0]["lower"] = [skel2]
    b.start()  # no proc/dev/tmp in the image: created in the upper layer
    code, out, _ = b.run("ls -d /proc /dev /tmp")
    assert code == 0
    b.stop()
    with open(os.path.join(skel2, "tmp"), "w") as f:  # a file where /tmp is mounted
        f.write("x")
    os.symlink("/etc", os.path.join(skel2, "proc"))    # a symlink where /proc is
    os.symlink("/etc", os.path.join(skel2, "dev"))
    c = make_box("mp2")
    c.cfg["overlays"][0]["lower"] = [skel2]
    c.cfg["overlays"].append({"target": "/opt/tools", "lower": ["/usr"],
                              "upper": c.dir + "/upper/2", "work": c.dir + "/work/2"})
    os.makedirs(c.dir + "/upper/2")
    os.makedirs(c.dir + "/work/2")
    c.start()
    code, out, _ = c.run("for p in /opt /opt/tools /proc /dev /tmp; do stat -c '%n %F' $p; done;"
                         " ls /opt/tools/bin | head -1; grep -c ' /tmp tmpfs' /proc/self/mounts")
    assert code == 0, out
    assert out.splitlines()[:5] == [f"{p} directory" for p in
                                    ("/opt", "/opt/tools", "/proc", "/dev", "/tmp")], out
    assert out.split()[-1] == "1"
    c.stop()
    assert not os.path.exists("/etc/tools")
    assert os.path.islink(os.path.join(skel2, "opt"))  # the lower layer is untouched


def test_overlay_options(state, make_box):
    b = make_box("vol")
    for o in b.cfg["overlays"]:
        o["options"] = ["volatile"]
    b.start()
    code, out, _ = b.run("grep -c 'overlay.*volatile' /proc/self/mountinfo")
    assert out.strip() == "2"


def test_pooled_netns(state, make_box):
    host_net = os.readlink("/proc/thread-self/ns/net")
    fd = _core.netns_new()
    try:
        assert os.readlink("/proc/thread-self/ns/net") == host_net  # the thread went back
        b = make_box("net2", netns_fd=fd).start()
        assert os.stat(f"/proc/{b.pid}/ns/net").st_ino == os.fstat(fd).st_ino
        code, out, _ = b.run("cat /sys/class/net/lo/flags 2>/dev/null || grep -c lo /proc/net/dev")
        assert code == 0
    finally:
        os.close(fd)


# ---- files -----------------------------------------------------------------------------------
def test_fs_roundtrip(box):
    r = box.rootfd
    _core.fs_write(r, "/work/dir/a.txt", b"hello", 0o600, True)
    assert _core.fs_read(r, "/work/dir/a.txt") == b"hello"
    assert _core.fs_read(r, "/work/dir/a.txt", 2) == b"he"
    kind, size, mode, mtime = _core.fs_stat(r, "/work/dir/a.txt")
    assert (kind, size, mode) == ("file", 5, 0o600) and mtime > 0
    _core.fs_write(r, "/work/dir/a.txt", b"bye", 0o777, True)  # existing: mode kept
    assert _core.fs_stat(r, "/work/dir/a.txt")[2] == 0o600
    _core.fs_chmod(r, "/work/dir/a.txt", 0o755)
    assert _core.fs_stat(r, "/work/dir/a.txt")[2] == 0o755
    code, out, _ = box.run("cat /work/dir/a.txt")
    assert out == "bye"
    _core.fs_mkdir(r, "/work/x/y/z", True)
    with pytest.raises(FileExistsError):
        _core.fs_mkdir(r, "/work/x", False)
    with pytest.raises(FileNotFoundError):
        _core.fs_mkdir(r, "/work/nope/a", False)
    _core.fs_symlink(r, "dir/a.txt", "/work/link")
    assert _core.fs_stat(r, "/work/link")[0] == "symlink"
    assert _core.fs_readlink(r, "/work/link") == "dir/a.txt"
    assert _core.fs_read(r, "/work/link") == b"bye"  # reads follow links (inside the root)
    names = [(e[0], e[1]) for e in _core.fs_list(r, "/work")]
    assert names == [("dir", "dir"), ("link", "symlink"), ("x", "dir")]
    _core.fs_rename(r, "/work/dir/a.txt", "/work/b.txt")
    assert _core.fs_read(r, "/work/b.txt") == b"bye"
    with pytest.raises(OSError) as ei:
        _core.fs_remove(r, "/work/x", False)
    assert ei.value.errno == errno.ENOTEMPTY
    _core.fs_remove(r, "/work/x", True)
    with pytest.raises(FileNotFoundError):
        _core.fs_stat(r, "/work/x")
    with pytest.raises(IsADirectoryError):
        _core.fs_read(r, "/work")
    with pytest.raises(FileNotFoundError) as ei:
        _core.fs_read(r, "/work/missing")
    assert ei.value.filename == "/work/missing"
    with pytest.raises(NotADirectoryError):
        _core.fs_list(r, "/work/b.txt")
    with pytest.raises(ValueError):
        _core.fs_remove(r, "/", True)
    with pytest.raises(ValueError):
        _core.fs_read(r, "")


def test_fs_paths_never_leave_the_root(box, state):
    r = box.rootfd
    # `..` is clamped at the root
    assert _core.fs_stat(r, "/../../..")[0] == "dir"
    with pytest.raises(FileNotFoundError):
        _core.fs_read(r, "/../../../host-secret")
    with pytest.raises(FileNotFoundError):
        _core.fs_read(r, "../host-secret")
    # absolute and relative symlinks resolve inside the root
    _core.fs_symlink(r, "/../../../../host-secret", "/work/abs")
    _core.fs_symlink(r, "../../../../../../host-secret", "/work/rel")
    for p in ("/work/abs", "/work/rel", "/work/abs/x"):
        with pytest.raises(OSError):
            _core.fs_read(r, p)
    # a symlink to "/" is the sandbox's root, not the host's
    _core.fs_symlink(r, "/", "/work/rootlink")
    assert "host-secret" not in [e[0] for e in _core.fs_list(r, "/work/rootlink/..")]
    # magic links are refused
    for p in ("/proc/self/root/etc/passwd", "/proc/1/root/etc/passwd", "/dev/fd/0"):
        with pytest.raises(OSError):
            _core.fs_read(r, p)
    # writes never follow a final symlink (not even one pointing inside)
    _core.fs_write(r, "/work/target", b"t", 0o644, True)
    _core.fs_symlink(r, "/work/target", "/work/wlink")
    with pytest.raises(OSError) as ei:
        _core.fs_write(r, "/work/wlink", b"x", 0o644, True)
    assert ei.value.errno == errno.ELOOP
    assert _core.fs_read(r, "/work/target") == b"t"
    # a directory symlinked to "/" is removed as a link, never recursed into
    _core.fs_mkdir(r, "/work/tree/sub", True)
    _core.fs_symlink(r, "/usr", "/work/tree/sub/escape")
    _core.fs_remove(r, "/work/tree", True)
    assert _core.fs_stat(r, "/usr/bin")[0] == "dir"
    assert os.path.exists(os.path.join(state, "host-secret"))


def test_fs_refuses_fifos_devices_and_procfs(box):
    r = box.rootfd
    box.run("mkfifo /tmp/fifo")
    t0 = time.monotonic()
    with pytest.raises(OSError) as ei:
        _core.fs_read(r, "/tmp/fifo")
    assert isinstance(ei.value, _core.ForbiddenPath) and time.monotonic() - t0 < 5
    with pytest.raises(OSError):
        _core.fs_write(r, "/tmp/fifo", b"x", 0o644, True)
    with pytest.raises(OSError):
        _core.fs_read(r, "/dev/zero")
    for p in ("/proc/1/environ", "/proc/sys/kernel/hostname", "/proc/meminfo"):
        with pytest.raises(PermissionError):
            _core.fs_read(r, p)
    with pytest.raises(OSError):  # the daemon has no "self" in the sandbox's /proc
        _core.fs_read(r, "/proc/self/status")
    with pytest.raises(OSError):
        _core.fs_write(r, "/proc/1/oom_score_adj", b"-1000", 0o644, False)


def test_fs_sees_the_sandbox_view(box):
    box.run("mkdir -p /tmp/in && echo inside > /tmp/in/f")  # /tmp is the sandbox's tmpfs
    assert _core.fs_read(box.rootfd, "/tmp/in/f") == b"inside\n"
    assert _core.fs_stat(box.rootfd, "/usr/bin/env")[0] == "file"


def test_root_fd_of_missing_process():
    with pytest.raises(OSError):
        _core.root_fd(2**22 + 12345)


def test_last_profile(box):
    prof = dict(_core.last_profile("spawn_sandbox"))
    assert "mount_root_overlay" in prof and "exec_init" in prof
    box.run(["true"])
    assert "seccomp" in dict(_core.last_profile("exec_in"))


def test_pty_session(box):
    master, slave = _core.pty_open(box.rootfd)
    try:
        pid = exec_in(init_pid=box.pid, pidfd=box.pidfd, argv=["/bin/sh", "-c",
                      "tty; test -t 0 && echo interactive"],
                      env=["PATH=/usr/bin:/bin"], stdin=slave, stdout=slave,
                      stderr=slave, tty=True)
        os.close(slave)
        slave = -1
        out = b""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO once the last slave fd closes
                break
            if not chunk:
                break
            out += chunk
        os.waitpid(pid, 0)
    finally:
        os.close(master)
        if slave >= 0:
            os.close(slave)
    assert b"/dev/pts/0" in out and b"interactive" in out


def test_a_timeout_ends_a_command_stopped_before_its_setsid():
    """A command is signalled by process group (it calls setsid itself); one stopped before
    it got there has no group yet, so a timeout must still reach the process itself."""
    import asyncio

    from corral.daemon import procs
    from corral.daemon.substrates.types import Spawned

    child = subprocess.Popen(["sleep", "30"])  # in our group: no group of its own
    assert os.getpgid(child.pid) != child.pid
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    os.close(out_w)
    os.close(err_w)

    async def main() -> procs.Process:
        spawned = Spawned(pidfd=-1, pid=child.pid, ns_pid=0, own_child=True)
        proc = procs.Process(asyncio.get_running_loop(), spawned, ["sleep", "30"], out_r,
                             err_r, -1, 1024, 0.2)
        await asyncio.wait_for(proc.done, 10)
        return proc

    try:
        proc = asyncio.run(main())
        assert proc.timed_out and proc.exit_code is not None
    finally:
        child.kill()
        child.wait()
