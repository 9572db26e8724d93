"""Apply one OCI layer (a tar stream, plain, gzip or zstd) to its own directory, in the form
overlayfs stacks as a lower layer: ``.wh.NAME`` becomes a whiteout (a 0/0 character device
named NAME), ``.wh..wh..opq`` the ``trusted.overlay.opaque`` xattr on its directory.

Nothing in the layer is trusted:
- names are relative, ``..`` and NUL refused; no member is written through a symlink or a
  non-directory (every parent is checked with lstat, symlinks are never followed);
- a hard link must name a regular file already unpacked from this same layer;
- device nodes are skipped (counted), FIFOs kept;
- setuid and setgid bits are cleared on files (setgid stays on directories, where it only
  picks the group of new files); ``security.capability`` and ``trusted.*`` xattrs are dropped
  (the first grants privileges like setuid does, the second would forge overlay metadata),
  ``user.*`` xattrs are kept;
- the bytes written and the members are bounded (a too_large error names the limit): a
  10 GB run of zeros or a million tiny files cannot fill the host's disk. A regular member's
  declared size must fit in what the image may still hold before a byte of it is written,
  and the disk must have room for it. Sparse members are refused (corral.daemon.safetar):
  their holes would be written as zeros that no compressed or tar byte accounts for;
- headers are read through corral.daemon.safetar.ImageTarInfo (bounded in size, parsed in
  linear time).
"""

from __future__ import annotations

import gzip
import hashlib
import math
import os
import re
import stat
import tarfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO

from corral.daemon import nofollow, removal, safetar
from corral.errors import InvalidImage, TooLarge

GZIP = ("application/vnd.oci.image.layer.v1.tar+gzip",
        "application/vnd.docker.image.rootfs.diff.tar.gzip")
ZSTD = ("application/vnd.oci.image.layer.v1.tar+zstd",)
PLAIN = ("application/vnd.oci.image.layer.v1.tar",)
LAYER_TYPES = GZIP + ZSTD + PLAIN
OPAQUE_XATTR = "trusted.overlay.opaque"
_WH = ".wh."
_OPQ = ".wh..wh..opq"
_PAX_XATTR = "SCHILY.xattr."
_DROPPED_XATTRS = ("trusted.", "security.capability")
_SUID = stat.S_ISUID | stat.S_ISGID
# An image's layers at most: each is a mount of the daemon's, kept while the daemon runs, and
# all of them are one overlay's lowerdir option, which the kernel takes up to a page.
MAX_IMAGE_LAYERS = 80
# The largest zstd window a layer may use: a frame's window is memory the decoder holds for
# the whole stream (a 4 KB blob may ask for 128 MiB). zstd picks at most 8 MiB up to level
# 19; only --long and --ultra go past it.
ZSTD_MAX_WINDOW = 32 << 20
MAX_DEPTH = 512  # directory levels of a member (the copy and mkfs walk trees this deep)


# How many decompressed bytes a pull unpacks between two checks of the state dir's disk.
DISK_CHECK_BYTES = 32 << 20


@dataclass
class Limits:
    max_bytes: int  # file bytes and decompressed stream bytes, across the whole image
    max_members: int
    used_bytes: int = 0
    used_members: int = 0
    # The state dir's disk (corral.daemon.diskguard.DiskGuard.check): called with what is
    # about to be written, before every DISK_CHECK_BYTES unpacked and before a layer's
    # conversion, so a pull stops (capacity_exceeded) before it cuts into the daemon's
    # reserve, not only at its start. None: not checked.
    disk_check: Callable[[str, int], None] | None = None
    checked_bytes: int = 0
    disk_what: str = "an image pull's layers"  # the work disk_check names when it refuses

    def check_member(self, stream_start: int, m: tarfile.TarInfo) -> None:
        """Before a regular member's bytes are written: the stream through its end (its
        stream begins at ``stream_start`` of used_bytes) must fit in max_bytes, and the disk
        must have room for it."""
        if stream_start + m.offset_data + m.size > self.max_bytes:
            raise _too_large(self)
        if self.disk_check is not None and m.size >= DISK_CHECK_BYTES:
            self.disk_check(self.disk_what, m.size)

    def check_disk(self) -> None:
        if self.disk_check is not None and \
                self.used_bytes - self.checked_bytes >= DISK_CHECK_BYTES:
            self.checked_bytes = self.used_bytes
            self.disk_check(self.disk_what, DISK_CHECK_BYTES)


