"""Push an image of the node's store to a registry (OCI image manifest, gzip tar layers).

A stored layer is a tree in overlay form (an EROFS image or a directory), not the blob it
came from, so a push writes each layer's tar form anew: whiteouts (0/0 character devices)
become ``.wh.NAME`` entries, an opaque directory (``trusted.overlay.opaque``) gets a
``.wh..wh..opq`` entry, hard links within the layer stay links, ``user.*`` xattrs travel as
PAX headers. The tar is deterministic (sorted names, the files' own mtimes and owners, gzip
without a timestamp), so pushing one layer twice gives one digest, which ``push.json`` in the
layer's directory remembers: a blob the registry has is not made or sent again. A layer that
was pulled is first looked for by its original digest. A layer with an overlay redirect or
metacopy xattr (a directory renamed under ``redirect_dir=on``) has no tar form, nor has a file
named like a whiteout (``.wh.*``): refused."""

from __future__ import annotations

import errno
import gzip
import hashlib
import json
import os
import stat
import tarfile
import tempfile
from typing import IO, Any

from corral.daemon.oci import egress, registry
from corral.daemon.oci.layers import LayerStore
from corral.daemon.oci.ref import Reference
from corral.daemon.oci.unpack import (
    EXACT_XATTRS,
    LITERAL,
    MTIME_NS,
    OPAQUE_XATTR,
    SOCKET,
    SPARSE,
    SPARSE_MAX,
    WHITEOUT,
    XATTR_HEX,
)
from corral.errors import InvalidImage, InvalidRequest

GZIP_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
_UNSUPPORTED_XATTRS = ("trusted.overlay.redirect", "trusted.overlay.metacopy")


class _Hashing:
    """A write-through that hashes and counts what passes."""

    def __init__(self, f: IO[bytes] | Any) -> None:
        self.f, self.h, self.n = f, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.h.update(data)
        self.n += len(data)
        self.f.write(data)
        return len(data)

    def flush(self) -> None:
        pass


def _plain_name(name: str) -> bool:
    """An xattr name a PAX keyword can hold: UTF-8 (not the surrogates os.listxattr decodes
    other bytes to), printable, without "=" (which ends a keyword)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return name.isprintable() and "=" not in name


def _member(at: str | int, rel: str, st: os.stat_result, exact: bool = False
            ) -> tarfile.TarInfo:
    """The tar header of the entry ``rel`` with its xattrs, read through ``at``: an fd of the
    entry itself, or the /proc/self/fd path of one (O_PATH); a symlink's are not read."""
    ti = tarfile.TarInfo(rel)
    ti.mode, ti.uid, ti.gid = stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid
    ti.mtime = int(st.st_mtime)
    ti.uname = ti.gname = ""
    pax: dict[str, str] = {}
    if not stat.S_ISLNK(st.st_mode):
        try:
            names = sorted(os.listxattr(at))
        except OSError:
            names = []
        for n in names:
            if n in _UNSUPPORTED_XATTRS:
                raise InvalidImage(f"cannot push: {rel!r} carries {n} (a directory renamed "
                                   "with overlay redirect_dir on has no tar form)",
                                   details={"path": rel, "xattr": n})
            if n.startswith("user.") or (exact and n in EXACT_XATTRS):
                v = os.getxattr(at, n)
                value = v.decode("utf-8", "surrogateescape")
                if _plain_name(n):
                    pax[f"SCHILY.xattr.{n}"] = value
                elif exact:  # a snapshot's layer holds what its sandbox set, as it set it
                    pax[XATTR_HEX + os.fsencode(n).hex()] = value
                else:
                    raise InvalidImage(f"cannot push: {rel!r} carries an xattr whose name is "
                                       "not printable UTF-8 or has a '=', which a tar cannot name",
                                       details={"path": rel, "xattr": n})
    ti.pax_headers = pax
    return ti


def write_tar(root: str, out: Any) -> None:
    """The OCI tar form of the overlay-form tree ``root``, written to ``out``."""
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tf:
        add_tree(tf, root)


def _add(tf: tarfile.TarFile, ti: tarfile.TarInfo, f: Any = None) -> None:
    """``tf.addfile``, forgetting the member: tarfile keeps every member it wrote (~600 bytes
    each), also to a stream, which never looks back at one (an export of 200,000 files grew
    the daemon by 120 MB)."""
    tf.addfile(ti, f)
    tf.members.clear()  # type: ignore[attr-defined]


