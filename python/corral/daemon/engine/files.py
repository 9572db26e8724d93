"""Files: the file operations of a sandbox, through its substrate."""

from __future__ import annotations

import builtins
from collections.abc import Callable
from typing import TYPE_CHECKING, BinaryIO

from corral.daemon import filethreads, oserrors, streams
from corral.daemon.substrates.base import NotCached, SandboxRuntime, Substrate
from corral.daemon.tenants import TENANT_LABEL
from corral.errors import CorralError, FileNotFound, NotADirectory, PermissionDenied
from corral.models import FileEntry

from .base import DIRECT_IO_BYTES, Sandbox, T

if TYPE_CHECKING:  # pragma: no cover
    from .host import EngineHost


# Entries read from a directory at a time while walking a tree.
TREE_PAGE = 1000


def walk_tree(sub: Substrate, rt: SandboxRuntime, path: str, depth: int,
              limit: int) -> tuple[builtins.list[FileEntry], bool]:
    """Substrate.list_page over the tree under ``path``, breadth first (Engine.tree). A
    directory below ``path`` that is gone, replaced or unreadable by the time it is read is
    skipped: the sandbox changes its tree while it is walked."""
    out: builtins.list[FileEntry] = []
    level = [path]
    for _ in range(depth):
        below: builtins.list[str] = []
        for d in level:
            after: str | None = None
            while True:
                try:
                    page, after = sub.list_page(rt, d, after, min(TREE_PAGE, limit + 1))
                except (FileNotFound, NotADirectory, PermissionDenied):
                    if d == path:
                        raise
                    break
                for e in page:
                    if len(out) == limit:
                        return out, True
                    out.append(e)
                    if e.type == "dir":
                        below.append(e.path)
                if after is None:
                    break
        level = below
        if not level:
            break
    return out, False


