"""The container substrate over the real core, cgroups and image store: no daemon, no mocks.

A private state dir, a private cgroup name and the builtin ``host`` image; every sandbox a test
makes is destroyed in a fixture finalizer, and the module checks at the end that no process,
cgroup, mount or directory is left.
"""

from __future__ import annotations

import array
import asyncio
import io
import os
import select
import shutil
import signal
import socket
import tarfile
import tempfile
import time

import pytest

pytest.importorskip("corral._core")

from corral.daemon import initexec  # noqa: E402
from corral.daemon.cgroups import CgroupManager  # noqa: E402
from corral.daemon.images import ImageStore  # noqa: E402
from corral.daemon.substrates.base import ExecSpec, SandboxRuntime  # noqa: E402
from corral.daemon.substrates.container import ContainerSubstrate, proc_starttime  # noqa: E402
from corral.errors import (  # noqa: E402
    DirectoryNotEmpty,
    FileExists,
    FileNotFound,
    InternalError,
    InvalidPath,
    InvalidRequest,
    IsADirectory,
    IsASymlink,
    NotADirectory,
    SandboxNotRunning,
)
from corral.models import SandboxSpec  # noqa: E402

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")


def _mounts_under(path: str) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if line.split()[4].startswith(path)]


@pytest.fixture(scope="module")
def env():
    state = tempfile.mkdtemp(prefix="corral-cs-test-", dir="/var/tmp")
    cg = CgroupManager(f"corral-cs-test-{os.getpid()}")
    sub = None
    try:
        images = ImageStore(state)
        images.ensure_host()
        sub = ContainerSubstrate(state, cg, images)
        yield state, cg, images, sub
    finally:
        leftover_ids = cg.list_ids()
        leftover_dirs = os.listdir(os.path.join(state, "sandboxes")) \
            if os.path.isdir(os.path.join(state, "sandboxes")) else []
        if sub is not None:
            sub.cleanup_orphans(set())
            sub.close(retire=True)  # every sandbox gone: spare cgroups and the scratch tmpfs too
        for base in {os.path.dirname(p) for p in cg.paths_for("x")}:
            try:
                os.rmdir(base)
            except OSError:
                pass
        mounts = _mounts_under(state)
        shutil.rmtree(state, ignore_errors=True)
        assert not leftover_ids, f"cgroups left behind: {leftover_ids}"
        assert not leftover_dirs, f"sandbox dirs left behind: {leftover_dirs}"
        assert not mounts, f"host mounts left behind: {mounts}"


@pytest.fixture
def make(env):
    state, cg, images, sub = env
    made: list[SandboxRuntime] = []
    counter = [0]

    def create(spec: SandboxSpec | None = None, image="host") -> SandboxRuntime:
        counter[0] += 1
        sid = f"t{os.getpid()}-{time.monotonic_ns() % 10**9}-{counter[0]}"
        rt = sub.create(sid, spec or SandboxSpec(), images.get(image))
        made.append(rt)
        return rt

    try:
        yield create
    finally:
        for rt in made:
            sub.destroy(rt)


@pytest.fixture
def sub(env):
    return env[3]


@pytest.fixture
def rt(make):
    return make()


def run(sub, rt, cmd, *, uid=0, gid=0, cwd="/root", env=None, timeout=30):
    r, w = os.pipe()
    argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else cmd
    try:
        pid = sub.launch(rt, ExecSpec(argv=argv, env=env or {"PATH": "/usr/bin:/bin"}, cwd=cwd,
                                      uid=uid, gid=gid, stdout_fd=w, stderr_fd=w))
    finally:
        os.close(w)
    out = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            b = os.read(r, 65536)
            if not b:
                break
            out += b
    finally:
        os.close(r)
    return os.waitstatus_to_exitcode(wait_child(pid)), out.decode(errors="replace")


def spawn_piped(sub, rt, argv, loop):
    """Start ``argv`` with stdout and stderr on a fresh pipe, answers awaited on ``loop``:
    (what spawn returned, the pipe's read end)."""
    r, w = os.pipe()
    try:
        return sub.spawn(rt, ExecSpec(argv=argv, env={"PATH": "/usr/bin:/bin"}, cwd="/",
                                      stdout_fd=w, stderr_fd=w), loop), r
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(w)


