"""Where the daemon keeps commands' output: memory it bounds, and spill files past it.

A command's result keeps up to ``max_output_bytes`` of each stream (4 MiB by default, 256 MiB
at most). Kept whole in memory, that is bounded only by how many commands run at once: 48
default-capped commands printing 8 MiB to each stream grew the daemon by 0.7-1.1 GB (~16-24
MiB a command with its answer), so a few thousand sandboxes doing it at once would take the
daemon, and every tenant with it, down. So each stream keeps its first ``FLOOR`` bytes in
memory for free (a pipe's own buffer is as big: the common small output never touches
anything else), and every byte past that is charged to one daemon-wide pool of ``limit``
bytes (a quarter of MemTotal, CORRAL_OUTPUT_MEMORY_MB). A stream whose next bytes the pool
cannot take goes on in a spill file: unlinked (``O_TMPFILE``) in the state directory, charged
to no pool in memory, read back slice by slice as the answer is written (``OutputText``). No
command is refused or slowed for its output: the pool decides only where the bytes go.

Spill files together hold at most ``disk_limit`` bytes (CORRAL_OUTPUT_DISK_MB, by default a
quarter of the state directory's free space at start), so that a flood cannot fill the disk
the trajectory log and the sandboxes' layers live on. A stream that can keep nothing more
(both full, or the file cannot be written: ENOSPC) keeps what it has and is ``truncated``
like one past its cap; its byte count and hash still cover everything it printed.

One tenant's commands hold at most ``TENANT_SHARE`` of the pool and of the spill share
(``OutputMemory.share``): past that its own streams keep nothing more, and another tenant's
output still fits. The admin's (no tenant) are bound by the whole store only.

What is kept (memory charged, file and its disk share) is given back when the last holder
lets go: the command's result once its answer is written, a background process's record once
forgotten, a follower's view once sent.
"""

from __future__ import annotations

import codecs
import hashlib
import logging
import os
import tempfile
from collections.abc import Iterator
from typing import Any

from corral.daemon import capacity

log = logging.getLogger("corral.outputmem")

MEMORY_SHARE = 0.25  # of MemTotal, when CORRAL_OUTPUT_MEMORY_MB does not say
DISK_SHARE = 0.25    # of the state dir's free space, when CORRAL_OUTPUT_DISK_MB does not say
# Kept in memory uncharged, per stream: a pipe's default buffer, which every command's
# stream already costs the kernel.
FLOOR = 64 << 10
READ_SLICE = 64 << 10  # bytes of a kept output read back (and decoded) at once
TENANT_SHARE = 0.5  # of the pool and of the spill share, the most one tenant's output holds


def default_limit() -> int:
    """A quarter of the host's memory (1 GiB if it cannot be read)."""
    total = capacity.meminfo_kib("MemTotal")
    return int((total or (4 << 20)) * 1024 * MEMORY_SHARE)