@dataclass
class Result:
    diff_id: str = ""  # sha256 of the uncompressed tar
    size: int = 0  # bytes of regular files
    skipped: dict[str, int] = field(default_factory=dict)


class _Hashing:
    """Reads through, hashing and counting the uncompressed bytes (the diff_id and the cap
    on decompressed size, which stops a zip bomb however it is packed)."""

    def __init__(self, f: IO[bytes], limits: Limits) -> None:
        self.f, self.limits, self.h = f, limits, hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n if n is not None and n >= 0 else 1 << 20)
        self.h.update(data)
        self.limits.used_bytes += len(data)
        if self.limits.used_bytes > self.limits.max_bytes:
            raise _too_large(self.limits)
        self.limits.check_disk()
        return data


def _too_large(limits: Limits) -> TooLarge:
    return TooLarge(f"the image is too large once unpacked (at most {limits.max_bytes} bytes "
                    f"and {limits.max_members} files)",
                    details={"limit": "image_max_bytes", "max_bytes": limits.max_bytes,
                             "max_members": limits.max_members})


# The bytes of an image's lowerdir option (its layers' paths, a ':' each): what the kernel
# takes in a page less the overlay's skeleton, upper, work and snapshots stacked on it. 80
# mounted layers under /var/lib/corral take 3,120.
MAX_LOWERS_BYTES = 3200


def check_lowers(paths: list[str]) -> None:
    """An image whose layers' paths do not fit in one overlay option is refused before any
    of them is mounted (a layer stored as a directory has a longer path than a mounted one)."""
    n = sum(len(p) + 1 for p in paths)
    if n > MAX_LOWERS_BYTES:
        raise InvalidImage(f"the image's {len(paths)} layers take {n} bytes of overlay "
                           f"options; at most {MAX_LOWERS_BYTES} fit",
                           details={"limit": "image_layers", "layers": len(paths),
                                    "option_bytes": n, "max_option_bytes": MAX_LOWERS_BYTES})


def check_layer_count(n: int) -> None:
    """An image of more layers than MAX_IMAGE_LAYERS is refused before anything of it is
    fetched or mounted."""
    if n > MAX_IMAGE_LAYERS:
        raise InvalidImage(f"the image has {n} layers; at most {MAX_IMAGE_LAYERS} are taken",
                           details={"limit": "image_layers", "max": MAX_IMAGE_LAYERS,
                                    "layers": n})


def open_stream(path: str, media_type: str) -> IO[bytes]:
    if media_type in GZIP:
        return gzip.open(path, "rb")  # type: ignore[return-value]
    if media_type in ZSTD:
        import zstandard

        return zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW).stream_reader(
            open(path, "rb"), closefd=True)
    if media_type in PLAIN:
        return open(path, "rb")
    raise InvalidImage(f"unsupported layer media type {media_type!r}",
                       details={"media_type": media_type})


def _rel(name: str) -> list[str]:
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts) or "\0" in name:
        raise InvalidImage(f"layer member {name!r} escapes the layer ('..' or NUL)",
                           details={"member": name})
    if len(parts) > MAX_DEPTH or any(len(p.encode("utf-8", "surrogateescape")) > 255
                                     for p in parts):
        raise InvalidImage(f"layer member {name[:200]!r}... is more than {MAX_DEPTH} "
                           "directories deep or has a name over 255 bytes",
                           details={"max_depth": MAX_DEPTH})
    return parts