def wait_child(child):
    """The wait status of what spawn started: our child (a pid) or the init's (Spawned)."""
    if not isinstance(child, initexec.Spawned):
        return os.waitpid(child, 0)[1]
    if child.own_child:  # the daemon's own path, answered on a loop
        return os.waitpid(child.pid, 0)[1]
    try:
        p = select.poll()
        p.register(child.pidfd, select.POLLHUP)  # the init reaped it
        assert p.poll(30_000), "the init did not reap the command"
        status = initexec.wait_status(child.pidfd)
        assert status is not None
        return status
    finally:
        os.close(child.pidfd)


# ---- lifecycle ----------------------------------------------------------------------------
def test_create_exec_destroy(env, make):
    state, cg, _, sub = env
    before = _mounts_under(state)
    rt = make(SandboxSpec(hostname="box-a", memory_mb=256, pids=64))
    assert rt.pidfd >= 0 and rt.init_starttime == proc_starttime(rt.init_pid)
    assert sub.is_alive(rt)
    assert rt.init_pid in cg.pids(rt.cgroup_paths)
    code, out = run(sub, rt, "hostname; id -u; cat /etc/os-release | head -1; ls /usr/bin/env")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "box-a" and lines[1] == "0" and lines[3] == "/usr/bin/env"
    assert _mounts_under(state) == before  # the overlay lives in the sandbox's mount ns only
    mem = [p for p in rt.cgroup_paths if "/memory/" in p]
    if mem:
        limit = int(open(os.path.join(mem[0], "memory.limit_in_bytes")).read())
        assert limit == 256 * 1024 * 1024
    sub.destroy(rt)
    assert not sub.is_alive(rt)
    assert rt.sandbox_id not in cg.list_ids()
    assert not os.path.exists(rt.sandbox_dir)
    assert proc_starttime(rt.init_pid) != rt.init_starttime
    sub.destroy(rt)  # idempotent


def test_exec_joins_the_sandbox_cgroup_and_pids_limit_holds(env, make):
    _, cg, _, sub = env
    rt = make(SandboxSpec(pids=16))
    # dash gives up at the first failed fork: the pids limit stopped it
    run(sub, rt, "for i in $(seq 40); do sleep 3 >/dev/null 2>&1 & done >/dev/null 2>&1")
    n = len(cg.pids(rt.cgroup_paths))
    assert 10 <= n <= 16, n


def test_user_and_writes_persist_in_upper(sub, rt):
    code, out = run(sub, rt, "id -u; touch /root/x 2>&1; echo $?", uid=65534, gid=65534)
    assert out.splitlines()[0] == "65534"
    assert out.splitlines()[-1] != "0"  # /root is 0700 root
    code, out = run(sub, rt, "echo data > /usr/local/new-file && cat /usr/local/new-file")
    assert out == "data\n"
    assert not os.path.exists("/usr/local/new-file")  # went to the sandbox's upper dir
    upper = os.path.join(rt.sandbox_dir, rt.extra.get("upper", "upper"))
    assert os.path.exists(os.path.join(upper, "1/local/new-file"))


def test_adopt_after_restart(env, make):
    state, cg, images, sub = env
    rt = make()
    sub2 = ContainerSubstrate(state, cg, images)  # a restarted daemon
    try:
        again = SandboxRuntime.from_json(rt.to_json())
        assert again.pidfd == -1
        assert sub2.adopt(again)
        assert again.pidfd >= 0 and sub2.is_alive(again)
        code, out = run(sub2, again, "echo adopted")
        assert out == "adopted\n"
        stale = SandboxRuntime.from_json({**rt.to_json(), "init_starttime": 1})
        assert not sub2.adopt(stale)
        sub2.destroy(again)  # not sub2's child: waits by polling the pidfd
        assert not sub.is_alive(rt)
        assert rt.sandbox_id not in cg.list_ids()
        gone = SandboxRuntime.from_json(rt.to_json())
        assert not sub2.adopt(gone)
    finally:
        sub2.close()


