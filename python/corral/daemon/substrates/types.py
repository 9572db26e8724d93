"""The types that cross the substrate boundary, shared by the engine, the exec I/O layer and
every substrate; nothing here belongs to one substrate."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

# RLIMIT_CORE of every command of every substrate: no core dumps, and 1 rather than 0. Where
# the host's kernel.core_pattern is a pipe (apport, systemd-coredump), the kernel ignores
# RLIMIT_CORE 0 and runs the host's helper, as root outside every sandbox cgroup, for each crash
# in a sandbox; 1 is the kernel's own guard against that (it aborts the dump), and below any
# core file's size.
NO_CORE = (1, 1)


class NotCached(Exception):
    """A file operation asked to use memory only (``cached_only``) needed the disk (a path
    lookup, bytes not in the page cache) or an unbounded walk (a symlink in the path, which
    the sandbox can chain 40 deep at 4 KiB each; more than 64 components). The engine asks
    again from a file thread; the event loop never waits for a disk a sandbox can keep busy
    and its files cold, nor walks a path a sandbox made long."""


class PauseHeldOff(TimeoutError):
    """A freeze that did not take because a thread of the sandbox itself stayed running in
    the kernel past every wait (a syscall the freezer cannot interrupt, such as populating or
    tearing down the page tables of a huge mapping, issued on purpose): the sandbox's own
    doing, never the platform's. ``tid``: one such thread (the host's id)."""

    def __init__(self, message: str, tid: int) -> None:
        super().__init__(message)
        self.tid = tid


class OomCount(NamedTuple):
    """Two counts a substrate reads off a sandbox's memory accounting before and after a span
    (a command's run, a sandbox's life): only their differences mean anything (oom_verdict).

    - ``kills``: the sandbox's processes the kernel's OOM killer killed, whichever OOM chose
      them: the sandbox's own limit, an enclosing limit (the daemon's, a node's), or the
      whole host out of memory (the kernel counts a kill at the victim whatever the cause).
    - ``own``: evidence that the sandbox's *own* limit was hit (a substrate's choice of
      counter: see corral.daemon.cgroups.common.oom_count_at for the container's). An OOM at
      its own limit always raises it."""

    kills: int
    own: int


def oom_verdict(before: OomCount | None, after: OomCount | None) -> str | None:
    """What the OOM kills between two readings were: None (none, or not counted), ``own``
    (the sandbox's own limit was hit in the span: its doing, category limit) or ``host``
    (killed by an OOM outside its own limit: the host's or an enclosing one's, infra)."""
    if before is None or after is None or after.kills <= before.kills:
        return None
    return "own" if after.own > before.own else "host"


@dataclass(slots=True)  # tens of thousands live at once
class SandboxRuntime:
    """What a substrate needs to find one live sandbox again; persisted as JSON by the engine.

    ``init_pid`` + ``init_starttime`` (field 22 of /proc/PID/stat) identify PID 1 of the sandbox
    without the pid-reuse race; ``pidfd`` is the live handle (not persisted). ``cgroup_paths``
    and ``extra`` are the substrate's own: the engine stores them, never reads them.
    """

    sandbox_id: str
    init_pid: int
    init_starttime: int
    sandbox_dir: str
    cgroup_paths: list[str]
    pidfd: int = -1
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "sandbox_id": self.sandbox_id,
            "init_pid": self.init_pid,
            "init_starttime": self.init_starttime,
            "sandbox_dir": self.sandbox_dir,
            "cgroup_paths": self.cgroup_paths,
            "extra": self.extra,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SandboxRuntime:
        return cls(
            sandbox_id=d["sandbox_id"],
            init_pid=int(d["init_pid"]),
            init_starttime=int(d["init_starttime"]),
            sandbox_dir=d["sandbox_dir"],
            cgroup_paths=list(d["cgroup_paths"]),
            extra=dict(d.get("extra", {})),
        )


@dataclass
class ExecSpec:
    """A command to start inside a sandbox, fully resolved by the engine."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    uid: int = 0
    gid: int = 0
    groups: list[int] = field(default_factory=list)
    stdin_fd: int = -1   # child's end of the pipes; -1 means /dev/null
    stdout_fd: int = -1
    stderr_fd: int = -1


@dataclass(slots=True)
class Spawned:
    """A started command: what ``Substrate.spawn`` gives, on every path.

    ``own_child``: the daemon's own child (``pidfd`` is -1: the exec layer opens one and reaps
    the child itself). Otherwise someone else reaps it (a sandbox's init) and ``pidfd`` (ours
    to close) is how the daemon learns of the reap and reads the exit status. ``pid`` is the
    host pid (0 if it already exited and was reaped before we asked), ``ns_pid`` the pid the
    sandbox sees (0: unknown yet, read from /proc by the exec layer)."""

    pidfd: int
    pid: int
    ns_pid: int
    own_child: bool = False


@dataclass(frozen=True)
class Capabilities:
    """What a substrate can do beyond the core every substrate has (create, exec, destroy,
    recover). The engine checks an operation against it before any side effect; one the
    substrate lacks answers ``unsupported`` (501). Shown by ``GET /v1/substrates``."""

    files: bool = False           # read/write/list/stat/mkdir/remove/rename, tar up/down
    snapshot: bool = False        # capture the sandbox's files as a layer (snapshot, fork)
    restore: bool = False         # roll back in place onto a snapshot (reset)
    pause: bool = False           # freeze and thaw every process (pause, resume)
    oom_kills: bool = False       # counts OOM kills: ExecResult.oom_killed, sandbox_crashed
    exit_watch: bool = False      # learns of dead inits without one fd per sandbox
    warm_pool: bool = False       # sandboxes can be made ahead of demand (warm pools)
    networks: tuple[str, ...] = ("none",)  # the SandboxSpec.network modes it can give

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    def operations(self) -> list[str]:
        """The API operations it takes (for ``corral status``)."""
        ops = ["create", "exec", "kill"]
        if self.files:
            ops.append("files")
        if self.snapshot:
            ops += ["snapshot", "fork"]
        if self.restore:
            ops.append("restore")
        if self.pause:
            ops += ["pause", "resume"]
        return ops
