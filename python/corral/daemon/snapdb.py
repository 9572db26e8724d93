"""Snapshot records in one SQLite file, ``<state_dir>/snapshots.db`` (WAL).

One row per snapshot (its record as JSON). A table and not a file per record: on ext4 every
new inode is an allocation, and on a filesystem without a journal the inode allocator scans
past every inode deleted in the last 30 s (``recently_deleted``), which made a record file
cost 0.2-0.9 ms on this project's test hosts. An insert into the WAL allocates nothing.

Durability is the same as the sandboxes' ``meta.json`` (corral.daemon.persist): the commit
reaches the OS before the call answers (``synchronous=NORMAL``), so a daemon crash loses
nothing; a power cut may lose the last commits, as it may lose the layers' unsynced pages.
Records written by older versions as ``snapshots/<id>.json`` are imported once at start.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
from collections.abc import Iterator
from typing import Any

log = logging.getLogger("corral.snapshots")

_SCHEMA = ("CREATE TABLE IF NOT EXISTS snapshots ("
           "id TEXT PRIMARY KEY, created_at REAL NOT NULL, rec TEXT NOT NULL)")


class SnapshotDB:
    """Used from one thread at a time (the loop; ``load`` from a worker before serving)."""

    def __init__(self, state_dir: str) -> None:
        self.path = os.path.join(state_dir, "snapshots.db")
        self.legacy_dir = os.path.join(state_dir, "snapshots")
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute(_SCHEMA)

    def put(self, rec: dict[str, Any]) -> None:
        self.db.execute("INSERT OR REPLACE INTO snapshots (id, created_at, rec) VALUES (?,?,?)",
                        (rec["id"], float(rec["created_at"]), json.dumps(rec)))

    def delete(self, snap_id: str) -> None:
        self.db.execute("DELETE FROM snapshots WHERE id = ?", (snap_id,))

    def count(self) -> int:
        return int(self.db.execute("SELECT count(*) FROM snapshots").fetchone()[0])

    def records(self) -> Iterator[tuple[str, dict[str, Any] | None]]:
        """(id, record or None when unreadable), oldest first; older JSON files imported."""
        self._import_legacy()
        for sid, text in self.db.execute("SELECT id, rec FROM snapshots ORDER BY created_at"):
            try:
                rec = json.loads(text)
                yield sid, rec if isinstance(rec, dict) else None
            except ValueError:
                yield sid, None

    def _import_legacy(self) -> None:
        try:
            names = sorted(os.listdir(self.legacy_dir))
        except FileNotFoundError:
            return
        for name in names:
            path = os.path.join(self.legacy_dir, name)
            if name.endswith(".json"):
                try:
                    with open(path, "rb") as f:
                        rec = json.loads(f.read())
                    self.put(rec)
                except (OSError, ValueError, KeyError, TypeError):
                    log.warning("dropping unreadable snapshot record", extra={"file": name})
            with contextlib.suppress(OSError):
                os.unlink(path)
        with contextlib.suppress(OSError):
            os.rmdir(self.legacy_dir)

    def close(self) -> None:
        self.db.close()