def default_disk_limit(path: str) -> int:
    """A quarter of the free space of ``path``'s filesystem now (0 if it cannot be read)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return int(st.f_bavail * st.f_frsize * DISK_SHARE)


class OutputMemory:
    """The daemon's pool for output past each stream's FLOOR (``limit`` bytes of memory), and
    its spill files in ``spill_dir`` (``disk_limit`` bytes)."""

    def __init__(self, limit: int, spill_dir: str | None = None, disk_limit: int = 0) -> None:
        self.limit = limit
        self.held = 0
        self.spill_dir = spill_dir
        self.disk_limit = disk_limit if spill_dir else 0
        self.spilled = 0
        self.counters = {"spills": 0, "spill_full": 0, "tenant_full": 0}
        # tenant -> [memory, spill] bytes its commands hold (TenantShare), none at zero
        self._tenant_use: dict[str, list[int]] = {}

    def share(self, tenant: str | None) -> OutputMemory:
        """Where a command of ``tenant`` keeps its output: its share of this store (the store
        itself for the admin's, None)."""
        return self if tenant is None else TenantShare(self, tenant)

    def tenant_held(self, tenant: str) -> tuple[int, int]:
        """(memory, spill) bytes ``tenant``'s commands hold now."""
        use = self._tenant_use.get(tenant, [0, 0])
        return use[0], use[1]

    def take(self, size: int) -> bool:
        if self.held + size > self.limit:
            return False
        self.held += size
        return True

    def give(self, size: int) -> None:
        self.held = max(0, self.held - size)

    def take_disk(self, size: int) -> int:
        """Up to ``size`` bytes of the spill files' share: how many it got."""
        got = max(0, min(size, self.disk_limit - self.spilled))
        self.spilled += got
        return got

    def give_disk(self, size: int) -> None:
        self.spilled = max(0, self.spilled - size)

    def open_spill(self) -> int:
        """A new unlinked file for one stream's spill; -1 if none can be made."""
        if not self.spill_dir:
            return -1
        try:
            return os.open(self.spill_dir, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
        except OSError:
            pass
        try:  # a filesystem without O_TMPFILE: made and unlinked at once
            fd, path = tempfile.mkstemp(prefix=".output-", dir=self.spill_dir)
            os.unlink(path)
            return fd
        except OSError as e:
            log.warning("cannot make an output spill file", extra={"error": str(e)})
            return -1


class TenantShare(OutputMemory):
    """One tenant's view of an OutputMemory: at most TENANT_SHARE of its pool and of its
    spill share, charged to both. What the tenant holds is counted in the store
    (``_tenant_use``, its entry dropped at zero), so every view of one tenant shares it."""

    def __init__(self, store: OutputMemory, tenant: str) -> None:
        self.store, self.tenant = store, tenant
        self.limit = int(store.limit * TENANT_SHARE)
        self.disk_limit = int(store.disk_limit * TENANT_SHARE)
        self.spill_dir = store.spill_dir
        self.counters = store.counters

    def _use(self) -> list[int]:
        return self.store._tenant_use.setdefault(self.tenant, [0, 0])

    def _settle(self, use: list[int]) -> None:
        if use == [0, 0]:
            self.store._tenant_use.pop(self.tenant, None)

    def take(self, size: int) -> bool:
        use = self._use()
        if use[0] + size > self.limit:
            self.counters["tenant_full"] += 1
            self._settle(use)
            return False
        if not self.store.take(size):
            self._settle(use)
            return False
        use[0] += size
        return True

    def give(self, size: int) -> None:
        use = self._use()
        size = min(size, use[0])
        use[0] -= size
        self.store.give(size)
        self._settle(use)

    def take_disk(self, size: int) -> int:
        use = self._use()
        got = self.store.take_disk(max(0, min(size, self.disk_limit - use[1])))
        use[1] += got
        self._settle(use)
        return got

    def give_disk(self, size: int) -> None:
        use = self._use()
        size = min(size, use[1])
        use[1] -= size
        self.store.give_disk(size)
        self._settle(use)

    def share(self, tenant: str | None) -> OutputMemory:
        return self.store.share(tenant)


class Kept:
    """What one stream keeps: ``head`` in memory (FLOOR free, the rest charged to the pool),
    then ``spilled`` bytes in the file ``fd``. Given back when collected."""

    __slots__ = ("store", "head", "fd", "spilled", "charged", "full")

    def __init__(self, store: OutputMemory | None) -> None:
        self.store = store  # None: all in memory, charged nowhere (nothing outside exec)
        self.head = bytearray()
        self.fd = -1
        self.spilled = 0
        self.charged = 0
        self.full = False  # nothing more can be kept (pool and disk full, a write failed)

    def __len__(self) -> int:
        return len(self.head) + self.spilled

    def add(self, data: bytes) -> int:
        """Keep ``data``; how many of its bytes were kept (fewer once ``full``)."""
        store = self.store
        if store is None:
            self.head += data
            return len(data)
        if self.full:
            return 0
        n = 0
        if self.fd < 0:
            free = FLOOR - len(self.head)
            if free > 0:
                self.head += data[:free]
                n = min(free, len(data))
            more = len(data) - n
            if more == 0:
                return n
            if store.take(more):
                self.head += data[n:]
                self.charged += more
                return len(data)
            self.fd = store.open_spill()
            if self.fd < 0:
                self.full = True
                return n
            store.counters["spills"] += 1
        got = store.take_disk(len(data) - n)
        view = memoryview(data)[n:n + got]
        done = 0
        try:
            while done < len(view):  # a regular file: short only when the disk is full
                w = os.pwrite(self.fd, view[done:], self.spilled + done)
                if w <= 0:
                    break
                done += w
        except OSError as e:
            log.warning("output spill write failed", extra={"error": str(e)})
        if done < len(data) - n:  # the share or the disk is full: nothing more is kept
            store.give_disk(got - done)
            store.counters["spill_full"] += 1
            self.full = True
        self.spilled += done
        return n + done

    def add_charged(self, data: bytes) -> bool:
        """Keep ``data`` (an empty Kept's first and only bytes) with nothing of it free: in
        memory if the pool takes it, else in a spill file. False, keeping nothing, if neither
        can (the pool and the spill share full, or the file cannot be written)."""
        store = self.store
        if store is None or store.take(len(data)):
            self.head += data
            self.charged += len(data) if store is not None else 0
            return True
        fd = store.open_spill()
        if fd < 0:
            return False
        got = store.take_disk(len(data))
        done = 0
        try:
            while done < got:
                w = os.pwrite(fd, memoryview(data)[done:got], done)
                if w <= 0:
                    break
                done += w
        except OSError as e:
            log.warning("output spill write failed", extra={"error": str(e)})
        if done < len(data):
            store.give_disk(got)
            os.close(fd)
            return False
        store.counters["spills"] += 1
        self.fd, self.spilled = fd, done
        return True

    def chunks(self, size: int | None = None) -> Iterator[bytes]:
        """The first ``size`` kept bytes (all of them: None), READ_SLICE at a time."""
        end = len(self) if size is None else min(size, len(self))
        head = self.head
        pos = 0
        while pos < min(end, len(head)):
            stop = min(end, len(head), pos + READ_SLICE)
            yield bytes(head[pos:stop])
            pos = stop
        while pos < end:
            off = pos - len(head)
            data = os.pread(self.fd, min(READ_SLICE, end - pos), off)
            if not data:  # cannot happen (written before counted); never spin
                break
            yield data
            pos += len(data)

    def tail(self, size: int) -> bytes:
        """The last ``size`` kept bytes."""
        end = len(self)
        start = max(0, end - size)
        return b"".join(self._range(start, end))

    def _range(self, start: int, end: int) -> Iterator[bytes]:
        head = self.head
        if start < len(head):
            yield bytes(head[start:min(end, len(head))])
            start = len(head)
        if start < end:
            yield os.pread(self.fd, end - start, start - len(head))

    def free(self) -> None:
        """Give back what it holds now (the collection does it otherwise)."""
        store = self.store
        if store is not None:
            if self.charged:
                store.give(self.charged)
                self.charged = 0
            if self.spilled:
                store.give_disk(self.spilled)
                self.spilled = 0
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.head = bytearray()

    def __del__(self) -> None:
        self.free()


class OutputText:
    """The text of a kept output's first ``size`` bytes (UTF-8, undecodable bytes replaced),
    without ever holding it whole: JSON answers (jsonbody) and the trajectory log's copy read
    it slice by slice. It keeps its ``Kept`` (memory, file) alive while it exists."""

    __slots__ = ("kept", "size")

    def __init__(self, kept: Kept, size: int | None = None) -> None:
        self.kept = kept
        self.size = len(kept) if size is None else size

    def __bool__(self) -> bool:
        return self.size > 0

    def slices(self) -> Iterator[str]:
        """Consecutive parts of the text (joined: ``bytes.decode("utf-8", "replace")``)."""
        dec = codecs.getincrementaldecoder("utf-8")("replace")
        for chunk in self.kept.chunks(self.size):
            text = dec.decode(chunk)
            if text:
                yield text
        text = dec.decode(b"", True)
        if text:
            yield text

    def text(self) -> str:
        return "".join(self.slices())

    def prefix(self, chars: int) -> tuple[str, bool]:
        """The first ``chars`` characters, and whether the text goes on past them."""
        parts: list[str] = []
        n = 0
        for s in self.slices():
            if n + len(s) > chars:
                parts.append(s[:chars - n])
                return "".join(parts), True
            parts.append(s)
            n += len(s)
        return "".join(parts), False

    def sha256(self) -> str:
        """sha256 of the text as UTF-8 (surrogates escaped), as of ``text()``."""
        h = hashlib.sha256()
        for s in self.slices():
            h.update(s.encode("utf-8", "surrogateescape"))
        return h.hexdigest()


def as_text(value: Any) -> Any:
    """``value`` with an OutputText as its str (for code that needs the whole text)."""
    return value.text() if isinstance(value, OutputText) else value