def test_netns_pool_never_hands_out_a_namespace_with_traces(env, make):
    """A destroyed sandbox's namespace goes back to the pool only if nothing of its tenant
    shows there (NetnsPool.recycle; quiet tenants' namespaces are reused: test_isolation's
    recycling test). One whose loopback carried a datagram is never given to another: its
    counters would show it."""
    state, cg, images, sub = env
    deadline = time.monotonic() + 10
    while len(sub.netns) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    a = make()
    # Held open so the namespace (and its inode number) outlives the sandbox: a later
    # namespace with the same number could only be this one.
    held = os.open(f"/proc/{a.init_pid}/ns/net", os.O_RDONLY)
    try:
        net_a = os.fstat(held).st_ino
        code, out = run(sub, a, ["python3", "-c", "import socket; socket.socket(socket.AF_INET, "
                                 "socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', 9))"])
        assert code == 0, out
        dropped = sub.netns.not_recycled
        sub.destroy(a)
        assert sub.netns.not_recycled == dropped + 1  # looked at, and dropped
        for _ in range(4):
            b = make()
            assert os.stat(f"/proc/{b.init_pid}/ns/net").st_ino != net_a
            sub.destroy(b)
    finally:
        os.close(held)


def test_destroy_half_made_runtime(sub, env):
    state = env[0]
    sdir = os.path.join(state, "sandboxes", "halfmade")
    os.makedirs(os.path.join(sdir, "upper"))
    rt = SandboxRuntime(sandbox_id="halfmade", init_pid=2**22 + 7, init_starttime=5,
                        sandbox_dir=sdir, cgroup_paths=[])
    sub.destroy(rt)
    sub.destroy(rt)
    assert not os.path.exists(sdir)


def test_cleanup_orphans(env, make):
    state, cg, images, sub = env
    keep = make()
    orphan = make()
    removed = sub.cleanup_orphans({keep.sandbox_id})
    assert orphan.sandbox_id in removed and keep.sandbox_id not in removed
    deadline = time.monotonic() + 5
    while sub.is_alive(orphan) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not sub.is_alive(orphan)
    assert orphan.sandbox_id not in cg.list_ids()
    assert not os.path.exists(orphan.sandbox_dir)
    assert sub.is_alive(keep)


def test_create_failure_leaves_nothing(env):
    state, cg, images, sub = env
    img = images.get("host")
    bad = type(img)(name="bad", kind="rootfs", created_at=0.0,
                    overlays=[("/", ["/var/tmp/no-such-corral-layer"])])
    with pytest.raises(InternalError) as ei:
        sub.create("badimage1", SandboxSpec(), bad)
    assert "mount_root_overlay" in str(ei.value)
    assert "badimage1" not in cg.list_ids()
    assert not os.path.exists(os.path.join(state, "sandboxes", "badimage1"))
    with pytest.raises(InvalidRequest):
        sub.create("../evil", SandboxSpec(), img)


