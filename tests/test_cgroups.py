"""CgroupManager against the real kernel (root required), on a private cgroup name."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time

import pytest

from corral.daemon.cgroups import COOL_S, CgroupManager

from conftest import wait_until

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="cgroups need root")
MiB = 1024 * 1024


def _cleanup(m: CgroupManager) -> None:
    for sid in m.list_ids():
        paths = m.paths_for(sid)
        m.kill_all(paths)
        m.remove(paths)
    m.drop_spares()  # and the drains queued by remove (as the daemon's remove_parents does)
    for b in m._bases:
        try:
            os.rmdir(b)
        except FileNotFoundError:
            pass


@pytest.fixture
def cg():
    m = CgroupManager(f"corral-unit-{os.getpid()}")
    try:
        yield m
    finally:
        _cleanup(m)
        assert not any(os.path.exists(b) for b in m._bases)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def _joined_child(cg: CgroupManager, paths: list[str]) -> subprocess.Popen:
    """A real process that joins the sandbox's cgroups the way the Rust core does (write "0"
    to each procs file) and then execs a sleeper."""
    files = " ".join(cg.procs_files(paths))
    child = subprocess.Popen(
        ["/bin/sh", "-c", f"for f in {files}; do echo 0 > $f || exit 3; done; exec sleep 300"])
    deadline = time.monotonic() + 20  # generous: CI machines are loaded
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise AssertionError(f"child exited early: {child.returncode}")
        if all(child.pid in set(map(int, _read(f).split())) for f in cg.procs_files(paths)) \
                and os.path.basename(os.readlink(f"/proc/{child.pid}/exe")) == "sleep":
            return child
        time.sleep(0.01)
    child.kill()
    raise AssertionError("child did not join its cgroups")


def _proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _settles_in(pid: int, want: str, timeout: float = 15.0) -> str:
    """The process's state once it reaches ``want`` (or the last one seen): a task that was
    just thawed or started can be briefly runnable (R) on a loaded machine."""
    deadline = time.monotonic() + timeout
    while (state := _proc_state(pid)) != want and time.monotonic() < deadline:
        time.sleep(0.01)
    return state


def test_version_matches_host(cg):
    try:
        ctl = set(_read("/sys/fs/cgroup/cgroup.controllers").split())
    except FileNotFoundError:
        try:
            ctl = set(_read("/sys/fs/cgroup/unified/cgroup.controllers").split())
        except FileNotFoundError:
            ctl = set()
    assert cg.version == (2 if {"memory", "pids", "cpu"} <= ctl else 1)


def test_create_writes_limits(cg):
    paths = cg.create("lim-1", cpu=1.5, memory_mb=96, pids=77)
    assert paths == cg.paths_for("lim-1")
    assert all(os.path.isdir(p) for p in paths)
    if cg.version == 2:
        (p,) = paths
        assert _read(p + "/memory.max") == str(96 * MiB)
        assert _read(p + "/pids.max") == "77"
        assert _read(p + "/cpu.max") == "150000 100000"
        if os.path.exists(p + "/memory.swap.max"):
            assert _read(p + "/memory.swap.max") == "0"
    else:
        by_ctl = {os.path.basename(os.path.dirname(os.path.dirname(p))): p for p in paths}
        mem = next(p for p in paths if os.path.exists(p + "/memory.limit_in_bytes"))
        assert _read(mem + "/memory.limit_in_bytes") == str(96 * MiB)
        if os.path.exists(mem + "/memory.memsw.limit_in_bytes"):
            # one page above: the memory counter refuses first (cgroups.common.MEMSW_SLACK)
            assert _read(mem + "/memory.memsw.limit_in_bytes") == str(96 * MiB + 4096)
            assert _read(mem + "/memory.swappiness") == "0"
        pid = next(p for p in paths if os.path.exists(p + "/pids.max"))
        assert _read(pid + "/pids.max") == "77"
        cpu = next(p for p in paths if os.path.exists(p + "/cpu.cfs_quota_us"))
        assert _read(cpu + "/cpu.cfs_quota_us") == "150000"
        assert _read(cpu + "/cpu.cfs_period_us") == "100000"
        if os.path.isdir("/sys/fs/cgroup/freezer"):
            assert any(os.path.exists(p + "/freezer.state") for p in paths), by_ctl
    assert cg.list_ids() == {"lim-1"}
    cg.remove(paths)
    assert not any(os.path.exists(p) for p in paths)
    assert cg.list_ids() == set()


def test_create_is_all_or_nothing(cg):
    with pytest.raises(OSError):
        cg.create("bad-limit", cpu=1, memory_mb=64, pids=-5)  # the kernel refuses pids.max
    assert not any(os.path.exists(p) for p in cg.paths_for("bad-limit"))
    cg.create("dup", cpu=1, memory_mb=64, pids=10)
    with pytest.raises(FileExistsError):
        cg.create("dup", cpu=1, memory_mb=64, pids=10)
    assert all(os.path.isdir(p) for p in cg.paths_for("dup"))  # the first one is untouched


def test_join_kill_remove_real_process(cg):
    paths = cg.create("run-1", cpu=1, memory_mb=64, pids=32)
    child = _joined_child(cg, paths)
    try:
        assert cg.pids(paths) == {child.pid}
        assert cg.memory_usage(paths) > 0
        cg.kill_all(paths)
        assert child.wait(5) == -signal.SIGKILL
        assert cg.pids(paths) == set()
        cg.remove(paths)
        assert not any(os.path.exists(p) for p in paths)
        assert "run-1" not in cg.list_ids()
        cg.remove(paths)  # idempotent: already gone is fine
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_kill_all_reaches_a_process_tree(cg):
    paths = cg.create("tree-1", cpu=1, memory_mb=64, pids=64)
    files = " ".join(cg.procs_files(paths))
    child = subprocess.Popen(
        ["/bin/sh", "-c", f"for f in {files}; do echo 0 > $f; done; "
                          "sleep 300 & sleep 300 & sleep 300 & wait"],
        start_new_session=True)
    try:
        deadline = time.monotonic() + 5
        while len(cg.pids(paths)) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(cg.pids(paths)) == 4
        cg.kill_all(paths)
        child.wait(5)
        assert cg.pids(paths) == set()  # grandchildren die too (reaped by init here)
        cg.remove(paths)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()


def test_freeze_thaw_real_process(cg):
    paths = cg.create("frz-1", cpu=1, memory_mb=64, pids=32)
    child = _joined_child(cg, paths)
    try:
        assert _settles_in(child.pid, "S") == "S"
        cg.freeze(paths)
        assert cg.is_frozen(paths)
        # A frozen task shows as uninterruptible sleep (D) in /proc.
        assert _settles_in(child.pid, "D") == "D"
        cg.thaw(paths)
        assert not cg.is_frozen(paths)
        assert _settles_in(child.pid, "S") == "S"
        # A frozen sandbox can still be killed (v1 needs the thaw kill_all does).
        cg.freeze(paths)
        cg.kill_all(paths)
        assert child.wait(5) == -signal.SIGKILL
        cg.remove(paths)
    finally:
        if child.poll() is None:
            cg.thaw(paths, wait=False)
            child.kill()
            child.wait()


@pytest.mark.parametrize("bad", ["", "../x", "..", "a/b", "A1", "x_y", "a b",
                                 "/abs", "a\0b", "x" * 200, "é"])
def test_bad_ids_rejected(cg, bad):
    with pytest.raises(ValueError):
        cg.paths_for(bad)
    with pytest.raises(ValueError):
        cg.create(bad, cpu=1, memory_mb=64, pids=10)
    assert cg.list_ids() == set()


def test_bad_name_rejected():
    for bad in ["../escape", "/abs", "a/../b", ""]:
        with pytest.raises(ValueError):
            CgroupManager(bad)


def test_list_ids_ignores_foreign_entries(cg):
    cg.create("one", cpu=0.5, memory_mb=32, pids=8)
    cg.create("two", cpu=0.5, memory_mb=32, pids=8)
    os.mkdir(os.path.join(cg._bases[0], "Not_An_Id"))
    try:
        assert cg.list_ids() == {"one", "two"}
    finally:
        os.rmdir(os.path.join(cg._bases[0], "Not_An_Id"))


def _alloc_in(cg: CgroupManager, paths: list[str], mib: int) -> int:
    """Run a process in the cgroups that allocates (and touches) ``mib`` MiB; its exit code."""
    files = " ".join(cg.procs_files(paths))
    return subprocess.run(
        ["/bin/sh", "-c", f"for f in {files}; do echo 0 > $f || exit 3; done; "
         f"exec python3 -c 'b = bytearray({mib} << 20); print(len(b))'"],
        capture_output=True, timeout=60).returncode


def _settle(cg: CgroupManager, timeout: float = 5.0) -> bool:
    """Wait until a cooling memory cgroup became a spare."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        cg._settle()
        if cg._spares:
            return True
        time.sleep(0.02)
    return False