def add_tree(tf: tarfile.TarFile, root: str, prefix: str = "", exact: bool = False) -> None:
    """Add the overlay-form tree ``root`` to ``tf``, every name (and hard link target) under
    ``prefix`` (empty, or ending in "/"). ``exact`` (a snapshot's layer moving to another
    node, whose digest must come out the same): a regular file's mtime to the nanosecond
    (PAX ``CORRAL.mtime_ns``), and a whiteout's or FIFO's own mode and owner.

    Walked by fds, one a directory on the way down: a sandbox's paths may be as long as the
    kernel lets it make them (4,095 bytes), which the layer's own place on the host makes
    longer than any path a call takes (a 4,020-byte one cut every export of its snapshot)."""
    links: dict[tuple[int, int], str] = {}
    top = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    # Each directory on the way down: its fd, its path in the tree, its subdirectories to go.
    frames: list[tuple[int, str, list[str]]] = []
    try:
        frames.append((top, "", _add_dir(tf, top, "", prefix, exact, links)))
    except BaseException:
        os.close(top)
        raise
    try:
        while frames:
            dfd, d, todo = frames[-1]
            if not todo:
                os.close(dfd)
                frames.pop()
                continue
            name = todo.pop()
            sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                          dir_fd=dfd)
            rel = f"{d}/{name}" if d else name
            try:
                frames.append((sub, rel, _add_dir(tf, sub, rel, prefix, exact, links)))
            except BaseException:
                os.close(sub)
                raise
    finally:
        for dfd, _, _ in frames:
            os.close(dfd)