def test_spawn_into_dead_sandbox(sub, rt):
    signal.pidfd_send_signal(rt.pidfd, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while sub.is_alive(rt) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not sub.is_alive(rt)
    with pytest.raises(SandboxNotRunning):
        sub.launch(rt, ExecSpec(argv=["true"], env={}, cwd="/"))


# ---- files -----------------------------------------------------------------------------------
def test_files(sub, rt):
    sub.write_file(rt, "/work/a/b.txt", b"hello", 0o640)
    assert sub.read_file(rt, "/work/a/b.txt", 100) == b"hello"
    assert sub.read_file(rt, "/work/a/b.txt", 3) == b"hel"
    e = sub.stat(rt, "/work/a/b.txt")
    assert (e.name, e.path, e.type, e.size, e.mode) == ("b.txt", "/work/a/b.txt", "file", 5,
                                                         0o640)
    assert sub.stat(rt, "/").type == "dir"
    sub.mkdir(rt, "/work/d/e")
    assert [(x.name, x.type, x.path) for x in sub.list_dir(rt, "/work")] == \
        [("a", "dir", "/work/a"), ("d", "dir", "/work/d")]
    sub.rename(rt, "/work/a/b.txt", "/work/d/c.txt")
    code, out = run(sub, rt, "cat /work/d/c.txt")
    assert out == "hello"
    with pytest.raises(FileNotFound):
        sub.read_file(rt, "/work/a/b.txt", 10)
    with pytest.raises(FileExists):
        sub.mkdir(rt, "/work/d", parents=False)
    with pytest.raises(NotADirectory):
        sub.list_dir(rt, "/work/d/c.txt")
    with pytest.raises(IsADirectory):
        sub.read_file(rt, "/work", 10)
    with pytest.raises(DirectoryNotEmpty):
        sub.remove(rt, "/work/d")
    sub.remove(rt, "/work/d", recursive=True)
    with pytest.raises(FileNotFound):
        sub.stat(rt, "/work/d")
    for bad in ("relative", "", "/a\0b"):
        with pytest.raises(InvalidPath):
            sub.read_file(rt, bad, 10)
    with pytest.raises(InvalidPath):
        sub.remove(rt, "/", recursive=True)


def test_files_stay_inside(sub, rt, env):
    state = env[0]
    secret = os.path.join(state, "outside-secret")
    with open(secret, "w") as f:
        f.write("s")
    run(sub, rt, "ln -s /../../../../../../.. /tmp/up; ln -s " + secret + " /tmp/abs")
    with pytest.raises(FileNotFound):
        sub.read_file(rt, "/tmp/abs", 10)
    with pytest.raises(FileNotFound):
        sub.read_file(rt, "/tmp/up" + secret, 10)
    with pytest.raises(FileNotFound):
        sub.read_file(rt, "/../../../../" + secret, 10)
    with pytest.raises(IsASymlink):
        sub.write_file(rt, "/tmp/abs", b"x")  # never through a final symlink
    with pytest.raises(InvalidRequest):
        sub.read_file(rt, "/proc/1/environ", 100)
    assert open(secret).read() == "s"


def _tar(entries) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, kind, payload, mode in entries:
            ti = tarfile.TarInfo(name)
            ti.mode = mode
            if kind == "file":
                ti.size = len(payload)
                tf.addfile(ti, io.BytesIO(payload))
            elif kind == "dir":
                ti.type = tarfile.DIRTYPE
                tf.addfile(ti)
            elif kind == "sym":
                ti.type = tarfile.SYMTYPE
                ti.linkname = payload
                tf.addfile(ti)
            elif kind == "hard":
                ti.type = tarfile.LNKTYPE
                ti.linkname = payload
                tf.addfile(ti)
            elif kind == "chr":
                ti.type = tarfile.CHRTYPE
                ti.devmajor, ti.devminor = 1, 3
                tf.addfile(ti)
    return buf.getvalue()


def test_tar_roundtrip(sub, rt):
    data = _tar([
        ("proj", "dir", None, 0o750),
        ("proj/run.sh", "file", b"#!/bin/sh\necho ran\n", 0o755),
        ("proj/sub/data.txt", "file", b"x" * 70000, 0o600),
        ("proj/link", "sym", "sub/data.txt", 0o777),
        ("proj/hard", "hard", "proj/run.sh", 0o644),
    ])
    sub.upload_tar(rt, "/work/up", data)
    code, out = run(sub, rt, "/work/up/proj/run.sh; stat -c '%a' /work/up/proj; "
                             "readlink /work/up/proj/link; wc -c < /work/up/proj/hard")
    assert out.split() == ["ran", "750", "sub/data.txt", "19"]
    back = tarfile.open(fileobj=io.BytesIO(sub.download_tar(rt, "/work/up")))
    members = {m.name: m for m in back.getmembers()}
    assert members["proj/link"].issym() and members["proj/link"].linkname == "sub/data.txt"
    assert members["proj/run.sh"].mode == 0o755
    assert back.extractfile(members["proj/sub/data.txt"]).read() == b"x" * 70000
    single = tarfile.open(fileobj=io.BytesIO(sub.download_tar(rt, "/work/up/proj/run.sh")))
    assert single.getnames() == ["run.sh"]


def test_tar_rejects_hostile_members(sub, rt):
    with pytest.raises(InvalidPath):
        sub.upload_tar(rt, "/work/t1", _tar([("../../escape", "file", b"x", 0o644)]))
    with pytest.raises(InvalidRequest):
        sub.upload_tar(rt, "/work/t2", _tar([("dev-null", "chr", None, 0o666)]))
    with pytest.raises(InvalidRequest):
        sub.upload_tar(rt, "/work/t3", b"not a tar at all")
    # A symlink member followed by a member "through" it stays inside the sandbox root.
    sub.upload_tar(rt, "/work/t4", _tar([("l", "sym", "/", 0o777),
                                         ("l/corral-tar-probe", "file", b"p", 0o644)]))
    assert not os.path.exists("/corral-tar-probe")


def test_exec_exit_codes_and_fds_with_cgroups(sub, rt):
    assert run(sub, rt, ["no-such-command-corral"])[0] == 127
    run(sub, rt, "printf x > /tmp/plain; chmod 644 /tmp/plain")
    assert run(sub, rt, ["/tmp/plain"])[0] == 126
    code, out = run(sub, rt, ["sh", "-c",
                              "cat /proc/self/cgroup | grep -c ':/$'; ls /proc/self/fd"])
    lines = out.split()
    assert int(lines[0]) >= 3  # memory, pids, cpu... all at the sandbox's cgroup ns root
    assert sorted(int(x) for x in lines[1:]) == [0, 1, 2, 3]  # no cgroup.procs fd leaked


def test_exec_survives_oom_in_the_sandbox(make, sub):
    """A sandbox at its memory limit with the OOM killer busy must never take the daemon (here:
    this test process) down with a command being started in it."""
    rt = make(SandboxSpec(memory_mb=48, pids=64))
    run(sub, rt, "head -c 40M /dev/zero > /dev/shm/fill 2>/dev/null; "
                 "(while :; do tail /dev/zero; done) >/dev/null 2>&1 &")
    codes = [run(sub, rt, ["true"])[0] for _ in range(30)]
    assert all(c in (0, -9, 137) for c in codes), codes
    assert os.getpid() > 0  # still here


def test_download_tar_is_capped(sub, rt, monkeypatch):
    import corral.daemon.substrates.rootfiles as rootfiles

    run(sub, rt, "mkdir -p /work/big && truncate -s 100G /work/big/sparse && echo hi > /work/big/a")
    monkeypatch.setattr(rootfiles, "TAR_MAX_BYTES", 1 << 20)
    with pytest.raises(InvalidRequest):
        sub.download_tar(rt, "/work/big")
    sub.remove(rt, "/work/big/sparse")
    assert tarfile.open(fileobj=io.BytesIO(sub.download_tar(rt, "/work/big"))).getnames() == \
        [".", "a"]


def test_netns_pool_grows_for_a_batch_and_decays():
    """expect(n) (a create_many or fork of n) raises the ready count to n, capped; with no
    batch for window_s it falls back to the base size and the extra namespaces are closed."""
    from corral.daemon.substrates.container import NetnsPool

    def wait_len(pool: NetnsPool, n: int, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(pool) == n:
                return True
            time.sleep(0.01)
        return False

    def netns_fds() -> set[str]:
        # Only the pool's own kind of fd: other threads of the test process (the session's
        # SDK clients) open and close sockets and files concurrently.
        out = set()
        for name in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{name}").startswith("net:["):
                    out.add(name)
            except OSError:
                pass
        return out

    fds_before = netns_fds()
    pool = NetnsPool(2, most=5, window_s=0.5)
    try:
        assert wait_len(pool, 2)
        pool.expect(50)
        assert pool.size == 5 and wait_len(pool, 5)  # capped at `most`
        fd = pool.take()
        assert fd is not None
        os.close(fd)
        assert wait_len(pool, 2, timeout=5)  # the window passed: back to the base
        off = NetnsPool(0)
        off.expect(10)  # pooling off stays off
        assert off.size == 0 and off.take() is None
        off.close()
    finally:
        pool.close()
    assert netns_fds() == fds_before


# ---- exec through the init (corral.daemon.initexec) -----------------------------------------
# What a command sees of its walls; the first line differs by design (the daemon's own path
# starts it as the daemon's child, from outside the pid namespace: PPid 0).
WALLS_PROBE = r"""
echo "ppid=$(awk '/^PPid/{print $2}' /proc/$$/status)"
grep -E '^(Uid|Gid|Groups|Cap[A-Za-z]+|NoNewPrivs|Seccomp|Seccomp_filters|Umask):' /proc/self/status
cat /proc/self/cgroup /proc/self/limits
for n in mnt pid net uts ipc cgroup; do readlink /proc/self/ns/$n; done
[ "$(cut -d' ' -f6 /proc/$$/stat)" = "$$" ] && echo session-leader
ls -di / ; pwd ; hostname
"""


@pytest.mark.parametrize("uid,network", [(0, "none"), (1000, "none"), (0, "disabled")])
def test_exec_through_the_init_matches_the_daemons_own_path(sub, make, uid, network):
    assert sub.init_exec, "this kernel should support exec through the init (6.15+)"
    rt = make(SandboxSpec(network=network))
    outs = {}
    try:
        for via_init in (True, False):
            sub.init_exec = via_init
            code, out = run(sub, rt, WALLS_PROBE, uid=uid, gid=uid, cwd="/tmp")
            assert code == 0, out
            outs[via_init] = out.splitlines()
    finally:
        sub.init_exec = True
    assert (outs[True][0], outs[False][0]) == ("ppid=1", "ppid=0")
    assert outs[True][1:] == outs[False][1:]
    assert "session-leader" in outs[True]


def test_exit_codes_through_the_init(sub, rt):
    assert run(sub, rt, "exit 7")[0] == 7
    assert run(sub, rt, "kill -9 $$")[0] == -9
    assert run(sub, rt, ["no-such-command"])[0] == 127
    assert run(sub, rt, ["/etc/passwd"])[0] == 126  # not executable
    assert run(sub, rt, "echo $0 $1", env={"PATH": "/nowhere:/bin"})[1] == "/bin/sh\n"


def test_big_commands_go_through_the_init_in_a_sealed_memfd(sub, rt):
    """A request beyond the init's 64 KiB buffer (or 1,024 strings, or 64 groups) goes through
    the init too (its body in a sealed memfd); one beyond what execve takes is refused."""
    probe = "echo \"${#0}:$#:$(awk '/^PPid/{print $2}' /proc/$$/status)\""
    code, out = run(sub, rt, ["/bin/sh", "-c", probe, "x" * 70_000])
    assert (code, out) == (0, "70000:0:1\n")
    code, out = run(sub, rt, ["/bin/sh", "-c", probe, "a", *["b"] * 3000])
    assert (code, out) == (0, "1:3000:1\n")
    with pytest.raises(InvalidRequest):
        run(sub, rt, ["/bin/sh", "-c", "true", "x" * 200_000])
    with pytest.raises(InvalidRequest):
        run(sub, rt, ["/bin/sh", "-c", "true", *["y" * 100_000] * 30])


def test_the_init_refuses_malformed_requests_and_keeps_serving(sub, rt):
    assert run(sub, rt, "true")[0] == 0
    chan = sub._channel(rt)
    good, _ = initexec.encode(77, ["true"], {}, "/", 0, 0, [], ["/bin/true"], False)
    big_head, big_body = initexec.encode(78, ["true", "x" * 70_000], {}, "/", 0, 0, [],
                                         ["/bin/true"], False)
    assert big_body is not None
    unsealed = os.memfd_create("x", os.MFD_CLOEXEC)
    os.write(unsealed, big_body)
    sealed_extra = initexec.sealed_memfd(big_body + b"junk\0")
    head = initexec._REQ
    r, w = os.pipe()
    cases = [
        (b"xx", [w, w, w]),                                          # short
        (b"\0" * head.size, [w, w, w]),                              # bad magic
        (good, [w, w]),                                              # fds do not match flags
        (good, []),                                                  # no fds at all
        (good[:-1], [w, w, w]),                                      # last string unterminated
        (head.pack(initexec.REQ_MAGIC, 1, 0, 0, 0, 0, 5000, 0, 1) + b"a\0" * 10, [w, w, w]),
        (head.pack(initexec.REQ_MAGIC, 1, 0, 0, 0, 10_000, 1, 0, 1) + b"a\0a\0/\0", [w, w, w]),
        (good + b"x" * 70_000, [w, w, w]),                           # beyond the init's buffer
        (good + b"x\0", [w, w, w]),                                  # after the cwd
        (big_head, [w, w, w]),                                       # no memfd
        (big_head, [w, w, w, unsealed]),                             # not sealed
        (big_head, [w, w, w, sealed_extra]),                         # after the cwd
        (big_head + b"x", [w, w, w, sealed_extra]),                  # more than the header
        (good, [w, w, w, w]),                                        # an fd too many
    ]
    try:
        for msg, fds in cases:
            chan.sock.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                       array.array("i", fds))] if fds else [])
            assert select.select([chan.sock], [], [], 10)[0], "no answer"
            data, got = chan._recv()
            assert data is not None and not got, msg[:40]
            magic, _rid, value, _step = initexec._REPLY.unpack(data)
            assert magic == initexec.REPLY_MAGIC and value < 0, (msg[:40], value)
    finally:
        os.close(r)
        os.close(w)
        os.close(unsealed)
        os.close(sealed_extra)
    # Still serving, and no received fd stayed open in the init: 0-2 (/dev/null), 3-4 (channel).
    assert run(sub, rt, "echo alive")[1] == "alive\n"
    assert sorted(int(f) for f in os.listdir(f"/proc/{rt.init_pid}/fd")) == [0, 1, 2, 3, 4]


