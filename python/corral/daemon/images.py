"""Image registry: the builtin ``host`` image, imported rootfs directories / tarballs and OCI
images (pulled from a registry or imported from an OCI layout / ``docker save`` archive), whose
layers live in the shared layer store (corral.daemon.oci.layers).

An image is a list of overlays ``(target inside the sandbox, lower dirs top-first)``, target "/"
first; the substrate mounts each with a private upper dir. Layout on disk:
``<state_dir>/images/<name>/{rootfs/, image.json}``. ``images/`` is 0700 because imported trees
may hold files that must not be reachable by unprivileged host users.

An OCI image is ``images/@<hash of its name>/image.json`` (its name is its reference, e.g.
``127.0.0.1:5000/team/task:v3``); its overlay is the store's layer mounts, top-first, over a
skeleton of mountpoints.

The ``host`` image shows the host's OS read-only and nothing else. overlayfs refuses a lower layer
that contains the upper dir, so host "/" cannot be a lower layer; instead ``host/rootfs`` is a
skeleton (bin/lib symlinks, empty mountpoints, a sanitized copy of /etc) and the host's /usr (and
/bin, /lib... on hosts without merged /usr) are stacked on top as their own overlays.
"""

from __future__ import annotations

import asyncio
import builtins
import dataclasses
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from corral.daemon import nofollow, removal, safetar
from corral.daemon.oci import ref as oci_ref
from corral.daemon.oci import unpack as oci_unpack
from corral.daemon.oci.layers import LayerStore
from corral.errors import (
    Conflict,
    Forbidden,
    ImageNotFound,
    InvalidRequest,
    QuotaExceeded,
    Unsupported,
)
from corral.models import MAX_TIMEOUT_S, ImageInfo

log = logging.getLogger("corral.images")

HOST = "host"
PULL_WORKERS = 8  # pulls at once on a node (each a thread; more wait their turn)
# Pulls one tenant may have started and not finished (running or waiting for a thread): a
# registry decides how long a pull takes, so without a bound one tenant's slow pulls (from a
# registry it controls) held all PULL_WORKERS threads and no other tenant could pull.
PULLS_PER_TENANT = PULL_WORKERS // 2
# Bump when the host skeleton's recipe changes: every daemon then rebuilds it once.
HOST_IMAGE_VERSION = 1
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.\-]{0,62}$")
RESERVED = ("pull", "prune", "tag", "push")  # routes under /v1/images/, not image names
_TOP_LEVEL_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
# Empty mountpoints / private dirs of the skeleton, with their modes.
_SKELETON_DIRS = {
    "usr": 0o755, "proc": 0o555, "dev": 0o755, "sys": 0o555, "tmp": 0o1777, "run": 0o755,
    "var": 0o755, "var/tmp": 0o1777, "root": 0o700, "home": 0o755, "mnt": 0o755,
    "opt": 0o755, "srv": 0o755,
}
_SUID_BITS = stat.S_ISUID | stat.S_ISGID
# Directory levels an imported tree may have (the copy is a loop with a stack this deep).
_MAX_DEPTH = 512
# Kernel and virtual filesystems: their files are views of the host's live state (a process's
# memory, kernel tunables, devices), not a rootfs; an import never copies from them.
PSEUDO_FS = frozenset({
    "proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs",
    "securityfs", "configfs", "bpf", "pstore", "efivarfs", "fusectl", "mqueue", "hugetlbfs",
    "binfmt_misc", "autofs", "rpc_pipefs", "nsfs", "selinuxfs", "fuse.gvfsd-fuse",
})


@dataclass
class Image:
    name: str
    kind: str  # "builtin" | "rootfs" | "oci"
    created_at: float
    overlays: list[tuple[str, list[str]]]
    size_bytes: int | None = None
    path: str = ""  # images/<name>
    meta: dict = field(default_factory=dict)

    def info(self) -> ImageInfo:
        m = self.meta
        return ImageInfo(name=self.name, kind=self.kind, created_at=self.created_at,
                         size_bytes=self.size_bytes, digest=m.get("digest"),
                         layers=["sha256:" + h for h in m["oci_layers"]]
                         if self.kind == "oci" else None,
                         config=m.get("config") if self.kind == "oci" else None,
                         source=m.get("source"))

    @property
    def config(self) -> dict[str, Any]:
        """The OCI image config's runtime part (Env, WorkingDir, User, Entrypoint, Cmd...)."""
        return dict(self.meta.get("config") or {})


# ---- host layout ---------------------------------------------------------------------------
def _host_layout() -> dict[str, str | None]:
    """For each of bin/sbin/lib*: its symlink target on the host, None if it is a real
    directory; absent if it does not exist."""
    out: dict[str, str | None] = {}
    for n in _TOP_LEVEL_LINKS:
        p = "/" + n
        if os.path.islink(p):
            out[n] = os.readlink(p)
        elif os.path.isdir(p):
            out[n] = None
    return out


