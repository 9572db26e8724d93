"""What the front remembers per sandbox: the processes it started (their config and tag, which
corral does not keep), so envd's List and tag selectors work. Bounded: a sandbox keeps at most
MAX_PROCS entries, finished ones are dropped first, and at most MAX_SANDBOXES sandboxes are
remembered."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

MAX_PROCS = 1024
MAX_SANDBOXES = 4096


@dataclass
class ProcEntry:
    pid: int
    cmd: str
    args: list[str]
    envs: dict[str, str]
    cwd: str | None
    tag: str | None
    finished: bool = False


@dataclass
class SandboxProcs:
    by_pid: dict[int, ProcEntry] = field(default_factory=dict)

    def add(self, entry: ProcEntry) -> None:
        if len(self.by_pid) >= MAX_PROCS:
            for pid in [p for p, e in self.by_pid.items() if e.finished]:
                del self.by_pid[pid]
            while len(self.by_pid) >= MAX_PROCS:
                del self.by_pid[next(iter(self.by_pid))]
        self.by_pid[entry.pid] = entry

    def by_tag(self, tag: str) -> ProcEntry | None:
        for e in reversed(list(self.by_pid.values())):
            if e.tag == tag and not e.finished:
                return e
        return None


class FrontState:
    """Per sandbox, least recently used first: sandboxes that end without the front's kill
    (TTL) are forgotten once MAX_SANDBOXES newer ones were used."""

    def __init__(self) -> None:
        self._procs: OrderedDict[str, SandboxProcs] = OrderedDict()

    def procs(self, sandbox_id: str) -> SandboxProcs:
        got = self._procs.get(sandbox_id)
        if got is None:
            got = self._procs[sandbox_id] = SandboxProcs()
            while len(self._procs) > MAX_SANDBOXES:
                self._procs.popitem(last=False)
        else:
            self._procs.move_to_end(sandbox_id)
        return got

    def forget(self, sandbox_id: str) -> None:
        self._procs.pop(sandbox_id, None)