def test_stale_answers_in_the_channel_are_dropped(sub, rt):
    """An answer nobody read (a daemon killed mid-request) does not answer the next call."""
    assert run(sub, rt, "true")[0] == 0
    chan = sub._channel(rt)
    r, w = os.pipe()
    try:
        msg, _ = initexec.encode(12345, ["/bin/sh", "-c", "exit 5"], {}, "/", 0, 0, [],
                                 ["/bin/sh"], True)
        chan.sock.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                   array.array("i", [w, w]))])
    finally:
        os.close(r)
        os.close(w)
    # Its answer (with a pidfd) now waits in the channel, unread.
    assert select.select([chan.sock], [], [], 10)[0]
    assert run(sub, rt, "exit 4")[0] == 4


def test_beyond_sixteen_awaited_answers_commands_wait_for_room(sub, rt):
    """With 16 answers awaited in one sandbox, further commands wait for an answer and go
    through the init too; every command runs, every one is answered."""
    loop = asyncio.new_event_loop()
    pipes, started = [], []
    try:
        for _ in range(initexec.MAX_IN_FLIGHT + 4):
            coro, r = spawn_piped(
                sub, rt, ["/bin/sh", "-c", "awk '/^PPid/{print $2}' /proc/$$/status"], loop)
            started.append(coro)
            pipes.append(r)
        # All coroutines (with a loop nothing blocks it): the init's answers to come, then the
        # daemon's own path in a worker thread.
        names = [c.cr_code.co_name for c in started]
        assert names == ["_answer"] * initexec.MAX_IN_FLIGHT + ["later"] * 4

        async def answers():
            return await asyncio.gather(*started)

        answered = loop.run_until_complete(answers())
        assert [type(c) for c in answered] == [initexec.Spawned] * (initexec.MAX_IN_FLIGHT + 4)
        outs = []
        for child, r in zip(answered, pipes, strict=True):
            out = b""
            while chunk := os.read(r, 4096):
                out += chunk
            assert os.waitstatus_to_exitcode(wait_child(child)) == 0
            outs.append(out.decode().strip())
        assert outs == ["1"] * (initexec.MAX_IN_FLIGHT + 4)
    finally:
        for r in pipes:
            os.close(r)
        sub._close_channel(rt.sandbox_id)  # its reader is on this loop: close it there
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()


