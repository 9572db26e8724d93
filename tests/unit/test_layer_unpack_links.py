"""A layer cannot reach the host through a symlink it makes after a directory: the
directories' owner, mode, times and xattrs, set last, go through fds reached from the layer's
root, never through paths. And members whose values no syscall takes are the image's fault
(``invalid_image``, or the xattr skipped), never a 500."""

from __future__ import annotations

import gzip
import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from corral.daemon.oci import unpack
from corral.errors import InvalidImage

GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"


def _member(name: str, kind: bytes, **kw: object) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type = kind
    ti.uid, ti.gid = os.getuid(), os.getgid()  # unpacked as any user: no chown to another
    ti.mtime = 1_700_000_000
    for k, v in kw.items():
        setattr(ti, k, v)
    return ti


def _layer(path: Path, members: list[tarfile.TarInfo]) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for m in members:
            tf.addfile(m)
    path.write_bytes(gzip.compress(buf.getvalue(), 1))


def _unpack(blob: Path, root: Path) -> unpack.Result:
    root.mkdir()
    return unpack.unpack(str(blob), GZIP, str(root), unpack.Limits(1 << 30, 1000))


def test_a_directory_made_before_its_parent_became_a_symlink_leaves_the_host_alone(
        tmp_path: Path) -> None:
    """``a/dir`` (mode 3777, an xattr, a time), then ``a`` -> a host directory holding a
    ``dir``: the host's ``dir`` took the member's mode, owner, time and xattr."""
    victim = tmp_path / "host" / "dir"
    victim.mkdir(parents=True, mode=0o755)
    os.chmod(victim, 0o755)
    before = os.stat(victim)
    blob = tmp_path / "layer"
    _layer(blob, [
        _member("a", tarfile.DIRTYPE, mode=0o755),
        _member("a/dir", tarfile.DIRTYPE, mode=0o3777,
                pax_headers={"SCHILY.xattr.user.pwn": "yes"}),
        _member("a", tarfile.SYMTYPE, linkname=str(tmp_path / "host")),
    ])
    _unpack(blob, tmp_path / "root")
    after = os.stat(victim)
    assert stat.S_IMODE(after.st_mode) == 0o755
    assert after.st_mtime_ns == before.st_mtime_ns
    assert "user.pwn" not in os.listxattr(victim)
    assert os.readlink(tmp_path / "root" / "a") == str(tmp_path / "host")  # the layer's own


def test_directories_still_get_their_metadata_last(tmp_path: Path) -> None:
    blob = tmp_path / "layer"
    _layer(blob, [
        _member("d", tarfile.DIRTYPE, mode=0o2750, pax_headers={"SCHILY.xattr.user.k": "v"}),
        _member("d/e", tarfile.DIRTYPE, mode=0o700),
        _member("d/e/f", tarfile.REGTYPE, mode=0o644),
    ])
    _unpack(blob, tmp_path / "root")
    d = os.stat(tmp_path / "root" / "d")
    assert stat.S_IMODE(d.st_mode) == 0o2750 and d.st_mtime == 1_700_000_000
    assert os.getxattr(tmp_path / "root" / "d", "user.k") == b"v"
    assert stat.S_IMODE(os.stat(tmp_path / "root" / "d" / "e").st_mode) == 0o700


def test_values_no_syscall_takes_are_the_images_fault(tmp_path: Path) -> None:
    nan = tmp_path / "nan"
    _layer(nan, [_member("f", tarfile.REGTYPE, pax_headers={"mtime": "nan"})])
    with pytest.raises(InvalidImage):
        _unpack(nan, tmp_path / "r1")
    nul = tmp_path / "nul"
    _layer(nul, [_member("f", tarfile.REGTYPE,
                         pax_headers={"SCHILY.xattr.user.a\x00b": "x",
                                      "SCHILY.xattr.user.ok": "y"})])
    res = _unpack(nul, tmp_path / "r2")
    assert res.skipped.get("xattrs") == 1
    assert os.getxattr(tmp_path / "r2" / "f", "user.ok") == b"y"
