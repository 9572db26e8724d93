"""Tar archives into and out of a sandbox."""

from __future__ import annotations

import io
import lzma
import os
import stat as stat_mod
import tarfile
import zlib
from typing import TYPE_CHECKING, Any, BinaryIO

from corral import _core
from corral.daemon import streams, uploads
from corral.daemon.oserrors import sandbox_file_error
from corral.errors import FileNotFound, InvalidPath, InvalidRequest, TooLarge

from ..base import SandboxRuntime
from .files import _check_path

if TYPE_CHECKING:  # pragma: no cover
    from .host import Host


TAR_MAX_MEMBERS = streams.TAR_MAX_MEMBERS
# What a corrupt or truncated upload raises while it is decompressed and parsed (bzip2 says
# OSError; the file writes raise CorralErrors, never these).
_BAD_ARCHIVE = (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError, OSError, ValueError)
TAR_MAX_BYTES = streams.TAR_MAX_BYTES


class Tar:
    """Tar upload (extracted through the fs primitives) and download (streamed)."""

    def upload_tar(self: Host, runtime: SandboxRuntime, path: str,
                   tar_bytes: bytes | BinaryIO) -> None:
        """Extract into ``path`` through the fs primitives only (never via host paths):
        members are normalized below ``path``, ``..`` refused, devices/FIFOs/sockets refused,
        hard links copied from an already extracted member, symlinks made verbatim (they
        resolve inside the sandbox's root)."""
        _check_path(path)
        base = path.rstrip("/")
        self._fs(runtime, _core.fs_mkdir, path, path, True)
        # Streamed (r|: no seek, so nothing is decompressed twice), decompressed lazily and
        # bounded (uploads.Bounded): the daemon never holds more than a chunk of a member.
        src = uploads.open_bounded(tar_bytes, self.upload_max_bytes)
        try:
            tf = tarfile.open(fileobj=src, mode="r|", tarinfo=uploads.BoundedTarInfo)
        except _BAD_ARCHIVE as e:
            raise InvalidRequest(f"not a tar archive: {e}") from None
        dirs: list[tuple[str, int]] = []
        try:
            with tf:
                for count, m in enumerate(tf):
                    if count >= TAR_MAX_MEMBERS:
                        raise TooLarge(f"tar has more than {TAR_MAX_MEMBERS} members",
                                       details={"limit": "members", "max": TAR_MAX_MEMBERS})
                    self._extract(runtime, tf, m, base, dirs)
        except _BAD_ARCHIVE as e:
            raise InvalidRequest(f"bad tar archive: {e}") from None
        # Directory modes last, deepest first, so a read-only dir does not block its contents.
        for dest, mode in reversed(dirs):
            self._fs(runtime, _core.fs_chmod, dest, dest, mode)

    def _extract(self: Host,
                 runtime: SandboxRuntime, tf: tarfile.TarFile, m: tarfile.TarInfo,
                 base: str, dirs: list[tuple[str, int]]) -> None:
        rel = self._tar_rel(m.name)
        if rel is None:
            return
        dest = f"{base}/{rel}"
        mode = m.mode & 0o7777 & ~(stat_mod.S_ISUID | stat_mod.S_ISGID)
        if m.isdir():
            self._fs(runtime, _core.fs_mkdir, dest, dest, True, 0o755)
            dirs.append((dest, mode or 0o755))
        elif m.isreg():
            f = tf.extractfile(m)
            self._replace(runtime, dest)
            self._write_from(runtime, dest, mode, f if f is not None else io.BytesIO())
        elif m.issym():
            self._parent(runtime, dest)
            self._replace(runtime, dest)
            self._fs(runtime, _core.fs_symlink, dest, m.linkname, dest)
        elif m.islnk():
            target_rel = self._tar_rel(m.linkname)
            if target_rel is None:
                raise InvalidRequest(f"tar hard link {m.name!r} points at the root")
            src = f"{base}/{target_rel}"
            fd, _ = self._fs(runtime, _core.fs_open_read, src, src)
            with open(fd, "rb", buffering=0) as f:  # a copy of the member extracted before
                self._replace(runtime, dest)
                self._write_from(runtime, dest, mode, f)
        else:
            raise InvalidRequest(
                f"tar member {m.name!r} is a device, FIFO or other special file")

    def _write_from(self: Host,
                    runtime: SandboxRuntime, dest: str, mode: int, src: Any) -> None:
        """Write ``src`` to ``dest`` in chunks, each charged to the sandbox's disk budget."""
        fd = self._fs(runtime, _core.fs_open_write, dest, dest, mode, True)
        try:
            while chunk := src.read(uploads.CHUNK):
                self._charge(runtime, len(chunk))
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view):]
        except OSError as e:
            raise sandbox_file_error(e, dest, self.scratch.quota) from None
        finally:
            os.close(fd)

    @staticmethod
    def _tar_rel(name: str) -> str | None:
        parts = [p for p in name.split("/") if p not in ("", ".")]
        if any(p == ".." for p in parts):
            raise InvalidPath(f"tar member {name!r} contains '..'", details={"member": name})
        if any("\0" in p for p in parts):
            raise InvalidPath(f"tar member {name!r} has a NUL byte")
        return "/".join(parts) or None

    def _parent(self: Host, runtime: SandboxRuntime, dest: str) -> None:
        parent = dest.rsplit("/", 1)[0] or "/"
        self._fs(runtime, _core.fs_mkdir, parent, parent, True)

    def _replace(self: Host, runtime: SandboxRuntime, dest: str) -> None:
        """Remove a non-directory at ``dest`` (tar semantics: a member replaces what is
        there); a symlink is removed, never followed."""
        try:
            kind, *_ = self._fs(runtime, _core.fs_stat, dest, dest)
        except FileNotFound:
            return
        if kind != "dir":
            self._fs(runtime, _core.fs_remove, dest, dest, False)

    def open_read(self: Host, runtime: SandboxRuntime, path: str) -> tuple[int, int]:
        """(fd, size) of a regular file, checked as read_file checks it, to stream from (the
        caller closes the fd)."""
        _check_path(path)
        return self._fs(runtime, _core.fs_open_read, path, path)

    def download_tar(self: Host, runtime: SandboxRuntime, path: str) -> bytes:
        """The whole tar in memory, for in-process callers (the API streams it instead)."""
        ops = self.tree_ops(runtime, path)
        root = path.rstrip("/") or "/"
        streams.plan(ops, root, TAR_MAX_BYTES, TAR_MAX_MEMBERS)
        return b"".join(streams.chunks(ops, root, TAR_MAX_BYTES))

    def tree_ops(self: Host, runtime: SandboxRuntime, path: str) -> streams.TreeOps:
        """The primitives a streamed tar download of ``path`` walks the sandbox's files with."""
        _check_path(path)
        def stat(p: str) -> tuple[str, int, int, float]:
            return self._fs(runtime, _core.fs_stat, p, p)

        def ls(p: str) -> list[tuple[str, str]]:
            return [(e[0], e[1]) for e in self._fs(runtime, _core.fs_list, p, p)]

        def readlink(p: str) -> str:
            return self._fs(runtime, _core.fs_readlink, p, p)

        def open_read(p: str) -> tuple[int, int]:
            return self._fs(runtime, _core.fs_open_read, p, p)

        return streams.TreeOps(stat=stat, list=ls, readlink=readlink, open_read=open_read)
