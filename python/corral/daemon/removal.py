"""Removing trees a sandbox controlled (its scratch dir, a stored layer, the trash).

Never ``shutil.rmtree``: its walk recurses once per directory level, so a tree a sandbox made
deep enough raises RecursionError (and, with ``ignore_errors``, leaves it all behind). The Rust
core's ``remove_tree`` is a loop with bounded fds, never follows a symlink and never crosses a
mount. A sandbox's writable layer on the btrfs scratch is a subvolume (``<dir>/disk``): it is
deleted whole by one ioctl (the kernel frees its extents in the background) before the rest of
the tree goes (corral.daemon.scratch). What it still cannot remove is moved aside to a
quarantine dir on the same filesystem and counted, so one sandbox's leftovers never stop the
daemon from starting or cleaning up the others.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading

from corral import _core

log = logging.getLogger("corral.removal")

QUARANTINE = ".quarantine"

# Trees moved aside since the daemon started (reported in metrics and /v1/status).
quarantined: list[str] = []
_lock = threading.Lock()


LAYER = "disk"  # corral.daemon.scratch.LAYER


def drop_layer(path: str) -> None:
    """Delete the btrfs subvolume of a sandbox's dir ``path`` (``path/disk``), or ``path``
    itself if it is one; anything else is left for remove_tree. Raises OSError."""
    if not _core.btrfs_subvol_delete(os.path.join(path, LAYER)):
        _core.btrfs_subvol_delete(path)


# How deep our own layout nests a sandbox's subvolume below a tree we remove:
# .quarantine/<trash>.<x>/<sandbox>/disk.
LAYOUT_DEPTH = 4


def drop_nested_layers(path: str, depth: int = LAYOUT_DEPTH) -> int:
    """Delete the subvolumes below ``path`` within ``depth`` levels (a sandbox dir moved into
    the trash or the quarantine holds its ``disk``); returns how many went. Only our own
    layout is walked: a directory on another device is a subvolume (deleted) or a mount (left),
    and neither is entered, so nothing a sandbox wrote is visited."""
    gone = 0
    try:
        top = os.lstat(path)
    except OSError:
        return 0
    level = [(path, top.st_dev)]
    for _ in range(depth):
        below: list[tuple[str, int]] = []
        for d, dev in level:
            try:
                names = os.listdir(d)
            except OSError:
                continue
            for name in names:
                p = os.path.join(d, name)
                try:
                    st = os.lstat(p)
                except OSError:
                    continue
                if not stat.S_ISDIR(st.st_mode):
                    continue
                if st.st_dev == dev:
                    below.append((p, dev))
                    continue
                try:
                    gone += _core.btrfs_subvol_delete(p)
                except (OSError, ValueError) as e:
                    log.warning("cannot delete a subvolume", extra={"path": p,
                                                                    "error": str(e)})
        level = below
    return gone


def remove_tree(path: str) -> None:
    """rm -rf ``path`` (missing is fine); raises OSError if something could not go."""
    try:
        drop_layer(path)
    except ValueError:
        pass  # not a name a subvolume can have: a plain tree
    try:
        _core.remove_tree(path)
    except OSError as e:
        # A subvolume deeper in our layout (a sandbox dir in the trash): drop it, try again.
        if e.errno != errno.EXDEV or not drop_nested_layers(path):
            raise
        _core.remove_tree(path)


def remove_or_quarantine(path: str, quarantine_root: str | None = None) -> bool:
    """Remove ``path``; if that fails, move it under ``<quarantine_root>/.quarantine`` (the
    default root: the directory holding ``path``, so the rename stays on its filesystem) and
    log it. True if it is gone from ``path``. Never raises."""
    try:
        remove_tree(path)
        return True
    except (OSError, ValueError) as e:
        err = e
    qdir = os.path.join(quarantine_root or os.path.dirname(path), QUARANTINE)
    dst = os.path.join(qdir, f"{os.path.basename(path)}.{os.urandom(4).hex()}")
    try:
        os.makedirs(qdir, mode=0o700, exist_ok=True)
        os.rename(path, dst)
    except FileNotFoundError:
        return True
    except OSError as e:
        log.error("cannot remove or quarantine a sandbox tree",
                  extra={"path": path, "error": str(err), "rename_error": str(e)})
        return False
    with _lock:
        quarantined.append(dst)
    log.error("tree quarantined: could not remove it", extra={"path": path, "moved_to": dst,
                                                              "error": str(err)})
    return True


def remove_later(path: str) -> None:
    """Remove in a background thread (quarantining what cannot go)."""
    threading.Thread(target=remove_or_quarantine, args=(path,), daemon=True,
                     name="corral-rm").start()


def quiet_remove(path: str) -> None:
    """For error paths: remove what can go, never raise."""
    try:
        remove_tree(path)
    except (OSError, ValueError) as e:
        log.warning("cannot remove a tree", extra={"path": path, "error": str(e)})
