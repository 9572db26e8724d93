"""File operations of a gVisor sandbox, done on the host side of its root: the overlay the
daemon mounted for it (bundle.make_root), which runsc serves to the sandbox with
``--file-access=shared`` so both sides see each other's writes at once. Every path is
resolved inside that root by the Rust core (openat2 RESOLVE_IN_ROOT: a symlink the sandbox
made cannot point the daemon outside it)."""

from __future__ import annotations

import io
import lzma
import os
import stat as stat_mod
import tarfile
import zlib
from typing import Any, BinaryIO

from corral import _core
from corral.daemon import streams, uploads
from corral.daemon.oserrors import sandbox_file_error
from corral.daemon.substrates.paths import check_path
from corral.errors import (
    CorralError,
    FileNotFound,
    InvalidPath,
    InvalidRequest,
    TooLarge,
)
from corral.models import FileEntry

_BAD_ARCHIVE = (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError, OSError, ValueError)


def file_error(e: OSError, path: str) -> CorralError:
    """The one errno map (corral.daemon.oserrors); the disk is a tmpfs of ``disk_mb``, so a
    full one is the sandbox's own limit."""
    return sandbox_file_error(e, path, disk_quota=False)


class RootFiles:
    """The file operations on one root fd (an O_PATH fd of the host-side root), which it
    owns: closed at the end of a ``with``."""

    def __init__(self, root_fd: int, upload_max_bytes: int) -> None:
        self.root = root_fd
        self.upload_max_bytes = upload_max_bytes

    def __enter__(self) -> RootFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.root)

    def _fs(self, fn: Any, path: str, *args: Any) -> Any:
        try:
            return fn(self.root, *args)
        except ValueError as e:
            raise InvalidPath(str(e), details={"path": path}) from None
        except OSError as e:
            raise file_error(e, path) from None
        except _core.LayerLimit as e:
            what, limit = e.args
            raise TooLarge(f"{path} has more than {limit} {what}",
                           details={"path": path, "limit": what, "max": limit}) from None

    def read(self, path: str, max_bytes: int) -> bytes:
        check_path(path)
        return self._fs(_core.fs_read, path, path, max(0, int(max_bytes)))

    def write(self, path: str, data: bytes | BinaryIO, mode: int, make_parents: bool) -> None:
        check_path(path)
        if isinstance(data, (bytes, bytearray)):
            self._fs(_core.fs_write, path, path, bytes(data), mode & 0o7777, make_parents)
        else:
            self._write_from(path, mode & 0o7777, data, make_parents)

    def _write_from(self, path: str, mode: int, src: Any, make_parents: bool = True) -> None:
        fd = self._fs(_core.fs_open_write, path, path, mode, make_parents)
        try:
            while chunk := src.read(uploads.CHUNK):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view):]
        except OSError as e:
            raise file_error(e, path) from None
        finally:
            os.close(fd)

    def ls(self, path: str) -> list[FileEntry]:
        check_path(path)
        base = path.rstrip("/") or ""
        return [FileEntry(name=name, path=f"{base}/{name}", type=kind, size=size, mode=mode,
                          mtime=mtime)
                for name, kind, size, mode, mtime in self._fs(_core.fs_list, path, path)]

    def stat(self, path: str) -> FileEntry:
        check_path(path)
        kind, size, mode, mtime = self._fs(_core.fs_stat, path, path)
        norm = os.path.normpath(path)
        if norm.startswith("//"):
            norm = norm[1:]
        return FileEntry(name=os.path.basename(norm) or "/", path=norm, type=kind, size=size,
                         mode=mode, mtime=mtime)

    def mkdir(self, path: str, parents: bool) -> None:
        check_path(path)
        self._fs(_core.fs_mkdir, path, path, parents)

    def remove(self, path: str, recursive: bool) -> None:
        check_path(path)
        self._fs(_core.fs_remove, path, path, recursive)

    def rename(self, src: str, dst: str) -> None:
        check_path(src)
        check_path(dst)
        self._fs(_core.fs_rename, src, src, dst)

    def open_read(self, path: str) -> tuple[int, int]:
        check_path(path)
        return self._fs(_core.fs_open_read, path, path)

    def tree_ops(self, path: str) -> streams.TreeOps:
        check_path(path)
        return streams.TreeOps(
            stat=lambda p: self._fs(_core.fs_stat, p, p),
            list=lambda p: [(e[0], e[1]) for e in self._fs(_core.fs_list, p, p)],
            readlink=lambda p: self._fs(_core.fs_readlink, p, p),
            open_read=lambda p: self._fs(_core.fs_open_read, p, p))

    def download_tar(self, path: str) -> bytes:
        ops = self.tree_ops(path)
        root = path.rstrip("/") or "/"
        streams.plan(ops, root, streams.TAR_MAX_BYTES, streams.TAR_MAX_MEMBERS)
        return b"".join(streams.chunks(ops, root, streams.TAR_MAX_BYTES))

    # ---- tar upload: members normalized below ``path``, ``..`` refused, devices refused,
    # symlinks made verbatim (they resolve inside the root), hard links copied ------------------
    def upload_tar(self, path: str, tar_bytes: bytes | BinaryIO) -> None:
        check_path(path)
        base = path.rstrip("/")
        self._fs(_core.fs_mkdir, path, path, True)
        src = uploads.open_bounded(tar_bytes, self.upload_max_bytes)
        try:
            tf = tarfile.open(fileobj=src, mode="r|", tarinfo=uploads.BoundedTarInfo)
        except _BAD_ARCHIVE as e:
            raise InvalidRequest(f"not a tar archive: {e}") from None
        dirs: list[tuple[str, int]] = []
        try:
            with tf:
                for count, m in enumerate(tf):
                    if count >= streams.TAR_MAX_MEMBERS:
                        raise TooLarge(f"tar has more than {streams.TAR_MAX_MEMBERS} members",
                                       details={"limit": "members",
                                                "max": streams.TAR_MAX_MEMBERS})
                    self._extract(tf, m, base, dirs)
        except _BAD_ARCHIVE as e:
            raise InvalidRequest(f"bad tar archive: {e}") from None
        for dest, mode in reversed(dirs):
            self._fs(_core.fs_chmod, dest, dest, mode)

    def _extract(self, tf: tarfile.TarFile, m: tarfile.TarInfo, base: str,
                 dirs: list[tuple[str, int]]) -> None:
        rel = _tar_rel(m.name)
        if rel is None:
            return
        dest = f"{base}/{rel}"
        mode = m.mode & 0o7777 & ~(stat_mod.S_ISUID | stat_mod.S_ISGID)
        if m.isdir():
            self._fs(_core.fs_mkdir, dest, dest, True, 0o755)
            dirs.append((dest, mode or 0o755))
        elif m.isreg():
            f = tf.extractfile(m)
            self._replace(dest)
            self._write_from(dest, mode, f if f is not None else io.BytesIO())
        elif m.issym():
            parent = dest.rsplit("/", 1)[0] or "/"
            self._fs(_core.fs_mkdir, parent, parent, True)
            self._replace(dest)
            self._fs(_core.fs_symlink, dest, m.linkname, dest)
        elif m.islnk():
            target_rel = _tar_rel(m.linkname)
            if target_rel is None:
                raise InvalidRequest(f"tar hard link {m.name!r} points at the root")
            src = f"{base}/{target_rel}"
            fd, _ = self._fs(_core.fs_open_read, src, src)
            with open(fd, "rb", buffering=0) as f:
                self._replace(dest)
                self._write_from(dest, mode, f)
        else:
            raise InvalidRequest(
                f"tar member {m.name!r} is a device, FIFO or other special file")

    def _replace(self, dest: str) -> None:
        try:
            kind, *_ = self._fs(_core.fs_stat, dest, dest)
        except FileNotFound:
            return
        if kind != "dir":
            self._fs(_core.fs_remove, dest, dest, False)


def _tar_rel(name: str) -> str | None:
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise InvalidPath(f"tar member {name!r} contains '..'", details={"member": name})
    if any("\0" in p for p in parts):
        raise InvalidPath(f"tar member {name!r} has a NUL byte")
    return "/".join(parts) or None
