"""A layer's tar cannot make the unpacker hold the GIL for seconds, hold a huge header in
memory, or write more than the image may hold: its headers go through
corral.daemon.safetar, sparse members are refused, and a member's declared size is checked
against the image's bound and the disk before a byte of it is written."""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import tarfile
import time
import tracemalloc
from pathlib import Path

import pytest

from corral.daemon.oci import unpack
from corral.errors import CapacityExceeded, InvalidImage, TooLarge

GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"


def _pax_layer(path: Path, body: bytes) -> None:
    hdr = tarfile.TarInfo("././@PaxHeader")
    hdr.type, hdr.size = tarfile.XHDTYPE, len(body)
    ti = tarfile.TarInfo("hello")
    ti.size = 3
    path.write_bytes(gzip.compress(
        hdr.tobuf(tarfile.USTAR_FORMAT) + body + b"\0" * (-len(body) % 512)
        + ti.tobuf(tarfile.USTAR_FORMAT) + b"hi\n" + b"\0" * 509 + b"\0" * 1024, 1))


def _unpack(blob: Path, root: Path, limits: unpack.Limits | None = None) -> unpack.Result:
    root.mkdir(exist_ok=True)
    return unpack.unpack(str(blob), GZIP, str(root), limits or unpack.Limits(1 << 30, 1000))


def test_a_pax_header_of_digits_is_refused_at_once(tmp_path: Path) -> None:
    blob = tmp_path / "layer"
    _pax_layer(blob, b"1" * 100_000)  # 21 s of the stdlib's search, the GIL held
    t0 = time.monotonic()
    with pytest.raises(InvalidImage) as e:
        _unpack(blob, tmp_path / "root")
    assert time.monotonic() - t0 < 0.5
    assert e.value.details["reason"] == "header_framing"
    assert not (tmp_path / "root" / "hello").exists()


def test_a_huge_pax_header_is_refused_unread(tmp_path: Path) -> None:
    blob = tmp_path / "layer"
    _pax_layer(blob, b"30 comment=" + b"x" * (2 << 20) + b"\n")
    tracemalloc.start()
    try:
        with pytest.raises(InvalidImage) as e:
            _unpack(blob, tmp_path / "root")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert e.value.details == {"limit": "header_bytes", "max": 1 << 20}
    assert peak < 1 << 20, peak  # read, the header is held ~3 times over (6 MiB here)


@pytest.mark.skipif(shutil.which("tar") is None, reason="needs GNU tar")
def test_a_sparse_member_is_refused_before_its_holes_are_written(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "big", "wb") as f:
        f.truncate(256 << 20)  # all hole: a few hundred bytes of tar
    tar = subprocess.run(["tar", "--sparse", "--format=pax", "-C", str(src), "-cf", "-", "big"],
                         check=True, capture_output=True).stdout
    blob = tmp_path / "layer"
    blob.write_bytes(gzip.compress(tar))
    limits = unpack.Limits(64 << 20, 1000)
    with pytest.raises(InvalidImage) as e:  # it wrote 256 MiB of zeros under a 64 MiB bound
        _unpack(blob, tmp_path / "root", limits)
    assert e.value.details["reason"] == "sparse"
    assert not (tmp_path / "root" / "big").exists()


def _one_file_layer(path: Path, size: int) -> None:
    ti = tarfile.TarInfo("big")
    ti.size = size
    ti.uid, ti.gid = os.getuid(), os.getgid()  # the unpack gives each file its owner
    with gzip.open(path, "wb", compresslevel=1) as out:
        out.write(ti.tobuf(tarfile.USTAR_FORMAT))
        zeros = b"\0" * (1 << 20)
        for _ in range(size >> 20):
            out.write(zeros)
        out.write(b"\0" * 1024)


def test_a_member_larger_than_what_the_image_may_still_hold_is_not_written(
        tmp_path: Path) -> None:
    blob = tmp_path / "layer"
    _one_file_layer(blob, 48 << 20)
    limits = unpack.Limits(64 << 20, 1000, used_bytes=32 << 20)  # earlier layers took 32
    with pytest.raises(TooLarge):
        _unpack(blob, tmp_path / "root", limits)
    assert not (tmp_path / "root" / "big").exists()  # 32 MiB of it were written first
    _unpack(blob, tmp_path / "fits", unpack.Limits(64 << 20, 1000, used_bytes=8 << 20))
    assert (tmp_path / "fits" / "big").stat().st_size == 48 << 20


def test_the_disk_is_asked_for_a_member_before_it_is_written(tmp_path: Path) -> None:
    blob = tmp_path / "layer"
    _one_file_layer(blob, 48 << 20)
    asked: list[int] = []

    def full(what: str, n: int) -> None:
        asked.append(n)
        raise CapacityExceeded("no room")

    with pytest.raises(CapacityExceeded):
        _unpack(blob, tmp_path / "root", unpack.Limits(1 << 30, 1000, disk_check=full))
    assert asked == [48 << 20]
    assert not (tmp_path / "root" / "big").exists()  # 32 MiB of it were written first