def _etc_fingerprint() -> str:
    """Changes when /etc gains, loses or changes a file (a package install adds
    /etc/alternatives links the sandbox needs), so the skeleton follows the host."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk("/etc"):
        dirnames.sort()
        for n in sorted(filenames) + dirnames:
            p = os.path.join(dirpath, n)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            h.update(f"{p}\0{st.st_mode}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_uid}\n".encode())
    return h.hexdigest()


def _host_marker() -> str:
    layout = json.dumps(_host_layout(), sort_keys=True)
    return f"v{HOST_IMAGE_VERSION}:{hashlib.sha256(layout.encode()).hexdigest()[:16]}:" \
           f"{_etc_fingerprint()[:32]}"


def _host_overlays(rootfs: str) -> list[tuple[str, list[str]]]:
    ov: list[tuple[str, list[str]]] = [("/", [rootfs]), ("/usr", ["/usr"])]
    for n, target in _host_layout().items():
        if target is None:
            ov.append(("/" + n, ["/" + n]))
    return ov


# ---- sources -------------------------------------------------------------------------------
def pseudo_devices() -> frozenset[int]:
    """The st_dev of every mounted kernel/virtual filesystem (PSEUDO_FS)."""
    devs = set()
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields = left.split()
                if len(fields) > 2 and right.split()[:1] and right.split()[0] in PSEUDO_FS:
                    major, _, minor = fields[2].partition(":")
                    devs.add(os.makedev(int(major), int(minor)))
    except (OSError, ValueError):
        pass
    return frozenset(devs)


def resolve_source(source: str, *, admin: bool, import_dir: str = "") -> str:
    """The host path an import may read, or why not. A source that is not an absolute path is
    a registry reference (pulled by POST /v1/images/pull, not imported). Host paths are for
    the admin (the local unix socket, root-equivalent) or, for any client, inside the
    configured import directory (checked after resolving symlinks)."""
    if "\0" in source:
        raise InvalidRequest("source must not contain NUL bytes")
    if not source.startswith("/"):
        raise Unsupported("an import names a host path or uploads a tarball (PUT "
                          "/v1/images/{name}); pull a registry reference with POST "
                          "/v1/images/pull", details={"source": source})
    real = os.path.realpath(source)
    if import_dir:
        base = os.path.realpath(import_dir)
        if real == base or real.startswith(base.rstrip("/") + "/"):
            return real
    if admin:
        return real
    raise Forbidden("a TCP token cannot import from host paths: upload a rootfs tarball "
                    "(PUT /v1/images/{name})" + (f", or name a path under {import_dir}"
                                                  if import_dir else ""),
                    details={"source": source})


# ---- copying -------------------------------------------------------------------------------
def _world_readable(st: os.stat_result) -> bool:
    if stat.S_ISDIR(st.st_mode):
        return st.st_mode & 0o005 == 0o005
    return bool(st.st_mode & 0o004)


def _copy_tree(src: str, dst: str, sanitize: bool) -> int:
    """Copy ``src`` into the existing dir ``dst`` with ``cp -a`` semantics: symlinks kept as
    symlinks, owners, modes and times preserved, hard links kept. Devices and sockets are
    skipped (a device node in a lower layer would be a door to host hardware) and setuid/setgid
    bits stripped. With ``sanitize`` anything not world-readable is skipped too (secrets).
    Returns the bytes of regular files copied.

    The tree is walked by fds, each entry opened from its parent's without following a
    symlink, and what is copied is what the opened fd is (fstat): a directory swapped for a
    symlink between a look and the copy (by whoever may write in the source) would otherwise
    copy the host directory it names."""
    total = 0
    links: dict[tuple[int, int], str] = {}
    dirs: list[tuple[str, os.stat_result]] = []
    pseudo = pseudo_devices()

    def listing(fd: int, d: str) -> list[tuple[str, str]]:
        with os.scandir(fd) as it:  # reversed: popped from the end, smallest name first
            return [(e.name, os.path.join(d, e.name))
                    for e in sorted(it, key=lambda e: e.name, reverse=True)]

    top = open_dir_nofollow(src)
    # a loop, not a recursion: a tree may be deep
    stack: list[tuple[int, list[tuple[str, str]]]] = []
    try:
        stack.append((top, listing(top, dst)))
    except BaseException:
        os.close(top)
        raise
    try:
        while stack:
            fd, todo = stack[-1]
            if not todo:
                os.close(fd)
                stack.pop()
                continue
            name, dp = todo.pop()
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError:
                continue
            if st.st_dev in pseudo:
                continue  # /proc, /sys ... mounted inside the tree: not files of a rootfs
            if stat.S_ISLNK(st.st_mode):
                try:
                    os.symlink(os.readlink(name, dir_fd=fd), dp)
                except OSError:
                    continue  # gone meanwhile
            elif sanitize and not _world_readable(st):
                continue
            elif stat.S_ISDIR(st.st_mode):
                if len(stack) >= _MAX_DEPTH:
                    raise InvalidRequest(f"{src} is more than {_MAX_DEPTH} directories deep")
                sub = _open_entry(fd, name, os.O_DIRECTORY)
                if sub is None:
                    continue
                sst = os.fstat(sub)
                if sst.st_dev in pseudo or (sanitize and not _world_readable(sst)):
                    os.close(sub)
                    continue
                try:
                    os.mkdir(dp, 0o700)
                    stack.append((sub, listing(sub, dp)))
                except BaseException:
                    os.close(sub)
                    raise
                dirs.append((dp, sst))
                continue  # owner, mode and times are set after its contents
            elif stat.S_ISREG(st.st_mode):
                key = (st.st_dev, st.st_ino)
                if st.st_nlink > 1 and key in links:
                    os.link(links[key], dp)
                    continue
                fin = _open_entry(fd, name, 0)
                if fin is None:
                    continue
                try:
                    st = os.fstat(fin)
                    if not stat.S_ISREG(st.st_mode) or (sanitize and not _world_readable(st)):
                        continue  # swapped for something else meanwhile
                    fout = os.open(dp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                                   0o600)
                    try:
                        while os.sendfile(fout, fin, None, 1 << 30):
                            pass
                        os.fchmod(fout, stat.S_IMODE(st.st_mode) & ~_SUID_BITS)
                    finally:
                        os.close(fout)
                finally:
                    os.close(fin)
                total += st.st_size
                if st.st_nlink > 1:
                    links[(st.st_dev, st.st_ino)] = dp
            elif stat.S_ISFIFO(st.st_mode):
                os.mkfifo(dp, stat.S_IMODE(st.st_mode) & 0o777)
            else:
                continue  # sockets, char and block devices
            os.lchown(dp, st.st_uid, st.st_gid)
            os.utime(dp, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)
    finally:
        for fd, _ in stack:
            os.close(fd)

    for dp, st in reversed(dirs):
        os.lchown(dp, st.st_uid, st.st_gid)
        os.chmod(dp, stat.S_IMODE(st.st_mode))
        os.utime(dp, ns=(st.st_atime_ns, st.st_mtime_ns))
    return total


def open_dir_nofollow(path: str) -> int:
    """An fd of the directory ``path`` (absolute, resolved: the path its caller checked),
    opened one component at a time from ``/`` without following a symlink: a component
    swapped for a symlink since the check (a source dir, or a parent of it, made a link to
    /root) is refused (``InvalidRequest``), never followed."""
    try:
        return nofollow.open_dir("/", path)
    except OSError as e:
        if e.errno in nofollow.GONE:
            raise InvalidRequest(f"{path} is no longer the directory it was (a symlink or "
                                 "something else now stands on its path)",
                                 details={"source": path}) from None
        raise


def _open_entry(dir_fd: int, name: str, flags: int) -> int | None:
    """An fd of ``name`` in the directory ``dir_fd``, not following a symlink and never
    blocking on a FIFO swapped in; None if it is no longer there as it was."""
    try:
        return os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
                       | flags, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR, errno.ENXIO):
            return None
        raise


def _safe_rel(name: str) -> str | None:
    """A tar member name as a path relative to the rootfs: leading "/" and "./" dropped like
    GNU tar does; ``..`` refused. None for the archive's root entry."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise InvalidRequest(f"tar member {name!r} escapes the image root ('..')")
    if any("\0" in p for p in parts):
        raise InvalidRequest(f"tar member {name!r} has a NUL byte")
    return "/".join(parts) or None


def _real_parent(root: str, rel: str) -> str:
    """The host path of ``rel``'s parent, made if missing; refuses a parent that is (or goes
    through) a symlink, so no member is ever written through a link to outside the root."""
    d = root
    for part in rel.split("/")[:-1]:
        d = os.path.join(d, part)
        try:
            st = os.lstat(d)
        except FileNotFoundError:
            os.mkdir(d, 0o755)
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise InvalidRequest(f"tar member {rel!r} goes through a non-directory {part!r}")
    return d


# Bounds of one imported tarball once extracted: a small compressed upload must not fill the
# state directory's disk (a gzip of zeros expands a thousandfold).
MAX_IMAGE_BYTES = 16 << 30
MAX_IMAGE_MEMBERS = 1_000_000


def _extract_tar(source: str, dst: str, max_bytes: int = MAX_IMAGE_BYTES,
                 max_members: int = MAX_IMAGE_MEMBERS) -> int:
    """Extract a (compressed) tarball into ``dst`` without trusting it: every path is made
    relative and checked component by component, nothing is written through a symlink, hard
    links must point at a file already extracted, devices are skipped, setuid bits stripped.
    Member symlinks are kept verbatim: the sandbox resolves them inside its own root."""
    total = 0
    dirs: list[tuple[str, tarfile.TarInfo]] = []
    try:
        tf = tarfile.open(source, "r:*", tarinfo=safetar.SafeTarInfo)
    except (tarfile.TarError, OSError) as e:
        raise InvalidRequest(f"cannot read tarball {source}: {e}") from e
    with tf:
        try:
            members = iter(tf)
            for count, m in enumerate(members):
                if count >= max_members or total + max(m.size, 0) > max_bytes:
                    raise InvalidRequest(f"tarball {os.path.basename(source)} is too big once "
                                         f"extracted (at most {max_bytes} bytes and "
                                         f"{max_members} members)",
                                         details={"max_bytes": max_bytes,
                                                  "max_members": max_members})
                rel = _safe_rel(m.name)
                if rel is None:
                    continue
                parent = _real_parent(dst, rel)
                target = os.path.join(parent, os.path.basename(rel))
                try:
                    st = os.lstat(target)
                    if not (m.isdir() and stat.S_ISDIR(st.st_mode)):
                        # A later member replaces an earlier one (tar semantics).
                        if stat.S_ISDIR(st.st_mode):
                            removal.remove_tree(target)
                        else:
                            os.unlink(target)
                except FileNotFoundError:
                    pass
                if m.isdir():
                    if not os.path.isdir(target):
                        os.mkdir(target, 0o700)
                    dirs.append((target, m))
                    continue
                if m.isreg():
                    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                                 | os.O_CLOEXEC, 0o600)
                    with os.fdopen(fd, "wb") as out:
                        f = tf.extractfile(m)
                        if f is not None:
                            shutil.copyfileobj(f, out, 1 << 20)
                    os.chmod(target, m.mode & 0o7777 & ~_SUID_BITS)
                    total += m.size
                elif m.issym():
                    if "\0" in m.linkname:
                        raise InvalidRequest(f"tar member {m.name!r}: bad link target")
                    os.symlink(m.linkname, target)
                elif m.islnk():
                    lrel = _safe_rel(m.linkname)
                    if lrel is None:
                        raise InvalidRequest(f"tar member {m.name!r}: bad hard link")
                    src = os.path.join(_real_parent(dst, lrel), os.path.basename(lrel))
                    try:
                        sst = os.lstat(src)
                    except FileNotFoundError:
                        raise InvalidRequest(
                            f"tar member {m.name!r}: hard link to missing {m.linkname!r}"
                        ) from None
                    if not stat.S_ISREG(sst.st_mode):
                        raise InvalidRequest(f"tar member {m.name!r}: hard link to non-file")
                    os.link(src, target, follow_symlinks=False)
                    continue
                elif m.isfifo():
                    os.mkfifo(target, m.mode & 0o777)
                else:
                    continue  # devices and unknown types
                os.lchown(target, m.uid, m.gid)
                if not m.issym():
                    os.utime(target, (m.mtime, m.mtime))
        except tarfile.TarError as e:
            raise InvalidRequest(f"corrupt tarball {source}: {e}") from e
    for target, m in reversed(dirs):
        if not stat.S_ISDIR(os.lstat(target).st_mode):
            continue  # replaced by a later member
        os.lchown(target, m.uid, m.gid)
        os.chmod(target, m.mode & 0o7777)
        os.utime(target, (m.mtime, m.mtime))
    return total


