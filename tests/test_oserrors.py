"""The one errno -> API error map (corral.daemon.oserrors): every context that turns an
OSError into a CorralError agrees on the error class of a file errno, and each context's own
rules (a sandbox's full disk, the daemon's limits, a process that cannot start) hold."""

from __future__ import annotations

import errno
import os

import pytest

from corral import _core
from corral.daemon import oserrors
from corral.errors import (
    CapacityExceeded,
    DirectoryNotEmpty,
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

EXPECTED = {
    errno.ENOENT: FileNotFound, errno.EEXIST: FileExists, errno.ENOTDIR: NotADirectory,
    errno.EISDIR: IsADirectory, errno.ENOTEMPTY: DirectoryNotEmpty, errno.ELOOP: IsASymlink,
    errno.EXDEV: InvalidPath, errno.ENAMETOOLONG: InvalidPath, errno.EINVAL: InvalidPath,
    errno.EACCES: PermissionDenied, errno.EPERM: PermissionDenied,
    errno.EROFS: PermissionDenied, errno.EBUSY: InvalidRequest, errno.EFBIG: InvalidRequest,
    errno.EOPNOTSUPP: InvalidRequest,
}


def err(n: int, filename: str | None = None) -> OSError:
    return OSError(n, os.strerror(n), filename) if filename else OSError(n, os.strerror(n))


@pytest.mark.parametrize("n", sorted(EXPECTED))
def test_a_file_errno_maps_to_one_class_everywhere(n):
    cls = EXPECTED[n]
    assert oserrors.file_error_class(n) is cls
    inside = oserrors.sandbox_file_error(err(n), "/work/x")
    host = oserrors.host_file_error(err(n), "/work/x")
    api = oserrors.request_error(err(n, "/work/x"))
    assert type(inside) is cls and type(host) is cls and type(api) is cls
    assert inside.details["path"] == "/work/x" and inside.details["errno"] == n
    assert host.message.endswith(": /work/x")


@pytest.mark.parametrize("n", [errno.EHOSTDOWN, errno.ECHILD, errno.ENOLINK])
def test_an_unknown_errno_is_whoever_shaped_the_file(n):
    # a sandbox's files are shaped by the code in it: an odd errno from them is the task's,
    # never an infra failure it could provoke to be masked
    inside = oserrors.sandbox_file_error(err(n), "/p")
    assert type(inside) is InvalidRequest and not inside.infra
    # the daemon's own files: infra
    assert type(oserrors.host_file_error(err(n), "/p")) is InternalError
    # at the API layer an unusable file the request named is the request's fault
    assert type(oserrors.request_error(err(n, "/p"))) is InvalidRequest


@pytest.mark.parametrize("n", sorted(oserrors.SANDBOX_FILE_INFRA - set(EXPECTED)))
def test_a_host_fault_under_a_sandboxs_file_stays_infra(n):
    e = oserrors.sandbox_file_error(err(n), "/p")
    assert type(e) is InternalError and e.infra


@pytest.mark.parametrize("n", sorted(oserrors.INPUT_ERRNOS - set(EXPECTED)))
def test_a_file_the_request_named_that_cannot_be_used_is_invalid_request(n):
    e = oserrors.host_file_error(err(n), "/dev/x")
    assert type(e) is InvalidRequest and e.details["errno"] == n


def test_a_sandboxs_full_disk_is_its_limit_and_a_full_scratch_area_is_capacity():
    for n in (errno.ENOSPC, errno.EDQUOT):
        e = oserrors.sandbox_file_error(err(n), "/work/f")
        assert type(e) is TooLarge and e.details["limit"] == "disk_mb"
    assert type(oserrors.sandbox_file_error(err(errno.EDQUOT), "/f", disk_quota=True)) \
        is TooLarge
    full = oserrors.sandbox_file_error(err(errno.ENOSPC), "/f", disk_quota=True)
    assert type(full) is CapacityExceeded and full.details["errno"] == errno.ENOSPC
    # the daemon's own files: the request asked for too much
    assert type(oserrors.host_file_error(err(errno.ENOSPC), "/f")) is InvalidRequest


def test_a_path_outside_the_sandboxs_root_is_forbidden():
    e = oserrors.sandbox_file_error(
        _core.ForbiddenPath(errno.EACCES, "resolves outside the root", "/proc/1/root"),
        "/proc/1/root")
    assert type(e) is ForbiddenPath and e.details == {"path": "/proc/1/root"}


@pytest.mark.parametrize("n", sorted(oserrors.DAEMON_LIMITS))
def test_the_daemons_own_limits_stay_infra_at_the_api(n):
    e = oserrors.request_error(err(n, "/x"))
    assert type(e) is InternalError and e.details["errno"] == n


@pytest.mark.parametrize("n", sorted(oserrors.OUT_OF_RESOURCES))
def test_a_process_that_cannot_start_for_want_of_resources_is_capacity(n):
    e = oserrors.start_error(err(n), "cannot start the process")
    assert type(e) is CapacityExceeded and e.details["errno"] == n
    assert e.message.startswith("cannot start the process: ")


def test_a_process_that_cannot_start_otherwise_is_internal():
    e = oserrors.start_error(err(errno.ENOEXEC), "cannot start the process")
    assert type(e) is InternalError and e.details["errno"] == errno.ENOEXEC
    assert type(oserrors.start_error(RuntimeError("x"), "w")) is InternalError


@pytest.mark.parametrize("n", sorted(oserrors.DISK_FULL))
def test_the_daemons_full_disk_at_the_api_is_capacity(n):
    # A sandbox's full disk is mapped where its files are written; at the API layer a full
    # disk is the daemon's own (a snapshot's layer, a request body): infra, never the task's.
    e = oserrors.request_error(err(n, "/var/lib/corral/layers/x"))
    assert type(e) is CapacityExceeded and e.infra and e.details["disk"] == "state_dir"
