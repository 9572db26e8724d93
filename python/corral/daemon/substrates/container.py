"""The container substrate: Linux namespaces + overlayfs + cgroups, driven by ``corral._core``.

One sandbox = a tiny init (PID 1 of new mnt/pid/uts/ipc/net/cgroup namespaces) whose root is an
overlay of the image's read-only layers and a private upper dir, assembled inside its own mount
namespace (the host mount table never sees it). Commands are forked straight from the daemon
into the namespaces (``_core.exec_in``); files are read and written from the daemon through an
O_PATH fd of the init's root with openat2(RESOLVE_IN_ROOT) (``_core.fs_*``).

On disk: ``<state_dir>/sandboxes/<id>/{root, upper/<n>, work/<n>}``; cgroups from
:class:`~corral.daemon.cgroups.CgroupManager`. Everything a sandbox owns can be found again from
its id alone, which is what :meth:`cleanup_orphans` relies on after a crash.
"""

from __future__ import annotations

import errno
import io
import os
import select
import shutil
import signal
import stat as stat_mod
import tarfile
import threading
from typing import TYPE_CHECKING, Any

from corral import _core
from corral.errors import (
    CapacityExceeded,
    CorralError,
    DirectoryNotEmpty,
    FileExists,
    FileNotFound,
    InternalError,
    InvalidPath,
    InvalidRequest,
    IsADirectory,
    NotADirectory,
    SandboxNotRunning,
)
from corral.models import FileEntry, SandboxSpec

from .base import ExecSpec, SandboxRuntime, Substrate

if TYPE_CHECKING:  # pragma: no cover
    from corral.daemon.cgroups import CgroupManager
    from corral.daemon.images import Image, ImageStore

# Limits every process of a sandbox starts with. No core dumps (a crash must not reach the
# host's core_pattern helper with a sandbox's memory); a generous but finite fd limit.
DEFAULT_RLIMITS: dict[str, int | tuple[int, int]] = {"core": (0, 0), "nofile": (1024, 524288)}

# errno -> CorralError class for file operations.
_FILE_ERRORS: dict[int, type[CorralError]] = {
    errno.ENOENT: FileNotFound,
    errno.EEXIST: FileExists,
    errno.ENOTDIR: NotADirectory,
    errno.EISDIR: IsADirectory,
    errno.ENOTEMPTY: DirectoryNotEmpty,
    errno.EXDEV: InvalidPath,
    errno.ELOOP: InvalidPath,
    errno.ENAMETOOLONG: InvalidPath,
    errno.EINVAL: InvalidPath,
    errno.EACCES: InvalidRequest,
    errno.EPERM: InvalidRequest,
    errno.EROFS: InvalidRequest,
    errno.EBUSY: InvalidRequest,
    errno.ENOSPC: InvalidRequest,
    errno.EDQUOT: InvalidRequest,
    errno.EFBIG: InvalidRequest,
    errno.EOPNOTSUPP: InvalidRequest,
}
_OUT_OF_RESOURCES = {errno.EAGAIN, errno.ENOMEM, errno.ENOSPC, errno.EMFILE, errno.ENFILE,
                     errno.EUSERS}

TAR_MAX_MEMBERS = 1_000_000
# Kernel-made trees a download of "/" records as empty directories.
_NO_DESCEND = {"/proc", "/sys", "/dev"}


def proc_starttime(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks since boot); None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # comm (field 2) may hold spaces and parentheses: split after the last ')'.
    rest = data[data.rindex(b")") + 2:].split()
    return int(rest[19])  # fields 3.. -> field 22 is index 19