# ---- the store -----------------------------------------------------------------------------
class ImageStore:
    def __init__(self, state_dir: str, max_bytes: int = MAX_IMAGE_BYTES,
                 max_files: int = MAX_IMAGE_MEMBERS,
                 insecure_registries: frozenset[str] = frozenset(),
                 allowed_registries: frozenset[str] = frozenset(), erofs: bool = True) -> None:
        self.dir = os.path.join(state_dir, "images")
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        os.chmod(self.dir, 0o700)
        self._lock = threading.Lock()
        self._images: dict[str, Image] = {}
        self.max_bytes, self.max_files = max_bytes, max_files
        self.insecure = insecure_registries
        self.allowed = allowed_registries  # empty: any
        # Where pulls and pushes may connect (oci.egress): the registries named here may be
        # on internal addresses; the engine gives it the blocked addresses.
        from corral.daemon.oci import egress

        self.egress = egress.Egress(allowed_registries, insecure_registries)
        self.layers = LayerStore(state_dir, erofs)
        self._flights: dict[str, Any] = {}  # reference -> the pull under way (oci.flight)
        # Pulls run in threads of their own: a registry decides how long a pull takes (it
        # may trickle bytes forever), so pulls must never hold the daemon's worker threads
        # (creates, files, snapshots); past PULL_WORKERS at once, pulls wait their turn.
        self._pull_pool = ThreadPoolExecutor(PULL_WORKERS, thread_name_prefix="corral-pull")
        self._tenant_pulls: dict[str, int] = {}  # tenant -> pulls it started, not ended
        # The state dir's disk (diskguard.DiskGuard.check), set by the daemon: pulls and
        # imports check it as they unpack (oci.unpack.Limits). None: not checked.
        self.disk_check: Callable[[str, int], None] | None = None
        self._gc_temp()
        for n in sorted(os.listdir(self.dir)):
            if NAME_RE.match(n) or n.startswith("@"):
                img = self._load(n)
                if img is not None:
                    self._images[img.name] = img

    # ---- loading ---------------------------------------------------------------------------
    def _load(self, name: str) -> Image | None:
        path = os.path.join(self.dir, name)
        try:
            with open(os.path.join(path, "image.json")) as f:
                meta = json.load(f)
        except (OSError, ValueError):
            return None
        rootfs = os.path.join(path, "rootfs")
        kind = meta.get("kind", "rootfs")
        if kind == "oci":
            name = str(meta.get("name", ""))
            if not name or _oci_dir(name) != os.path.basename(path):
                return None
            overlays = []  # made (layers mounted) at first use: get()
        else:
            overlays = _host_overlays(rootfs) if kind == "builtin" else [("/", [rootfs])]
        return Image(name=name, kind=kind, created_at=float(meta.get("created_at", 0.0)),
                     overlays=overlays, size_bytes=meta.get("size_bytes"), path=path, meta=meta)

    def _gc_temp(self) -> None:
        """Remove half-built images left by a crash, and old host skeletons that no live
        sandbox can still use (older than the longest sandbox TTL)."""
        now = time.time()
        for n in os.listdir(self.dir):
            p = os.path.join(self.dir, n)
            if n.startswith(".tmp-"):
                shutil.rmtree(p, ignore_errors=True)
            elif n.startswith(".old-"):
                try:
                    if now - os.lstat(p).st_mtime > MAX_TIMEOUT_S:
                        shutil.rmtree(p, ignore_errors=True)
                except OSError:
                    pass

    def _tmpdir(self, name: str) -> str:
        return tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=self.dir)

    @staticmethod
    def _write_meta(path: str, meta: dict) -> None:
        with open(os.path.join(path, "image.json"), "w") as f:
            json.dump(meta, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())

    # ---- host ------------------------------------------------------------------------------
    def ensure_host(self) -> Image:
        """Build the ``host`` skeleton if missing or stale; cheap (~ms) when up to date."""
        marker = _host_marker()
        with self._lock:
            cur = self._images.get(HOST)
            if cur is not None and cur.meta.get("marker") == marker \
                    and os.path.isdir(os.path.join(cur.path, "rootfs")):
                return cur
            tmp = self._tmpdir(HOST)
            try:
                os.chmod(tmp, 0o755)
                size = self._build_host(os.path.join(tmp, "rootfs"))
                meta = {"name": HOST, "kind": "builtin", "created_at": time.time(),
                        "marker": marker, "size_bytes": size}
                self._write_meta(tmp, meta)
                final = os.path.join(self.dir, HOST)
                if os.path.lexists(final):
                    # Live sandboxes may still have the old skeleton as a lower layer: set it
                    # aside (deleted after the longest TTL) instead of deleting it under them.
                    old = os.path.join(self.dir, f".old-{HOST}-{time.time_ns()}")
                    os.rename(final, old)
                    os.utime(old)
                os.rename(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            img = self._load(HOST)
            assert img is not None
            self._images[HOST] = img
            return img

    @staticmethod
    def _build_host(rootfs: str) -> int:
        os.mkdir(rootfs, 0o755)
        layout = _host_layout()
        for n, target in layout.items():
            if target is not None:
                os.symlink(target, os.path.join(rootfs, n))
            else:
                os.mkdir(os.path.join(rootfs, n), 0o755)  # mountpoint for the host's dir
        for d, mode in _SKELETON_DIRS.items():
            p = os.path.join(rootfs, d)
            os.mkdir(p)
            os.chmod(p, mode)  # chmod, not mkdir's mode: the umask must not eat 1777
        etc = os.path.join(rootfs, "etc")
        os.mkdir(etc)
        size = _copy_tree("/etc", etc, sanitize=True)
        st = os.stat("/etc")
        os.chmod(etc, stat.S_IMODE(st.st_mode))
        return size

    # ---- queries ---------------------------------------------------------------------------
    def canonical(self, name: str) -> str:
        """The store's key for ``name``: itself for a local name (no ``/``, ``:`` or ``@``:
        never looked up in a registry), the full reference for a registry reference
        (``team/x`` is ``docker.io/team/x:latest``)."""
        if name == HOST or name in self._images or not oci_ref.looks_like_ref(name):
            return name
        return str(oci_ref.parse(name))

    def has(self, name: str) -> bool:
        try:
            return self.canonical(name) in self._images or name == HOST
        except InvalidRequest:
            return False

    def get(self, name: str) -> Image:
        with self._lock:
            img = self._images.get(name)
        if img is None and name != HOST:
            try:
                key = self.canonical(name)
            except InvalidRequest:
                key = name
            with self._lock:
                img = self._images.get(key)
        if img is not None and img.kind == "oci":
            return self._composed(img)
        if img is None and name == HOST:
            return self.ensure_host()
        if img is None:
            avail = ", ".join(sorted(set(self._images) | {HOST}))
            hint = "" if oci_ref.looks_like_ref(name) else (
                " (a name without '/', ':' or '@' is a local image; a registry image is named "
                "by its reference, e.g. docker.io/library/NAME:TAG)")
            raise ImageNotFound(f"no image named {name!r}{hint}; available: {avail}",
                                details={"image": name, "available": sorted(
                                    set(self._images) | {HOST})})
        return img

    def list(self) -> list[ImageInfo]:
        if HOST not in self._images:
            self.ensure_host()
        with self._lock:
            return [self._images[n].info() for n in sorted(self._images)]

    # ---- OCI images ------------------------------------------------------------------------
    def _composed(self, img: Image) -> Image:
        """The image with its overlay: the layers' mounts top-first over the skeleton. A layer
        listed twice is stacked once, at its top place (overlay refuses a lower twice; what
        the lower copy holds the upper one holds too, so the files are the same)."""
        top_first: builtins.list[str] = []
        for h in reversed(img.meta["oci_layers"]):
            if h not in top_first:
                top_first.append(h)
        oci_unpack.check_layer_count(len(top_first))  # before any is mounted
        oci_unpack.check_lowers([self.layers.lower_path(h) for h in top_first])
        lowers = [self.layers.lower(h) for h in top_first]
        return dataclasses.replace(img, overlays=[("/", [*lowers, self.layers.skeleton])])

    def compose(self, image: Image, layers: builtins.list[Any] | None) -> Image:
        """``image`` with a create's extra layers (LayerSpec: another image's files, or a
        resolved host dir) stacked at their targets, each an overlay of its own."""
        if not layers:
            return image
        overlays = list(image.overlays)
        for lay in layers:
            if lay.image is not None:
                lowers = self.lowers_of(lay.image)
            else:
                digest = lay.digest or ""
                if not digest.startswith("dir:") or not self.layers.has(digest[4:]):
                    raise InvalidRequest(f"layer dir {lay.dir!r} is not resolved")
                lowers = [self.layers.lower(digest[4:])]
            overlays.append((lay.at.rstrip("/") or "/", lowers))
        return dataclasses.replace(image, overlays=overlays)

    def shared_snapshot_parts(self) -> builtins.list[str]:
        """The snapshot parts image layers are (each holds one reference in the snapshot
        store, recounted at every start); one whose part is gone is logged."""
        shared = self.layers.shared_parts()
        for hexd in shared:
            if not os.path.isdir(self.layers.snapshot_part(hexd)):
                log.warning("image layer missing: its snapshot part is gone",
                            extra={"layer": hexd})
        return shared

    def lowers_of(self, name: str) -> builtins.list[str]:
        """An image's files as lower layers to stack elsewhere (a toolkit at /opt/tools)."""
        img = self.get(name)
        if img.kind == "builtin":
            raise InvalidRequest("the host image cannot be a layer")
        return [p for p in img.overlays[0][1] if p != self.layers.skeleton]

    def limits(self) -> oci_unpack.Limits:
        return oci_unpack.Limits(self.max_bytes, self.max_files, disk_check=self.disk_check)

    def record_oci(self, name: str, meta: dict, replace: bool = True,
                   replace_made: bool = True) -> ImageInfo:
        """Record (or, if ``replace``, replace: a tag pulled again) the OCI image ``name``
        whose layers are in the layer store; written whole (rename) or not at all. The name
        is checked again here, under the lock: another commit may have taken it since the
        caller's first check. ``replace_made`` False (a pull): an image made here (a commit,
        tag, build or import: it has a ``source``) is not replaced, a Conflict."""
        meta = {**meta, "name": name, "kind": "oci", "created_at": time.time()}
        tmp = self._tmpdir("oci")
        try:
            os.chmod(tmp, 0o700)
            self._write_meta(tmp, meta)
            final = os.path.join(self.dir, _oci_dir(name))
            with self._lock:
                cur = self._images.get(name)
                if cur is not None and (not replace or cur.kind != "oci"):
                    raise Conflict(f"image {name!r} already exists", details={"image": name})
                if cur is not None and not replace_made and cur.meta.get("source"):
                    # Any tenant may pull; what was made here under a registry name (to push
                    # it later) is another's work: a pull of that name must not replace it.
                    raise Conflict(f"image {name!r} was made here ({cur.meta['source']}), "
                                   "not pulled: a pull does not replace it (remove it first)",
                                   details={"image": name})
                if os.path.lexists(final):
                    trash = os.path.join(self.dir, f".tmp-rm-{time.time_ns()}")
                    os.rename(final, trash)
                    removal.remove_tree(trash)
                os.rename(tmp, final)
                img = self._load(_oci_dir(name))
                assert img is not None
                self._images[name] = img
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return img.info()

    # ---- commits, tags (oci.commit) ---------------------------------------------------------
    def target_name(self, name: str, replace: bool) -> str:
        """The store's key for a new image ``name`` (a local name, or a registry reference
        to push it to later); an existing one is a Conflict unless ``replace``."""
        if name == HOST or name in RESERVED:
            raise Conflict(f"image name {name!r} is taken (the host image, or a route under "
                           "/v1/images/)", details={"image": name})
        if NAME_RE.match(name) and not oci_ref.looks_like_ref(name):
            key = name
        else:  # a registry reference (a long one-word name is docker.io/library/NAME)
            key = str(oci_ref.parse(name))
        with self._lock:
            cur = self._images.get(key)
        if cur is not None and (not replace or cur.kind != "oci"):
            raise Conflict(f"image {key!r} already exists" + ("" if cur.kind != "oci" else
                           " (replace it: replace=true)"), details={"image": key})
        return key

    def layers_of(self, img: Image) -> builtins.list[str]:
        """The layer ids an image stands on, base first; a rootfs image's tree becomes one
        content-addressed layer (stored once)."""
        if img.kind == "oci":
            return list(img.meta.get("oci_layers", ()))
        if img.kind == "rootfs":
            # The store's own path, resolved: a state dir on a symlink (to a bigger disk) is
            # the admin's, and the copy opens its source without following one.
            return [self.layers.from_dir(os.path.realpath(os.path.join(img.path, "rootfs")),
                                         self.max_bytes,
                                         self.max_files)]
        raise Unsupported("the host image is the host's own files, not layers: commit or "
                          "build on an OCI or rootfs image", details={"image": img.name})

    def record_derived(self, key: str, layers: builtins.list[str], config: dict[str, Any],
                       source: str, replace: bool) -> ImageInfo:
        """Record image ``key`` made here (a commit, a tag, a build) from stored layers."""
        size = sum(int(self.layers.meta(h).get("unpacked_bytes", 0)) for h in layers)
        return self.record_oci(key, {"kind": "oci", "oci_layers": list(layers),
                                     "config": config, "source": source, "digest": None,
                                     "size_bytes": size}, replace)

    def tag(self, src: str, name: str, changes: dict[str, Any] | None,
            replace: bool) -> ImageInfo:
        """A new name for image ``src``'s layers, its config changed by ``changes``: no file
        is copied."""
        from corral.daemon.oci import commit

        key = self.target_name(name, replace)
        img = self.get(src)
        layers = self.layers_of(img)
        config = commit.merge_config(img.config, changes)
        self.layers.pin(layers)
        try:
            return self.record_derived(key, layers, config, f"tag of {img.name}", replace)
        finally:
            self.layers.unpin(layers)

    def push(self, name: str, reference: str | None) -> dict[str, Any]:
        """Push image ``name`` to ``reference`` (default: its name, a reference) in this
        (worker) thread (oci.push)."""
        from corral.daemon.oci import push

        img = self.get(name)
        target = reference or img.name
        if not oci_ref.looks_like_ref(target):  # the image's state, not the request's form
            raise Conflict(f"image {img.name!r} has a local name: say where to push it "
                           "(a registry reference)", details={"image": img.name})
        ref = oci_ref.parse(target)
        if self.allowed and ref.registry not in self.allowed:
            raise Forbidden(f"registry {ref.registry} is not one this daemon talks to "
                            f"(CORRAL_REGISTRIES: {', '.join(sorted(self.allowed))})",
                            details={"registry": ref.registry})
        layers = self.layers_of(img)
        self.layers.pin(layers)
        try:
            return push.push(ref, self.layers, layers, img.config, self.egress)
        finally:
            self.layers.unpin(layers)

    def pull_sync(self, ref: oci_ref.Reference,
                  progress: Callable[[dict[str, Any]], None] | None = None) -> ImageInfo:
        """Pull ``ref`` in this (worker) thread and record it; oci.flight makes concurrent
        asks for one reference share one pull."""
        from corral.daemon.oci import pull

        pinned: builtins.list[str] = []
        created: builtins.list[str] = []
        try:
            meta = pull.pull(ref, self.layers, self.limits(), self.egress, progress, pinned,
                             created)
            return self.record_oci(str(ref), meta, replace_made=False)
        except BaseException:
            self.layers.unpin(pinned)
            pinned = []
            # nothing half-imported stays: the layers this pull made that no image lists
            self.layers.gc(self.referenced_layers(), only=created)
            raise
        finally:
            self.layers.unpin(pinned)

    async def pull(self, text: str, progress: Callable[[dict[str, Any]], None] | None = None,
                   missing_only: bool = False, tenant: str | None = None) -> ImageInfo:
        """Pull the reference ``text`` (again: a tag may have moved) or, ``missing_only``,
        only if the store lacks it; one pull per reference at a time (oci.flight). A pull
        ``tenant`` starts counts in its PULLS_PER_TENANT until it ends (joining a pull under
        way costs nothing); past it, QuotaExceeded before anything is fetched."""
        from corral.daemon.oci import flight

        ref = oci_ref.parse(text)
        key = str(ref)
        if self.allowed and ref.registry not in self.allowed:
            raise Forbidden(f"registry {ref.registry} is not one this daemon pulls from "
                            f"(CORRAL_REGISTRIES: {', '.join(sorted(self.allowed))})",
                            details={"registry": ref.registry})
        if missing_only:
            with self._lock:
                img = self._images.get(key)
            if img is not None:
                return img.info()
        started = None
        if tenant is not None and key not in self._flights:  # this call starts the pull
            held = self._tenant_pulls.get(tenant, 0)
            if held >= PULLS_PER_TENANT:
                raise QuotaExceeded(
                    f"tenant {tenant!r} has {held} image pulls under way on this daemon, as "
                    f"many as a tenant may ({PULLS_PER_TENANT} of its {PULL_WORKERS} pull "
                    "threads); retry when one ends",
                    details={"tenant": tenant, "in_use": held, "limit": PULLS_PER_TENANT,
                             "requested": 1, "resource": "pulls"})
            self._tenant_pulls[tenant] = held + 1

            def started(task: asyncio.Future[Any]) -> None:
                task.add_done_callback(lambda _: self._pull_ended(tenant))

        info: ImageInfo = await flight.join(
            self._flights, key, lambda emit: self.pull_sync(ref, emit), progress,
            self._pull_pool, started)
        return info

    def _pull_ended(self, tenant: str) -> None:
        left = self._tenant_pulls.get(tenant, 0) - 1
        if left > 0:
            self._tenant_pulls[tenant] = left
        else:
            self._tenant_pulls.pop(tenant, None)

    def referenced_layers(self) -> builtins.set[str]:
        with self._lock:
            return {h for img in self._images.values() if img.kind == "oci"
                    for h in img.meta.get("oci_layers", ())}

    def gc_layers(self, keep: builtins.set[str] | None = None) -> builtins.list[str]:
        """Remove the layers no image lists and not in ``keep`` (their mounts, files)."""
        return self.layers.gc(self.referenced_layers() | (keep or set()))

    def close(self) -> None:
        self._pull_pool.shutdown(wait=False, cancel_futures=True)
        self.layers.close()

    # ---- import / remove -------------------------------------------------------------------
    def check_new(self, name: str) -> None:
        if not isinstance(name, str) or not NAME_RE.match(name) or name in RESERVED:
            raise InvalidRequest(f"invalid image name {name!r}: must match {NAME_RE.pattern}"
                                 f" and not be {' or '.join(RESERVED)}")
        if name == HOST or name in self._images:
            raise Conflict(f"image {name!r} already exists", details={"image": name})

    def import_image(self, name: str, source: str, label: str | None = None) -> ImageInfo:
        """Import a rootfs directory or tarball (.tar, .tar.gz, .tgz, .tar.xz, ...) at the
        absolute host path ``source`` as ``name`` (callers check the client may name it:
        resolve_source). Built in a temp dir and renamed into place, so it appears whole or
        not at all; a name already taken is a Conflict. An unreadable source is
        invalid_request, never an internal error."""
        self.check_new(name)
        if not isinstance(source, str) or not source.startswith("/") or "\0" in source:
            raise InvalidRequest("source must be an absolute host path")
        try:
            return self._import(name, os.path.abspath(source), label or source)
        except OSError as e:
            raise InvalidRequest(f"cannot import {source!r}: {e.strerror or e}"
                                 + (f" ({e.filename})" if e.filename else ""),
                                 details={"errno": e.errno}) from e

    def _import(self, name: str, src: str, source: str) -> ImageInfo:
        try:
            st = os.stat(src)
        except OSError as e:
            raise InvalidRequest(f"cannot read source {source!r}: {e.strerror}") from e
        if st.st_dev in pseudo_devices():
            raise InvalidRequest(f"source {source!r} is on a kernel filesystem (proc, sysfs, "
                                 "...), not a rootfs")
        from corral.daemon.oci import archive

        if archive.kind(src) is not None:  # an OCI layout or a docker save archive
            pinned: builtins.list[str] = []
            try:
                meta = archive.load(src, self.layers, self.limits(), pinned)
                return self.record_oci(name, {**meta, "source": source}, replace=False)
            finally:
                self.layers.unpin(pinned)
        tmp = self._tmpdir(name)
        try:
            os.chmod(tmp, 0o755)
            rootfs = os.path.join(tmp, "rootfs")
            os.mkdir(rootfs, 0o755)
            if stat.S_ISDIR(st.st_mode):
                if os.path.commonpath([src, self.dir]) == self.dir \
                        or os.path.commonpath([src, tmp]) == src:
                    raise InvalidRequest("source overlaps the image store")
                size = _copy_tree(src, rootfs, sanitize=False)
                os.chmod(rootfs, stat.S_IMODE(st.st_mode) | 0o755)
            elif stat.S_ISREG(st.st_mode):
                size = _extract_tar(src, rootfs)
                os.chmod(rootfs, 0o755)
            else:
                raise InvalidRequest(f"source {source!r} is neither a directory nor a file")
            meta = {"name": name, "kind": "rootfs", "created_at": time.time(),
                    "source": source, "size_bytes": size}
            self._write_meta(tmp, meta)
            with self._lock:
                final = os.path.join(self.dir, name)
                try:
                    os.rename(tmp, final)
                except OSError as e:  # EEXIST / ENOTEMPTY: taken meanwhile
                    raise Conflict(f"image {name!r} already exists",
                                   details={"image": name}) from e
                img = self._load(name)
                assert img is not None
                self._images[name] = img
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return img.info()

    def remove(self, name: str) -> None:
        """Delete an image (its layers stay until gc_layers finds no image that lists them).
        The engine must make sure no live sandbox or snapshot uses it."""
        if name == HOST:
            raise InvalidRequest("the builtin 'host' image cannot be removed")
        try:
            key = self.canonical(name)
        except InvalidRequest:
            key = name
        with self._lock:
            img = self._images.pop(key, None)
            if img is None:
                raise ImageNotFound(f"no image named {name!r}", details={"image": name})
            trash = os.path.join(self.dir, f".tmp-rm-{time.time_ns()}")
            os.rename(img.path, trash)
        shutil.rmtree(trash, ignore_errors=True)


def _oci_dir(name: str) -> str:
    return "@" + hashlib.sha256(name.encode()).hexdigest()[:32]
