"""A layer mkfs.erofs cannot take stays a directory layer (corral.daemon.oci.layers.
LayerStore._convert): the installed mkfs.erofs fails on a file name of exactly 255 bytes,
which Linux allows, and such an image (a commit pushed and pulled back) was refused as
invalid_image, the image's fault."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import shutil
import tarfile

import pytest

from corral.daemon.oci import unpack
from corral.daemon.oci.layers import LayerStore
from corral.errors import InvalidImage

MT = "application/vnd.oci.image.layer.v1.tar+gzip"
LONG = "n" * 255


def _layer(name: str) -> tuple[bytes, str, str]:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tf:
        ti = tarfile.TarInfo(name)
        ti.size = 3
        ti.uid, ti.gid = os.getuid(), os.getgid()  # the unpack gives each file its owner
        tf.addfile(ti, io.BytesIO(b"hi\n"))
    plain = raw.getvalue()
    blob = gzip.compress(plain, mtime=0)
    return blob, hashlib.sha256(blob).hexdigest(), "sha256:" + hashlib.sha256(plain).hexdigest()


def _ensure(store: LayerStore, name: str) -> tuple[str, dict]:
    blob, hexd, diff = _layer(name)

    def fetch(dest: str) -> None:
        with open(dest, "wb") as f:
            f.write(blob)
    return hexd, store.ensure(hexd, MT, diff, fetch, unpack.Limits(1 << 30, 10 ** 6))


def test_a_tree_mkfs_refuses_is_kept_as_a_directory(tmp_path, monkeypatch):
    store = LayerStore(str(tmp_path), erofs=False)
    store.erofs = True

    def refuse(src: str, dest: str) -> None:
        open(dest, "wb").close()  # a partial image it leaves
        raise InvalidImage("mkfs.erofs failed: Could not format the device")

    monkeypatch.setattr(store, "_mkfs", refuse)
    hexd, meta = _ensure(store, "f")
    assert meta["format"] == "dir", meta
    assert open(os.path.join(store.path(hexd), "tree", "f")).read() == "hi\n"
    assert not os.path.exists(os.path.join(store.path(hexd), "layer.erofs"))


@pytest.mark.skipif(shutil.which("mkfs.erofs") is None, reason="needs mkfs.erofs")
def test_a_name_of_255_bytes_is_stored_whatever_mkfs_makes_of_it(tmp_path):
    store = LayerStore(str(tmp_path), erofs=False)
    store.erofs = True
    hexd, meta = _ensure(store, LONG)
    assert meta["format"] in ("erofs", "dir"), meta
    if meta["format"] == "dir":
        assert open(os.path.join(store.path(hexd), "tree", LONG)).read() == "hi\n"
