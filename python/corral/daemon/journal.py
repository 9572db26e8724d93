"""The trajectory log's journal: append-only files of JSON lines, the log's commit point.

A finished call's record is one line copied into the current journal file, on the event
loop, before the call answers. The file is mapped shared (``mmap``): the copy lands in the
file's pages in the kernel's page cache, with no system call, and those pages outlive the
daemon (kill -9, a crash, the OOM killer) and are written back like any dirty page. That is
the durability of a ``write()``, and of a SQLite WAL frame under ``synchronous=NORMAL``. The
trajectory log (``corral.daemon.trajlog``) ingests the lines into SQLite in batches behind the
calls and, at the next start, whatever a dead daemon had not ingested yet.

A line's newline is stored after the rest of it: a daemon killed in the middle of a copy
leaves a line without its newline (the call never answered), which a start skips. A file is
``FILE_BYTES``, allocated on disk when it is made (``posix_fallocate``): a full disk is an
error of the append that needs a new file (the call fails, infra), never a SIGBUS on a write
to an unallocated page.

Files: ``<state>/trajlog.journal.<first record number, 20 digits>``. The current file is set
aside for a new one when a line does not fit (it is then cut to what it holds); a set-aside
file is deleted once every record in it is in the database. A line is
``[number, kind, ...fields]`` (the fields: the parameters of the kind's SQL statement): the
number orders records across files and tells which ones the database already has
(``log_meta`` ``journal``).

Only the event loop appends and sets files aside; the ingester thread deletes the set-aside
files it has finished with (``release``), hence the lock around that list.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import threading
from typing import Any

log = logging.getLogger("corral.trajlog")

PREFIX = "trajlog.journal."
FILE_BYTES = 16 << 20
# Fields of each kind of record (corral.daemon.trajlog, _J_SQL): entry, dropped entry,
# sandbox created, sandbox ended, its network counters as it ended.
FIELDS = {"e": 12, "d": 2, "sc": 3, "se": 3, "sn": 2}


class Journal:
    def __init__(self, state_dir: str) -> None:
        self.dir = state_dir
        self.fd = -1
        self.map: mmap.mmap | None = None
        self.path = ""
        self.pos = 0  # bytes used in the current file
        self.cap = 0  # its size
        self.last = 0  # number of the last record appended to the current file
        self._mu = threading.Lock()
        self._aside: list[tuple[int, str]] = []  # (last record number, path), oldest first

    # ---- files ---------------------------------------------------------------------------------
    def files(self) -> list[str]:
        """Journal files in the state dir, oldest first."""
        names = [n for n in os.listdir(self.dir) if n.startswith(PREFIX)
                 and n[len(PREFIX):].isdigit()]
        names.sort(key=lambda n: int(n[len(PREFIX):]))
        return [os.path.join(self.dir, n) for n in names]

    def read(self, after: int) -> tuple[list[tuple[int, str, tuple[Any, ...]]], int, int]:
        """Every record numbered past ``after``, in order: ``(number, kind, fields)``; the
        highest number seen; how many lines were unreadable (a torn last line: the daemon
        died in the middle of its copy, before the call could answer)."""
        out: list[tuple[int, str, tuple[Any, ...]]] = []
        top, bad = after, 0
        for path in self.files():
            with open(path, "rb") as f:
                data = f.read()
            end = data.rfind(b"\n") + 1
            if data[end:].strip(b"\0"):
                bad += 1  # a line without its newline: torn by a crash mid-copy
            lines = data[:end].split(b"\n")
            for raw in lines[:-1]:
                rec = _parse(raw)
                if rec is None:
                    bad += 1
                    continue
                n = rec[0]
                top = max(top, n)
                if n > after:
                    out.append((n, rec[1], tuple(rec[2:])))
        out.sort(key=lambda r: r[0])  # already in order unless files were renamed by hand
        return out, top, bad

    def start(self, first: int, size: int = 0) -> None:
        """Make and map a new current file (FILE_BYTES, or ``size`` if larger), named after
        the number of its first record."""
        path = os.path.join(self.dir, f"{PREFIX}{first:020d}")
        cap = max(FILE_BYTES, size)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, cap)
            self.map = mmap.mmap(fd, cap, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            try:
                os.unlink(path)
            except OSError:
                pass
            raise
        self.fd, self.path, self.pos, self.cap, self.last = fd, path, 0, cap, first - 1

    def append(self, line: bytes, number: int) -> None:
        """One line (``line`` without its newline): copied in, then its newline."""
        n = len(line)
        if self.pos + n + 1 > self.cap:
            self.set_aside()
        if self.map is None:
            self.start(number, n + 1)
        m, pos = self.map, self.pos
        assert m is not None
        m[pos:pos + n] = line
        m[pos + n] = 10  # b"\n", stored after the line
        self.pos = pos + n + 1
        self.last = number

    def set_aside(self) -> None:
        """Close the current file, cut to what it holds (the next append makes a new one)."""
        if self.fd < 0:
            return
        try:
            if self.map is not None:
                self.map.close()
            os.ftruncate(self.fd, self.pos)
        except OSError as e:  # its zeroed tail is skipped when read
            log.warning("could not close a journal file", extra={"path": self.path,
                                                                 "error": str(e)})
        finally:
            os.close(self.fd)
        with self._mu:
            self._aside.append((self.last, self.path))
        self.fd, self.map, self.path, self.pos, self.cap = -1, None, "", 0, 0

    def release(self, ingested: int) -> int:
        """(The ingester) delete the set-aside files whose records are all in the database
        (numbered up to ``ingested``); how many."""
        with self._mu:
            done = [a for a in self._aside if a[0] <= ingested]
            self._aside = [a for a in self._aside if a[0] > ingested]
        for _, path in done:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as e:  # left for the next start (it ingests nothing twice)
                log.warning("could not remove a journal file", extra={"path": path,
                                                                      "error": str(e)})
        return len(done)

    def close(self, remove: bool) -> None:
        """Close the current file; with ``remove`` (everything is in the database) delete
        every journal file."""
        self.set_aside()
        if remove:
            with self._mu:
                self._aside = []
            self.remove_all()

    def remove_all(self) -> None:
        for path in self.files():
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def _parse(raw: bytes) -> list[Any] | None:
    try:
        rec = json.loads(raw)
    except ValueError:
        return None
    if (isinstance(rec, list) and len(rec) >= 2 and type(rec[0]) is int
            and len(rec) == 2 + FIELDS.get(rec[1], -10)):
        return rec
    return None