def test_recycled_memory_cgroup_gets_new_limits(cg):
    """A recycled v1 memory cgroup gets the new sandbox's limit, lower or higher than the old
    one, and starts with no usage and no failure count."""
    if cg.version != 1:
        pytest.skip("memory cgroups are recycled on cgroup v1 only")
    try:
        a = cg.create("rec-a", cpu=1, memory_mb=700, pids=64)
        assert cg.recycle_memory("rec-a")
        cg.remove(a)
        assert not os.path.exists(a[0])  # renamed aside at once: the id is free again
        assert _settle(cg), "an uncharged cgroup did not become a spare"
        b = cg.create("rec-b", cpu=1, memory_mb=64, pids=64)
        assert cg.spare_stats["reused"] == 1
        m = os.path.join(cg._mem, "rec-b")
        assert int(_read(m + "/memory.limit_in_bytes")) == 64 * MiB
        assert _read(m + "/memory.usage_in_bytes") == "0"
        assert _read(m + "/memory.failcnt") == "0"
        assert _alloc_in(cg, b, 200) != 0  # the lower limit holds: killed
        cg.remove(b)

        c0 = cg.create("rec-c0", cpu=1, memory_mb=64, pids=64)
        assert cg.recycle_memory("rec-c0")
        cg.remove(c0)
        assert _settle(cg)
        c = cg.create("rec-c", cpu=1, memory_mb=700, pids=64)
        assert cg.spare_stats["reused"] == 2
        m = os.path.join(cg._mem, "rec-c")
        assert int(_read(m + "/memory.limit_in_bytes")) == 700 * MiB
        assert _alloc_in(cg, c, 200) == 0  # the higher limit holds too
        cg.remove(c)
    finally:
        cg.drop_spares()


