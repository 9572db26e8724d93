"""The engine's on-disk records: ``<state_dir>/sandboxes/<id>/meta.json``, written atomically.

The sandbox's directory is made before the sandbox and its record written once it runs, so a
daemon killed at any point leaves either a record it can re-adopt or a directory without one,
which recovery cleans (with the cgroups and processes of that id) through cleanup_orphans.
No fsync: the failure to survive is a daemon crash (kill -9), not a power cut, and a sync per
create would cost more than the create itself.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

META = "meta.json"


def write_json_atomic(path: str, obj: Any) -> None:
    tmp = f"{path}.tmp"
    data = json.dumps(obj, separators=(",", ":")).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_json(path: str) -> Any:
    with open(path, "rb") as f:
        return json.loads(f.read())


def iter_records(sandboxes_dir: str) -> Iterator[tuple[str, dict[str, Any] | None]]:
    """Every sandbox directory with its record (None when missing or unreadable)."""
    try:
        names = os.listdir(sandboxes_dir)
    except FileNotFoundError:
        return
    for name in sorted(names):
        path = os.path.join(sandboxes_dir, name, META)
        try:
            meta = read_json(path)
            if not isinstance(meta, dict):
                meta = None
        except (OSError, ValueError):
            meta = None
        yield name, meta