def _add_dir(tf: tarfile.TarFile, dfd: int, d: str, prefix: str, exact: bool,
             links: dict[tuple[int, int], str]) -> list[str]:
    """Add the entries of the directory ``dfd`` (``d`` in the tree) to ``tf``, in name order;
    return its subdirectories' names, last first (to be popped in name order)."""
    with os.scandir(dfd) as it:
        names = sorted(e.name for e in it)
    subdirs = []
    for name in names:
        rel = f"{d}/{name}" if d else name
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        m = st.st_mode
        if stat.S_ISCHR(m) and st.st_rdev == 0:  # a whiteout
            wh = tarfile.TarInfo(prefix + (f"{d}/.wh.{name}" if d else f".wh.{name}"))
            wh.mtime = int(st.st_mtime)
            if exact:
                wh.mode, wh.uid, wh.gid = stat.S_IMODE(m), st.st_uid, st.st_gid
                wh.pax_headers = {WHITEOUT: "1"}  # ".wh..opq"'s is no opaque marker
            _add(tf, wh)
            continue
        # A snapshot's layer holds what its sandbox made: a socket file (a leftover of a
        # server), names like whiteouts, ACLs. The exact form carries them (unpack.LITERAL,
        # SOCKET, EXACT_XATTRS): dropped, the layer would hash differently on arrival and a
        # sandbox could make every copy of its snapshot fail as the cluster's (infra).
        sock = exact and stat.S_ISSOCK(m)
        if not (stat.S_ISDIR(m) or stat.S_ISREG(m) or stat.S_ISLNK(m)
                or stat.S_ISFIFO(m) or sock):
            continue  # devices and sockets never reach an image layer; skip if any
        if name.startswith(".wh.") and not exact:
            # Any reader of an OCI layer takes it for a whiteout (of the name after the
            # prefix, or the opaque marker): pushed, the image would lose a file.
            raise InvalidImage(f"cannot push: {rel!r} is named like an OCI whiteout "
                               "(.wh.*) and would read as one; rename it",
                               details={"path": rel})
        if stat.S_ISLNK(m):
            ti = _member(dfd, rel, st, exact)  # a symlink's xattrs are not read
            ti.name, ti.type = prefix + rel, tarfile.SYMTYPE
            ti.linkname = os.readlink(name, dir_fd=dfd)
            if exact and name.startswith(".wh."):
                ti.pax_headers = {**ti.pax_headers, LITERAL: "1"}
            _add(tf, ti)
            continue
        # The entry itself, by an fd that does not follow (a FIFO's is never opened for
        # reading: O_PATH), for its xattrs and a file's data.
        fd = os.open(name, (os.O_RDONLY if stat.S_ISREG(m) or stat.S_ISDIR(m) else os.O_PATH)
                     | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        try:
            at: str | int = fd if stat.S_ISREG(m) or stat.S_ISDIR(m) else f"/proc/self/fd/{fd}"
            ti = _member(at, rel, st, exact)
            ti.name = prefix + rel
            if exact and name.startswith(".wh."):
                ti.pax_headers = {**ti.pax_headers, LITERAL: "1"}
            if sock:
                ti.pax_headers = {**ti.pax_headers, SOCKET: "1"}
            if stat.S_ISDIR(m):
                ti.type = tarfile.DIRTYPE
                _add(tf, ti)
                try:
                    opaque = os.getxattr(fd, OPAQUE_XATTR)
                except OSError:
                    opaque = b""
                if opaque == b"y":
                    _add(tf, tarfile.TarInfo(f"{prefix}{rel}/.wh..wh..opq"))
                subdirs.append(name)
            elif stat.S_ISFIFO(m) or sock:
                ti.type = tarfile.FIFOTYPE
                _add(tf, ti)
            else:
                key = (st.st_dev, st.st_ino)
                if st.st_nlink > 1 and key in links:
                    ti.type, ti.linkname = tarfile.LNKTYPE, prefix + links[key]
                    _add(tf, ti)
                    continue
                if st.st_nlink > 1:
                    links[key] = rel
                ti.size = st.st_size
                if exact:
                    ti.pax_headers = {**ti.pax_headers, MTIME_NS: str(st.st_mtime_ns)}
                f = os.fdopen(os.dup(fd), "rb")
                with f:
                    segs = _data_segments(f.fileno(), st.st_size) \
                        if exact and st.st_blocks * 512 < st.st_size else None
                    if segs is None:
                        _add(tf, ti, f)
                        continue
                    # Only the data travels (unpack.SPARSE): a 15 GiB file of holes the
                    # sandbox made for nothing was 15 GiB of zeros sent and written.
                    ti.size = sum(n for _, n in segs)
                    ti.pax_headers = {**ti.pax_headers, SPARSE: f"{st.st_size};" + ",".join(
                        f"{o}:{n}" for o, n in segs)}
                    _add(tf, ti, _Segments(f, segs))
        finally:
            os.close(fd)
    return list(reversed(subdirs))


def _data_segments(fd: int, size: int) -> list[tuple[int, int]] | None:
    """The (offset, length) of a file's data, holes left out (SEEK_DATA/SEEK_HOLE), at most
    SPARSE_MAX of them: the smallest holes between are sent as data until they fit. None
    where the filesystem cannot tell."""
    segs: list[tuple[int, int]] = []
    off = 0
    try:
        while off < size:
            try:
                start = os.lseek(fd, off, os.SEEK_DATA)
            except OSError as e:
                if e.errno == errno.ENXIO:  # holes to the end
                    break
                raise
            end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
            segs.append((start, end - start))
            off = end
    except OSError:
        return None
    gap = 4096
    while len(segs) > SPARSE_MAX:  # merge across holes smaller than gap, doubling it
        merged = [segs[0]]
        for o, n in segs[1:]:
            po, pn = merged[-1]
            if o - (po + pn) < gap:
                merged[-1] = (po, o + n - po)
            else:
                merged.append((o, n))
        segs, gap = merged, gap * 2
    return segs


class _Segments:
    """A file read as the concatenation of its data segments (a sparse member's content)."""

    def __init__(self, f: IO[bytes], segs: list[tuple[int, int]]) -> None:
        self.f, self.segs, self.i, self.pos = f, segs, 0, 0

    def read(self, n: int = -1) -> bytes:
        out = bytearray()
        while self.i < len(self.segs) and (n < 0 or len(out) < n):
            o, ln = self.segs[self.i]
            want = ln - self.pos if n < 0 else min(ln - self.pos, n - len(out))
            data = os.pread(self.f.fileno(), want, o + self.pos)
            if not data:  # the file shrank: tarfile pads and the digest check refuses it
                break
            out += data
            self.pos += len(data)
            if self.pos >= ln:
                self.i, self.pos = self.i + 1, 0
        return bytes(out)


def layer_blob(store: LayerStore, hexd: str, dest: str) -> dict[str, Any]:
    """Write layer ``hexd``'s gzip tar to ``dest``: its digest, diff_id and size."""
    root = store.lower(hexd)
    with open(dest, "wb") as f:
        comp = _Hashing(f)
        with gzip.GzipFile(fileobj=comp, mode="wb", compresslevel=1, mtime=0) as gz:
            plain = _Hashing(gz)
            write_tar(root, plain)
    return {"digest": "sha256:" + comp.h.hexdigest(),
            "diff_id": "sha256:" + plain.h.hexdigest(), "size": comp.n,
            "media_type": GZIP_LAYER}


def _remembered(store: LayerStore, hexd: str) -> list[dict[str, Any]]:
    """Blobs known to hold this layer: its tar form made before, the one it was pulled as."""
    out = []
    try:
        with open(os.path.join(store.path(hexd), "push.json")) as f:
            out.append(dict(json.load(f)))
    except (OSError, ValueError):
        pass
    m = store.meta(hexd)
    if str(m.get("digest", "")).startswith("sha256:") and m.get("diff_id"):
        out.append({"digest": m["digest"], "diff_id": m["diff_id"],
                    "media_type": m.get("media_type", GZIP_LAYER)})
    return out


def push(ref: Reference, store: LayerStore, hexes: list[str], config: dict[str, Any],
         policy: egress.Egress | None = None) -> dict[str, Any]:
    """Push the image of stored layers ``hexes`` (base first) and runtime ``config`` as
    ``ref``; returns the PushResult fields."""
    if ref.digest:
        raise InvalidRequest(f"push to a tag, not a digest ({ref})",
                             details={"reference": str(ref)})
    tag = ref.tag or "latest"
    descs, diff_ids = [], []
    uploaded = sent = 0
    with registry.Registry(ref, policy, actions="pull,push") as reg:
        for hexd in hexes:
            found = None
            for cand in _remembered(store, hexd):
                size = reg.blob_size(cand["digest"])
                if size is not None and size >= 0:
                    found = {**cand, "size": size}
                    break
            if found is None:
                fd, tmp = tempfile.mkstemp(prefix="push-", dir=store.tmp_dir)
                os.close(fd)
                try:
                    found = layer_blob(store, hexd, tmp)
                    reg.upload(found["digest"], tmp)
                finally:
                    os.unlink(tmp)
                uploaded += 1
                sent += found["size"]
                with open(os.path.join(store.path(hexd), "push.json"), "w") as f:
                    json.dump(found, f, sort_keys=True)
            descs.append({"mediaType": found["media_type"], "digest": found["digest"],
                          "size": found["size"]})
            diff_ids.append(found["diff_id"])
        cfg = dict(config)
        if isinstance(cfg.get("ExposedPorts"), list):
            cfg["ExposedPorts"] = {p: {} for p in cfg["ExposedPorts"]}
        cfg_b = json.dumps({"architecture": "amd64", "os": "linux", "config": cfg,
                            "rootfs": {"type": "layers", "diff_ids": diff_ids}},
                           sort_keys=True, separators=(",", ":")).encode()
        cfg_digest = "sha256:" + hashlib.sha256(cfg_b).hexdigest()
        if reg.blob_size(cfg_digest) is None:
            fd, tmp = tempfile.mkstemp(prefix="push-", dir=store.tmp_dir)
            try:
                os.write(fd, cfg_b)
                os.close(fd)
                reg.upload(cfg_digest, tmp)
            finally:
                os.unlink(tmp)
        manifest = json.dumps({"schemaVersion": 2, "mediaType": registry.OCI_MANIFEST,
                               "config": {"mediaType": OCI_CONFIG, "digest": cfg_digest,
                                          "size": len(cfg_b)},
                               "layers": descs}, sort_keys=True,
                              separators=(",", ":")).encode()
        reg.put_manifest(tag, manifest, registry.OCI_MANIFEST)
    return {"reference": str(ref), "digest": "sha256:" + hashlib.sha256(manifest).hexdigest(),
            "layers": [d["digest"] for d in descs], "uploaded": uploaded, "bytes": sent}
