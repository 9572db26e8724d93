"""Exclusive advisory locks (flock) on files: one daemon per state dir and per cgroup name, one
writer per trajectory log, one starter per socket (the launcher). The kernel drops a lock when
its fd is closed or its process dies, kill -9 included, so a lock never outlives its owner."""

from __future__ import annotations

import fcntl
import os


def try_lock(path: str, mode: int = 0o600) -> int | None:
    """An fd holding an exclusive flock on ``path`` (made if missing), or None if another
    process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, mode)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd
