"""The file operations of a sandbox whose root the daemon holds as an fd: every path resolved
inside that root by the Rust core (openat2 RESOLVE_IN_ROOT: a symlink the sandbox made cannot
point the daemon outside it), errors mapped once (corral.daemon.oserrors). The container
substrate's root is its init's root (a cached fd), the gvisor substrate's the host side of the
sandbox's root (an fd per operation); what differs between them (the disk budget) is what
they pass in."""

from __future__ import annotations

import contextlib
import io
import lzma
import os
import stat as stat_mod
import tarfile
import zlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, BinaryIO

from corral import _core
from corral.daemon import safetar, streams, uploads
from corral.daemon.oserrors import sandbox_file_error
from corral.errors import CorralError, FileNotFound, InvalidPath, InvalidRequest, TooLarge
from corral.models import FileEntry

from .paths import check_path
from .types import NotCached

if TYPE_CHECKING:
    from .base import SandboxRuntime

TAR_MAX_MEMBERS = streams.TAR_MAX_MEMBERS
TAR_MAX_BYTES = streams.TAR_MAX_BYTES
# Names a recursive remove handles at most (a snapshot's and a tar's bound). The sandbox can
# keep growing the tree while the daemon removes it (ever deeper, ahead of the walk); the
# removal must end, or its thread holds the sandbox's destroy and a worker of the daemon.
REMOVE_MAX_ENTRIES = 1_000_000
# What a corrupt or truncated upload raises while it is decompressed and parsed (bzip2 says
# OSError; the file writes raise CorralErrors, never these).
_BAD_ARCHIVE = (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError, OSError, ValueError)


class RootFiles:
    """File operations on one sandbox's root. ``rooted()``: a context manager giving the root
    fd for one primitive call. ``disk_quota``: the kernel bounds the sandbox's disk with a
    quota (EDQUOT is the sandbox's limit, not the host's). ``charge``: counts bytes a tar
    upload writes against the sandbox's disk budget, chunk by chunk (None: no budget)."""

    __slots__ = ("rooted", "disk_quota", "charge", "upload_max_bytes", "holds_its_share")

    def __init__(self, rooted: Callable[[], AbstractContextManager[int]], disk_quota: bool,
                 charge: Callable[[int], None] | None, upload_max_bytes: int,
                 holds_its_share: Callable[[], bool | None] | None = None) -> None:
        self.rooted = rooted
        self.disk_quota = disk_quota
        self.charge = charge
        self.upload_max_bytes = upload_max_bytes
        # A full shared scratch: this sandbox's doing? (oserrors.sandbox_file_error)
        self.holds_its_share = holds_its_share

    def fs(self, fn: Any, path: str, *args: Any) -> Any:
        """``fn(root_fd, *args)``, its errors as the API's (``path`` names the file)."""
        try:
            with self.rooted() as root:
                return fn(root, *args)
        except ValueError as e:
            raise InvalidPath(str(e), details={"path": path}) from None
        except OSError as e:
            raise sandbox_file_error(e, path, self.disk_quota, self.holds_its_share) from None
        except _core.LayerLimit as e:  # a listing past fs.rs LIST_MAX, a remove past its bound
            what, limit = e.args
            raise TooLarge(f"{path} has more than {limit} {what}",
                           details={"path": path, "limit": what, "max": limit}) from None

    # ---- one file or directory ---------------------------------------------------------
    def read(self, path: str, max_bytes: int, cached_only: bool = False) -> bytes:
        check_path(path)
        try:
            return self.fs(_core.fs_read, path, path, max(0, int(max_bytes)), cached_only)
        except _core.NotCached:
            raise NotCached(path) from None

    def write(self, path: str, data: bytes | BinaryIO, mode: int, make_parents: bool) -> None:
        """``data``: bytes, or a binary file at its start (a spooled request body), copied in
        chunks so the daemon holds one chunk of it at a time."""
        check_path(path)
        if isinstance(data, (bytes, bytearray)):
            self.fs(_core.fs_write, path, path, bytes(data), mode & 0o7777, make_parents)
        else:
            self.copy_in(path, mode & 0o7777, data, make_parents, charge=False)

    def copy_in(self, path: str, mode: int, src: Any, make_parents: bool = True, *,
                charge: bool) -> None:
        """Write ``src`` (a binary file) to ``path`` in chunks; ``charge``: each chunk counted
        against the disk budget as it is written."""
        fd = self.fs(_core.fs_open_write, path, path, mode, make_parents)
        count = self.charge if charge else None
        try:
            while chunk := src.read(uploads.CHUNK):
                if count is not None:
                    count(len(chunk))
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view):]
        except OSError as e:
            raise sandbox_file_error(e, path, self.disk_quota, self.holds_its_share) from None
        finally:
            os.close(fd)

    def ls(self, path: str) -> list[FileEntry]:
        check_path(path)
        base = path.rstrip("/") or ""
        return [FileEntry(name=name, path=f"{base}/{name}", type=kind, size=size, mode=mode,
                          mtime=mtime)
                for name, kind, size, mode, mtime in self.fs(_core.fs_list, path, path)]

    def ls_page(self, path: str, after: str | None,
                limit: int) -> tuple[list[FileEntry], str | None]:
        check_path(path)
        base = path.rstrip("/") or ""
        found, cursor = self.fs(_core.fs_list_page, path, path, after, limit)
        return [FileEntry(name=name, path=f"{base}/{name}", type=kind, size=size, mode=mode,
                          mtime=mtime)
                for name, kind, size, mode, mtime in found], cursor

    def stat(self, path: str, cached_only: bool = False) -> FileEntry:
        check_path(path)
        try:
            kind, size, mode, mtime = self.fs(_core.fs_stat, path, path, cached_only)
        except _core.NotCached:
            raise NotCached(path) from None
        norm = os.path.normpath(path)
        if norm.startswith("//"):
            norm = norm[1:]
        return FileEntry(name=os.path.basename(norm) or "/", path=norm, type=kind, size=size,
                         mode=mode, mtime=mtime)

    def is_dir(self, path: str) -> bool:
        """``path`` is a directory, its symlinks followed inside the root (a walk: not on
        the event loop)."""
        check_path(path)
        return bool(self.fs(_core.fs_is_dir, path, path))

    def mkdir(self, path: str, parents: bool) -> None:
        check_path(path)
        self.fs(_core.fs_mkdir, path, path, parents)

    def remove(self, path: str, recursive: bool) -> None:
        check_path(path)
        self.fs(_core.fs_remove, path, path, recursive, REMOVE_MAX_ENTRIES)

    def rename(self, src: str, dst: str) -> None:
        check_path(src)
        check_path(dst)
        self.fs(_core.fs_rename, src, src, dst)

    def open_read(self, path: str) -> tuple[int, int]:
        """(fd, size) of a regular file, checked as read is, to stream from (the caller
        closes the fd)."""
        check_path(path)
        return self.fs(_core.fs_open_read, path, path)

    # ---- tar -----------------------------------------------------------------------------
    def tree_ops(self, path: str) -> streams.TreeOps:
        """The primitives a streamed tar download of ``path`` walks the sandbox's files with."""
        check_path(path)
        fs = self.fs
        return streams.TreeOps(
            stat=lambda p: fs(_core.fs_stat, p, p),
            list=lambda p: [(e[0], e[1]) for e in fs(_core.fs_list, p, p)],
            readlink=lambda p: fs(_core.fs_readlink, p, p),
            open_read=lambda p: fs(_core.fs_open_read, p, p))

    def download_tar(self, path: str) -> bytes:
        """The whole tar in memory, for in-process callers (the API streams it instead)."""
        ops = self.tree_ops(path)
        root = path.rstrip("/") or "/"
        streams.plan(ops, root, TAR_MAX_BYTES, TAR_MAX_MEMBERS)
        return b"".join(streams.chunks(ops, root, TAR_MAX_BYTES))

    def upload_tar(self, path: str, tar_bytes: bytes | BinaryIO) -> None:
        """Extract into ``path`` through the fs primitives only (never via host paths):
        members are normalized below ``path``, ``..`` refused, devices/FIFOs/sockets refused,
        hard links copied from an already extracted member, symlinks made verbatim (they
        resolve inside the sandbox's root)."""
        check_path(path)
        base = path.rstrip("/")
        self.fs(_core.fs_mkdir, path, path, True)
        # Streamed (r|: no seek, so nothing is decompressed twice), decompressed lazily and
        # bounded (uploads.Bounded): the daemon never holds more than a chunk of a member.
        src = uploads.open_bounded(tar_bytes, self.upload_max_bytes)
        try:
            tf = tarfile.open(fileobj=src, mode="r|", tarinfo=safetar.SafeTarInfo)
        except _BAD_ARCHIVE as e:
            raise InvalidRequest(f"not a tar archive: {e}") from None
        dirs: list[tuple[str, int]] = []
        try:
            with tf:
                count = 0
                while (m := tf.next()) is not None:
                    # tarfile keeps every member it has read (~500 bytes each: a million of
                    # them held ~0.5 GB an upload); a stream never looks back at one
                    tf.members.clear()  # type: ignore[attr-defined]  # (not in typeshed)
                    if count >= TAR_MAX_MEMBERS:
                        raise TooLarge(f"tar has more than {TAR_MAX_MEMBERS} members",
                                       details={"limit": "members", "max": TAR_MAX_MEMBERS})
                    count += 1
                    self._extract(tf, m, base, dirs)
        except _BAD_ARCHIVE as e:
            raise InvalidRequest(f"bad tar archive: {e}") from None
        # Directory modes last, deepest first, so a read-only dir does not block its contents.
        for dest, mode in reversed(dirs):
            self.fs(_core.fs_chmod, dest, dest, mode)

    def _extract(self, tf: tarfile.TarFile, m: tarfile.TarInfo, base: str,
                 dirs: list[tuple[str, int]]) -> None:
        rel = tar_rel(m.name)
        if rel is None:
            return
        dest = f"{base}/{rel}"
        mode = m.mode & 0o7777 & ~(stat_mod.S_ISUID | stat_mod.S_ISGID)
        if m.isdir():
            self.fs(_core.fs_mkdir, dest, dest, True, 0o755)
            dirs.append((dest, mode or 0o755))
        elif m.isreg():
            f = tf.extractfile(m)
            self._replace(dest)
            self.copy_in(dest, mode, f if f is not None else io.BytesIO(), charge=True)
        elif m.issym():
            parent = dest.rsplit("/", 1)[0] or "/"
            self.fs(_core.fs_mkdir, parent, parent, True)
            self._replace(dest)
            self.fs(_core.fs_symlink, dest, m.linkname, dest)
        elif m.islnk():
            target_rel = tar_rel(m.linkname)
            if target_rel is None:
                raise InvalidRequest(f"tar hard link {m.name!r} points at the root")
            src = f"{base}/{target_rel}"
            fd, _ = self.fs(_core.fs_open_read, src, src)
            with open(fd, "rb", buffering=0) as f:  # a copy of the member extracted before
                self._replace(dest)
                self.copy_in(dest, mode, f, charge=True)
        else:
            raise InvalidRequest(
                f"tar member {m.name!r} is a device, FIFO or other special file")

    def _replace(self, dest: str) -> None:
        """Remove a non-directory at ``dest`` (tar semantics: a member replaces what is
        there); a symlink is removed, never followed."""
        try:
            kind, *_ = self.fs(_core.fs_stat, dest, dest)
        except FileNotFound:
            return
        if kind != "dir":
            self.fs(_core.fs_remove, dest, dest, False)


def tar_rel(name: str) -> str | None:
    """A tar member's name relative to the extraction dir; None for the dir itself."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise InvalidPath(f"tar member {name!r} contains '..'", details={"member": name})
    if any("\0" in p for p in parts):
        raise InvalidPath(f"tar member {name!r} has a NUL byte")
    return "/".join(parts) or None


class RootFileOps:
    """The substrate protocol's file methods for a substrate whose sandbox root the daemon
    reaches from the host side: each call opens the root for itself (``_files``: a context
    manager giving RootFiles) and delegates. ``_made``: what the substrate does with what a
    call created (a process session gives it to its uid); nothing by default."""

    def _files(self, runtime: SandboxRuntime) -> AbstractContextManager[RootFiles]:
        raise NotImplementedError

    def _made(self, runtime: SandboxRuntime, f: RootFiles, path: str,
              tree: bool = False) -> None:
        return None

    def read_file(self, runtime: SandboxRuntime, path: str, max_bytes: int,
                  cached_only: bool = False) -> bytes:
        with self._files(runtime) as f:
            return f.read(path, max_bytes, cached_only)

    def write_file(self, runtime: SandboxRuntime, path: str, data: bytes | BinaryIO,
                   mode: int = 0o644, make_parents: bool = True) -> None:
        with self._files(runtime) as f:
            try:
                f.write(path, data, mode, make_parents)
            except TooLarge:
                # no partial file stays behind to fill the disk the write could not fit in
                with contextlib.suppress(CorralError):
                    f.remove(path, False)
                raise
            self._made(runtime, f, path)

    def list_dir(self, runtime: SandboxRuntime, path: str) -> list[FileEntry]:
        with self._files(runtime) as f:
            return f.ls(path)

    def list_page(self, runtime: SandboxRuntime, path: str, after: str | None,
                  limit: int) -> tuple[list[FileEntry], str | None]:
        with self._files(runtime) as f:
            return f.ls_page(path, after, limit)

    def stat(self, runtime: SandboxRuntime, path: str, cached_only: bool = False) -> FileEntry:
        with self._files(runtime) as f:
            return f.stat(path, cached_only)

    def mkdir(self, runtime: SandboxRuntime, path: str, parents: bool = True) -> None:
        with self._files(runtime) as f:
            f.mkdir(path, parents)
            self._made(runtime, f, path)

    def remove(self, runtime: SandboxRuntime, path: str, recursive: bool = False) -> None:
        with self._files(runtime) as f:
            f.remove(path, recursive)

    def rename(self, runtime: SandboxRuntime, src: str, dst: str) -> None:
        with self._files(runtime) as f:
            f.rename(src, dst)

    def upload_tar(self, runtime: SandboxRuntime, path: str,
                   tar_bytes: bytes | BinaryIO) -> None:
        with self._files(runtime) as f:
            f.upload_tar(path, tar_bytes)
            self._made(runtime, f, path, tree=True)

    def download_tar(self, runtime: SandboxRuntime, path: str) -> bytes:
        with self._files(runtime) as f:
            return f.download_tar(path)

    def open_read(self, runtime: SandboxRuntime, path: str) -> tuple[int, int]:
        with self._files(runtime) as f:
            return f.open_read(path)

    def tree_ops(self, runtime: SandboxRuntime, path: str) -> streams.TreeOps:
        # The walk outlives this call: each primitive opens the root for itself.
        check_path(path)

        def on_root(name: str) -> Any:
            def call(p: str) -> Any:
                with self._files(runtime) as f:
                    return getattr(f.tree_ops(p), name)(p)
            return call

        return streams.TreeOps(stat=on_root("stat"), list=on_root("list"),
                               readlink=on_root("readlink"), open_read=on_root("open_read"))
