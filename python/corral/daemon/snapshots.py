"""Snapshots: a sandbox's overlay upper dirs captured as a read-only, content-addressed layer.

On disk (``<state_dir>``):
  layers/<digest>/<n>/      the layer: a copy of upper dir ``n`` (one per overlay target of the
                            image: "/" is 0, "/usr" 1 ...); absent when that upper was empty
  snapshots.db              the snapshot records (SQLite, corral.daemon.snapdb): id, name,
                            parent, image, layers (bottom first)
  spares/<random>/0/        empty layer dirs made ahead, off the request path (a capture
                            takes one; a new inode on ext4 can cost most of a millisecond)
  trash/                    directories being removed in the background

A snapshot is a *chain* of layers: the layers the sandbox was started on (its own snapshot's
chain) plus the new layer on top. A sandbox started from a snapshot mounts each overlay with
the chain's parts as extra lowerdirs above the image's. Deletions carry over because the copy
keeps overlayfs' whiteouts (char 0/0) and opaque / redirect xattrs (``trusted.overlay.*``).

Capture: freeze the sandbox's cgroup (cgroup freezer) so no process writes mid-copy, then the
Rust core (``_core.capture_layer``, rust/src/layer.rs, GIL released) copies each upper and
hashes it in one pass: big files with copy_file_range (in-kernel; on ext4 a data copy, on
btrfs/XFS a reflink) while a second thread hashes the same source file, small ones read once,
hashed and written; then thaw. The digest is blake3 over a sorted manifest (paths, types,
modes, owners, mtimes, xattrs, link targets and file contents) of what was written; the source
cannot change while frozen, so hashing it is hashing the copy, without reading the copy back.
:func:`layer_digest` recomputes it from a stored layer (the tests check that the two agree).
Cost grows with what the sandbox changed, never with the image. A capture is given a
``CaptureControl``: the caller reads the bytes copied so far from it (progress lines) and
cancels through it (the client left): the copy stops within one chunk and its partial layer
dir is removed.
Hard-linking the upper's files would be cheaper but wrong: the sandbox keeps writing to those
inodes in place (the upper is not copied up again), which would change the snapshot.

Reference counting: each layer counts the snapshot records and the sandboxes (live, or being
destroyed) whose chain holds it, and the image layer store's entries that are its part 0 (a
commit lists a part that needed no cleaning as the same files: corral.daemon.oci.layers,
``format: "snapshot"``; the commit's own capture may be such a layer with no snapshot record).
``rm`` drops a record at once; a layer goes when its count reaches zero, so a layer a sandbox,
a child snapshot or an image still stands on is never removed. The counts are rebuilt at start
from the records, the image layer store's entries and the re-adopted sandboxes' runtimes, and
any layer nothing references (or a half-made one) is collected then.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import mmap
import os
import stat
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import blake3

from corral import _core
from corral.daemon import diskguard, removal
from corral.daemon.snapdb import SnapshotDB
from corral.errors import SnapshotChainTooDeep, SnapshotExists, SnapshotNotFound, TooLarge

log = logging.getLogger("corral.snapshots")

# The first bytes of every layer manifest (rust/src/layer.rs MANIFEST_VERSION).
MANIFEST_VERSION = b"corral layer manifest 2\n"

# overlayfs xattrs that describe the layer's content and must carry over; the others
# (origin, impure, nlink, upper, uuid) describe one mount's upper and are dropped.
_KEEP_OVL = {"trusted.overlay.opaque", "trusted.overlay.redirect", "trusted.overlay.metacopy",
             "trusted.overlay.whiteout", "trusted.overlay.whiteouts"}
# A running capture's shared state: bytes copied so far, and its cancel.
CaptureControl = _core.CaptureControl

# mount(2) takes the overlay options in one page: "lowerdir=...,upperdir=...,workdir=...".
MOUNT_OPTIONS_MAX = 4095


def new_id() -> str:
    return "snap-" + os.urandom(8).hex()


def _xattrs(path: str) -> list[tuple[str, bytes]]:
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return []
    out = []
    for n in sorted(names):
        if (n.startswith("trusted.overlay.") and n not in _KEEP_OVL) or \
                n == "security.capability":
            continue
        try:
            out.append((n, os.getxattr(path, n, follow_symlinks=False)))
        except OSError:
            continue
    return out


def layer_digest(layer: str) -> str:
    """The digest of a stored layer dir, recomputed from its files: the same manifest
    ``_core.capture_layer`` hashes while it copies (an independent check; not on a hot path)."""
    h = blake3.blake3(MANIFEST_VERSION)
    for n in sorted(int(x) for x in os.listdir(layer) if x.isdigit()):
        h.update(f"part {n}\n".encode())
        tree_digest(os.path.join(layer, str(n)), h)
    return h.hexdigest()


def _xattr_section(path: str) -> bytes:
    got = _xattrs(path)
    return f"{len(got)}\0".encode() + b"".join(
        os.fsencode(n) + f"\0{len(v)}\0".encode() + v for n, v in got)


def tree_digest(root: str, h: Any) -> None:
    """Feed a canonical manifest of ``root`` (sorted, every field a sandbox chooses
    terminated or length-prefixed; the root's own line last) with file contents into hasher
    ``h``: the encoding is the Rust core's (rust/src/layer.rs)."""
    def listing(d: str, rel: str) -> list[tuple[str, str]]:
        with os.scandir(d) as it:  # reversed: popped from the end, smallest name first
            return [(e.path, f"{rel}/{e.name}") for e in sorted(it, key=lambda e: e.name,
                                                                reverse=True)]

    stack = [listing(root, "")]  # a loop, not a recursion: trees may be deep
    while stack:
        if not stack[-1]:
            stack.pop()
            continue
        path, r = stack[-1].pop()
        st = os.lstat(path)
        m = st.st_mode
        x = _xattr_section(path)
        head = os.fsencode(r) + f"\0{m:o}\0{st.st_uid}\0{st.st_gid}\0{st.st_rdev}\0".encode()
        if stat.S_ISDIR(m):
            h.update(b"D" + head + x + b"\n")
            stack.append(listing(path, r))
        elif stat.S_ISLNK(m):
            target = os.fsencode(os.readlink(path))
            h.update(b"L" + head + f"{len(target)}\0".encode() + target + x + b"\n")
        elif stat.S_ISREG(m):
            h.update(b"F" + head + f"{st.st_size}\0{st.st_mtime_ns}\0".encode() + x)
            h.update(_file_hash(path, st.st_size) + b"\n")
        else:
            h.update(b"O" + head + x + b"\n")
    st = os.lstat(root)
    h.update(f"R\0{st.st_mode:o}\0{st.st_uid}\0{st.st_gid}\0{st.st_rdev}\0".encode()
             + _xattr_section(root) + b"\n")


_ZEROS = bytes(1 << 20)


def _file_hash(path: str, size: int) -> bytes:
    """blake3 of the file's content. Holes are hashed as zeros without being read: a read
    fault on a hole of a tmpfs file allocates its page, and a 16 GiB file of holes (an
    imported snapshot's, checked on a tmpfs state dir) would have taken 16 GiB of memory."""
    if size == 0:
        return blake3.blake3(b"").digest()
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        h = blake3.blake3()
        with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as mm:
            off = 0
            while off < size:
                try:
                    data = os.lseek(fd, off, os.SEEK_DATA)
                except OSError as e:
                    if e.errno != errno.ENXIO:
                        raise
                    data = size  # holes to the end
                data = min(data, size)
                while off < data:  # a hole
                    n = min(data - off, len(_ZEROS))
                    h.update(memoryview(_ZEROS)[:n])
                    off += n
                if off < size:
                    end = min(os.lseek(fd, off, os.SEEK_HOLE), size)
                    h.update(memoryview(mm)[off:end])
                    off = end
        return h.digest()
    finally:
        os.close(fd)


def _empty(path: str) -> bool:
    try:
        with os.scandir(path) as it:
            return next(it, None) is None
    except FileNotFoundError:
        return True


# (The store's own ``list`` method shadows the builtin in its class body.)
Layers = list[str]                       # layer digests or dirs, bottom first
Overlays = list[tuple[str, list[str]]]   # (target, lowerdirs) per overlay


class SnapshotStore:
    """Snapshot records, layers and their reference counts. Methods run on the event loop
    except :meth:`capture`, which does the I/O (a worker thread)."""

    # Levels of directories a capture follows (two fds each while it walks); deeper trees
    # cannot be snapshotted (a path that deep is past PATH_MAX for most tools anyway).
    MAX_DEPTH = 512

    def __init__(self, state_dir: str, max_bytes: int = 16 << 30,
                 max_entries: int = 1_000_000) -> None:
        self.state_dir = state_dir
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.layers_dir = os.path.join(state_dir, "layers")
        self.spares_dir = os.path.join(state_dir, "spares")
        self.trash_dir = os.path.join(state_dir, "trash")
        self.records: dict[str, dict[str, Any]] = {}
        self.by_name: dict[str, str] = {}
        self.refs: Counter[str] = Counter()
        # Bytes of each layer (its capture's file content), for the tenants' quotas: from
        # every record's layer_sizes (a layer outlives the record that made it).
        self.layer_sizes: dict[str, int] = {}
        # Captures in flight per tenant: they count against its snapshot quota.
        self.pending: Counter[str] = Counter()
        self._parts: dict[tuple[str, int], bool] = {}  # (digest, n) -> that part has content
        for d in (self.layers_dir, self.spares_dir, self.trash_dir):
            os.makedirs(d, mode=0o700, exist_ok=True)
        self.db = SnapshotDB(state_dir)
        self._spares: list[str] = []  # empty layer dirs ready for a capture
        self._spares_lock = threading.Lock()
        self._refilling = False
        self._closed = False

    # ---- start ---------------------------------------------------------------------------
    def load(self) -> None:
        """Read the records and count their layers (before sandboxes are re-adopted)."""
        for sid, rec in list(self.db.records()):
            try:
                if rec is None:
                    raise ValueError("unreadable")
                layers = [str(x) for x in rec["layers"]]
                if not all(os.path.isdir(self.layer_path(d)) for d in layers):
                    raise ValueError("missing layer")
            except (ValueError, KeyError, TypeError):
                log.warning("dropping unreadable snapshot record", extra={"snapshot": sid})
                self.db.delete(sid)
                continue
            self.records[rec["id"]] = rec
            if rec.get("name"):
                self.by_name[rec["name"]] = rec["id"]
            self.refs.update(layers)
            self.note_sizes(rec)

    def note_sizes(self, rec: dict[str, Any]) -> None:
        sizes = rec.get("layer_sizes")
        if isinstance(sizes, list) and len(sizes) == len(rec["layers"]):
            for d, n in zip(rec["layers"], sizes, strict=True):
                if isinstance(n, int):
                    self.layer_sizes.setdefault(d, n)
        if isinstance(rec.get("size"), int):
            self.layer_sizes[rec["digest"]] = rec["size"]

    def usage(self, tenant: str) -> tuple[int, int, set[str]]:
        """What ``tenant``'s snapshots hold: (records, bytes of the distinct layers of their
        chains, those layers). A layer is counted once however many of its snapshots share
        it, and for as long as one of them stands on it (its own record deleted or not)."""
        count, held = 0, set()
        for rec in self.records.values():
            if rec.get("tenant") == tenant:
                count += 1
                held.update(rec["layers"])
        return count, sum(self.layer_sizes.get(d, 0) for d in held), held

    def collect(self) -> list[str]:
        """Remove every layer dir nothing references (after re-adoption), and the trash."""
        removed = []
        for name in os.listdir(self.layers_dir):
            if self.refs.get(name, 0) <= 0:
                self._discard(os.path.join(self.layers_dir, name))
                removed.append(name)
        for name in os.listdir(self.trash_dir):
            self._rm_later(os.path.join(self.trash_dir, name))
        for name in os.listdir(self.spares_dir):  # a crash may have left one half-filled
            self._discard(os.path.join(self.spares_dir, name))
        return removed

    def close(self) -> None:
        """At shutdown: the spare dirs go (they are remade on demand), the records file closes."""
        with self._spares_lock:
            spares, self._spares, self._closed = self._spares, [], True
        for path in spares:
            removal.quiet_remove(path)
        self.db.close()

    # ---- spare layer dirs ----------------------------------------------------------------
    SPARES = 2  # one capture at a time is the common case; two cover a snapshot + fork

    def _take_spare(self) -> str:
        """An empty layer dir (with part 0 made) for a capture: a spare, else a new one."""
        with self._spares_lock:
            if self._spares:
                return self._spares.pop()
        return self._make_spare()

    def _make_spare(self) -> str:
        path = os.path.join(self.spares_dir, os.urandom(8).hex())
        os.mkdir(path, 0o755)
        os.mkdir(os.path.join(path, "0"), 0o700)
        return path

    def refill_spares(self) -> None:
        """Top the spares up (a worker thread, after a capture answered)."""
        try:
            while True:
                with self._spares_lock:
                    if len(self._spares) >= self.SPARES:
                        return
                path = self._make_spare()
                with self._spares_lock:
                    if self._closed:  # the daemon stopped meanwhile: leave nothing behind
                        removal.quiet_remove(path)
                        return
                    self._spares.append(path)
        except OSError as e:
            log.warning("could not make a spare layer dir", extra={"error": str(e)})
        finally:
            self._refilling = False

    def wants_spares(self) -> bool:
        """True once per needed refill (the caller then runs refill_spares off the loop)."""
        if self._refilling or len(self._spares) >= self.SPARES:
            return False
        self._refilling = True
        return True

    # ---- lookup --------------------------------------------------------------------------
    def get(self, key: str) -> dict[str, Any]:
        rec = self.records.get(key)
        if rec is None and key in self.by_name:
            rec = self.records.get(self.by_name[key])
        if rec is None:
            raise SnapshotNotFound(f"no snapshot {key!r}", details={"snapshot": key})
        return rec

    def list(self) -> list[dict[str, Any]]:
        return sorted(self.records.values(), key=lambda r: r["created_at"])

    def layer_path(self, digest: str, n: int | None = None) -> str:
        p = os.path.join(self.layers_dir, digest)
        return p if n is None else os.path.join(p, str(n))

    def _has_part(self, digest: str, n: int) -> bool:
        key = (digest, n)
        v = self._parts.get(key)
        if v is None:
            v = self._parts[key] = not _empty(self.layer_path(digest, n))
        return v

    # ---- overlays ------------------------------------------------------------------------
    def stack(self, overlays: Overlays,
              layers: Layers) -> Overlays:
        """The image's overlays with the chain's non-empty parts as lowerdirs on top
        (top first; a layer twice in a chain counts once, at its top position)."""
        out: Overlays = []
        for n, (target, lowers) in enumerate(overlays):
            extra: Layers = []
            for d in reversed(layers):
                p = self.layer_path(d, n)
                if p not in extra and self._has_part(d, n):
                    extra.append(p)
            out.append((target, extra + list(lowers)))
        return out

    def check_fits(self, overlays: Overlays, sandboxes_dir: str,
                   extra_layers: int = 0) -> None:
        """Refuse a chain whose overlay options would not fit in one page (mount(2))."""
        sdir = os.path.join(sandboxes_dir, "sb-" + "0" * 16)
        per_layer = len(self.layer_path("0" * 64, 0)) + 1
        for n, (_, lowers) in enumerate(overlays):
            opts = (f"lowerdir={':'.join(lowers)},upperdir={sdir}/upper/{n},"
                    f"workdir={sdir}/work/{n},volatile,userxattr")
            if len(opts) + extra_layers * per_layer > MOUNT_OPTIONS_MAX:
                raise SnapshotChainTooDeep(
                    f"the snapshot chain is too deep: {len(lowers)} lower layers do not fit "
                    f"in one overlay mount (options are limited to {MOUNT_OPTIONS_MAX} bytes); "
                    f"start a fresh sandbox or snapshot an earlier level",
                    details={"lower_layers": len(lowers)})

    # ---- refs ----------------------------------------------------------------------------
    def acquire(self, layers: Layers) -> None:
        self.refs.update(layers)

    def release(self, layers: Layers) -> None:
        for d in layers:
            self.refs[d] -= 1
            if self.refs[d] <= 0:
                del self.refs[d]
                self._discard(self.layer_path(d))

    def _discard(self, path: str) -> None:
        """Move a layer to the trash at once (a rename) and delete it in the background."""
        digest = os.path.basename(path)
        self.layer_sizes.pop(digest, None)
        for key in [k for k in self._parts if k[0] == digest]:
            del self._parts[key]
        dst = os.path.join(self.trash_dir, f"{digest}.{os.urandom(4).hex()}")
        try:
            os.rename(path, dst)
        except FileNotFoundError:
            return
        self._rm_later(dst)

    @staticmethod
    def _rm_later(path: str) -> None:
        removal.remove_later(path)

    # ---- capture (worker thread) -----------------------------------------------------------
    def capture(self, uppers: Layers, freeze: Callable[[], Any], thaw: Callable[[], Any],
                control: CaptureControl | None = None) -> tuple[str, str, int]:
        """Copy the uppers into a new temporary layer dir; return (tmp dir, digest, bytes: its
        file data, or with ``control`` what the copy took of the disk, a block for each entry
        and its xattrs included: a layer of empty files is not free).
        ``freeze`` returns False when it could not hold the sandbox (the copy is then made
        live, and hashed again from the copy). Cancelled through ``control``: raises
        ``_core.CaptureCancelled``, nothing kept."""
        tmp = self._take_spare()
        parts = [(n, upper, os.path.join(tmp, str(n))) for n, upper in enumerate(uppers)]
        try:
            held = freeze()
            try:
                # One pass in the Rust core, GIL released: copy and hash side by side (the
                # source cannot change while frozen, so its hash is the copy's).
                digest, size = _core.capture_layer(parts, self.max_bytes, self.max_entries,
                                                   self.MAX_DEPTH, control)
            finally:
                thaw()
            if control is not None:
                # Its weight on the disk and in the tenant's quota: what the copy took (file
                # data, holes kept; a block for each entry; xattrs), never the files' apparent
                # sizes (sparse files of 15 GiB on 29 MB of disk took a tenant's quota, and
                # its honest snapshots were quota_exceeded, infra). ``max_bytes`` still bounds
                # the apparent size, in the copy.
                size = control.charged()
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(tmp, "0"))  # the spare's part 0, if its upper was empty
            if held is False:
                # Copied live (the sandbox could not be frozen): a file may have changed
                # between what was hashed and what was copied. Layers are shared by digest,
                # also across tenants: the digest must be the stored copy's own.
                digest = layer_digest(tmp)
            return tmp, digest, size
        except _core.LayerLimit as e:
            removal.quiet_remove(tmp)
            what, limit = e.args
            raise TooLarge(f"cannot snapshot: the sandbox's files exceed the limit of {limit} "
                           f"{what}", details={"limit": what, "max": limit}) from None
        except OSError as e:
            removal.quiet_remove(tmp)
            if e.errno in diskguard.DISK_FULL:
                # The copy's disk (the state dir's), not the sandbox's: never the task's.
                raise diskguard.disk_full("a snapshot's copy", e) from None
            raise
        except BaseException:
            removal.quiet_remove(tmp)
            raise

    def drop(self, tmp: str) -> None:
        """A captured layer dir that will not be committed (its call was cancelled)."""
        self._rm_later(tmp)

    def commit(self, tmp: str, digest: str, size: int, *, name: str | None,
               parent: str | None, image: str, base: Layers,
               sandbox_id: str, tenant: str | None = None) -> dict[str, Any]:
        """Put a captured layer in place (or drop it if that content is already stored) and
        record the snapshot (of ``tenant``: corral.daemon.tenants). Runs on the loop, so it
        cannot race with a collection."""
        if name is not None and name in self.by_name:
            self._rm_later(tmp)
            other = self.records[self.by_name[name]]
            # Names are one namespace; another tenant's snapshot's id is not told.
            details = ({"name": name, "id": other["id"]}
                       if other.get("tenant") == tenant else {"name": name})
            raise SnapshotExists(f"a snapshot named {name!r} exists", details=details)
        final = self.layer_path(digest)
        if os.path.isdir(final):
            self._rm_later(tmp)  # same content already stored: share it
        else:
            os.rename(tmp, final)
        rec: dict[str, Any] = {"id": new_id(), "name": name, "parent": parent, "image": image,
               "digest": digest, "layers": [*base, digest], "size": size,
               "layer_sizes": [self.layer_sizes.get(d, 0) for d in base] + [size],
               "created_at": time.time(), "sandbox_id": sandbox_id}
        if tenant is not None:
            rec["tenant"] = tenant
        self.refs.update(rec["layers"])
        try:
            self.db.put(rec)
        except BaseException:
            self.release(rec["layers"])
            raise
        self.records[rec["id"]] = rec
        self.note_sizes(rec)
        if name:
            self.by_name[name] = rec["id"]
        return rec

    def adopt(self, tmp: str, digest: str) -> None:
        """Put a captured layer dir in place as layer ``digest`` with no snapshot record (an
        image commit's layer, corral.daemon.oci.commit.share_layers: the caller takes its
        reference next, on the loop); if that content is already stored, ``tmp`` stays for
        the caller to remove."""
        final = self.layer_path(digest)
        if not os.path.isdir(final):
            os.rename(tmp, final)

    def delete(self, key: str) -> dict[str, Any]:
        rec = self.get(key)
        self.db.delete(rec["id"])
        del self.records[rec["id"]]
        if rec.get("name") and self.by_name.get(rec["name"]) == rec["id"]:
            del self.by_name[rec["name"]]
        self.release(rec["layers"])
        return rec


def info(rec: dict[str, Any]) -> dict[str, Any]:
    return {k: rec.get(k) for k in ("id", "name", "parent", "image", "digest", "layers", "size",
                                    "created_at", "sandbox_id")}


def dumps(rec: dict[str, Any]) -> str:
    return json.dumps(info(rec))