class FileOps:
    async def _files(self: EngineHost, sid: str, path: str,
                     call: Callable[[Substrate, SandboxRuntime], T], big: bool = False) -> T:
        """Run a substrate file operation on ``path`` (errors name it); ``big`` ones in a
        file thread, within the sandbox's tenant's share of them (_in_file_thread). Only
        what cannot take long runs on the loop (a stat, a read of at most DIRECT_IO_BYTES,
        each only when its path resolves from the dentry cache without a symlink in at most
        64 steps and its bytes are in memory, else NotCached and a file thread): what makes
        directories, or changes or replaces a file's data, can take long in the kernel (a
        copy-up of an image's file whole, a truncate, the last unlink of a big file), which
        must not hold the loop."""
        if self._capturing(sid):
            await self.ready(sid)
        sb = self.get(sid)
        sub = self.substrates[sb.spec.substrate]
        if not sub.capabilities.files:
            raise self._lacks(sub, "files")
        runtime = sb.runtime
        assert runtime is not None
        try:
            if big:
                return await _in_file_thread(self, sb, lambda: call(sub, runtime))
            return call(sub, runtime)
        except CorralError as e:
            if sb.state == "running":
                self._check_alive(sb)
            elif sb.reason is not None:  # it ended (or is ending) meanwhile: say why, as exec
                raise self._gone(sb.id, sb) from e  # does (a shutdown: daemon_restarted)
            raise
        except OSError as e:
            self._check_alive(sb)
            raise oserrors.host_file_error(e, path) from e

    async def stat(self: EngineHost, sid: str, path: str) -> FileEntry:
        """On the loop when memory serves it in bounded time (as read_file), else in a file
        thread."""
        try:
            return await self._files(sid, path, lambda s, rt: s.stat(rt, path, cached_only=True))
        except NotCached:
            return await self._files(sid, path, lambda s, rt: s.stat(rt, path), big=True)

    async def list_dir(self: EngineHost, sid: str, path: str) -> builtins.list[FileEntry]:
        return await self._files(sid, path, lambda s, rt: s.list_dir(rt, path), big=True)

    async def list_page(self: EngineHost, sid: str, path: str, after: str | None,
                        limit: int) -> tuple[builtins.list[FileEntry], str | None]:
        """One page of a listing (Substrate.list_page), in a thread: a directory of 100,000
        names takes a while to read."""
        return await self._files(sid, path, lambda s, rt: s.list_page(rt, path, after, limit),
                                 big=True)

    async def tree(self: EngineHost, sid: str, path: str, depth: int,
                   limit: int) -> tuple[builtins.list[FileEntry], bool]:
        """The entries under directory ``path`` to ``depth`` levels, breadth first, at most
        ``limit`` of them, and whether there were more: one file-thread job for the tree
        (a client polling it makes one call, not one per directory)."""
        return await self._files(sid, path, lambda s, rt: walk_tree(s, rt, path, depth, limit),
                                 big=True)

    async def mkdir(self: EngineHost, sid: str, path: str, parents: bool) -> None:
        """In a thread: a path of 2,000 components makes 2,000 directories (~0.5 s each
        call on the loop, measured)."""
        await self._files(sid, path, lambda s, rt: s.mkdir(rt, path, parents), big=True)

    async def remove(self: EngineHost, sid: str, path: str, recursive: bool) -> None:
        """In a thread, also one file: the last unlink of a big file frees its pages and
        extents in the caller (~0.1 s a GB measured, longer for data still written back)."""
        await self._files(sid, path, lambda s, rt: s.remove(rt, path, recursive), big=True)

    async def rename(self: EngineHost, sid: str, src: str, dst: str) -> None:
        """In a thread: renaming a file of an image's lower layer copies it up whole first
        (a 300 MB one held the loop ~0.35 s, six at once 1.7 s), and a replaced ``dst`` is
        unlinked (remove)."""
        await self._files(sid, src, lambda s, rt: s.rename(rt, src, dst), big=True)

    async def write_file(self: EngineHost, sid: str, path: str, data: bytes | BinaryIO,
                         mode: int) -> None:
        """In a thread, however small ``data``: opening a lower-layer file for writing copies
        it up whole before it is truncated (a 1-byte write to a 300 MB file held the loop
        ~0.4 s, six at once 2.4 s)."""
        await self._files(sid, path, lambda s, rt: s.write_file(rt, path, data, mode, True),
                          big=True)

    async def upload_tar(self: EngineHost, sid: str, path: str, data: bytes | BinaryIO,
                         big: bool = True) -> None:
        await self._files(sid, path, lambda s, rt: s.upload_tar(rt, path, data), big=big)

    async def read_file(self: EngineHost, sid: str, path: str,
                        max_bytes: int) -> tuple[bytes, bool, int | None]:
        """(data, truncated, fd): at most ``max_bytes``. Most reads are small: tried on the
        loop and returned whole. A bigger file is not read here: ``fd`` is an open, checked fd
        of it (data empty) for the caller to stream in bounded chunks and close
        (corral.daemon.streams), so the daemon's memory does not grow with the file."""
        first = min(max_bytes, DIRECT_IO_BYTES)
        try:  # from memory on the loop; what needs the disk (cold: the sandbox can make it
            # so, and keep the disk busy) is read in a file thread
            data = await self._files(sid, path, lambda s, rt: s.read_file(rt, path, first + 1,
                                                                          cached_only=True))
        except NotCached:
            data = await self._files(sid, path, lambda s, rt: s.read_file(rt, path, first + 1),
                                     big=True)
        if len(data) > first and first < max_bytes:
            fd, size = await self._files(sid, path, lambda s, rt: s.open_read(rt, path),
                                         big=True)
            return b"", size > max_bytes, fd
        if len(data) > max_bytes:
            return data[:max_bytes], True, None
        return data, False, None

    async def plan_tar(self: EngineHost, sid: str, path: str, max_bytes: int,
                       max_members: int) -> streams.TreeOps:
        """Check that a tar of ``path`` stays within the caps (a walk that only stats, in a
        thread); returns the primitives to stream it with (streams.chunks)."""
        ops = await self._files(sid, path, lambda s, rt: s.tree_ops(rt, path))
        await self.stat(sid, path)  # a missing path fails here, with its error
        await self.ready(sid, capture=False)
        sb = self.get(sid)
        await _in_file_thread(self, sb, lambda: streams.plan(ops, path.rstrip("/") or "/",
                                                            max_bytes, max_members))
        return ops


async def _in_file_thread(engine: EngineHost, sb: Sandbox, fn: Callable[[], T]) -> T:
    """``fn()`` in a file thread, within the share of the sandbox's tenant
    (corral.daemon.filethreads). Queued behind the tenant's others, it holds nothing; once it
    has a thread it checks that the sandbox still runs, and counts in its threads (which its
    destroy waits for) until ``fn`` has ended, even if its caller left."""

    def start() -> None:
        if sb.state != "paused":  # paused while queued: run on its files, not resumed here
            engine.get(sb.id)  # ended while queued: its error, nothing run
        sb.enter_thread()

    return await filethreads.run(sb.spec.labels.get(TENANT_LABEL), fn, start, sb.leave_thread)