MTIME_NS = "CORRAL.mtime_ns"  # PAX: a file's mtime to the nanosecond (exact form)
# Exact form only (a snapshot's layer, which holds whatever the sandbox made): PAX ``LITERAL``
# marks a member whose name starts with ``.wh.`` as that name, not a whiteout or opaque marker;
# ``SOCKET`` a FIFO member that is a UNIX socket file, ``WHITEOUT`` a ``.wh.`` member as a
# whiteout even where it reads ``.wh..wh..opq`` (the whiteout of a file named ``.wh..opq``).
# POSIX ACLs travel as xattrs.
# ``SPARSE`` ("<size>;<offset>:<length>,..."): a regular member whose content is only its
# data segments, holes left out, at most SPARSE_MAX of them.
LITERAL = "CORRAL.literal"
SPARSE = "CORRAL.sparse"
SPARSE_MAX = 4096
WHITEOUT = "CORRAL.whiteout"
SOCKET = "CORRAL.socket"
# ``XATTR_HEX`` + the name's bytes in hex: an xattr whose name is not UTF-8 (a PAX keyword
# must be), its value as ``SCHILY.xattr.`` values are.
XATTR_HEX = "CORRAL.xattr."
_MTIME_NS_RE = re.compile(r"-?[0-9]{1,24}")
EXACT_XATTRS = ("system.posix_acl_access", "system.posix_acl_default")