def test_a_command_whose_caller_gave_up_is_killed(sub, rt):
    """An exec cancelled before the init's answer arrives (the client went away) must not
    leave its command running unobserved."""
    loop = asyncio.new_event_loop()
    try:
        coro, r = spawn_piped(sub, rt, ["sleep", "60"], loop)
        task = loop.create_task(coro)
        loop.call_soon(task.cancel)
        with pytest.raises(asyncio.CancelledError):
            loop.run_until_complete(task)
        # The answer arrives later; the loop reads it and kills the command's group.
        deadline = time.monotonic() + 10
        eof = False  # the pipe's only writer is the command
        while not eof and time.monotonic() < deadline:
            loop.run_until_complete(asyncio.sleep(0.05))
            if select.select([r], [], [], 0)[0]:
                eof = os.read(r, 1) == b""
        os.close(r)
        assert eof, "the abandoned command still runs"
    finally:
        sub._close_channel(rt.sandbox_id)
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()
    code, out = run(sub, rt, "pgrep -x sleep || echo none")
    assert out.strip() == "none"


def test_an_init_that_dies_stops_being_watched(sub, make):
    """EOF on a dead init's channel stays readable: the loop must stop watching it rather than
    spin on it until the sandbox is destroyed."""
    rt = make()
    loop = asyncio.new_event_loop()
    try:
        coro, r = spawn_piped(sub, rt, ["true"], loop)
        child = loop.run_until_complete(coro)
        os.close(r)
        assert os.waitstatus_to_exitcode(wait_child(child)) == 0
        chan = sub._channel(rt)
        calls = []
        real = chan._on_readable
        loop.remove_reader(chan.sock.fileno())
        loop.add_reader(chan.sock.fileno(), lambda: (calls.append(1), real()))
        signal.pidfd_send_signal(rt.pidfd, signal.SIGKILL)
        loop.run_until_complete(asyncio.sleep(0.5))
        assert 1 <= len(calls) <= 3, len(calls)
        assert chan.loop is None
    finally:
        sub._close_channel(rt.sandbox_id)
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()


