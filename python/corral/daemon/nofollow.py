"""Opening a directory by a path without following a symlink on the way: one component at a
time, each from the last one's fd, ``O_NOFOLLOW``. For paths whose parts someone else may
change between a check and a use (an image layer's members, a host directory being
imported): a part made a symlink since fails (ELOOP or ENOTDIR), it is never followed."""

from __future__ import annotations

import errno
import os

# What a part that is no longer a directory (or no longer there) answers.
GONE = (errno.ELOOP, errno.ENOTDIR, errno.ENOENT)


def open_dir(start: str, rel: str) -> int:
    """An fd (O_RDONLY) of the directory ``rel`` (relative; "" or "." for ``start``) below
    ``start`` (opened as it is: its caller's own). Raises OSError, ``errno`` in GONE for a
    part that is not a directory now."""
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    fd = os.open(start, (os.O_PATH if parts else os.O_RDONLY) | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i, part in enumerate(parts):
            mode = os.O_RDONLY if i == len(parts) - 1 else os.O_PATH
            nfd = os.open(part, mode | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                          dir_fd=fd)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd
