"""A pulled layer is unpacked from a stream: what the daemon holds while it does must not grow
with the layer's member count (a tenant may pull from any registry, and a layer of a million
headers gzips to a few MiB)."""

from __future__ import annotations

import gzip
import io
import os
import tarfile
import tracemalloc
from pathlib import Path

from corral.daemon.oci import unpack

MEMBERS = 40_000


def _layer_of_many_headers(path: Path) -> None:
    """MEMBERS symlink headers, all named ``l``: each replaces the last, on disk nothing grows."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("l")
        info.type, info.linkname = tarfile.SYMTYPE, "target"
        info.uid, info.gid = os.getuid(), os.getgid()  # unpack chowns: also as nobody
        for _ in range(MEMBERS):
            tar.addfile(info)
    path.write_bytes(gzip.compress(buf.getvalue(), compresslevel=1))


def test_unpacking_a_layer_holds_one_member_not_all_of_them(tmp_path: Path) -> None:
    blob = tmp_path / "layer.tar.gz"
    _layer_of_many_headers(blob)
    root = tmp_path / "root"
    root.mkdir()
    tracemalloc.start()
    try:
        unpack.unpack(str(blob), "application/vnd.oci.image.layer.v1.tar+gzip", str(root),
                      unpack.Limits(1 << 30, 2 * MEMBERS))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Kept, the headers are ~450 bytes each (~18 MB here); cleared, one at a time.
    assert peak < 4 << 20, peak
    assert (root / "l").is_symlink()
