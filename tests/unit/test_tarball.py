"""The SDK's download extraction (``files.download``): the tar comes from a sandbox's tree, so
every member must land inside the target directory, whatever links the tar carries."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from corral.errors import InvalidRequest
from corral.sdk import tarball


def make_tar(*members: tuple[str, str, str]) -> bytes:
    """(name, kind, link target); kind: d dir, f file ("x" as content), s symlink, h hard link."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, kind, link in members:
            info = tarfile.TarInfo(name)
            data = None
            if kind == "d":
                info.type = tarfile.DIRTYPE
            elif kind == "s":
                info.type, info.linkname = tarfile.SYMTYPE, link
            elif kind == "h":
                info.type, info.linkname = tarfile.LNKTYPE, link
            else:
                info.size, data = 1, io.BytesIO(b"x")
            tar.addfile(info, data)
    return buf.getvalue()


def path_max_chain_tar() -> bytes:
    """The shape of CVE-2025-4517: links through directories with names so long that the
    stdlib's realpath check stops at PATH_MAX and sees the escape as inside, then a file
    written through the escaping link."""
    comp, steps, path = "d" * 247, "abcdefghijklmnop", ""
    members = []
    for step in steps:
        members += [(os.path.join(path, comp), "d", ""), (os.path.join(path, step), "s", comp)]
        path = os.path.join(path, comp)
    deepest = os.path.join(*steps, "l" * 254)
    members += [(deepest, "s", "../" * len(steps)),
                ("escape", "s", deepest + "/../outside"),
                ("escape/pwned", "f", "")]
    return make_tar(*members)


def test_a_path_max_link_chain_writes_nothing_outside(tmp_path: Path) -> None:
    (tmp_path / "outside").mkdir()
    with pytest.raises(InvalidRequest):
        tarball.unpack(path_max_chain_tar(), tmp_path / "into")
    assert list((tmp_path / "outside").iterdir()) == []


@pytest.mark.parametrize("members", [
    [("e", "s", "../x")],
    [("s", "s", "/etc")],
    [("a", "s", "."), ("e", "s", "a/a/a/../..")],      # out only through another link
    [("d", "d", ""), ("d/up", "s", ".."), ("e", "s", "d/up/..")],
    [("loop", "s", "loop")],
    [("d", "d", ""), ("d/l", "s", "."), ("d/l/f", "f", "")],  # a member beneath a link
    [("a", "s", "."), ("h", "h", "a/../x")],             # a hard link out through a link
], ids=["up", "absolute", "via-link", "via-dir-link", "loop", "beneath", "hard-via-link"])
def test_links_that_leave_the_tree_are_refused_and_nothing_is_written(
        tmp_path: Path, members: list[tuple[str, str, str]]) -> None:
    with pytest.raises(InvalidRequest):
        tarball.unpack(make_tar(*members), tmp_path / "into")
    assert list((tmp_path / "into").iterdir()) == []


def test_links_inside_the_tree_are_extracted(tmp_path: Path) -> None:
    names = tarball.unpack(make_tar(
        ("lib", "d", ""), ("lib/libx.so.1.2", "f", ""), ("lib/libx.so.1", "s", "libx.so.1.2"),
        ("lib/libx.so", "s", "libx.so.1"), ("nm", "d", ""), ("nm/foo", "d", ""),
        ("nm/foo/cli.js", "f", ""), ("nm/.bin", "d", ""), ("nm/.bin/foo", "s", "../foo/cli.js"),
        ("root", "s", "nm/.."), ("hard", "h", "lib/libx.so.1.2")), tmp_path / "into")
    into = tmp_path / "into"
    assert names[:2] == ["lib", "lib/libx.so.1.2"] and len(names) == 11
    assert (into / "lib/libx.so").read_text() == "x"
    assert os.readlink(into / "nm/.bin/foo") == "../foo/cli.js"
    assert (into / "nm/.bin/foo").read_text() == "x"
    assert (into / "hard").stat().st_ino == (into / "lib/libx.so.1.2").stat().st_ino