def test_the_channel_cache_never_closes_a_channel_with_answers_to_come(sub, make, monkeypatch):
    """Past the cache's bound the least recently used channel closes, unless commands in its
    sandbox still await their answers: closing it would fail them as if the sandbox died."""
    from corral.daemon.substrates.container import rootcache as container

    monkeypatch.setattr(container, "ROOT_CACHE", 1)
    a, b = make(), make()
    loop = asyncio.new_event_loop()
    try:
        coro, r = spawn_piped(sub, a, ["true"], loop)
        busy = sub._channel(a)
        assert busy.waiting  # its answer is not read yet (the loop has not run)
        assert run(sub, b, "echo b")[1] == "b\n"  # b's channel: over the bound of 1
        assert sub._channel(a) is busy and busy.sock.fileno() >= 0
        child = loop.run_until_complete(coro)
        assert os.waitstatus_to_exitcode(wait_child(child)) == 0
        os.close(r)
        c = make()
        run(sub, c, "true")  # a third channel: a's and b's, idle now, go
        loop.run_until_complete(asyncio.sleep(0))  # a's closes on the loop that watches it
        assert busy.sock.fileno() < 0
    finally:
        for rt in (a, b):
            sub._close_channel(rt.sandbox_id)
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()


@pytest.mark.parametrize("via_init", [True, False])
def test_disabled_commands_are_landlock_domains_of_their_own(sub, make, via_init):
    """Network "disabled": each command is a Landlock domain of its own on both paths (nested
    in the init's, or a fresh one), so one cannot read another's /proc/<pid>/environ; the
    usual process tools still see it."""
    rt = make(SandboxSpec(network="disabled"))
    try:
        sub.init_exec = via_init
        assert run(sub, rt, "sleep 60 >/dev/null 2>&1 &")[0] == 0
        code, out = run(sub, rt, "p=$(pgrep -x sleep); cat /proc/$p/environ >/dev/null 2>&1; "
                                 "echo environ=$?; grep -q State /proc/$p/status && echo seen; "
                                 "kill $p")
        assert code == 0 and "environ=1" in out and "seen" in out, out
    finally:
        sub.init_exec = True