def _uncached_file(path: str, mib: int) -> None:
    """A file of ``mib`` MiB that is not in the page cache: the next reader brings it in and
    is charged for it."""
    with open(path, "wb") as f:
        f.write(os.urandom(mib * MiB))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _memcg_count() -> int:
    """The memory hierarchy's cgroups as the kernel counts them: live and dying."""
    with open("/proc/cgroups") as f:
        for line in f:
            fields = line.split()
            if fields and fields[0] == "memory":
                return int(fields[2])
    raise AssertionError("no memory controller in /proc/cgroups")


def _run_in(cg: CgroupManager, paths: list[str], script: str) -> int:
    files = " ".join(cg.procs_files(paths))
    return subprocess.run(["/bin/sh", "-c", f"for f in {files}; do echo 0 > $f || exit 3; "
                           f"done; {script}"], capture_output=True, timeout=60).returncode


def _cooled(cg: CgroupManager) -> None:
    deadline = time.monotonic() + 3 * COOL_S
    while time.monotonic() < deadline and cg._cooling:
        cg._settle()
        time.sleep(0.05)
    assert not cg._cooling


def test_memory_cgroup_charged_with_page_cache_is_recycled_then_drained(cg, tmp_path):
    """A dead sandbox's memory cgroup still charged with page cache it brought in (a file no
    one had read) is handed on, not removed: removed, it would stay dying until the kernel
    evicts those pages. The next tenant's lower limit reclaims the charge; at the end the
    spare is drained, so its pages leave the cache with it."""
    if cg.version != 1:
        pytest.skip("memory cgroups are recycled on cgroup v1 only")
    f = str(tmp_path / "data")
    _uncached_file(f, 48)
    try:
        before = _memcg_count()
        a = cg.create("rec-a", cpu=1, memory_mb=700, pids=64)
        assert _run_in(cg, a, f"cat {f} > /dev/null") == 0
        charged = int(_read(os.path.join(cg._mem, "rec-a", "memory.usage_in_bytes")))
        assert charged >= 40 * MiB  # the file's pages are charged to the sandbox
        assert cg.recycle_memory("rec-a")
        cg.remove(a)
        _cooled(cg)
        assert len(cg._spares) == 1 and cg.spare_stats["kept_charged"] == 1
        assert int(_read(cg._spares[0] + "/memory.usage_in_bytes")) >= 40 * MiB
        b = cg.create("rec-b", cpu=1, memory_mb=16, pids=64)  # under what is charged
        assert cg.spare_stats["reused"] == 1
        m = os.path.join(cg._mem, "rec-b")
        assert int(_read(m + "/memory.limit_in_bytes")) == 16 * MiB
        assert int(_read(m + "/memory.usage_in_bytes")) <= 16 * MiB  # reclaimed
        assert _alloc_in(cg, b, 4) == 0  # and usable
        assert cg.recycle_memory("rec-b")
        cg.remove(b)
        _cooled(cg)
        _uncached_file(f, 48)  # charged anew, to the next tenant (a higher limit this time)
        c = cg.create("rec-c", cpu=1, memory_mb=700, pids=64)
        assert _run_in(cg, c, f"cat {f} > /dev/null") == 0
        assert cg.recycle_memory("rec-c")
        cg.remove(c)
        _cooled(cg)
        spare = cg._spares[0]
        assert int(_read(spare + "/memory.usage_in_bytes")) >= 40 * MiB
        cg.drop_spares()
        assert not os.path.exists(spare)
        # Not dying either: the kernel's count of memory cgroups (live and dying) is back.
        deadline = time.monotonic() + 5
        while _memcg_count() > before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _memcg_count() <= before
    finally:
        cg.drop_spares()