class _Layer:
    """``exact`` (a snapshot's layer from another node, corral.daemon.snapxfer): a file's
    mtime is taken to the nanosecond and a whiteout's or FIFO's mode and owner as given, so
    the layer's digest comes out as on the node that made it. The protections are the same."""

    def __init__(self, root: str, limits: Limits, result: Result,
                 exact: bool = False) -> None:
        self.root, self.limits, self.result, self.exact = root, limits, result, exact
        self.dirs: list[tuple[str, tarfile.TarInfo]] = []

    def parent(self, parts: list[str], name: str) -> str:
        """The host path of the member's parent: every component a real directory of this
        layer (made, 0755, if the layer does not list it), never a symlink."""
        d = self.root
        for p in parts[:-1]:
            d = os.path.join(d, p)
            try:
                st = os.lstat(d)
            except FileNotFoundError:
                os.mkdir(d, 0o755)
                continue
            if not stat.S_ISDIR(st.st_mode):
                kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "a non-directory"
                raise InvalidImage(f"layer member {name!r} goes through {kind} ({p!r}); "
                                   "nothing is written through links", details={"member": name})
        return d

    def clear(self, path: str, keep_dir: bool) -> None:
        """A later member replaces an earlier one (tar semantics); a symlink is unlinked,
        never followed."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            if not keep_dir:
                removal.remove_tree(path)
        else:
            os.unlink(path)

    def skip(self, what: str) -> None:
        self.result.skipped[what] = self.result.skipped.get(what, 0) + 1

    def apply(self, tf: tarfile.TarFile, m: tarfile.TarInfo) -> None:
        lim = self.limits
        lim.used_members += 1
        if lim.used_members > lim.max_members:
            raise _too_large(lim)
        parts = _rel(m.name)
        if not parts:  # the layer's root itself
            if m.isdir():
                self.dirs.append((self.root, m))
            return
        base = parts[-1]
        parent = self.parent(parts, m.name)
        pax = (m.pax_headers or {}) if self.exact else {}
        literal, whiteout = pax.get(LITERAL) == "1", pax.get(WHITEOUT) == "1"
        if base == _OPQ and not (literal or whiteout):
            os.setxattr(parent, OPAQUE_XATTR, b"y", follow_symlinks=False)
            return
        if base.startswith(_WH) and not literal:
            real = base[len(_WH):]
            if not real or real in (".", ".."):
                raise InvalidImage(f"bad whiteout {m.name!r}", details={"member": m.name})
            target = os.path.join(parent, real)
            self.clear(target, keep_dir=False)
            os.mknod(target, stat.S_IFCHR | 0o600, os.makedev(0, 0))
            if self.exact:
                os.chmod(target, m.mode & 0o777)
                os.lchown(target, m.uid, m.gid)
            return
        target = os.path.join(parent, base)
        self.clear(target, keep_dir=m.isdir())
        if m.isdir():
            if not os.path.lexists(target):
                os.mkdir(target, 0o700)
            self.dirs.append((target, m))
            return
        if m.isreg():
            if m.size < 0:
                raise InvalidImage(f"layer member {m.name!r} has a negative size")
            sparse = _sparse(m, self.limits) if self.exact and SPARSE in m.pax_headers \
                else None
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as out:
                src = tf.extractfile(m)
                if sparse is not None and src is not None:
                    size, segs = sparse
                    for off, n in segs:  # each segment's data at its offset, holes left
                        out.seek(off)
                        while n > 0 and (chunk := src.read(min(n, 1 << 20))):
                            out.write(chunk)
                            n -= len(chunk)
                    out.truncate(size)
                elif src is not None:
                    while chunk := src.read(1 << 20):
                        out.write(chunk)
            self.result.size += m.size
            os.chmod(target, m.mode & 0o7777 & ~_SUID)
        elif m.issym():
            if "\0" in m.linkname or not m.linkname:
                raise InvalidImage(f"layer member {m.name!r}: bad symlink target")
            os.symlink(m.linkname, target)  # kept verbatim: resolved inside the sandbox
        elif m.islnk():
            lparts = _rel(m.linkname)
            if not lparts:
                raise InvalidImage(f"layer member {m.name!r}: bad hard link")
            src_path = os.path.join(self.parent(lparts, m.name), lparts[-1])
            try:
                sst = os.lstat(src_path)
            except FileNotFoundError:
                raise InvalidImage(f"layer member {m.name!r}: hard link to {m.linkname!r}, "
                                   "which this layer does not have",
                                   details={"member": m.name}) from None
            if not stat.S_ISREG(sst.st_mode):
                raise InvalidImage(f"layer member {m.name!r}: hard link to a non-file",
                                   details={"member": m.name})
            os.link(src_path, target, follow_symlinks=False)
            return  # the inode's owner, mode and xattrs are the first name's
        elif m.isfifo():
            if self.exact and (m.pax_headers or {}).get(SOCKET) == "1":
                os.mknod(target, stat.S_IFSOCK | (m.mode & 0o777))
            else:
                os.mkfifo(target, m.mode & 0o777)
            if self.exact:  # not narrowed by the daemon's umask; a sticky bit kept
                os.chmod(target, m.mode & 0o7777 & ~_SUID)
        elif m.ischr() or m.isblk():
            self.skip("devices")
            return
        else:
            self.skip("other")
            return
        self.finish(target, m)

    def finish(self, target: str | int, m: tarfile.TarInfo) -> None:
        """A member's owner, xattrs and times, on its path (its last component not followed:
        its parents were checked as it was applied) or on an fd of it."""
        is_fd = isinstance(target, int)  # an fd: nothing to follow (and no such argument)
        nofollow: dict[str, bool] = {} if is_fd else {"follow_symlinks": False}
        os.chown(target, m.uid, m.gid, **nofollow)
        for k, v in (m.pax_headers or {}).items():
            if k.startswith(_PAX_XATTR):
                name: str | bytes = k[len(_PAX_XATTR):]
            elif self.exact and k.startswith(XATTR_HEX):
                try:
                    name = bytes.fromhex(k[len(XATTR_HEX):])
                except ValueError:
                    raise InvalidImage(f"layer member {m.name!r}: bad {XATTR_HEX}") from None
            else:
                continue
            text = os.fsdecode(name)
            if "\0" in text or text.startswith(_DROPPED_XATTRS) or not (
                    text.startswith("user.") or (self.exact and text in EXACT_XATTRS)):
                self.skip("xattrs")
                continue
            try:
                os.setxattr(target, name, v.encode("utf-8", "surrogateescape"), **nofollow)
            except OSError:
                self.skip("xattrs")
        if not m.issym():
            if not math.isfinite(m.mtime):
                raise InvalidImage(f"layer member {m.name!r}: bad mtime {m.mtime!r}",
                                   details={"member": m.name})
            ns = (m.pax_headers or {}).get(MTIME_NS, "") if self.exact else ""
            times = (int(ns), int(ns)) if _MTIME_NS_RE.fullmatch(ns) else None
            # before 1970 too: the copy's digest needs it
            if times is not None and is_fd:
                os.utime(target, ns=times)
            elif times is not None:
                os.utime(target, ns=times, follow_symlinks=False)
            elif is_fd:
                os.utime(target, (m.mtime, m.mtime))
            else:
                os.utime(target, (m.mtime, m.mtime), follow_symlinks=False)

    def _open_dir(self, target: str) -> int | None:
        """An fd of the directory at ``target`` in the layer, opened one component at a time
        from the layer's root without following a symlink: None if it is no longer there as
        a directory. A later member may have made one of its parents a symlink (``a/dir``,
        then ``a`` -> /etc): its path would then name the host's directory."""
        try:
            return nofollow.open_dir(self.root, os.path.relpath(target, self.root))
        except OSError as e:
            if e.errno in nofollow.GONE:
                return None  # replaced by a later member
            raise

    def close(self) -> None:
        """The directories' metadata, last (their children's creation would change their
        times), each through an fd reached from the layer's root, never through a path."""
        for target, m in reversed(self.dirs):
            fd = self._open_dir(target)
            if fd is None:
                continue
            try:
                # setuid on a directory means nothing to Linux; the exact form keeps it
                mode = m.mode & 0o7777 & (~0 if self.exact else ~stat.S_ISUID)
                self.finish(fd, m)
                os.chmod(fd, mode)
            finally:
                os.close(fd)


