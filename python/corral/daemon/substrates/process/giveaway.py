"""What the daemon made in a process session's /tmp (an upload, a write, a mkdir) goes to the
session's uid, so that its commands may change it.

The session's code runs while the daemon walks: a directory it lists can be swapped for a
symlink (to ``/``) before the walk goes into it, and a walk by path from the root would follow
it and give away what it points at (the session's ``/dev``, root's, went to its uid). So the
walk goes by fd: each step opens a name relative to its parent's fd with ``O_NOFOLLOW``, each
chown is of a name in an open directory without following it, and nothing on another
filesystem than ``/tmp``'s is touched.
"""

from __future__ import annotations

import os
import stat

# A tree deeper than this below the path stays as it is (the daemon's own uploads are
# bounded much lower; what is deeper was made by the session itself, and is its own).
MAX_DEPTH = 256

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def give(root: int, home: str, names: list[str], uid: int, tree: bool) -> int:
    """chown ``home/names[0]``, ``home/names[0]/names[1]``... (each to ``uid``), and with
    ``tree`` everything below the last; ``root`` is an fd of the session's root. Returns how
    many were given; a step that is not there (any more) ends the walk. Raises OSError only
    if ``home`` cannot be opened."""
    top = os.open(home.strip("/"), _DIR, dir_fd=root)
    given = 0
    try:
        dev = os.fstat(top).st_dev
        parent = os.dup(top)
        try:
            for i, name in enumerate(names):
                last = i == len(names) - 1
                try:
                    st = os.stat(name, dir_fd=parent, follow_symlinks=False)
                    if st.st_dev != dev:
                        return given
                    os.chown(name, uid, uid, dir_fd=parent, follow_symlinks=False)
                    given += 1
                    if last and not (tree and stat.S_ISDIR(st.st_mode)):
                        return given
                    nxt = os.open(name, _DIR, dir_fd=parent)
                except OSError:
                    return given  # gone, or swapped for something else: not ours to follow
                os.close(parent)
                parent = nxt
            given += _give_below(parent, dev, uid)
        finally:
            os.close(parent)
    finally:
        os.close(top)
    return given


def _give_below(top: int, dev: int, uid: int) -> int:
    """chown everything below the directory ``top``, depth first, never following a symlink
    nor leaving ``dev``: the directories open at once are the chain from ``top`` to the one
    being walked (at most MAX_DEPTH), never a whole listing's subdirectories."""
    given = 0
    stack: list[tuple[int, list[str]]] = []
    try:
        fd = os.dup(top)
        stack.append((fd, _names(fd)))
        while stack:
            fd, names = stack[-1]
            if not names:
                os.close(fd)
                stack.pop()
                continue
            name = names.pop()
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if st.st_dev != dev:
                    continue
                os.chown(name, uid, uid, dir_fd=fd, follow_symlinks=False)
                given += 1
                if stat.S_ISDIR(st.st_mode) and len(stack) < MAX_DEPTH:
                    sub = os.open(name, _DIR, dir_fd=fd)
                    stack.append((sub, _names(sub)))
            except OSError:
                continue  # gone or swapped meanwhile: not ours to follow
    finally:
        for fd, _ in stack:
            os.close(fd)
    return given


def _names(fd: int) -> list[str]:
    try:
        return os.listdir(fd)
    except OSError:
        return []
