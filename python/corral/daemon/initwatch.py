"""Watch many sandbox inits for their death without an fd per sandbox in the daemon's fd table.

A pidfd turns readable when its process exits: the exact, race-free way to learn that an init
died. But one pidfd per sandbox makes the daemon's fd table as big as its sandbox count, and
RLIMIT_NOFILE caps it (at 20,000 on hosts where the daemon may not raise its hard limit), and
every fd in that table was copied and closed by each fork (see rust/src/child.rs).

So the pidfds live elsewhere: in *shard threads*, each with a private fd table
(``unshare(CLONE_FILES)`` affects only the calling thread) holding up to ``PER_SHARD`` pidfds
in its own epoll set. RLIMIT_NOFILE bounds each table, not their sum. A shard opens the pidfd
itself from the pid. An init is the daemon's child and nobody reaps it before its sandbox is
destroyed, whose ``remove`` is queued before the reap; a shard runs its queue in order. So
should the pid be reused before the shard gets to it, the pidfd it opens from the ``add``
is closed by the ``remove`` right behind it, and a death reported meanwhile carries the
ended registration's token and is ignored. ``remove`` therefore only queues: a destroy
does not wait for a shard thread. Within one batch of epoll events a shard handles the
deaths before the commands (``run_batch`` says why). Deaths come back to the event loop
through one eventfd.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import threading
from collections.abc import Callable
from typing import Any

from corral.daemon import kernel

log = logging.getLogger("corral.initwatch")

PER_SHARD = int(os.environ.get("CORRAL_INITWATCH_PER_SHARD", "15000"))


class _Shard:
    def __init__(self, watcher: InitWatcher, index: int) -> None:
        self.watcher = watcher
        self.index = index
        self.lock = threading.Lock()
        self.cmds: list[tuple[str, int, Any]] = []  # (op, pid, token or Event)
        self.count = 0                   # pids registered (or queued)
        self.wake = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)  # in both tables
        self.ready = threading.Event()
        self.failed: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"corral-initwatch-{index}",
                                       daemon=True)
        self.thread.start()
        self.ready.wait()
        if self.failed is not None:
            os.close(self.wake)
            raise self.failed

    def send(self, op: str, pid: int, arg: Any = None) -> None:
        with self.lock:
            self.cmds.append((op, pid, arg))
        os.eventfd_write(self.wake, 1)

    # ---- the shard thread (its own fd table) -------------------------------------------------
    def _run(self) -> None:
        try:
            kernel.unshare_files()
            # Our copy of the daemon's table: keep only what this thread uses.
            keep = {self.wake, self.watcher.notify}
            for fd in _open_fds():
                if fd > 2 and fd not in keep:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            ep = select.epoll()
            ep.register(self.wake, select.EPOLLIN)
        except BaseException as e:  # noqa: BLE001 - reported to the creator
            self.failed = e
            self.ready.set()
            return
        self.ready.set()
        table = _Table(ep)
        while True:
            try:
                events = ep.poll()
            except InterruptedError:
                continue
            ready = [fd for fd, _ in events]
            if not run_batch(ready, self.wake, table, self._take, self.watcher._died):
                os.close(self.wake)
                return

    def _take(self) -> list[tuple[str, int, Any]]:
        """The queued commands (the wake eventfd read first, so none is missed)."""
        try:
            os.eventfd_read(self.wake)
        except BlockingIOError:
            pass
        with self.lock:
            cmds, self.cmds = self.cmds, []
        return cmds


class _Table:
    """A shard's pidfds, in its own fd table and epoll set: pidfd -> (pid, token), pid ->
    pidfd."""

    def __init__(self, ep: Any) -> None:
        self.ep = ep
        self.fds: dict[int, tuple[int, int]] = {}
        self.by_pid: dict[int, int] = {}

    def add(self, pid: int, token: int) -> bool:
        """Watch ``pid``; False if it is already gone (no pidfd)."""
        try:
            pfd = kernel.pidfd_open(pid)
        except OSError:
            return False
        self.fds[pfd] = (pid, token)
        self.by_pid[pid] = pfd
        self.ep.register(pfd, select.EPOLLIN)
        return True

    def remove(self, pid: int) -> None:
        pfd = self.by_pid.pop(pid, -1)
        if pfd >= 0:
            del self.fds[pfd]
            self._close(pfd)

    def ended(self, pfd: int) -> tuple[int, int] | None:
        """The registration whose pidfd turned readable, now closed; None if ``pfd`` is not
        one of ours."""
        entry = self.fds.pop(pfd, None)
        if entry is not None:
            self.by_pid.pop(entry[0], None)
            self._close(pfd)
        return entry

    def close_all(self) -> None:
        for pfd in list(self.fds):
            os.close(pfd)
        self.fds.clear()
        self.by_pid.clear()
        self.ep.close()

    def _close(self, pfd: int) -> None:
        self.ep.unregister(pfd)
        os.close(pfd)


def run_batch(ready: list[int], wake: int, table: Any,
              take: Callable[[], list[tuple[str, int, Any]]],
              died: Callable[[int, int], None]) -> bool:
    """One batch of ready fds from a shard's epoll: the deaths first, then the commands.
    In that order because a command closes pidfds (``remove``) and opens others (``add``),
    and the kernel gives a new fd the lowest free number: a death event of this batch for a
    pidfd that a ``remove`` closed would otherwise be read as the death of the process whose
    ``add`` just got the same number, a live sandbox reported dead. False once told to stop.
    """
    for fd in ready:
        if fd != wake and (entry := table.ended(fd)) is not None:
            died(*entry)
    if wake not in ready:
        return True
    for op, pid, arg in take():
        if op == "add":
            if not table.add(pid, arg):
                died(pid, arg)  # already gone
        elif op == "remove":
            table.remove(pid)
        elif op == "stop":
            table.close_all()
            arg.set()
            return False
    return True


def _open_fds() -> list[int]:
    try:
        return [int(x) for x in os.listdir("/proc/thread-self/fd")]
    except OSError:
        return []


class InitWatcher:
    """``add(pid)`` after a sandbox's init is made; ``remove(pid)`` before destroy reaps it;
    ``on_dead(pids)`` runs on the event loop."""

    def __init__(self, loop: Any, on_dead: Callable[[list[int]], None]) -> None:
        self.loop = loop
        self.on_dead = on_dead
        self.notify = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._dead: list[tuple[int, int]] = []
        self._dead_lock = threading.Lock()
        self._shards: list[_Shard] = []
        # pid -> (shard, token): a death report counts only with the token of the current
        # registration (a late report about an earlier process with the same pid does not).
        self._where: dict[int, tuple[_Shard, int]] = {}
        self._token = 0
        self._lock = threading.Lock()
        loop.add_reader(self.notify, self._drain)

    def add(self, pid: int) -> None:
        with self._lock:
            shard = next((s for s in self._shards if s.count < PER_SHARD), None)
            if shard is None:
                shard = _Shard(self, len(self._shards))
                self._shards.append(shard)
            shard.count += 1
            self._token += 1
            token = self._token
            self._where[pid] = (shard, token)
        shard.send("add", pid, token)

    def remove(self, pid: int) -> None:
        """Stop watching ``pid``: no death of it is reported from now on. Queued, not waited
        for (see the module's docstring): the caller may reap it at once."""
        self.remove_many([pid])

    def remove_many(self, pids: list[int]) -> None:
        """``remove`` for a batch."""
        for pid in pids:
            with self._lock:
                entry = self._where.pop(pid, None)
                if entry is None:
                    continue
                shard = entry[0]
                shard.count -= 1
            shard.send("remove", pid)

    def watching(self, pid: int) -> bool:
        return pid in self._where

    def __len__(self) -> int:
        return len(self._where)

    # called from shard threads
    def _died(self, pid: int, token: int) -> None:
        with self._dead_lock:
            self._dead.append((pid, token))
        try:
            os.eventfd_write(self.notify, 1)
        except OSError as e:  # closed at shutdown
            if e.errno != errno.EBADF:
                raise

    def _drain(self) -> None:
        try:
            os.eventfd_read(self.notify)
        except BlockingIOError:
            pass
        with self._dead_lock:
            dead, self._dead = self._dead, []
        pids = []
        with self._lock:
            for pid, token in dead:
                entry = self._where.get(pid)
                if entry is not None and entry[1] == token:
                    del self._where[pid]
                    entry[0].count -= 1
                    pids.append(pid)
        if pids:
            self.on_dead(pids)

    def close(self) -> None:
        try:
            self.loop.remove_reader(self.notify)
        except Exception:  # noqa: BLE001 - the loop may be closed
            pass
        for shard in self._shards:
            done = threading.Event()
            shard.send("stop", 0, done)
            done.wait(5)
            os.close(shard.wake)  # the daemon's copy
        self._shards.clear()
        self._where.clear()
        os.close(self.notify)
