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


def test_a_zstd_layer_asking_a_huge_window_is_refused_unread(tmp_path: Path) -> None:
    """A zstd frame's window is memory the decoder holds for the whole stream: 200 MiB of
    zeros with a 128 MiB window and no content size is a 7 KB blob that took the daemon
    128 MiB a pull (four pulls at once: ~600 MB)."""
    import pytest
    import zstandard

    from corral.errors import InvalidImage

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("zeros")
        info.size = 8 << 20
        info.uid, info.gid = os.getuid(), os.getgid()
        tar.addfile(info, io.BytesIO(bytes(info.size)))
    params = zstandard.ZstdCompressionParameters.from_level(3, window_log=27,
                                                            write_content_size=False)
    cctx = zstandard.ZstdCompressor(compression_params=params)
    blob = tmp_path / "layer"
    with open(blob, "wb") as f, cctx.stream_writer(f) as w:
        w.write(buf.getvalue())
    root = tmp_path / "root"
    root.mkdir()
    with pytest.raises(InvalidImage) as e:
        unpack.unpack(str(blob), unpack.ZSTD[0], str(root), unpack.Limits(1 << 30, 1000))
    assert "memory" in e.value.message.lower() or "window" in e.value.message.lower(), e.value
    assert not (root / "zeros").exists()
