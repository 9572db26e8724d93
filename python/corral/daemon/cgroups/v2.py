"""cgroup v2: one unified hierarchy, one directory per sandbox."""

from __future__ import annotations

import errno
import os

from .common import (
    _V2_REQUIRED,
    CFS_PERIOD_US,
    DAEMON_CGROUP,
    CgroupManager,
    _mounts,
    _read,
    _read_pids,
    _v2_controllers,
    _v2_options,
    _write,
)


class CgroupsV2(CgroupManager):
    version = 2
    _procs_file = "cgroup.procs"
    _threads_file = "cgroup.threads"
    _usage_file = "memory.current"
    _oom_file = "memory.events"

    def __init__(self, name: str = "corral") -> None:
        super().__init__(name)
        _, v2 = _mounts()
        controllers = _v2_controllers(v2)
        if not v2 or not _V2_REQUIRED <= controllers:
            raise RuntimeError(f"no usable cgroup2: at {v2} it offers {sorted(controllers)}")
        self._root = v2
        self._pids_events_own = "pids_localevents" not in _v2_options(v2)
        self._bases = [os.path.join(v2, name)]
        self._setup_v2()
        self._views[self._bases[0]] = ("", "cgroup2", "")

    def _setup_v2(self) -> None:
        """Make <root>/<name> and enable memory, pids, cpu down the chain to our sandboxes."""
        chain = [self._root]
        for part in self.name.split("/"):
            chain.append(os.path.join(chain[-1], part))
        for d in chain[1:]:
            os.makedirs(d, exist_ok=True)
        for d in chain:
            self._enable_v2(d)
        self._swap: bool | None = None  # learnt on the first create (memory.swap.max exists or not)

    def _enable_v2(self, d: str) -> None:
        ctl = os.path.join(d, "cgroup.subtree_control")
        if _V2_REQUIRED <= set(_read(ctl).split()):
            return
        try:
            _write(ctl, "+memory +pids +cpu")
        except OSError as e:
            # "No internal processes": a non-root cgroup (typically the root of a container's
            # cgroup namespace) that holds processes cannot delegate controllers. Move those
            # processes to a leaf, as docker-in-docker does, and retry once.
            if e.errno != errno.EBUSY or d != self._root:
                raise
            leaf = os.path.join(d, "init")
            os.makedirs(leaf, exist_ok=True)
            for pid in _read_pids(d):
                try:
                    _write(os.path.join(leaf, "cgroup.procs"), str(pid))
                except OSError:
                    pass  # exited, or a kernel thread
            _write(ctl, "+memory +pids +cpu")

    @property
    def _memcgs(self) -> str:
        return self._bases[0]

    @property
    def lazy_memory_ok(self) -> bool:
        return False

    @property
    def memory_base(self) -> str | None:
        return None

    def host_cpus(self) -> list[int] | None:
        return None

    def later_paths(self, sandbox_id: str) -> list[str]:
        return []

    def create(self, sandbox_id: str, cpu: float, memory_mb: int, pids: int,
               later: bool = False, cpus: str | None = None) -> list[str]:
        paths = self.paths_for(sandbox_id)
        mem = int(memory_mb) * 1024 * 1024
        quota = max(1000, int(round(cpu * CFS_PERIOD_US)))
        p = paths[0]
        os.mkdir(p, 0o755)
        try:
            _write(p + "/memory.max", str(mem))
            if self._swap is None:
                self._swap = os.path.exists(p + "/memory.swap.max")
            if self._swap:
                _write(p + "/memory.swap.max", "0")
            _write(p + "/pids.max", str(int(pids)))
            _write(p + "/cpu.max", f"{quota} {CFS_PERIOD_US}")
        except BaseException:
            try:
                os.rmdir(p)
            except OSError:
                pass
            raise
        return paths

    def ensure_later(self, sandbox_id: str, cpu: float, memory_mb: int,
                     pids: list[int], cpus: str | None = None) -> None:
        """Nothing comes later on v2 (later_paths is empty)."""

    def recycle_memory(self, sandbox_id: str) -> bool:
        return False

    def recycle_rest(self, sandbox_id: str) -> None:
        return

    def spare_ready(self) -> bool:
        return False

    def drop_spares(self, all_on_disk: bool = False) -> None:
        return  # nothing is recycled on v2

    def _kill_first(self, paths: list[str]) -> None:
        if paths:
            try:
                _write(paths[0] + "/cgroup.kill", "1")
            except FileNotFoundError:
                pass  # no cgroup.kill (kernel < 5.14) or no cgroup: the loop below does it

    def _protect_daemon(self, reserve_bytes: int) -> None:
        chain = [self._root]
        for part in [*self.name.split("/"), DAEMON_CGROUP]:
            chain.append(os.path.join(chain[-1], part))
        for c in chain[1:]:  # top down: a child's protection is capped by its parent's
            for f, want in (("memory.min", reserve_bytes),
                            ("memory.low", 2 * reserve_bytes)):
                try:
                    have = _read(os.path.join(c, f)).strip()
                    if have != "max" and int(have) < want:
                        _write(os.path.join(c, f), str(want))
                except (OSError, ValueError):
                    pass  # an ancestor we do not control: protection stops there

    # ---- freezer ---------------------------------------------------------------------------
    def _freezer_path(self, paths: list[str]) -> str:
        return paths[0]

    def is_frozen(self, paths: list[str]) -> bool:
        return "frozen 1" in _read(self._freezer_path(paths) + "/cgroup.events")

    def freeze_requested(self, paths: list[str]) -> bool:
        return _read(self._freezer_path(paths) + "/cgroup.freeze").strip() == "1"

    def _set_frozen(self, path: str, frozen: bool) -> None:
        _write(path + "/cgroup.freeze", "1" if frozen else "0")


