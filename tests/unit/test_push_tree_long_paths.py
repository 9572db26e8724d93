"""A layer's tar form (image push, a snapshot's export to another node) is read by fds: a
sandbox may make paths as long as the kernel lets it (4,095 bytes), and the layer's own place
on the host made one of 4,020 bytes too long for any call, which cut every export of its
snapshot (the cluster's copies of it then failed as infra, and a node drain with them)."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

from corral.daemon.oci import push


def _deep(root: Path, parts: list[str], data: bytes) -> str:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for p in parts:
            os.mkdir(p, 0o755, dir_fd=fd)
            nfd = os.open(p, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        wfd = os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
        os.write(wfd, data)
        os.setxattr(wfd, "user.k", b"v")
        os.close(wfd)
        os.mkfifo("fifo", dir_fd=fd)
        os.symlink("/etc/passwd", "link", dir_fd=fd)
    finally:
        os.close(fd)
    return "/".join(parts)


def test_a_tree_deeper_than_any_path_a_call_takes_is_exported_whole(tmp_path: Path) -> None:
    root = tmp_path / "layer"
    root.mkdir()
    (root / "top").write_text("top")
    deep = _deep(root, ["a" * 200] * 20 + ["b" * 50], b"deep data")
    assert len(str(root)) + len(deep) > 4096
    for exact in (False, True):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
            push.add_tree(tf, str(root), exact=exact)
        buf.seek(0)
        with tarfile.open(fileobj=buf) as tf:
            members = {m.name: m for m in tf.getmembers()}
            assert tf.extractfile(members[f"{deep}/f"]).read() == b"deep data"  # type: ignore[union-attr]
        f = members[f"{deep}/f"]
        assert f.pax_headers.get("SCHILY.xattr.user.k") == "v"
        assert members[f"{deep}/fifo"].isfifo()
        assert members[f"{deep}/link"].linkname == "/etc/passwd"
        assert members["top"].size == 3
        names = list(members)
        assert names.index("a" * 200) < names.index(f"{'a' * 200}/{'a' * 200}")


def test_entries_named_like_whiteouts_travel_as_what_they_are(tmp_path: Path) -> None:
    """A sandbox's ``.wh.x`` symlink (or directory) is no whiteout: in a snapshot's exact form
    it carries the literal marker, else the importer read it as one, the layer hashed
    differently, and every copy of the snapshot was refused (infra)."""
    from corral.daemon.oci.unpack import LITERAL

    root = tmp_path / "layer"
    root.mkdir()
    os.symlink("target", root / ".wh.link")
    (root / ".wh.dir").mkdir()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        push.add_tree(tf, str(root), exact=True)
    buf.seek(0)
    with tarfile.open(fileobj=buf) as tf:
        members = {m.name: m for m in tf.getmembers()}
    assert members[".wh.link"].issym() and members[".wh.link"].pax_headers.get(LITERAL) == "1"
    assert members[".wh.dir"].isdir() and members[".wh.dir"].pax_headers.get(LITERAL) == "1"