def _pidfd_exited(pidfd: int, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for a pidfd to become readable (its process has exited)."""
    p = select.poll()
    p.register(pidfd, select.POLLIN)
    return bool(p.poll(max(0, int(timeout_s * 1000))))


def _file_error(e: OSError, path: str) -> CorralError:
    cls = _FILE_ERRORS.get(e.errno or 0, InternalError)
    reason = e.strerror or str(e)
    msg = f"{reason}: {path}" if path else reason
    return cls(msg, details={"path": path, "errno": e.errno})


def _check_path(path: str) -> str:
    if not isinstance(path, str) or not path.startswith("/"):
        raise InvalidPath(f"paths must be absolute inside the sandbox: {path!r}",
                          details={"path": path})
    if "\0" in path:
        raise InvalidPath("NUL byte in path", details={"path": path})
    if len(path) > 4096:
        raise InvalidPath("path longer than 4096 bytes", details={"path": path[:100] + "..."})
    return path


class ContainerSubstrate(Substrate):
    name = "container"

    def __init__(self, state_dir: str, cgroups: CgroupManager, images: ImageStore) -> None:
        self.state_dir = state_dir
        self.sandboxes_dir = os.path.join(state_dir, "sandboxes")
        os.makedirs(self.sandboxes_dir, mode=0o700, exist_ok=True)
        self.cgroups = cgroups
        self.images = images
        self.init_fd = _core.init_memfd()
        self.rlimits = dict(DEFAULT_RLIMITS)
        # O_PATH fds of sandbox roots, opened on first use; never persisted.
        self._root_fds: dict[str, int] = {}
        self._lock = threading.Lock()

    # ---- lifecycle -----------------------------------------------------------------------
    def create(self, sandbox_id: str, spec: SandboxSpec, image: Any) -> SandboxRuntime:
        from corral.daemon.cgroups import check_id

        try:
            check_id(sandbox_id)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        img: Image = self.images.get(image) if isinstance(image, str) else image
        if not img.overlays or img.overlays[0][0] != "/":
            raise InvalidRequest(f"image {img.name!r} has no root overlay")
        sdir = os.path.join(self.sandboxes_dir, sandbox_id)
        root = os.path.join(sdir, "root")
        paths: list[str] = []
        pid, pidfd = -1, -1
        try:
            os.makedirs(sdir, mode=0o700, exist_ok=True)
            os.mkdir(root, 0o755)
            os.mkdir(os.path.join(sdir, "upper"), 0o700)
            os.mkdir(os.path.join(sdir, "work"), 0o700)
            overlays = []
            for n, (target, lowers) in enumerate(img.overlays):
                upper = os.path.join(sdir, "upper", str(n))
                work = os.path.join(sdir, "work", str(n))
                os.mkdir(upper, 0o755)
                os.mkdir(work, 0o700)
                overlays.append({"target": target, "lower": list(lowers), "upper": upper,
                                 "work": work})
            paths = self.cgroups.create(sandbox_id, spec.cpu, spec.memory_mb, spec.pids)
            cfg = {
                "init_fd": self.init_fd,
                "root": root,
                "overlays": overlays,
                "hostname": spec.hostname or sandbox_id[:63],
                "cgroup_procs": self.cgroups.procs_files(paths),
                "rlimits": self.rlimits,
            }
            pid, pidfd = _core.spawn_sandbox(cfg)
            starttime = proc_starttime(pid)
            if starttime is None:
                raise OSError(errno.ESRCH, "spawn_sandbox: the init died right after exec")
            return SandboxRuntime(sandbox_id=sandbox_id, init_pid=pid, init_starttime=starttime,
                                  sandbox_dir=sdir, cgroup_paths=paths, pidfd=pidfd,
                                  extra={"image": img.name})
        except BaseException as e:
            self._undo_create(sandbox_id, sdir, paths, pid, pidfd)
            if isinstance(e, CorralError) or not isinstance(e, Exception):
                raise
            if isinstance(e, ValueError):
                raise InvalidRequest(f"cannot create sandbox: {e}") from e
            if isinstance(e, OSError):
                details = {"errno": e.errno}
                if e.errno in _OUT_OF_RESOURCES:
                    raise CapacityExceeded(f"host out of resources: {e.strerror or e}",
                                           details=details) from e
                raise InternalError(f"cannot create sandbox: {e.strerror or e}",
                                    details=details) from e
            raise InternalError(f"cannot create sandbox: {e}") from e

    def _undo_create(self, sandbox_id: str, sdir: str, paths: list[str], pid: int,
                     pidfd: int) -> None:
        if pidfd >= 0:
            self._kill_and_wait(pid, pidfd)
            os.close(pidfd)
        if paths:
            try:
                self.cgroups.kill_all(paths)
                self.cgroups.remove(paths)
            except OSError:
                pass
        shutil.rmtree(sdir, ignore_errors=True)

    def _kill_and_wait(self, pid: int, pidfd: int, timeout_s: float = 10.0) -> None:
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            # Our child: waitid reaps it (and returns once the pid namespace is torn down).
            os.waitid(os.P_PIDFD, pidfd, os.WEXITED)
        except ChildProcessError:
            # Adopted after a daemon restart: someone else reaps it; wait for the exit.
            _pidfd_exited(pidfd, timeout_s)

    def adopt(self, runtime: SandboxRuntime) -> bool:
        pid = runtime.init_pid
        if pid <= 0 or proc_starttime(pid) != runtime.init_starttime:
            return False
        try:
            fd = os.pidfd_open(pid)
        except (ProcessLookupError, OSError):
            return False
        # The pid could have been reused between the check and pidfd_open: check again now
        # that the pidfd pins the process.
        if proc_starttime(pid) != runtime.init_starttime or _pidfd_exited(fd, 0):
            os.close(fd)
            return False
        runtime.pidfd = fd
        return True

    def destroy(self, runtime: SandboxRuntime) -> None:
        self._close_root(runtime.sandbox_id)
        pidfd = runtime.pidfd
        if pidfd < 0 and runtime.init_pid > 0 and \
                proc_starttime(runtime.init_pid) == runtime.init_starttime:
            try:
                pidfd = os.pidfd_open(runtime.init_pid)
                if proc_starttime(runtime.init_pid) != runtime.init_starttime:
                    os.close(pidfd)
                    pidfd = -1
            except OSError:
                pidfd = -1
        if pidfd >= 0:
            self._kill_and_wait(runtime.init_pid, pidfd)
        paths = runtime.cgroup_paths or self.cgroups.paths_for(runtime.sandbox_id)
        self.cgroups.kill_all(paths)
        self.cgroups.remove(paths)
        if pidfd >= 0:
            os.close(pidfd)
        runtime.pidfd = -1
        sdir = os.path.join(self.sandboxes_dir, runtime.sandbox_id)
        shutil.rmtree(sdir, ignore_errors=True)

    def cleanup_orphans(self, known_ids: set[str]) -> list[str]:
        ids = set(self.cgroups.list_ids())
        try:
            ids.update(n for n in os.listdir(self.sandboxes_dir)
                       if os.path.isdir(os.path.join(self.sandboxes_dir, n)))
        except FileNotFoundError:
            pass
        removed = []
        for sid in sorted(ids - set(known_ids)):
            try:
                paths = self.cgroups.paths_for(sid)
            except ValueError:
                continue  # not one of ours
            self._close_root(sid)
            self.cgroups.kill_all(paths)
            try:
                self.cgroups.remove(paths)
            except OSError:
                pass
            shutil.rmtree(os.path.join(self.sandboxes_dir, sid), ignore_errors=True)
            removed.append(sid)
        return removed

    def is_alive(self, runtime: SandboxRuntime) -> bool:
        if runtime.pidfd >= 0:
            return not _pidfd_exited(runtime.pidfd, 0)
        return proc_starttime(runtime.init_pid) == runtime.init_starttime

    # ---- exec ----------------------------------------------------------------------------
    def spawn(self, runtime: SandboxRuntime, spec: ExecSpec) -> int:
        cfg = {
            "init_pid": runtime.init_pid,
            "pidfd": runtime.pidfd,
            "root_fd": self._root(runtime),
            "argv": list(spec.argv),
            "env": [f"{k}={v}" for k, v in spec.env.items()],
            "cwd": spec.cwd or "/",
            "uid": spec.uid,
            "gid": spec.gid,
            "groups": list(spec.groups),
            "stdin": spec.stdin_fd,
            "stdout": spec.stdout_fd,
            "stderr": spec.stderr_fd,
            "cgroup_procs": self.cgroups.procs_files(runtime.cgroup_paths),
            "rlimits": self.rlimits,
        }
        try:
            return _core.exec_in(cfg)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        except OSError as e:
            if not self.is_alive(runtime):
                raise SandboxNotRunning("the sandbox's init is gone") from e
            if e.errno in _OUT_OF_RESOURCES:
                raise CapacityExceeded(f"cannot start the process: {e.strerror or e}",
                                       details={"errno": e.errno}) from e
            raise InternalError(f"cannot start the process: {e.strerror or e}",
                                details={"errno": e.errno}) from e

    # ---- files ---------------------------------------------------------------------------
    def _root(self, runtime: SandboxRuntime) -> int:
        fd = self._root_fds.get(runtime.sandbox_id)
        if fd is not None:
            return fd
        if runtime.pidfd < 0:
            raise SandboxNotRunning("the sandbox is not running")
        try:
            fd = _core.root_fd(runtime.init_pid)
        except OSError as e:
            raise SandboxNotRunning(f"the sandbox's root is gone: {e.strerror}") from e
        # Same pid-reuse argument as in exec_in: the pidfd's process still runs after the open.
        if _pidfd_exited(runtime.pidfd, 0):
            os.close(fd)
            raise SandboxNotRunning("the sandbox's init is gone")
        with self._lock:
            old = self._root_fds.get(runtime.sandbox_id)
            if old is not None:  # another thread won the race
                os.close(fd)
                return old
            self._root_fds[runtime.sandbox_id] = fd
        return fd

    def _close_root(self, sandbox_id: str) -> None:
        with self._lock:
            fd = self._root_fds.pop(sandbox_id, None)
        if fd is not None:
            os.close(fd)

    def _fs(self, runtime: SandboxRuntime, fn: Any, path: str, *args: Any) -> Any:
        try:
            return fn(self._root(runtime), *args)
        except ValueError as e:
            raise InvalidPath(str(e), details={"path": path}) from None
        except OSError as e:
            raise _file_error(e, path) from None

    def read_file(self, runtime: SandboxRuntime, path: str, max_bytes: int) -> bytes:
        _check_path(path)
        return self._fs(runtime, _core.fs_read, path, path, max(0, int(max_bytes)))

    def write_file(self, runtime: SandboxRuntime, path: str, data: bytes, mode: int = 0o644,
                   make_parents: bool = True) -> None:
        _check_path(path)
        self._fs(runtime, _core.fs_write, path, path, bytes(data), mode & 0o7777, make_parents)

    def list_dir(self, runtime: SandboxRuntime, path: str) -> list[FileEntry]:
        _check_path(path)
        base = path.rstrip("/") or ""
        return [FileEntry(name=name, path=f"{base}/{name}", type=kind, size=size, mode=mode,
                          mtime=mtime)
                for name, kind, size, mode, mtime in self._fs(runtime, _core.fs_list, path, path)]

    def stat(self, runtime: SandboxRuntime, path: str) -> FileEntry:
        _check_path(path)
        kind, size, mode, mtime = self._fs(runtime, _core.fs_stat, path, path)
        norm = os.path.normpath(path)
        if norm.startswith("//"):
            norm = norm[1:]
        return FileEntry(name=os.path.basename(norm) or "/", path=norm, type=kind, size=size,
                         mode=mode, mtime=mtime)

    def mkdir(self, runtime: SandboxRuntime, path: str, parents: bool = True) -> None:
        _check_path(path)
        self._fs(runtime, _core.fs_mkdir, path, path, parents)

    def remove(self, runtime: SandboxRuntime, path: str, recursive: bool = False) -> None:
        _check_path(path)
        self._fs(runtime, _core.fs_remove, path, path, recursive)

    def rename(self, runtime: SandboxRuntime, src: str, dst: str) -> None:
        _check_path(src)
        _check_path(dst)
        self._fs(runtime, _core.fs_rename, src, src, dst)

    # ---- tar -----------------------------------------------------------------------------
    def upload_tar(self, runtime: SandboxRuntime, path: str, tar_bytes: bytes) -> None:
        """Extract into ``path`` through the fs primitives only (never via host paths):
        members are normalized below ``path``, ``..`` refused, devices/FIFOs/sockets refused,
        hard links copied from an already extracted member, symlinks made verbatim (they
        resolve inside the sandbox's root)."""
        _check_path(path)
        base = path.rstrip("/")
        self._fs(runtime, _core.fs_mkdir, path, path, True)
        try:
            tf = tarfile.open(fileobj=io.BytesIO(tar_bytes), mode="r:*")
        except tarfile.TarError as e:
            raise InvalidRequest(f"not a tar archive: {e}") from None
        dirs: list[tuple[str, int]] = []
        with tf:
            for count, m in enumerate(tf):
                if count >= TAR_MAX_MEMBERS:
                    raise InvalidRequest(f"tar has more than {TAR_MAX_MEMBERS} members")
                rel = self._tar_rel(m.name)
                if rel is None:
                    continue
                dest = f"{base}/{rel}"
                mode = m.mode & 0o7777 & ~(stat_mod.S_ISUID | stat_mod.S_ISGID)
                if m.isdir():
                    self._fs(runtime, _core.fs_mkdir, dest, dest, True, 0o755)
                    dirs.append((dest, mode or 0o755))
                elif m.isreg():
                    f = tf.extractfile(m)
                    data = f.read() if f is not None else b""
                    self._replace(runtime, dest)
                    self._fs(runtime, _core.fs_write, dest, dest, data, mode, True)
                elif m.issym():
                    self._parent(runtime, dest)
                    self._replace(runtime, dest)
                    self._fs(runtime, _core.fs_symlink, dest, m.linkname, dest)
                elif m.islnk():
                    target_rel = self._tar_rel(m.linkname)
                    if target_rel is None:
                        raise InvalidRequest(f"tar hard link {m.name!r} points at the root")
                    src = f"{base}/{target_rel}"
                    data = self._fs(runtime, _core.fs_read, src, src, 1 << 40)
                    self._replace(runtime, dest)
                    self._fs(runtime, _core.fs_write, dest, dest, data, mode, True)
                else:
                    raise InvalidRequest(
                        f"tar member {m.name!r} is a device, FIFO or other special file")
        # Directory modes last, deepest first, so a read-only dir does not block its contents.
        for dest, mode in reversed(dirs):
            self._fs(runtime, _core.fs_chmod, dest, dest, mode)

    @staticmethod
    def _tar_rel(name: str) -> str | None:
        parts = [p for p in name.split("/") if p not in ("", ".")]
        if any(p == ".." for p in parts):
            raise InvalidPath(f"tar member {name!r} contains '..'", details={"member": name})
        if any("\0" in p for p in parts):
            raise InvalidPath(f"tar member {name!r} has a NUL byte")
        return "/".join(parts) or None

    def _parent(self, runtime: SandboxRuntime, dest: str) -> None:
        parent = dest.rsplit("/", 1)[0] or "/"
        self._fs(runtime, _core.fs_mkdir, parent, parent, True)

    def _replace(self, runtime: SandboxRuntime, dest: str) -> None:
        """Remove a non-directory at ``dest`` (tar semantics: a member replaces what is
        there); a symlink is removed, never followed."""
        try:
            kind, *_ = _core.fs_stat(self._root(runtime), dest)
        except FileNotFoundError:
            return
        except OSError as e:
            raise _file_error(e, dest) from None
        if kind != "dir":
            self._fs(runtime, _core.fs_remove, dest, dest, False)

    def download_tar(self, runtime: SandboxRuntime, path: str) -> bytes:
        _check_path(path)
        root = path.rstrip("/") or "/"
        kind, *_ = self._fs(runtime, _core.fs_stat, path, root)
        buf = io.BytesIO()
        arc_base = os.path.basename(root) if kind != "dir" else "."
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
            if kind != "dir":
                self._tar_add(runtime, tf, root, arc_base)
            else:
                stack = [(root, ".")]
                while stack:
                    d, arc = stack.pop()
                    self._tar_add(runtime, tf, d, arc)
                    entries = self._fs(runtime, _core.fs_list, d, d)
                    for name, ekind, *_ in sorted(entries, reverse=True):
                        p = f"{d.rstrip('/')}/{name}"
                        a = f"{arc}/{name}" if arc != "." else name
                        if ekind == "dir":
                            if p in _NO_DESCEND:
                                self._tar_add(runtime, tf, p, a)
                            else:
                                stack.append((p, a))
                        else:
                            self._tar_add(runtime, tf, p, a)
        return buf.getvalue()

    def _tar_add(self, runtime: SandboxRuntime, tf: tarfile.TarFile, path: str,
                 arcname: str) -> None:
        try:
            kind, size, mode, mtime = _core.fs_stat(self._root(runtime), path)
        except FileNotFoundError:
            return  # removed meanwhile
        except OSError as e:
            raise _file_error(e, path) from None
        ti = tarfile.TarInfo(arcname)
        ti.mode = mode
        ti.mtime = int(mtime)
        if kind == "dir":
            ti.type = tarfile.DIRTYPE
            tf.addfile(ti)
        elif kind == "symlink":
            ti.type = tarfile.SYMTYPE
            ti.linkname = self._fs(runtime, _core.fs_readlink, path, path)
            tf.addfile(ti)
        elif kind == "file":
            try:
                data = _core.fs_read(self._root(runtime), path, 1 << 40)
            except OSError as e:
                if e.errno == errno.EACCES:  # /proc and friends: skipped
                    return
                raise _file_error(e, path) from None
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
        # sockets, FIFOs, devices: skipped

