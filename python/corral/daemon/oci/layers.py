"""The node's store of image layers, content-addressed by the digest of the layer blob and
shared by every image that lists it. A layer is unpacked once (oci.unpack), turned into an
EROFS image (mkfs.erofs) and mounted read-only once per node with the kernel's file-backed
EROFS mount; sandboxes stack the mounts as overlay lower layers, so every sandbox of an image
reads one page-cache copy. Where EROFS is missing (no mkfs.erofs, a kernel without file-backed
mounts) the unpacked directory itself is the lower layer.

Layout under ``<state_dir>/oci/`` (0700): ``layers/<hex>/{layer.json, layer.erofs | tree/}``,
``m/<hex[:16]>`` the mountpoints (short: overlay's options must fit in one page, so a short
path per layer lets ~100 layers stack), ``tmp/`` half-made layers (removed at start).
Mounts live in the daemon's mount namespace; each sandbox's namespace keeps its own reference,
so unmounting at daemon stop (or GC) never pulls a layer out from under a live sandbox.

A layer may also be a part of the snapshot store (``format: "snapshot"``: a commit's part that
needed no cleaning, corral.daemon.oci.commit): its ``layers/<hex>/`` holds only ``layer.json``
and the files are the snapshot store's ``<state_dir>/layers/<hex>/0``, reached by the short
symlink ``m/<hex[:16]>``. Each such entry holds one reference in the snapshot store's counts
(taken by the commit, recounted at start from :meth:`shared_parts`), so deleting snapshots never
removes a part an image lists; GC of the entry hands the reference back (:meth:`drain_released`).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import logging
import os
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterable

from corral.daemon import removal
from corral.daemon.oci import unpack
from corral.errors import ImagePullFailed, InvalidImage

log = logging.getLogger("corral.images")

# Mountpoints under the skeleton that every rootfs needs (the substrate mounts over them).
# How long a pull waits for another caller's build of the same layer before it fetches the
# layer itself: a tenant's registry that trickles a layer (just above the rate floor) held
# every other pull of that digest, any tenant's, for hours, and the pull threads with them.
GATE_WAIT_S = 30.0

SKELETON = {"proc": 0o555, "dev": 0o755, "sys": 0o555, "tmp": 0o1777, "etc": 0o755,
            "run": 0o755, "root": 0o700}


class LayerStore:
    def __init__(self, state_dir: str, erofs: bool = True) -> None:
        self.dir = os.path.join(state_dir, "oci")
        self.layers_dir = os.path.join(self.dir, "layers")
        self.mnt_dir = os.path.join(self.dir, "m")
        self.tmp_dir = os.path.join(self.dir, "tmp")
        self.snap_dir = os.path.join(state_dir, "layers")  # the snapshot store's parts
        for d in (self.dir, self.layers_dir, self.mnt_dir, self.tmp_dir):
            os.makedirs(d, mode=0o700, exist_ok=True)
        os.chmod(self.dir, 0o700)
        for n in os.listdir(self.tmp_dir):  # half-made layers of a crashed pull
            removal.remove_tree(os.path.join(self.tmp_dir, n))
        self._lock = threading.Lock()
        self._building: dict[str, threading.Lock] = {}
        self._mounted: set[str] = set()
        # Layers a pull or import in progress has made or found, not yet listed by an image
        # it recorded: GC leaves them alone (pin/unpin).
        self._pins: collections.Counter[str] = collections.Counter()
        self._snap_layers: dict[str, bool] = {}  # hex -> is a snapshot part (cache)
        # Snapshot parts whose entries GC removed: their references go back to the snapshot
        # store, on the loop (drain_released).
        self._released: list[str] = []
        self.skeleton = os.path.join(self.dir, "skel")
        self.file_backed = True
        self._make_skeleton()
        self.erofs = erofs and self._probe_erofs()

    # ---- set-up ---------------------------------------------------------------------------
    def _make_skeleton(self) -> None:
        if os.path.isdir(self.skeleton):
            return
        tmp = tempfile.mkdtemp(dir=self.tmp_dir)
        for d, mode in SKELETON.items():
            p = os.path.join(tmp, d)
            os.mkdir(p)
            os.chmod(p, mode)
        os.chmod(tmp, 0o755)
        os.rename(tmp, self.skeleton)

    def _probe_erofs(self) -> bool:
        """Can this node make EROFS images and mount them from a file?"""
        if shutil.which("mkfs.erofs") is None:
            log.info("mkfs.erofs not found: image layers stay plain directories")
            return False
        from corral import _core

        tmp = tempfile.mkdtemp(dir=self.tmp_dir)
        img, mnt = os.path.join(tmp, "probe.erofs"), os.path.join(tmp, "m")
        os.mkdir(mnt)
        try:
            self._mkfs(self.skeleton, img)
            self._mount(img, mnt)
            _core.umount_detach(mnt)
            return True
        except (OSError, subprocess.SubprocessError, InvalidImage) as e:
            log.info("EROFS unavailable (%s): image layers stay directories", e)
            return False
        finally:
            removal.remove_tree(tmp)

    def _mount(self, img: str, mnt: str) -> None:
        """File-backed (no loop device); where the store's filesystem cannot back one
        (tmpfs: ENOTBLK), a loop device that goes away with the mount (autoclear)."""
        from corral import _core

        if self.file_backed:
            try:
                _core.mount_file_ro(img, mnt, "erofs")
                return
            except OSError as e:
                if e.errno != errno.ENOTBLK:
                    raise
                self.file_backed = False
                log.info("file-backed EROFS mounts unavailable on %s: loop devices instead",
                         self.dir)
        _core.mount_loop(img, mnt, "erofs", "", direct_io=False)

    def _convert(self, tree: str, tmp: str, hexd: str) -> str:
        """Make ``tmp/tree`` (``tree``) the layer's EROFS image ``tmp/layer.erofs`` and
        remove it: "erofs". A tree mkfs.erofs cannot take (the installed one fails on a name
        of exactly 255 bytes, which Linux allows) stays a directory layer: "dir", a layer all
        the same, logged (a valid image refused would read as the image's fault)."""
        try:
            self._mkfs(tree, os.path.join(tmp, "layer.erofs"))
        except InvalidImage as e:
            log.warning("a layer stays a directory: mkfs.erofs cannot take it",
                        extra={"layer": hexd, "error": str(e)[-300:]})
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(tmp, "layer.erofs"))
            return "dir"
        removal.remove_tree(tree)
        return "erofs"

    @staticmethod
    def _mkfs(src: str, dest: str) -> None:
        r = subprocess.run(["mkfs.erofs", "--quiet", "-x1", dest, src],
                           stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=3600, check=False)
        if r.returncode != 0:
            raise InvalidImage(f"mkfs.erofs failed: {r.stdout.decode(errors='replace')[-500:]}")

    # ---- queries --------------------------------------------------------------------------
    def path(self, hexd: str) -> str:
        return os.path.join(self.layers_dir, hexd)

    def has(self, hexd: str) -> bool:
        return os.path.isfile(os.path.join(self.path(hexd), "layer.json"))

    def meta(self, hexd: str) -> dict:
        with open(os.path.join(self.path(hexd), "layer.json")) as f:
            return dict(json.load(f))

    def all(self) -> list[str]:
        return sorted(n for n in os.listdir(self.layers_dir) if len(n) == 64)

    def is_snapshot_part(self, hexd: str) -> bool:
        v = self._snap_layers.get(hexd)
        if v is None:
            try:
                v = self.meta(hexd).get("format") == "snapshot"
            except (OSError, ValueError):
                return False
            self._snap_layers[hexd] = v
        return v

    def shared_parts(self) -> list[str]:
        """The snapshot parts the entries of this store are (one per entry): the references
        this store holds in the snapshot store, recounted at start."""
        return [h for h in self.all() if self.is_snapshot_part(h)]

    def snapshot_part(self, hexd: str) -> str:
        return os.path.join(self.snap_dir, hexd, "0")

    def lower_path(self, hexd: str) -> str:
        """The directory ``lower`` gives for this layer, without mounting anything."""
        base = self.path(hexd)
        if os.path.isfile(os.path.join(base, "layer.erofs")) or self.is_snapshot_part(hexd):
            return os.path.join(self.mnt_dir, hexd[:16])
        return os.path.join(base, "tree")

    def lower(self, hexd: str) -> str:
        """The directory to stack for this layer, mounted first if it is an EROFS image."""
        base = self.path(hexd)
        img = os.path.join(base, "layer.erofs")
        mnt = os.path.join(self.mnt_dir, hexd[:16])
        if not os.path.isfile(img):
            if not self.is_snapshot_part(hexd):
                return os.path.join(base, "tree")
            with self._lock:  # a short name for the part: overlay's options fit one page
                if not os.path.islink(mnt):
                    part = os.path.join(self.mnt_dir, ".ln-" + os.urandom(6).hex())
                    os.symlink(self.snapshot_part(hexd), part)
                    os.rename(part, mnt)
                self._mounted.add(hexd)
            return mnt
        with self._lock:
            if hexd in self._mounted:
                return mnt
            os.makedirs(mnt, mode=0o755, exist_ok=True)
            if not os.path.ismount(mnt):
                self._mount(img, mnt)
            self._mounted.add(hexd)
            return mnt

    # ---- adding ---------------------------------------------------------------------------
    def pin(self, hexes: Iterable[str]) -> None:
        with self._lock:
            self._pins.update(hexes)

    def unpin(self, hexes: Iterable[str]) -> None:
        with self._lock:
            self._pins.subtract(hexes)
            self._pins += collections.Counter()  # drop the zeros

    def ensure(self, hexd: str, media_type: str, diff_id: str | None,
               fetch: Callable[[str], None], limits: unpack.Limits,
               on_state: Callable[[str], None] | None = None) -> dict:
        """The layer's record, fetched (``fetch(dest)`` writes the verified blob), unpacked
        and converted first if the store lacks it. Concurrent calls for one digest make it
        once, unless one waits GATE_WAIT_S for another (then it fetches too, and the first
        placed is kept); a failure leaves nothing behind. The caller pins the layer first
        (GC)."""
        with self._lock:
            gate = self._building.setdefault(hexd, threading.Lock())
        held = gate.acquire(timeout=GATE_WAIT_S)  # else: build it too, the first one placed wins
        try:
            if self.has(hexd):
                m = self.meta(hexd)
                # The same blob read another way (another media type) is other files: the
                # stored layer stands for this image only if it unpacked to its diff_id.
                # A layer stored some other way (a host dir's, a commit's: no diff_id) is
                # not one of an image's blobs either.
                if diff_id is not None and m.get("diff_id") != diff_id:
                    raise InvalidImage(f"layer sha256:{hexd} unpacks to {m.get('diff_id')}, "
                                       f"the image config says {diff_id}",
                                       details={"expected": diff_id, "got": m.get("diff_id")})
                limits.used_bytes += int(m.get("unpacked_bytes", 0))
                if limits.used_bytes > limits.max_bytes:
                    raise unpack._too_large(limits)
                return m
            if media_type not in unpack.LAYER_TYPES:
                raise InvalidImage(f"layer sha256:{hexd} has unsupported media type "
                                   f"{media_type!r}", details={"media_type": media_type})
            tmp = tempfile.mkdtemp(prefix=hexd[:16] + "-", dir=self.tmp_dir)
            try:
                blob = os.path.join(tmp, "blob")
                fetch(blob)
                tree = os.path.join(tmp, "tree")
                os.mkdir(tree, 0o755)
                if on_state:
                    on_state("unpacking")
                res = unpack.unpack(blob, media_type, tree, limits)
                os.unlink(blob)
                if diff_id is not None and res.diff_id != diff_id:
                    raise InvalidImage(f"layer sha256:{hexd} unpacks to {res.diff_id}, the "
                                       f"image config says {diff_id}",
                                       details={"expected": diff_id, "got": res.diff_id})
                fmt = "dir"
                if self.erofs:
                    if limits.disk_check is not None:  # the image is written once more
                        limits.disk_check("an image layer's conversion", res.size)
                    if on_state:
                        on_state("converting")
                    fmt = self._convert(tree, tmp, hexd)
                meta = {"digest": "sha256:" + hexd, "diff_id": res.diff_id,
                        "media_type": media_type, "unpacked_bytes": res.size,
                        "skipped": res.skipped, "format": fmt}
                with open(os.path.join(tmp, "layer.json"), "w") as f:
                    json.dump(meta, f, sort_keys=True)
                if not self._place(tmp, hexd):
                    return self.meta(hexd)
                return meta
            except OSError as e:
                removal.remove_tree(tmp)
                raise ImagePullFailed(f"cannot store layer sha256:{hexd}: {e}",
                                      details={"errno": e.errno}) from e
            except BaseException:
                removal.remove_tree(tmp)
                raise
        finally:
            self._done_building(hexd, gate, held)

    def _place(self, tmp: str, hexd: str) -> bool:
        """Move a built layer dir into place; False (``tmp`` removed) if another build of
        the same layer got there first (builds of one digest may run at once: GATE_WAIT_S,
        and a gate is dropped by its last holder while another waits on it)."""
        try:
            os.rename(tmp, self.path(hexd))
            return True
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not self.has(hexd):
                raise
        removal.remove_tree(tmp)
        return False

    def _done_building(self, hexd: str, gate: threading.Lock, held: bool) -> None:
        if held:
            gate.release()
        with self._lock:
            if self._building.get(hexd) is gate:
                del self._building[hexd]

    def from_dir(self, src: str, max_bytes: int, max_files: int) -> str:
        """The layer id of host directory ``src``, copied (devices skipped, setuid and
        setgid cleared: the import rules) and converted the first time its contents are
        seen (oci.dirlayer)."""
        from corral.daemon import images
        from corral.daemon.oci import dirlayer

        dirlayer.check_source(src)
        fp = dirlayer.fingerprint(src, max_files)
        known = os.path.join(self.dir, "dirs", fp)
        try:
            with open(known) as f:
                hexd = f.read().strip()
            if self.has(hexd):
                return hexd
        except OSError:
            pass
        tmp = tempfile.mkdtemp(prefix="dir-", dir=self.tmp_dir)
        try:
            tree = os.path.join(tmp, "tree")
            os.mkdir(tree)
            size = images._copy_tree(src, tree, sanitize=False)
            if size > max_bytes:
                raise unpack._too_large(unpack.Limits(max_bytes, max_files))
            os.chmod(tree, stat.S_IMODE(os.stat(src).st_mode) | 0o755)
            hexd = dirlayer.content_hash(tree)
            with self._lock:
                gate = self._building.setdefault(hexd, threading.Lock())
            with gate:
                if not self.has(hexd):
                    fmt = self._convert(tree, tmp, hexd) if self.erofs else "dir"
                    with open(os.path.join(tmp, "layer.json"), "w") as f:
                        json.dump({"digest": "dir:" + hexd, "source": src, "format": fmt,
                                   "unpacked_bytes": size}, f, sort_keys=True)
                    self._place(tmp, hexd)
                with self._lock:
                    if self._building.get(hexd) is gate:  # not a newer caller's gate
                        del self._building[hexd]
            os.makedirs(os.path.dirname(known), mode=0o700, exist_ok=True)
            # A name of its own: the same directory may be imported by several creates at once.
            fd, part = tempfile.mkstemp(prefix=fp[:16] + "-", dir=os.path.dirname(known))
            with os.fdopen(fd, "w") as f:
                f.write(hexd)
            os.rename(part, known)
            return hexd
        finally:
            if os.path.lexists(tmp):
                removal.remove_tree(tmp)

    def from_tree(self, hexd: str, tree: str, meta: dict) -> dict:
        """Store the overlay-form directory ``tree`` (a sandbox's captured changes: whiteouts
        as 0/0 devices, opaque dirs by xattr) as layer ``hexd``, taking the tree over: made
        an EROFS image (then removed), or moved into place. A layer already stored is kept
        and ``tree`` removed. The caller pins ``hexd`` (GC) until an image lists it."""
        with self._lock:
            gate = self._building.setdefault(hexd, threading.Lock())
        tmp = tempfile.mkdtemp(prefix=hexd[:16] + "-", dir=self.tmp_dir)
        try:
            with gate:
                if self.has(hexd):
                    return self.meta(hexd)
                os.rename(tree, os.path.join(tmp, "tree"))
                fmt = self._convert(os.path.join(tmp, "tree"), tmp, hexd) if self.erofs \
                    else "dir"
                meta = {**meta, "format": fmt}
                with open(os.path.join(tmp, "layer.json"), "w") as f:
                    json.dump(meta, f, sort_keys=True)
                if not self._place(tmp, hexd):
                    return self.meta(hexd)
                return meta
        finally:
            with self._lock:
                if self._building.get(hexd) is gate:  # not a newer caller's gate
                    del self._building[hexd]
            for p in (tmp, tree):
                if os.path.lexists(p):
                    removal.remove_tree(p)

    def from_snapshot(self, hexd: str, meta: dict) -> bool:
        """Record snapshot part ``<snap_dir>/hexd/0`` as layer ``hexd`` (no copy); returns
        whether the entry is new (the caller then takes its reference in the snapshot store,
        on the loop, before the part's own holders may let go). The caller pins ``hexd``."""
        with self._lock:
            gate = self._building.setdefault(hexd, threading.Lock())
        try:
            with gate:
                if self.has(hexd):
                    return False
                tmp = tempfile.mkdtemp(prefix=hexd[:16] + "-", dir=self.tmp_dir)
                try:
                    with open(os.path.join(tmp, "layer.json"), "w") as f:
                        json.dump({**meta, "format": "snapshot"}, f, sort_keys=True)
                    if not self._place(tmp, hexd):
                        return False
                except BaseException:
                    removal.remove_tree(tmp)
                    raise
                self._snap_layers[hexd] = True
                return True
        finally:
            with self._lock:
                if self._building.get(hexd) is gate:  # not a newer caller's gate
                    del self._building[hexd]

    def drain_released(self) -> list[str]:
        """The snapshot parts whose entries GC removed since the last call (their references
        go back to the snapshot store)."""
        with self._lock:
            out, self._released = self._released, []
        return out

    # ---- removal --------------------------------------------------------------------------
    def _unmount(self, hexd: str) -> None:
        from corral import _core

        mnt = os.path.join(self.mnt_dir, hexd[:16])
        self._mounted.discard(hexd)
        if os.path.islink(mnt):  # a snapshot part's name
            os.unlink(mnt)
            return
        if os.path.ismount(mnt):
            _core.umount_detach(mnt)
        try:
            os.rmdir(mnt)
        except OSError:
            pass

    def gc(self, keep: Iterable[str], only: Iterable[str] | None = None) -> list[str]:
        """Remove every layer (of ``only``, if given) not in ``keep`` (the layers of every
        image) and not pinned; returns them."""
        wanted = set(keep)
        gone = []
        with self._lock:
            for hexd in self.all() if only is None else sorted(set(only) & set(self.all())):
                if hexd in wanted or hexd in self._building or self._pins[hexd] > 0:
                    continue
                shared = self.is_snapshot_part(hexd)
                self._unmount(hexd)
                trash = os.path.join(self.tmp_dir, f"rm-{hexd}")
                os.rename(self.path(hexd), trash)
                self._snap_layers.pop(hexd, None)
                if shared:
                    self._released.append(hexd)
                gone.append(hexd)
        for hexd in gone:
            removal.remove_tree(os.path.join(self.tmp_dir, f"rm-{hexd}"))
        return gone

    def close(self) -> None:
        """Unmount every layer (daemon stop): live sandboxes hold their own references."""
        with self._lock:
            for hexd in list(self._mounted):
                self._unmount(hexd)
