"""What the daemon made in a process session's /tmp goes to the session's uid by a walk that
never follows a symlink nor leaves /tmp's filesystem (corral.daemon.substrates.process.
giveaway): a walk by path gave the session's root-owned /dev to its uid once the session
swapped a directory of an upload for a symlink to /."""

from __future__ import annotations

import os

import pytest

from corral.daemon.substrates.process import giveaway

UID = 12345

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def _tree(root: str) -> None:
    os.makedirs(f"{root}/tmp/up/a/b")
    os.makedirs(f"{root}/dev")
    for p in ("tmp/up/f", "tmp/up/a/g", "tmp/up/a/b/h", "dev/keep"):
        with open(f"{root}/{p}", "w") as f:
            f.write("x")
    os.symlink("/", f"{root}/tmp/up/to_root")  # what the session swapped in
    os.symlink("../../dev", f"{root}/tmp/up/a/to_dev")


def _owners(root: str) -> dict[str, int]:
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(d, n)
            out[os.path.relpath(p, root)] = os.lstat(p).st_uid
    return out


def test_the_tree_goes_to_the_uid_and_nothing_a_link_points_at(tmp_path):
    root = str(tmp_path)
    _tree(root)
    fd = os.open(root, os.O_PATH | os.O_DIRECTORY)
    try:
        given = giveaway.give(fd, "/tmp", ["up"], UID, tree=True)
    finally:
        os.close(fd)
    owners = _owners(root)
    mine = {p for p in owners if p.startswith("tmp/up")}
    assert given == len(mine) and all(owners[p] == UID for p in mine), owners
    assert owners["dev"] == 0 and owners["dev/keep"] == 0 and owners["tmp"] == 0, owners


def test_a_path_through_a_link_is_not_followed(tmp_path):
    """The path's own steps (an upload to /tmp/up/to_root/dev/keep) stop at the link."""
    root = str(tmp_path)
    _tree(root)
    fd = os.open(root, os.O_PATH | os.O_DIRECTORY)
    try:
        given = giveaway.give(fd, "/tmp", ["up", "to_root", "dev"], UID, tree=True)
    finally:
        os.close(fd)
    owners = _owners(root)
    assert given == 2  # up, and the link itself
    assert owners["tmp/up"] == UID and owners["tmp/up/to_root"] == UID
    assert owners["dev"] == 0 and owners["dev/keep"] == 0 and owners["tmp/up/f"] == 0


def test_another_filesystem_below_is_left(tmp_path):
    """A mount below /tmp (none the session can make; /proc, say) is not entered."""
    root = str(tmp_path)
    _tree(root)
    os.makedirs(f"{root}/tmp/up/proc")
    os.system(f"mount -t tmpfs none {root}/tmp/up/proc && touch {root}/tmp/up/proc/x")
    fd = os.open(root, os.O_PATH | os.O_DIRECTORY)
    try:
        giveaway.give(fd, "/tmp", ["up"], UID, tree=True)
        assert os.lstat(f"{root}/tmp/up/proc/x").st_uid == 0
        assert os.lstat(f"{root}/tmp/up/proc").st_uid == 0  # the mount's root, not entered
    finally:
        os.close(fd)
        os.system(f"umount {root}/tmp/up/proc")
    assert os.lstat(f"{root}/tmp/up/a/b/h").st_uid == UID


def test_the_walk_holds_a_chain_of_directories_not_a_listing(tmp_path, monkeypatch):
    """A session's 2,000 directories below an upload's target: the walk opened each before
    walking any (2,001 fds at once; the daemon's fds are every tenant's)."""
    root = str(tmp_path)
    os.makedirs(f"{root}/tmp/up")
    for i in range(2000):
        os.mkdir(f"{root}/tmp/up/d{i}")
    os.makedirs(f"{root}/tmp/up/d0/a/b/c")
    live, peak = set(), [0]
    real_open, real_dup, real_close = os.open, os.dup, os.close

    def track(fd: int) -> int:
        live.add(fd)
        peak[0] = max(peak[0], len(live))
        return fd
    monkeypatch.setattr(os, "open", lambda *a, **k: track(real_open(*a, **k)))
    monkeypatch.setattr(os, "dup", lambda fd: track(real_dup(fd)))
    monkeypatch.setattr(os, "close", lambda fd: (live.discard(fd), real_close(fd))[1])
    fd = real_open(root, os.O_PATH | os.O_DIRECTORY)
    try:
        given = giveaway.give(fd, "/tmp", ["up"], UID, tree=True)
    finally:
        real_close(fd)
    assert given == 1 + 2000 + 3
    assert peak[0] <= 8, peak[0]
    assert os.lstat(f"{root}/tmp/up/d0/a/b/c").st_uid == UID