def test_removed_memory_cgroup_with_page_cache_is_drained_off_the_callers_path(cg, tmp_path):
    """A sandbox's memory cgroup removed with page cache charged (spares full, or off) is
    renamed aside at once (its id is free again) and drained, then removed, by the drainer
    thread: not left dying, and no caller waits for the drain. A stop finishes the queue."""
    if cg.version != 1:
        pytest.skip("memory cgroups are drained on cgroup v1 only")
    files = [str(tmp_path / f"f{i}") for i in range(3)]
    for f in files:
        _uncached_file(f, 8)
    before = _memcg_count()
    made = []
    for i, f in enumerate(files):
        paths = cg.create(f"drain-{i}", cpu=1, memory_mb=700, pids=64)
        assert _run_in(cg, paths, f"cat {f} > /dev/null") == 0
        made.append(paths)
    for paths in made:  # not recycled (as with the spares full): removed
        assert cg.try_remove(paths)
        assert not any(os.path.exists(p) for p in paths)  # the ids are free at once
    deadline = time.monotonic() + 10
    while cg.spare_stats["drained"] < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cg.spare_stats["drained"] == 3
    while _memcg_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _memcg_count() <= before  # freed, not dying
    # Queued at a stop: drop_spares finishes them; nothing is left under our name.
    paths = cg.create("drain-last", cpu=1, memory_mb=700, pids=64)
    _uncached_file(files[0], 8)
    assert _run_in(cg, paths, f"cat {files[0]} > /dev/null") == 0
    assert cg.try_remove(paths)
    cg.drop_spares()
    assert not [e for e in os.listdir(cg._mem) if e.startswith(".")]


def test_memory_cgroup_with_tmpfs_charge_is_never_a_spare(cg):
    """tmpfs pages (a file a sandbox left on a host tmpfs) cannot be reclaimed without swap:
    a cgroup charged with them is not handed on; it is removed after the cooling time."""
    if cg.version != 1:
        pytest.skip("memory cgroups are recycled on cgroup v1 only")
    f = f"/dev/shm/corral-unit-{os.getpid()}"
    try:
        a = cg.create("rec-a", cpu=1, memory_mb=700, pids=64)
        assert _run_in(cg, a, f"head -c {8 * MiB} /dev/zero > {f}") == 0
        assert cg.recycle_memory("rec-a")
        cg.remove(a)
        _cooled(cg)
        assert cg._spares == [] and cg.spare_stats["discarded"] == 1
    finally:
        cg.drop_spares()
        if os.path.exists(f):
            os.unlink(f)


def test_recycled_pids_cpu_freezer_cgroups_get_new_limits(cg):
    """A destroyed sandbox's pids, cpu and freezer cgroups are handed to the next sandbox
    (v1): renamed aside at once, with the next sandbox's limits written, no task, thawed."""
    if cg.version != 1:
        pytest.skip("pids/cpu/freezer cgroups are recycled on cgroup v1 only")
    try:
        a = cg.create("set-a", cpu=0.5, memory_mb=64, pids=8)
        assert _alloc_in(cg, a, 1) == 0
        cg.recycle_rest("set-a")
        kept = cg.set_spare_stats["kept"]
        assert kept == len(cg._set_spares)  # one per pids/cpu/freezer hierarchy
        assert all(not os.path.exists(p) for p in a if not p.startswith(cg._mem))
        cg.remove(a)  # the memory cgroup (not recycled here) and nothing else
        b = cg.create("set-b", cpu=1.5, memory_mb=64, pids=16)
        assert cg.set_spare_stats["reused"] == kept
        assert _read(os.path.join(cg._pids, "set-b", "pids.max")) == "16"
        assert _read(os.path.join(cg._cpu, "set-b", "cpu.cfs_quota_us")) == "150000"
        for p in b:
            assert _read(p + "/tasks") == ""
        if cg._freezer is not None:
            assert _read(os.path.join(cg._freezer, "set-b", "freezer.state")) == "THAWED"
        assert _alloc_in(cg, b, 1) == 0
        cg.remove(b)
    finally:
        cg.drop_spares()
    assert not any(n.startswith(".") for base in cg._bases for n in os.listdir(base))


