"""Copying a host directory into an image or a layer (``Layer.from_dir``, an image imported from
a directory) walks it by fds: whoever may write in the source cannot make the daemon copy a
host directory by swapping one of the source's directories for a symlink while it is copied
(a look with lstat, then a listing by path, followed the swapped-in symlink)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from corral.daemon import images

SWAPPER = r"""
import os, sys, time
src, secret = sys.argv[1], sys.argv[2]
a, real, link = (os.path.join(src, n) for n in ("a", "a.real", "a.link"))
os.symlink(secret, link)
while True:  # "a" is the directory or the symlink, in turn, each for a while
    os.rename(a, real)
    os.rename(link, a)
    time.sleep(0.0002)
    os.rename(a, link)
    os.rename(real, a)
    time.sleep(0.0002)
"""


def test_a_directory_swapped_for_a_symlink_mid_copy_never_copies_what_it_names(
        tmp_path: Path) -> None:
    secret = tmp_path / "host" / "secret"
    secret.mkdir(parents=True)
    (secret / "SECRET").write_text("host data")
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "inner").write_text("ok")
    swapper = subprocess.Popen([sys.executable, "-c", SWAPPER, str(src), str(secret)])
    try:
        for i in range(400):
            dst = tmp_path / f"copy{i}"
            dst.mkdir()
            images._copy_tree(str(src), str(dst), sanitize=False)
            leaked = [str(p) for p in dst.rglob("SECRET")]
            assert not leaked, (i, leaked)
            shutil.rmtree(dst)
    finally:
        swapper.kill()
        swapper.wait()


def test_a_copy_keeps_the_tree(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "d" / "e").mkdir(parents=True)
    (src / "d" / "e" / "f").write_text("data")
    os.chmod(src / "d" / "e" / "f", 0o4751)
    os.link(src / "d" / "e" / "f", src / "hl")
    os.symlink("/etc/passwd", src / "out")
    os.mkfifo(src / "fifo")
    os.utime(src / "d", ns=(1_000_000_000, 1_700_000_000_000_000_000))
    dst = tmp_path / "dst"
    dst.mkdir()
    assert images._copy_tree(str(src), str(dst), sanitize=False) == 4
    f = dst / "d" / "e" / "f"
    assert f.read_text() == "data" and (f.stat().st_mode & 0o7777) == 0o751  # set-id dropped
    assert os.path.samefile(f, dst / "hl")
    assert os.readlink(dst / "out") == "/etc/passwd"
    assert (dst / "fifo").is_fifo()
    assert (dst / "d").stat().st_mtime_ns == 1_700_000_000_000_000_000


def test_a_source_swapped_for_a_symlink_after_its_check_is_refused(tmp_path: Path) -> None:
    """The source's own path (and every parent) was checked as a resolved path when the
    request came: made a symlink to a host directory since, it is refused, never followed."""
    import pytest

    from corral.errors import InvalidRequest

    secret = tmp_path / "host" / "secret"
    secret.mkdir(parents=True)
    (secret / "SECRET").write_text("host data")
    parent = tmp_path / "import" / "team"
    (parent / "ws").mkdir(parents=True)
    src = os.path.realpath(parent / "ws")  # what the request's check resolved
    for swapped in (Path(src), parent):  # the source itself, then a parent of it
        real = swapped.with_name(swapped.name + ".real")
        os.rename(swapped, real)
        os.symlink(secret if swapped == Path(src) else secret.parent, swapped)
        dst = tmp_path / f"copy-{swapped.name}"
        dst.mkdir()
        with pytest.raises(InvalidRequest):
            images._copy_tree(src, str(dst), sanitize=False)
        assert not list(dst.rglob("SECRET"))
        os.unlink(swapped)
        os.rename(real, swapped)
