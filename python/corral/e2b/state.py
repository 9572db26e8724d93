"""What the front remembers per sandbox: the processes it started (their config and tag, which
corral does not keep), so envd's List and tag selectors work. Bounded: a sandbox keeps at most
MAX_PROCS entries, finished ones are dropped first, and at most MAX_SANDBOXES sandboxes are
remembered.

And what each sandbox holds of the front (``Quota``): open streams, directory watchers, request
bytes in memory. Whoever has a sandbox's access token (code inside it may learn it) can use up
that sandbox's share, never the front's.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

from corral.e2b.connect import ConnectError

MAX_PROCS = 1024
MAX_SANDBOXES = 4096
# Streams (Start, Connect, WatchDir, GET /files) each hold a client socket and most a
# connection to corrald; the SDK's pool to corrald has 2048, half is kept for everything else.
STREAMS_PER_SANDBOX = 64
STREAMS_TOTAL = 1024


class QuotaExceeded(ConnectError):
    """A share is used up: ``resource_exhausted`` on envd's RPCs, 429 on its HTTP API (both
    the SDK's RateLimitException)."""

    def __init__(self, message: str) -> None:
        super().__init__("resource_exhausted", message)


class Quota:
    """Units of one resource held per sandbox, capped per sandbox and in all."""

    def __init__(self, what: str, per_sandbox: int, total: int) -> None:
        self.what, self.per_sandbox, self.total = what, per_sandbox, total
        self._held: dict[str, int] = {}
        self._sum = 0

    def held(self, sandbox_id: str) -> int:
        return self._held.get(sandbox_id, 0)

    def take(self, sandbox_id: str, n: int = 1) -> None:
        mine = self.held(sandbox_id)
        if mine + n > self.per_sandbox:
            raise QuotaExceeded(f"a sandbox holds at most {self.per_sandbox} {self.what}")
        if self._sum + n > self.total:
            raise QuotaExceeded(f"the front holds at most {self.total} {self.what}")
        self._held[sandbox_id] = mine + n
        self._sum += n

    def give(self, sandbox_id: str, n: int = 1) -> None:
        left = self.held(sandbox_id) - n
        if left > 0:
            self._held[sandbox_id] = left
        else:
            self._held.pop(sandbox_id, None)
        self._sum -= n

    @contextlib.contextmanager
    def slot(self, sandbox_id: str) -> Iterator[None]:
        self.take(sandbox_id)
        try:
            yield
        finally:
            self.give(sandbox_id)


class Held:
    """What one request holds of a quota, taken as it goes and given back when it ends."""

    def __init__(self, quota: Quota, sandbox_id: str) -> None:
        self.quota, self.sandbox_id, self.n = quota, sandbox_id, 0

    def take(self, n: int) -> None:
        self.quota.take(self.sandbox_id, n)
        self.n += n

    def __enter__(self) -> Held:
        return self

    def __exit__(self, *exc: object) -> None:
        self.quota.give(self.sandbox_id, self.n)
        self.n = 0


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
