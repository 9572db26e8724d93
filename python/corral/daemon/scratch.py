"""Where sandboxes' writable layers live: ``<state_dir>/sandboxes`` (``CORRAL_SCRATCH``).

- ``btrfs`` (the default): a btrfs filesystem on a loop device over a sparse image file
  (``<state_dir>/scratch.img``), quotas on (simple quotas where the kernel has them). Each
  sandbox's writable layer is a subvolume ``<id>/disk`` (overlay ``upper/<n>``, ``work/<n>``,
  and with them ``/tmp``) whose quota is its ``disk_mb``: a write past it fails in the kernel
  with EDQUOT ("Disk quota exceeded"), whoever writes (the sandbox, or the daemon for a
  client). The files are ordinary page cache, written back and reclaimable, so they do not
  pin the sandbox's memory. ``meta.json`` and the overlay mount point stay outside the
  subvolume, in ``<id>/``: the daemon can always write a full sandbox's record.
- ``tmpfs``: one tmpfs for all sandboxes (RAM: the pages a sandbox writes are charged to its
  memory cgroup); each sandbox's ``/tmp`` is a tmpfs of ``size=disk_mb`` and the daemon counts
  what it writes for a client against ``disk_mb`` (corral.daemon.uploads.DiskBudget). The
  fallback when btrfs cannot be set up (no loop devices, no btrfs, no mkfs.btrfs).
- ``disk``: the state dir's own filesystem, nothing mounted (bounded like ``tmpfs``).

A mount a previous daemon left (crash, kill -9) is kept with its sandboxes; a graceful stop
that leaves no sandbox unmounts it, which detaches the loop device (autoclear), and removes
the image.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import time

from corral import _core

log = logging.getLogger("corral.scratch")

SCRATCH_SOURCE = "corral-scratch"  # the tmpfs's source name in mountinfo
IMAGE = "scratch.img"
LAYER = "disk"  # the sandbox's subvolume, below its dir
BTRFS_OPTIONS = "discard=async"  # mounted noatime too
MIN_IMAGE = 1 << 30
LOOP_RELEASE_S = 10.0  # the longest a stop waits for the loop device to let go (_unmount)


def mount_of(path: str) -> tuple[str, str] | None:
    """(fstype, source) of the mount whose mount point is ``path``, or None."""
    real = os.path.realpath(path)
    found = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            if len(fields) >= 5 and len(rfields) >= 2 and \
                    fields[4].replace("\\040", " ") == real:
                found = (rfields[0], rfields[1])  # the last one is the one on top
    return found


def _image_size(state_dir: str, spec: str) -> int:
    """Bytes for the sparse image: ``spec`` is bytes with an optional k/m/g/t suffix, or a
    percentage of the free space of the state dir's filesystem (the image grows into it)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kmgtKMGT%]?)\s*", spec)
    if not m:
        raise ValueError(f"CORRAL_SCRATCH_SIZE {spec!r}: bytes, k/m/g/t or a %")
    n, unit = int(m.group(1)), m.group(2).lower()
    if unit == "%":
        st = os.statvfs(state_dir)
        return max(MIN_IMAGE, st.f_bavail * st.f_frsize * min(n, 100) // 100)
    return max(MIN_IMAGE, n << {"": 0, "k": 10, "m": 20, "g": 30, "t": 40}[unit])


class Scratch:
    """The scratch area of one daemon: its kind and how a sandbox's layer is made there."""

    def __init__(self, state_dir: str, sandboxes_dir: str) -> None:
        self.state_dir = state_dir
        self.dir = sandboxes_dir
        self.image = os.path.join(state_dir, IMAGE)
        self.device: str | None = None
        mode = os.environ.get("CORRAL_SCRATCH", "btrfs")
        if mode not in ("btrfs", "tmpfs", "disk"):
            raise ValueError(f"CORRAL_SCRATCH must be 'btrfs', 'tmpfs' or 'disk', not {mode!r}")
        self.kind = "disk"
        have = mount_of(self.dir)
        if have is not None and have[0] == "btrfs":
            # A previous daemon's, with its sandboxes (whatever this one's setting): re-adopted.
            self.kind, self.device = "btrfs", have[1]
            return
        if mode == "btrfs":
            if self._mount_btrfs():
                self.kind = "btrfs"
                return
            mode = "tmpfs"
        if mode == "tmpfs" and self._mount_tmpfs():
            self.kind = "tmpfs"

    @property
    def quota(self) -> bool:
        """Whether the kernel bounds each sandbox's layer by its ``disk_mb``."""
        return self.kind == "btrfs"

    # ---- who filled it ---------------------------------------------------------------------
    def holds_its_share(self, layer: str, live: int) -> bool | None:
        """Whether the sandbox whose writable layer is ``layer`` holds at least its fair
        share of the scratch (its size over the ``live`` sandboxes); None if unknown.

        The scratch is shared and overcommitted (each sandbox's ``disk_mb`` is a bound, not
        a reservation), so it can fill up while every sandbox is within its own quota. Then a
        write fails with ENOSPC for all of them: for one that holds its share or more, that
        is its own doing (an agent filling the disk to have its episode masked); for the
        others, the platform's."""
        used = self.used_bytes(layer)
        if used is None:
            return None
        try:
            st = os.statvfs(self.dir)
        except OSError:
            return None
        return used * max(1, live) >= st.f_blocks * st.f_frsize

    def used_bytes(self, layer: str) -> int | None:
        """What the sandbox whose writable layer is ``layer`` holds on the scratch (the
        kernel's qgroup counter of its subvolume); None where the scratch cannot tell."""
        if self.kind != "btrfs":
            return None
        try:
            qgroup = f"0_{_core.btrfs_subvol_id(layer)}"
            sysfs = self._sysfs()
            if sysfs is None:
                return None
            with open(os.path.join(sysfs, "qgroups", qgroup, "referenced")) as f:
                return int(f.read())
        except (OSError, ValueError):
            return None

    def _sysfs(self) -> str | None:
        """The scratch filesystem's directory in /sys/fs/btrfs (named by its uuid), found by
        its loop device."""
        if self.device is None:
            return None
        dev = os.path.basename(self.device)
        for fsid in os.listdir("/sys/fs/btrfs"):
            if os.path.exists(os.path.join("/sys/fs/btrfs", fsid, "devices", dev)):
                return os.path.join("/sys/fs/btrfs", fsid)
        return None

    # ---- set-up ----------------------------------------------------------------------------
    def _mount_btrfs(self) -> bool:
        have = mount_of(self.dir)
        if have is not None or os.listdir(self.dir):
            log.warning("scratch: sandbox dir not empty or mounted over; btrfs not set up",
                        extra={"dir": self.dir, "mount": have})
            return False
        mkfs = shutil.which("mkfs.btrfs")
        if mkfs is None:
            log.warning("scratch: mkfs.btrfs not found (install btrfs-progs): sandboxes' disks "
                        "fall back to a tmpfs, bounded by memory_mb, not by disk_mb")
            return False
        try:
            size = _image_size(self.state_dir, os.environ.get("CORRAL_SCRATCH_SIZE", "50%"))
            # A fresh filesystem every time it is not mounted: what an earlier one held belonged
            # to sandboxes that are gone (a reboot, or a graceful stop). A new inode, never the
            # old one truncated: a loop device could still hold that one.
            self._remove_image()
            fd = os.open(self.image, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                os.ftruncate(fd, size)
            finally:
                os.close(fd)
            subprocess.run([mkfs, "-q", "-f", "-m", "single", "-d", "single", self.image],
                           check=True, capture_output=True, timeout=120)
            self.device = _core.mount_loop(self.image, self.dir, "btrfs", BTRFS_OPTIONS, True)
        except (OSError, ValueError, subprocess.SubprocessError) as e:
            err = getattr(e, "stderr", None) or str(e)
            log.warning("scratch: cannot set up the btrfs scratch (loop device + btrfs): "
                        "sandboxes' disks fall back to a tmpfs, bounded by memory_mb, not by "
                        "disk_mb", extra={"image": self.image, "error": str(err).strip()})
            self._remove_image()
            return False
        try:
            try:
                _core.btrfs_quota_enable(self.dir, True)  # simple quotas (Linux >= 6.7)
                quotas = "simple"
            except OSError:
                _core.btrfs_quota_enable(self.dir, False)
                quotas = "full"
            os.chmod(self.dir, 0o700)
        except OSError as e:
            log.warning("scratch: cannot turn btrfs quotas on: falling back to a tmpfs",
                        extra={"error": str(e)})
            self._unmount()
            return False
        log.info("scratch: btrfs on a loop device, a subvolume with a quota per sandbox",
                 extra={"image": self.image, "device": self.device, "bytes": size,
                        "quotas": quotas})
        return True

    def _mount_tmpfs(self) -> bool:
        if mount_of(self.dir) == ("tmpfs", SCRATCH_SOURCE):
            return True
        if os.listdir(self.dir):
            log.warning("sandbox dir not empty: scratch stays on disk for this run",
                        extra={"dir": self.dir})
            return False
        size = os.environ.get("CORRAL_SCRATCH_SIZE", "50%")
        try:
            _core.mount_tmpfs(self.dir, f"size={size},mode=0700")
        except (OSError, ValueError) as e:
            log.warning("cannot mount the scratch tmpfs: sandboxes' dirs stay on disk",
                        extra={"dir": self.dir, "error": str(e)})
            return False
        return True

    # ---- per sandbox -----------------------------------------------------------------------
    def make_layer(self, sdir: str, disk_mb: int) -> str:
        """Make the sandbox's writable layer below ``sdir`` (which exists); returns the dir
        that holds ``upper/`` and ``work/``. btrfs: the subvolume ``sdir/disk``, quota
        ``disk_mb``; else ``sdir`` itself."""
        if self.kind != "btrfs":
            return sdir
        _core.btrfs_subvol_create(sdir, LAYER, int(disk_mb) << 20)
        return os.path.join(sdir, LAYER)

    # ---- tear-down -------------------------------------------------------------------------
    def close(self) -> None:
        """Unmount (graceful stop, no sandbox left). A scratch still holding a sandbox's dir
        stays mounted (logged), so nothing is lost and the leak shows."""
        if self.kind == "disk":
            return
        if mount_of(self.dir) is None:
            return
        left = [n for n in os.listdir(self.dir) if not self._empty_service_dir(n)]
        if left:
            log.warning("scratch: sandbox dirs left at stop: the scratch stays mounted",
                        extra={"dir": self.dir, "left": left[:10]})
            return
        self._unmount()

    def _empty_service_dir(self, name: str) -> bool:
        if name not in (".trash", ".quarantine"):
            return False
        try:
            return not os.listdir(os.path.join(self.dir, name))
        except OSError:
            return True

    def _unmount(self) -> None:
        try:
            _core.umount(self.dir)
        except OSError as e:
            log.warning("cannot unmount the scratch", extra={"dir": self.dir, "error": str(e)})
            return
        if self.kind == "btrfs" or self.device is not None:
            self._remove_image()
            self._wait_loop_released()

    def _wait_loop_released(self, timeout: float = LOOP_RELEASE_S) -> None:
        """The loop device detaches itself (autoclear) once its filesystem is gone from every
        mount namespace: a sandbox's, torn down by its last process, can outlive the unmount
        here by a moment. A daemon that has stopped leaves nothing behind, so it waits."""
        if self.device is None:
            return
        backing = f"/sys/block/{os.path.basename(self.device)}/loop/backing_file"
        deadline = time.monotonic() + timeout
        delay = 0.005
        while os.path.exists(backing):
            if time.monotonic() >= deadline:
                log.warning("scratch: the loop device is still attached after the unmount",
                            extra={"device": self.device, "waited_s": timeout})
                return
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def _remove_image(self) -> None:
        try:
            os.unlink(self.image)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("cannot remove the scratch image", extra={"image": self.image,
                                                                  "error": str(e)})
