"""A layer from a host directory (a task's workspace), content-addressed: its id is the hash
of what it holds (names, types, modes, owners, bytes, link targets), so a thousand sandboxes
of one task share one copy whatever path it came from. A stat-only fingerprint of the source
(paths, sizes, mtimes, inodes) maps to that id, so an unchanged directory is not read again."""

from __future__ import annotations

import hashlib
import os
import stat

from corral.errors import InvalidRequest, TooLarge


def fingerprint(src: str, max_files: int) -> str:
    """Changes when anything under ``src`` is added, removed, or changes size, mode, owner
    or mtime (symlinks are not followed)."""
    h = hashlib.sha256(os.path.realpath(src).encode())
    n = 0
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames.sort()
        for name in sorted(filenames) + dirnames:
            p = os.path.join(dirpath, name)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            n += 1
            if n > max_files:
                raise TooLarge(f"directory {src} has more than {max_files} files",
                               details={"limit": "image_max_files", "max_files": max_files})
            h.update(f"{p}\0{st.st_mode}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\0"
                     f"{st.st_uid}\0{st.st_gid}\n".encode())
    return h.hexdigest()


def content_hash(tree: str) -> str:
    """The id of a copied tree: what a sandbox would see of it, nothing about the host."""
    h = hashlib.sha256(b"corral-dir-layer-v1\n")
    for dirpath, dirnames, filenames in os.walk(tree):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, tree)
        for name in sorted(filenames) + dirnames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            rel = os.path.normpath(os.path.join(rel_dir, name))
            h.update(f"{rel}\0{st.st_mode}\0{st.st_uid}\0{st.st_gid}\0".encode())
            if stat.S_ISLNK(st.st_mode):
                h.update(os.readlink(p).encode("utf-8", "surrogateescape"))
            elif stat.S_ISREG(st.st_mode):
                fh = hashlib.sha256()
                with open(p, "rb") as f:
                    while chunk := f.read(1 << 20):
                        fh.update(chunk)
                h.update(fh.digest())
            h.update(b"\n")
    st = os.lstat(tree)
    h.update(f".\0{st.st_mode}\0{st.st_uid}\0{st.st_gid}\n".encode())
    return h.hexdigest()


def check_source(src: str) -> None:
    if not os.path.isdir(src):
        raise InvalidRequest(f"layer dir {src!r} is not a directory", details={"dir": src})
