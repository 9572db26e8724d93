"""The trajectory log's journal: append-only files of JSON lines, the log's commit point.

A finished call's record is one ``write()`` of one line to the current journal file, on the
event loop, before the call answers. Once ``write()`` returns, the kernel holds the bytes:
they survive the daemon's death (kill -9, a crash, the OOM killer), exactly like a SQLite WAL
frame written with ``synchronous=NORMAL``. The trajectory log (``corral.daemon.trajlog``)
ingests the lines into SQLite in batches behind the calls and, at the next start, whatever a
dead daemon had not ingested yet.

Files: ``<state>/trajlog.journal.<first record number, 20 digits>``. The current file is set
aside for a new one once it holds ``ROTATE_BYTES`` (or after a failed write, so that a torn
line can only ever be a file's last); a set-aside file is deleted once every record in it is
in the database. A line is ``[number, kind, ...fields]`` (the fields: the parameters of the
kind's SQL statement): the number orders records across files and tells which ones the
database already has (``log_meta`` ``journal``).

Only the event loop appends and sets files aside; the ingester thread deletes the set-aside
files it has finished with (``release``), hence the lock around that list.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
from typing import Any

log = logging.getLogger("corral.trajlog")

PREFIX = "trajlog.journal."
ROTATE_BYTES = 16 << 20
# Fields of each kind of record (corral.daemon.trajlog, _J_SQL): entry, dropped entry,
# sandbox created, sandbox ended.
FIELDS = {"e": 12, "d": 2, "sc": 3, "se": 3}


class Journal:
    def __init__(self, state_dir: str) -> None:
        self.dir = state_dir
        self.fd = -1
        self.path = ""
        self.size = 0
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
        died in the middle of its ``write()``, before the call could answer)."""
        out: list[tuple[int, str, tuple[Any, ...]]] = []
        top, bad = after, 0
        for path in self.files():
            with open(path, "rb") as f:
                data = f.read()
            lines = data.split(b"\n")
            if lines[-1]:
                bad += 1  # no newline: torn by a crash mid-write
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

    def start(self, first: int) -> None:
        """Open a new current file, named after the number of its first record."""
        path = os.path.join(self.dir, f"{PREFIX}{first:020d}")
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.path, self.size, self.last = path, 0, first - 1

    def append(self, data: bytes, number: int) -> None:
        """One line (``data`` ends with a newline), in one ``write()``."""
        if self.fd < 0:
            self.start(number)
        n = os.write(self.fd, data)
        if n != len(data):  # a regular file writes short only when it cannot write more
            raise OSError(errno.ENOSPC, f"short write to {self.path} ({n} of {len(data)} bytes)")
        self.size += n
        self.last = number
        if self.size >= ROTATE_BYTES:
            self.set_aside()

    def set_aside(self) -> None:
        """Close the current file (the next append opens a new one). After a failed write
        too: whatever part of a line it wrote stays the last bytes of this file."""
        if self.fd < 0:
            return
        try:
            os.close(self.fd)
        except OSError:
            pass
        with self._mu:
            self._aside.append((self.last, self.path))
        self.fd, self.path, self.size = -1, "", 0

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
