"""The admission limit derived from a machine: what bounds it, from the kernel's own files.

Pure reads of /proc and /sys (given here as directories of the same layout): no root, no
daemon. The daemon's use of it is in test_api (status) and test_batch.
"""

from __future__ import annotations

from pathlib import Path

from corral.daemon import capacity


def _machine(root: Path, mem_kib: int, ns: int, pid_max: int, threads: int,
             v1_memory: bool) -> tuple[str, str]:
    proc, sys_root = root / "proc", root / "sys"
    (proc / "sys/user").mkdir(parents=True)
    (proc / "sys/kernel").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal:       {mem_kib} kB\nMemAvailable:   1 kB\n")
    for kind in capacity.NAMESPACE_KINDS:
        (proc / "sys/user" / f"max_{kind}_namespaces").write_text(f"{ns}\n")
    (proc / "sys/kernel/pid_max").write_text(f"{pid_max}\n")
    (proc / "sys/kernel/threads-max").write_text(f"{threads}\n")
    if v1_memory:
        (sys_root / "fs/cgroup/memory").mkdir(parents=True)
        (sys_root / "fs/cgroup/memory/memory.limit_in_bytes").write_text("max\n")
    else:
        sys_root.mkdir()
    return str(proc), str(sys_root)


def test_memory_bounds_a_big_kernel(tmp_path):
    proc, sys_root = _machine(tmp_path, 24 << 20, 200_000, 4 << 20, 400_000, v1_memory=False)
    lim = capacity.derive(proc, sys_root)
    assert lim.bound_by == "memory"
    assert lim.count == int((24 << 20) * capacity.MEMORY_SHARE / capacity.IDLE_SANDBOX_KIB)


def test_the_tightest_kernel_limit_wins(tmp_path):
    proc, sys_root = _machine(tmp_path, 256 << 20, 30_000, 4 << 20, 400_000, v1_memory=True)
    lim = capacity.derive(proc, sys_root)
    assert lim == capacity.Limit(30_000 - capacity.NAMESPACE_RESERVE, "max_mnt_namespaces")
    proc2, sys2 = _machine(tmp_path / "b", 256 << 20, 200_000, 4 << 20, 400_000, v1_memory=True)
    assert capacity.derive(proc2, sys2) == capacity.Limit(
        capacity.V1_MEMCG_IDS - capacity.NAMESPACE_RESERVE, "v1_memory_cgroup_ids")
    proc3, sys3 = _machine(tmp_path / "c", 256 << 20, 200_000, 40_000, 400_000, v1_memory=False)
    assert capacity.derive(proc3, sys3) == capacity.Limit(40_000 - capacity.TASK_RESERVE,
                                                          "pid_max")


def test_nothing_readable_gives_a_modest_limit(tmp_path):
    assert capacity.derive(str(tmp_path / "none"), str(tmp_path / "none")) == \
        capacity.Limit(1000, "default")


def test_memory_guard_reads_this_host():
    g = capacity.MemoryGuard()
    avail = g.available_kib()
    assert avail is not None and avail > 0
    assert g.floor_kib >= capacity.LOW_MEMORY_FLOOR_KIB
    assert g.low() == (avail < g.floor_kib)
