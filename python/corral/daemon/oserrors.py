"""One map from an OSError's errno to the API's error (corral.errors).

Every place that turns an OSError into a CorralError goes through here: file operations in a
sandbox (``sandbox_file_error``), file operations the daemon makes for a request
(``host_file_error``), an OSError that reached the API layer (``request_error``), and a
process or sandbox that could not be started (``start_error``, ``OUT_OF_RESOURCES``).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable

from corral import _core
from corral.errors import (
    CapacityExceeded,
    CorralError,
    DirectoryNotEmpty,
    FileBusy,
    FileExists,
    FileNotFound,
    ForbiddenPath,
    InternalError,
    InvalidPath,
    InvalidRequest,
    IsADirectory,
    IsASymlink,
    NotADirectory,
    PermissionDenied,
    TooLarge,
)

# errno -> CorralError class for a file operation; an errno not here is InternalError.
FILE_ERRORS: dict[int, type[CorralError]] = {
    errno.ENOENT: FileNotFound,
    errno.EEXIST: FileExists,
    errno.ENOTDIR: NotADirectory,
    errno.EISDIR: IsADirectory,
    errno.ENOTEMPTY: DirectoryNotEmpty,
    errno.EXDEV: InvalidPath,
    errno.ELOOP: IsASymlink,
    errno.ENAMETOOLONG: InvalidPath,
    errno.EINVAL: InvalidPath,
    errno.EACCES: PermissionDenied,
    errno.EPERM: PermissionDenied,
    errno.EROFS: PermissionDenied,
    errno.EBUSY: InvalidRequest,
    errno.EFBIG: InvalidRequest,
    errno.EOPNOTSUPP: InvalidRequest,
    errno.ETXTBSY: FileBusy,
    errno.EWOULDBLOCK: FileBusy,
}
# A full disk: inside a sandbox its own limit (disk_mb); for the daemon's files the request's.
DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
# Errors a file operation the daemon makes gets from what the request named (a special file,
# a busy file), not from a fault of the daemon.
INPUT_ERRNOS = frozenset({errno.EIO, errno.ENXIO, errno.ENODEV, errno.EOPNOTSUPP,
                          errno.ETXTBSY, errno.EBUSY, errno.ESPIPE, errno.EOVERFLOW,
                          errno.E2BIG, errno.ERANGE, errno.EMLINK, errno.EFAULT})
# A process or sandbox could not be made for want of host resources: CapacityExceeded.
OUT_OF_RESOURCES = frozenset({errno.EAGAIN, errno.ENOMEM, errno.ENOSPC, errno.EMFILE,
                              errno.ENFILE, errno.EUSERS})
# The same, for the engine's own steps of a create (not the substrate's).
HOST_OUT_OF_RESOURCES = frozenset({errno.EAGAIN, errno.ENOMEM, errno.ENOSPC})
# The daemon's own limits reached while serving a request: infra (InternalError), never the
# request's fault.
DAEMON_LIMITS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN})
# What a file operation in a sandbox can fail with because of the daemon or the host, not
# because of what is in the sandbox: infra. Any other errno there comes from the sandbox's
# files (code in it shapes them at will), so it is the task's, never a way to be masked.
SANDBOX_FILE_INFRA = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EIO,
                                errno.EUCLEAN, errno.ESTALE, errno.EINTR, errno.ENOBUFS})

# The messages host_file_error gives without an errno in the details.
_PLAIN = {
    errno.ENOENT: "no such file or directory",
    errno.EEXIST: "file exists",
    errno.ENOTDIR: "not a directory",
    errno.EISDIR: "is a directory",
    errno.ENOTEMPTY: "directory not empty",
}


def _strerror(n: int | None) -> str:
    return os.strerror(n) if n is not None else ""


def file_error_class(n: int | None) -> type[CorralError]:
    return FILE_ERRORS.get(n or 0, InternalError)


def sandbox_file_error(e: OSError, path: str, disk_quota: bool = False,
                       holds_its_share: Callable[[], bool | None] | None = None
                       ) -> CorralError:
    """A file operation inside a sandbox failed (through its root fd). ``disk_quota``: the
    sandbox's disk is a kernel quota (btrfs), not the tmpfs fallback. ``holds_its_share``:
    whether the sandbox holds its fair share of the shared scratch area (scratch.Scratch)."""
    if isinstance(e, _core.ForbiddenPath):
        return ForbiddenPath(f"{e.strerror}: {path}", details={"path": path})
    reason = e.strerror or str(e)
    msg = f"{reason}: {path}" if path else reason
    if e.errno in DISK_FULL:
        # The sandbox's own disk is full (its quota, or its /tmp on the tmpfs fallback): its
        # limit, as a write inside it sees it. A full host disk is the same errno on the
        # tmpfs fallback and ENOSPC on btrfs: then it is the scratch area's, CapacityExceeded.
        if e.errno == errno.ENOSPC and disk_quota:
            if holds_its_share is not None and holds_its_share():
                return TooLarge(f"the sandboxes' scratch area is full, and this sandbox holds "
                                f"its share of it or more: {msg}",
                                details={"path": path, "errno": e.errno,
                                         "limit": "disk_share"})
            return CapacityExceeded(f"the sandboxes' scratch area is full: {msg}",
                                    details={"path": path, "errno": e.errno})
        return TooLarge(f"the sandbox's disk is full (disk_mb): {msg}",
                        details={"path": path, "errno": e.errno, "limit": "disk_mb"})
    cls = file_error_class(e.errno)
    if cls is InternalError and e.errno not in SANDBOX_FILE_INFRA:
        cls = InvalidRequest
    return cls(msg, details={"path": path, "errno": e.errno})


def host_file_error(e: OSError, path: str = "") -> CorralError:
    """A file operation the daemon made for a request failed (outside any sandbox)."""
    where = f": {path}" if path else ""
    n = e.errno
    if n in _PLAIN:
        return file_error_class(n)(f"{_PLAIN[n]}{where}")
    if n in DISK_FULL or n == errno.EFBIG or n in INPUT_ERRNOS:
        # the request named a file that cannot be used that way, or too much for it
        return InvalidRequest(f"{_strerror(n)}{where}", details={"errno": n})
    # EWOULDBLOCK on the daemon's own files is no lease of a sandbox's process: infra
    cls = file_error_class(n) if n != errno.EWOULDBLOCK else InternalError
    if cls is InternalError:
        return InternalError(f"{e.strerror or e}{where}", details={"errno": n})
    if cls is InvalidPath:
        return InvalidPath(f"{_strerror(n)}{where}")
    return cls(f"{_strerror(n)}{where}", details={"errno": n})


def request_error(e: OSError) -> CorralError:
    """An OSError that reached the API layer: the request named something the daemon cannot
    use (a path it may not read, a special file); the daemon's own limits stay infra."""
    if e.errno in DAEMON_LIMITS:
        return InternalError(f"{e.strerror or e}", details={"errno": e.errno})
    if e.errno in DISK_FULL:
        # A sandbox's full disk is mapped where its files are written (sandbox_file_error);
        # one that reaches here is the daemon's own disk (a layer, a body, an image being
        # stored): the platform's, whoever's request it was.
        return CapacityExceeded(f"the daemon's disk is full: {e.strerror or e}",
                                details={"errno": e.errno, "disk": "state_dir"})
    err = host_file_error(e, getattr(e, "filename", None) or "")
    if isinstance(err, InternalError):  # EIO, ENXIO, ...: the input named an unusable file
        return InvalidRequest(f"{e.strerror or e}", details={"errno": e.errno})
    return err


def start_error(e: BaseException, what: str) -> CorralError:
    """A process could not be started (``what``: "cannot start the process")."""
    err = getattr(e, "errno", None)
    msg = getattr(e, "strerror", None) or str(e)
    if err in OUT_OF_RESOURCES:
        return CapacityExceeded(f"{what}: {msg}", details={"errno": err})
    return InternalError(f"{what}: {msg}", details={"errno": err})