def test_busy_or_frozen_cgroups_are_never_spares(cg):
    """A cgroup with a task in it, or a frozen freezer cgroup, is not recycled (the caller
    then removes it)."""
    if cg.version != 1 or cg._freezer is None:
        pytest.skip("needs cgroup v1 with a freezer")
    p = subprocess.Popen(["sleep", "60"])
    try:
        a = cg.create("set-busy", cpu=1, memory_mb=64, pids=8)
        for path in a:
            with open(path + "/cgroup.procs", "w") as f:
                f.write(str(p.pid))
        cg.freeze(a)
        cg.recycle_rest("set-busy")
        assert cg.set_spare_stats["kept"] == 0
        cg.thaw(a)
        p.kill()
        p.wait()
        cg.freeze(a)  # empty but frozen: the next tenant would start frozen
        cg.recycle_rest("set-busy")
        assert os.path.exists(os.path.join(cg._freezer, "set-busy"))
        cg.thaw(a)
        cg.remove(a)
    finally:
        p.kill()
        p.wait()
        cg.drop_spares()


# Joins the cgroups (argv: procs files), forks paused children until a fork is refused, says
# how many it made, then waits for a line on stdin and ends them all.
FORK_TO_LIMIT = r"""
import os, signal, sys
for f in sys.argv[1:]:
    with open(f, "w") as fh:
        fh.write("0")
kids = []
try:
    while True:
        pid = os.fork()
        if pid == 0:
            signal.pause()
            os._exit(0)
        kids.append(pid)
except OSError as e:
    print(e.errno, len(kids), flush=True)
sys.stdin.readline()
for k in kids:
    os.kill(k, signal.SIGKILL)
    os.waitpid(k, 0)
"""


def _fork_to_limit(cg: CgroupManager, paths: list[str]) -> tuple[subprocess.Popen, int]:
    """A process in the cgroups that forked until refused (EAGAIN); (it, children made)."""
    p = subprocess.Popen([sys.executable, "-c", FORK_TO_LIMIT, *cg.procs_files(paths)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    err, made = p.stdout.readline().split()
    assert int(err) == errno.EAGAIN
    return p, int(made)


def _end(p: subprocess.Popen) -> None:
    assert p.stdin is not None
    p.stdin.write("\n")
    p.stdin.close()
    assert p.wait(20) == 0


def test_a_refused_fork_is_the_sandboxs_own_by_the_kernels_count_not_the_processes_left(cg):
    """A fork refused at the sandbox's own pids limit is its own even when every one of its
    processes has ended by the time the daemon looks (pids.events "max" rose since the base
    read before the spawn); a fork refused by an ancestor's limit (the host's) is not, though
    the sandbox's refusal count rises on v1 too: the ancestor is full."""
    paths = cg.create("pr-own", cpu=1, memory_mb=64, pids=4)
    base = cg.pids_refusals(paths)
    assert base is not None
    p, made = _fork_to_limit(cg, paths)
    assert made == 3  # the forker and 3 children: its limit of 4
    _end(p)
    assert wait_until(lambda: cg.pids_count(paths) == (0, 4))
    assert cg.pids_at_own_limit(paths, base) == 4  # its processes are gone: the count says so
    assert cg.pids_at_own_limit(paths, cg.pids_refusals(paths)) is None  # no refusal since
    assert cg.pids_at_own_limit(paths, None) is None  # no base, no processes: the count

    other = cg.create("pr-host", cpu=1, memory_mb=64, pids=100)
    pids_dir = next(p for p in other if os.path.exists(p + "/pids.max"))
    parent = os.path.dirname(pids_dir)
    with open(parent + "/pids.max", "w") as f:
        f.write("3")
    try:
        base = cg.pids_refusals(other)
        p, made = _fork_to_limit(cg, other)
        assert made == 2  # the ancestor's limit of 3
        try:
            assert cg.pids_at_own_limit(other, base) is None  # the host's: infra
        finally:
            _end(p)
    finally:
        with open(parent + "/pids.max", "w") as f:
            f.write("max")
