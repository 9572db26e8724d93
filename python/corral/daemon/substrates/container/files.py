"""Files of a sandbox, read and written from the daemon through its root fd (the shared
operations: substrates/rootfiles.py), with the container's disk budget."""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, BinaryIO

from corral.daemon import scratch, streams
from corral.errors import CorralError, TooLarge
from corral.models import DEFAULT_DISK_MB, FileEntry

from ..base import SandboxRuntime
from ..paths import check_path
from ..rootfiles import RootFiles

if TYPE_CHECKING:  # pragma: no cover
    from .host import Host


class Files:
    """File operations and tar through the sandbox's root fd (the root cache's), charged to
    the sandbox's disk budget where no kernel quota bounds it."""

    def _files(self: Host, runtime: SandboxRuntime) -> RootFiles:
        charge = None if self.scratch.quota else (
            lambda delta: self._charge(runtime, delta))
        layer = os.path.join(runtime.sandbox_dir, scratch.LAYER)
        return RootFiles(lambda: self._rooted(runtime), self.scratch.quota, charge,
                         self.upload_max_bytes,
                         lambda: self.scratch.holds_its_share(layer, len(self._live)))

    def read_file(self: Host, runtime: SandboxRuntime, path: str, max_bytes: int,
                  cached_only: bool = False) -> bytes:
        return self._files(runtime).read(path, max_bytes, cached_only)

    def write_file(self: Host,
                   runtime: SandboxRuntime, path: str, data: bytes | BinaryIO,
                   mode: int = 0o644, make_parents: bool = True) -> None:
        check_path(path)  # before anything is charged
        f = self._files(runtime)
        if self.scratch.quota:  # the kernel bounds it (EDQUOT: TooLarge)
            try:
                f.write(path, data, mode, make_parents)
            except TooLarge:
                # No partial file stays behind to fill the disk the write could not fit in.
                with contextlib.suppress(CorralError):
                    f.remove(path, False)
                raise
            return
        size = (os.fstat(data.fileno()).st_size if not isinstance(data, (bytes, bytearray))
                else len(data))
        try:  # what the write replaces is freed (lstat: a symlink is replaced, not followed)
            old_entry = f.stat(path)
            old = old_entry.size if old_entry.type == "file" else 0
        except CorralError:
            old = 0
        self._charge(runtime, size - old)
        try:
            f.write(path, data, mode, make_parents)
        except BaseException:
            self._charge(runtime, old - size)
            raise

    def list_dir(self: Host, runtime: SandboxRuntime, path: str) -> list[FileEntry]:
        return self._files(runtime).ls(path)

    def list_page(self: Host, runtime: SandboxRuntime, path: str, after: str | None,
                  limit: int) -> tuple[list[FileEntry], str | None]:
        return self._files(runtime).ls_page(path, after, limit)

    def stat(self: Host, runtime: SandboxRuntime, path: str,
             cached_only: bool = False) -> FileEntry:
        return self._files(runtime).stat(path, cached_only)

    def mkdir(self: Host,
              runtime: SandboxRuntime, path: str, parents: bool = True) -> None:
        self._files(runtime).mkdir(path, parents)

    def remove(self: Host,
               runtime: SandboxRuntime, path: str, recursive: bool = False) -> None:
        self._files(runtime).remove(path, recursive)

    def rename(self: Host, runtime: SandboxRuntime, src: str, dst: str) -> None:
        self._files(runtime).rename(src, dst)

    def open_read(self: Host, runtime: SandboxRuntime, path: str) -> tuple[int, int]:
        return self._files(runtime).open_read(path)

    def upload_tar(self: Host, runtime: SandboxRuntime, path: str,
                   tar_bytes: bytes | BinaryIO) -> None:
        self._files(runtime).upload_tar(path, tar_bytes)

    def download_tar(self: Host, runtime: SandboxRuntime, path: str) -> bytes:
        return self._files(runtime).download_tar(path)

    def tree_ops(self: Host, runtime: SandboxRuntime, path: str) -> streams.TreeOps:
        return self._files(runtime).tree_ops(path)

    def _charge(self: Host, runtime: SandboxRuntime, delta: int) -> None:
        if self.scratch.quota:
            return  # the kernel bounds the sandbox's layer: EDQUOT
        limit = int(runtime.extra.get("disk_mb", DEFAULT_DISK_MB)) << 20
        self.disk.charge(runtime.sandbox_id, delta, limit)