MOUNT_WATCH = r"""
import json, os, subprocess, sys
from corral.daemon.substrates.container.layout import MountWatch, detachable_mounts
base = sys.argv[1]
keep = os.path.join(base, "keep")
os.makedirs(keep)
w = MountWatch(keep)
out = {"first": w.get() == detachable_mounts(keep)}
out["unchanged"] = [w.get() == detachable_mounts(keep) for _ in range(3)]
out["reads_unchanged"] = w.reads
side = os.path.join(base, "side")
os.makedirs(side)
subprocess.run(["mount", "-t", "tmpfs", "tmpfs", side], check=True)
got = w.get()
out["mounted"] = side in got and got == detachable_mounts(keep)
subprocess.run(["mount", "-t", "tmpfs", "tmpfs", keep], check=True)  # below keep: stays
out["below_keep"] = w.get() == detachable_mounts(keep) and keep not in w.get()
subprocess.run(["umount", side], check=True)
out["unmounted"] = side not in w.get() and w.get() == detachable_mounts(keep)
out["reads"] = w.reads
w.close()
print(json.dumps(out))
"""


def test_the_mounts_a_spawn_detaches_follow_every_change_of_the_table(tmp_path):
    """MountWatch reads the mount table again only when the kernel flags a change: each
    mount or unmount is seen by the next spawn, an unchanged table is not read again. Run in
    a private mount namespace of its own, so the host's table is never touched."""
    import json
    import subprocess
    import sys

    script = tmp_path / "watch.py"
    script.write_text(MOUNT_WATCH)
    r = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable,
                        str(script), str(tmp_path)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out == {"first": True, "unchanged": [True, True, True], "reads_unchanged": 1,
                   "mounted": True, "below_keep": True, "unmounted": True, "reads": 4}, out