def _sparse(m: tarfile.TarInfo, limits: Limits) -> tuple[int, list[tuple[int, int]]]:
    """A SPARSE member's (size, segments), checked: ascending, apart, within its size (at
    most the bytes a layer may hold), their lengths adding up to the member's."""
    try:
        head, _, body = m.pax_headers[SPARSE].partition(";")
        size = int(head)
        segs = [(int(o), int(n)) for o, n in (x.split(":") for x in body.split(",") if x)]
    except ValueError:
        raise InvalidImage(f"layer member {m.name!r}: bad {SPARSE}") from None
    end = 0
    for off, n in segs:
        if off < end or n <= 0:
            raise InvalidImage(f"layer member {m.name!r}: bad {SPARSE}")
        end = off + n
    if len(segs) > SPARSE_MAX or not 0 <= end <= size or \
            sum(n for _, n in segs) != m.size:
        raise InvalidImage(f"layer member {m.name!r}: bad {SPARSE}")
    if size > limits.max_bytes:
        raise _too_large(limits)
    return size, segs


def unpack(blob: str, media_type: str, root: str, limits: Limits) -> Result:
    """Unpack the layer blob at ``blob`` into the existing empty directory ``root``. Raises
    InvalidImage / TooLarge; the caller removes ``root`` on failure."""
    result = Result()
    layer = _Layer(root, limits, result)
    stream = open_stream(blob, media_type)
    start = limits.used_bytes  # the image's bytes before this layer's stream
    try:
        hashed = _Hashing(stream, limits)
        try:
            with tarfile.open(fileobj=hashed, mode="r|",  # type: ignore[call-overload]
                              tarinfo=safetar.ImageTarInfo) as tf:
                while (m := tf.next()) is not None:
                    # tarfile keeps every member it has read (~500 bytes each), also from a
                    # stream, which never looks back at one: cleared as it goes, a layer of
                    # a million members costs its one member, not ~0.5 GB a pull
                    tf.members.clear()
                    if m.isreg():
                        limits.check_member(start, m)
                    layer.apply(tf, m)
            while hashed.read(1 << 20):  # the end-of-archive padding counts in the diff_id
                pass
            layer.close()  # the directories' owners and times: out of range is the layer's
        except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as e:
            raise InvalidImage(f"corrupt layer: {e}", details={"error": str(e)}) from e
        except OverflowError as e:  # an owner (PAX uid) or time no syscall takes
            raise InvalidImage(f"layer member out of range: {e}",
                               details={"error": str(e)}) from e
        except Exception as e:
            if type(e).__name__ == "ZstdError":
                raise InvalidImage(f"corrupt zstd layer: {e}", details={"error": str(e)}) from e
            raise
    finally:
        stream.close()
    result.diff_id = "sha256:" + hashed.h.hexdigest()
    return result
