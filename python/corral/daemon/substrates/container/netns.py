"""Network namespaces: the pool of ready ones and the one shared by network "disabled"."""

from __future__ import annotations

import collections
import os
import threading
import time

from corral import _core
from corral.daemon import kernel
from corral.errors import Unsupported

# The first Landlock ABI with scopes (LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET): network "disabled".
LANDLOCK_ABI_SCOPES = 6


def background_priority() -> None:
    """Lowest CPU priority (nice 19) for the calling thread: a refill that runs while a batch
    of creates is in flight would take CPU from those creates, on the path, for work meant
    to be off it."""
    kernel.nice_thread(19)


class NetnsPool:
    """Ready network namespaces (fds with loopback up), so creating a sandbox does not pay the
    ~0.8 ms a new netns costs, nor its teardown. Refilled by a background thread with fresh
    namespaces, and by ``recycle`` with those of destroyed sandboxes that did nothing there.

    Part of what a sandbox does to its namespace outlives its processes and cannot be reset
    (it has no CAP_NET_ADMIN, and counters have no reset at all): lo's packet and byte
    counters (/proc/net/dev, netlink), the TCP/IP MIB counters (/proc/net/snmp, netstat), and
    sockets left in TIME_WAIT by the side that closed first (60 s, in /proc/net/tcp and
    sock_diag, holding their ports). So a namespace is reused only when all of that equals a
    fresh namespace's (``_core.netns_fingerprint``): one whose sandbox sent nothing and holds
    no socket, which most sandboxes of an agent's shell session are. Any trace, and it is
    dropped. tests/test_isolation.py::test_network_namespace_never_shows_a_previous_sandbox
    attacks it; a restore (``reset``) keeps the same tenant's own namespace."""

    def __init__(self, size: int, most: int | None = None, window_s: float = 30.0) -> None:
        self.base = self.size = max(0, size)
        # A batch of creates (create_many, fork) raises the target to its size, up to
        # ``most``, for ``window_s`` after the last such batch: a GRPO trainer forks groups
        # of the same size again and again, and each netns made on the request path costs
        # ~0.8 ms of CPU. Each idle one costs ~180 KiB, hence the cap and the decay.
        self.most = max(self.base, most if most is not None else 2 * self.base)
        self.window_s = window_s
        self._raised_until = 0.0
        self._fds: collections.deque[int] = collections.deque()
        self._fresh_print: bytes | None = None  # a fresh namespace's fingerprint
        self.recycled = 0       # destroyed sandboxes' namespaces reused
        self.not_recycled = 0   # dropped: a trace of their sandbox, or no room
        self._cv = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        if self.size:
            self._thread = threading.Thread(target=self._run, name="corral-netns-pool",
                                            daemon=True)
            self._thread.start()

    def take(self) -> int | None:
        """A ready namespace, or None if empty."""
        with self._cv:
            fd = self._fds.pop() if self._fds else None
            self._cv.notify()
        return fd

    def expect(self, n: int) -> None:
        """A batch of ``n`` creates is starting: keep up to ``n`` ready for the next one."""
        if not self.base:
            return  # pooling is off
        with self._cv:
            self._raised_until = time.monotonic() + self.window_s
            want = min(self.most, max(self.base, n))
            if want > self.size:
                self.size = want
                self._cv.notify()

    def _decay(self) -> None:
        """Back to the base size once no batch came for a while (the lock is held)."""
        if self.size > self.base and time.monotonic() >= self._raised_until:
            self.size = self.base
            while len(self._fds) > self.size:
                os.close(self._fds.popleft())

    def give(self, fd: int) -> None:
        """Keep a namespace for later: only one no sandbox code has used (that of a create that
        failed before its init ran anything of the sandbox's). Kept up to twice ``size``."""
        with self._cv:
            if not self._closed and len(self._fds) < 2 * self.size:
                self._fds.append(fd)
                return
        os.close(fd)

    def recycle(self, fd: int) -> bool:
        """Keep the namespace of a destroyed sandbox (every process of it gone) for a later
        one if nothing of that sandbox shows in it; else, or without room (up to twice
        ``size``: the refill thread makes new ones only below ``size``), close it. This call
        owns ``fd``; True if kept."""
        try:
            with self._cv:
                room = not self._closed and self.base and len(self._fds) < 2 * self.size
            if room and _core.netns_fingerprint(fd) == self._fresh():
                with self._cv:
                    if not self._closed and len(self._fds) < 2 * self.size:
                        self._fds.append(fd)
                        self.recycled += 1
                        return True
        except OSError:
            pass  # unreadable: not provably clean
        os.close(fd)
        self.not_recycled += 1
        return False

    def _fresh(self) -> bytes:
        """The fingerprint every fresh namespace has (read once, from a new one)."""
        if self._fresh_print is None:
            fd = _core.netns_new()
            try:
                self._fresh_print = _core.netns_fingerprint(fd)
            finally:
                os.close(fd)
        return self._fresh_print

    def __len__(self) -> int:
        return len(self._fds)

    def _run(self) -> None:
        background_priority()
        while True:
            with self._cv:
                while not self._closed and len(self._fds) >= self.size:
                    # Woken by takes and raises; the timeout lets a raised size decay.
                    self._cv.wait(timeout=self.window_s if self.size > self.base else None)
                    self._decay()
                if self._closed:
                    return
            try:
                fd = _core.netns_new()
            except OSError:
                time.sleep(1.0)  # e.g. out of memory: try again later, creates fall back
                continue
            with self._cv:
                if not self._closed and len(self._fds) < self.size:
                    self._fds.appendleft(fd)
                    continue
            os.close(fd)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            fds = list(self._fds)
            self._fds.clear()
            self._cv.notify_all()
        for fd in fds:
            os.close(fd)
        if self._thread is not None:
            self._thread.join(timeout=5)


class SharedNetns:
    """The one network namespace every sandbox with network "disabled" joins, made on first
    use and held by the daemon. A network namespace costs ~180 KiB and ~0.8 ms of CPU to tear
    down; these sandboxes need none of their own because they cannot make a socket other than
    AF_UNIX (seccomp). What a shared namespace would still share is the namespace of abstract
    unix socket names: every process of such a sandbox runs in a Landlock domain scoped for
    abstract sockets (ABI >= 6), so it cannot connect to one bound outside its domain. Hence the
    mode is refused where Landlock lacks scopes.

    After a daemon restart, re-adopted sandboxes keep the namespace they were made in (the old
    daemon's); new ones join this daemon's. Both hold no interfaces but a loopback that nobody
    can use."""

    def __init__(self) -> None:
        self._fd = -1
        self._lock = threading.Lock()

    @staticmethod
    def check_supported() -> None:
        abi = _core.landlock_abi()
        if abi < LANDLOCK_ABI_SCOPES:
            why = (f"Landlock ABI {abi}" if abi >= 0
                   else f"Landlock unavailable ({os.strerror(-abi)})")
            raise Unsupported(
                "network 'disabled' needs Landlock ABI >= 6 (abstract unix socket scoping; "
                f"Linux >= 6.12 with landlock in CONFIG_LSM / lsm=): this host has {why}",
                details={"landlock_abi": abi})

    def fd(self) -> int:
        """The namespace's fd (owned here: callers must not close it)."""
        with self._lock:
            if self._fd < 0:
                self.check_supported()
                self._fd = _core.netns_new()
            return self._fd

    def same(self, fd: int) -> bool:
        """Whether ``fd`` is this namespace (belt and braces: never pool it)."""
        shared = self._fd
        if shared < 0:
            return False
        a, b = os.fstat(fd), os.fstat(shared)
        return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
