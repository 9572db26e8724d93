"""What every sandbox's mounts are made of on the host: /sys and /proc mask skeletons, the
image's /tmp check."""

from __future__ import annotations

import os
import shutil
import stat as stat_mod

from corral.daemon import scratch

# The sandboxes' scratch area (btrfs with a quota per sandbox, or a tmpfs): corral.daemon.scratch.
SCRATCH_SOURCE = scratch.SCRATCH_SOURCE
_mount_of = scratch.mount_of
# xattr that makes an overlay upper dir hide what the lower layers hold at its path.
OVL_OPAQUE = "trusted.overlay.opaque"


def _image_tmp_unfit(lowers: list[str]) -> bool:
    """Whether the /tmp these image layers (top first) make is not an empty 1777 directory."""
    top = None
    for lo in lowers:
        p = os.path.join(lo, "tmp")
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue
        if top is None:
            top = st
        if not stat_mod.S_ISDIR(st.st_mode):
            return True
        with os.scandir(p) as it:
            if any(True for _ in it):
                return True
    return top is None or stat_mod.S_IMODE(top.st_mode) != 0o1777


def make_sys_dir(path: str, views: list[str]) -> str:
    """The skeleton bound read-only at each sandbox's /sys: fs/cgroup/<view> mountpoints,
    root-owned, mode 0555, nothing else."""
    for name in views:
        os.makedirs(os.path.join(path, "fs", "cgroup", name), mode=0o555, exist_ok=True)
    for dirpath, _, _ in os.walk(path):
        os.chmod(dirpath, 0o555)
    return path


def make_mask_dir(path: str) -> str:
    """The empty directory every sandbox binds (read-only) over the /proc directories it
    masks, instead of mounting a tmpfs of its own there: one superblock fewer per sandbox, and
    each superblock alive costs every memory cgroup of the host a slot in its shrinker table
    until the host reboots (docs/daemon.md, "Recycled memory cgroups"). Root-owned, mode 0555,
    emptied if anything is found in it."""
    try:
        os.mkdir(path, 0o555)
    except FileExistsError:
        st = os.lstat(path)
        if not stat_mod.S_ISDIR(st.st_mode):
            os.unlink(path)
            os.mkdir(path, 0o555)
        elif os.listdir(path):
            shutil.rmtree(path)
            os.mkdir(path, 0o555)
    os.chown(path, 0, 0)
    os.chmod(path, 0o555)
    return path
