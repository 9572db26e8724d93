"""Files of a sandbox, read and written from the daemon through its root fd."""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any, BinaryIO

from corral import _core
from corral.daemon import uploads
from corral.daemon.oserrors import sandbox_file_error
from corral.errors import CorralError, InvalidPath, TooLarge
from corral.models import DEFAULT_DISK_MB, FileEntry

from ..base import SandboxRuntime
from ..paths import check_path

if TYPE_CHECKING:  # pragma: no cover
    from .host import Host


_check_path = check_path  # the one check every substrate makes (substrates/paths.py)


class Files:
    """File operations through the sandbox's root fd (openat2 RESOLVE_IN_ROOT)."""

    def _fs(self: Host,
            runtime: SandboxRuntime, fn: Any, path: str, *args: Any) -> Any:
        try:
            with self._rooted(runtime) as root:
                return fn(root, *args)
        except ValueError as e:
            raise InvalidPath(str(e), details={"path": path}) from None
        except OSError as e:
            raise sandbox_file_error(e, path, self.scratch.quota) from None
        except _core.LayerLimit as e:  # a listing past fs.rs LIST_MAX
            what, limit = e.args
            raise TooLarge(f"{path} has more than {limit} {what}",
                           details={"path": path, "limit": what, "max": limit}) from None

    def read_file(self: Host,
                  runtime: SandboxRuntime, path: str, max_bytes: int) -> bytes:
        _check_path(path)
        return self._fs(runtime, _core.fs_read, path, path, max(0, int(max_bytes)))

    def write_file(self: Host,
                   runtime: SandboxRuntime, path: str, data: bytes | BinaryIO,
                   mode: int = 0o644, make_parents: bool = True) -> None:
        """``data``: bytes, or a binary file at its start (a spooled request body), copied in
        chunks so the daemon holds one chunk of it at a time."""
        _check_path(path)
        if self.scratch.quota:  # the kernel bounds it (EDQUOT: TooLarge, see _file_error)
            try:
                self._write(runtime, path, data, mode, make_parents)
            except TooLarge:
                # No partial file stays behind to fill the disk the write could not fit in.
                with contextlib.suppress(CorralError):
                    self._fs(runtime, _core.fs_remove, path, path, False)
                raise
            return
        size = (os.fstat(data.fileno()).st_size if not isinstance(data, (bytes, bytearray))
                else len(data))
        try:  # what the write replaces is freed (lstat: a symlink is replaced, not followed)
            kind, old, *_ = self._fs(runtime, _core.fs_stat, path, path)
            old = old if kind == "file" else 0
        except CorralError:
            old = 0
        self._charge(runtime, size - old)
        try:
            self._write(runtime, path, data, mode, make_parents)
        except BaseException:
            self._charge(runtime, old - size)
            raise

    def _write(self: Host,
               runtime: SandboxRuntime, path: str, data: bytes | BinaryIO, mode: int,
               make_parents: bool) -> None:
        if isinstance(data, (bytes, bytearray)):
            self._fs(runtime, _core.fs_write, path, path, bytes(data), mode & 0o7777,
                     make_parents)
        else:
            self._copy_in(runtime, path, mode & 0o7777, make_parents, data)

    def _copy_in(self: Host,
                 runtime: SandboxRuntime, path: str, mode: int, make_parents: bool,
                 src: BinaryIO) -> None:
        """The body of write_file from a file (already charged to the disk budget whole)."""
        fd = self._fs(runtime, _core.fs_open_write, path, path, mode, make_parents)
        try:
            while chunk := src.read(uploads.CHUNK):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view):]
        except OSError as e:
            raise sandbox_file_error(e, path, self.scratch.quota) from None
        finally:
            os.close(fd)

    def list_dir(self: Host, runtime: SandboxRuntime, path: str) -> list[FileEntry]:
        _check_path(path)
        base = path.rstrip("/") or ""
        return [FileEntry(name=name, path=f"{base}/{name}", type=kind, size=size, mode=mode,
                          mtime=mtime)
                for name, kind, size, mode, mtime in self._fs(runtime, _core.fs_list, path, path)]

    def stat(self: Host, runtime: SandboxRuntime, path: str) -> FileEntry:
        _check_path(path)
        kind, size, mode, mtime = self._fs(runtime, _core.fs_stat, path, path)
        norm = os.path.normpath(path)
        if norm.startswith("//"):
            norm = norm[1:]
        return FileEntry(name=os.path.basename(norm) or "/", path=norm, type=kind, size=size,
                         mode=mode, mtime=mtime)

    def mkdir(self: Host,
              runtime: SandboxRuntime, path: str, parents: bool = True) -> None:
        _check_path(path)
        self._fs(runtime, _core.fs_mkdir, path, path, parents)

    def remove(self: Host,
               runtime: SandboxRuntime, path: str, recursive: bool = False) -> None:
        _check_path(path)
        self._fs(runtime, _core.fs_remove, path, path, recursive)

    def rename(self: Host, runtime: SandboxRuntime, src: str, dst: str) -> None:
        _check_path(src)
        _check_path(dst)
        self._fs(runtime, _core.fs_rename, src, src, dst)

    def _charge(self: Host, runtime: SandboxRuntime, delta: int) -> None:
        if self.scratch.quota:
            return  # the kernel bounds the sandbox's layer: EDQUOT (see _file_error)
        limit = int(runtime.extra.get("disk_mb", DEFAULT_DISK_MB)) << 20
        self.disk.charge(runtime.sandbox_id, delta, limit)
