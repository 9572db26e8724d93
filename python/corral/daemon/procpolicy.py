"""What a sandbox sees of /proc: an allow list of top-level entries; everything else is masked.

A sandbox mounts a fresh procfs of its own pid namespace. Its process directories are its own,
but most other top-level entries are host-wide kernel state: physical page data (kpageflags,
kpagecount, kpagecgroup), the slab allocator (slabinfo), interrupts, timers, keys, kernel
symbols, the host's disks and devices. Only what a normal program reads is left (ps, top, free,
uptime, df, ip, ss, nproc, Python's os/platform/multiprocessing, psutil); every other entry is
covered when the sandbox starts (rust/src/spawn.rs, step "mask_proc"): a file by /dev/null, a
directory by one empty, read-only host directory (no superblock of its own). The process tier
(run_code, process sessions) covers the same entries once per zygote, in the mount namespace
every request and command of it shares (substrates/process/view.py). /proc/sys stays
readable but read-only. The policy is computed once per daemon from the host's /proc (one
kernel, the same entries) and handed to every spawn.

Pid 1's OOM score is read-only too: raised to 1000, it would make the init the OOM killer's
first choice, so the sandbox could end itself by exhausting its own memory.
"""

from __future__ import annotations

import os
import shutil
import stat
from dataclasses import dataclass

# Top-level /proc entries a sandbox may read. Not cmdline (the host's boot arguments) nor
# cgroups (its num_cgroups column counts every cgroup on the host: other tenants' churn).
PROC_ALLOWED = frozenset({
    "self", "thread-self", "mounts", "net",   # symlinks into the caller's own pid directory
    "sys",                                     # sysctl values (read-only, below)
    "cpuinfo", "meminfo", "stat", "uptime", "loadavg", "version", "vmstat", "swaps",
    "filesystems", "sysvipc",
})

# Bound read-only onto themselves: writable kernel-wide state below an allowed entry, and the
# init's OOM score (both spellings, through /proc/1 and its one thread).
PROC_READONLY = ("sys", "1/oom_score_adj", "1/oom_adj", "1/task/1/oom_score_adj",
                 "1/task/1/oom_adj")


@dataclass(frozen=True)
class ProcPolicy:
    readonly: tuple[str, ...]
    mask_files: tuple[str, ...]
    mask_dirs: tuple[str, ...]

    def spawn_config(self) -> dict[str, list[str]]:
        """The /proc arguments of ``_core.SpawnConfig``, by name."""
        return {"proc_readonly": list(self.readonly), "proc_mask_files": list(self.mask_files),
                "proc_mask_dirs": list(self.mask_dirs)}


def compute(proc: str = "/proc") -> ProcPolicy:
    """The policy for this kernel: every top-level entry of ``proc`` that is neither a process
    directory nor allowed is masked, by its type. Symlinks cannot be covered (a bind mount
    follows them): any not allowed is an error, so a new kernel's cannot slip through."""
    files: list[str] = []
    dirs: list[str] = []
    for name in sorted(os.listdir(proc)):
        if name.isdigit() or name in PROC_ALLOWED:
            continue
        try:
            mode = os.lstat(os.path.join(proc, name)).st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(mode):
            dirs.append(name)
        elif stat.S_ISLNK(mode):
            raise RuntimeError(f"/proc/{name} is a symlink the /proc policy does not know")
        else:
            files.append(name)
    return ProcPolicy(PROC_READONLY, tuple(files), tuple(dirs))


def make_mask_dir(path: str) -> str:
    """The empty directory every sandbox (and every zygote of the process tier) binds
    read-only over the /proc directories it masks, instead of mounting a tmpfs of its own
    there: one superblock fewer per sandbox, and each superblock alive costs every memory
    cgroup of the host a slot in its shrinker table until the host reboots (docs/daemon.md,
    "Recycled memory cgroups"). Root-owned, mode 0555, emptied if anything is found in it."""
    try:
        os.mkdir(path, 0o555)
    except FileExistsError:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(path)
            os.mkdir(path, 0o555)
        elif os.listdir(path):
            shutil.rmtree(path)
            os.mkdir(path, 0o555)
    os.chown(path, 0, 0)
    os.chmod(path, 0o555)
    return path
