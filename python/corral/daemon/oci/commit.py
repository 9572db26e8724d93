"""What a sandbox's captured changes must become before they are an image layer, and how an
image's config changes (a commit, a tag, a build step).

A captured upper is in overlay form already (whiteouts as 0/0 character devices, opaque
directories by the ``trusted.overlay.opaque`` xattr: corral.daemon.snapshots), which is the
form a layer of the store has. The sandbox made those files, so the unpack rules apply to
them as to a pulled layer: setuid and setgid bits are cleared on files (kept on directories
for setgid), device nodes other than whiteouts and sockets are removed, and
``security.capability`` xattrs are dropped."""

from __future__ import annotations

import os
import stat
import subprocess
from typing import TYPE_CHECKING, Any

from corral.daemon.oci import pull
from corral.errors import InvalidRequest

if TYPE_CHECKING:  # pragma: no cover
    from corral.daemon.oci.layers import LayerStore
    from corral.daemon.snapshots import SnapshotStore

_SUID = stat.S_ISUID | stat.S_ISGID
_DROP_XATTRS = ("security.capability",)
# Config keys a commit or tag may set (docs/images.md); the others stay the base image's.
SETTABLE = ("Env", "WorkingDir", "User", "Entrypoint", "Cmd", "Labels", "ExposedPorts",
            "StopSignal")


def sanitize(tree: str, fix: bool = True) -> tuple[dict[str, int], int]:
    """Apply the layer rules to ``tree`` in place; returns what was removed or changed, and
    the bytes of its regular files. With ``fix=False`` nothing is changed (a read-only scan):
    the counts say what a cleaning would do, none means the tree may be shared as it is."""
    counts: dict[str, int] = {}
    nbytes = 0

    def note(what: str) -> None:
        counts[what] = counts.get(what, 0) + 1

    for dirpath, dirnames, filenames in os.walk(tree):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            m = st.st_mode
            if stat.S_ISCHR(m) or stat.S_ISBLK(m) or stat.S_ISSOCK(m):
                if stat.S_ISCHR(m) and st.st_rdev == 0:
                    continue  # a whiteout: a deletion this layer records
                if fix:
                    os.unlink(p)
                note("devices")
                continue
            if stat.S_ISLNK(m):
                continue
            try:
                names = os.listxattr(p, follow_symlinks=False)
            except OSError:
                names = []
            for x in names:
                if x in _DROP_XATTRS:
                    if fix:
                        os.removexattr(p, x, follow_symlinks=False)
                    note("xattrs")
            if stat.S_ISREG(m):
                nbytes += st.st_size
            if stat.S_ISREG(m) and m & _SUID:
                if fix:
                    os.chmod(p, stat.S_IMODE(m) & ~_SUID)
                note("setuid")
            elif stat.S_ISDIR(m) and m & stat.S_ISUID:
                if fix:
                    os.chmod(p, stat.S_IMODE(m) & ~stat.S_ISUID)
                note("setuid")
    return counts, nbytes


def merge_config(base: dict[str, Any], changes: dict[str, Any] | None) -> dict[str, Any]:
    """``base`` with ``changes`` applied: a key set to None is removed; ``Env`` entries
    replace the base's of the same variable; ``Labels`` are merged. Types are checked the
    way a pulled config's are (pull.image_config); a wrong one is invalid_request."""
    out = dict(base)
    for k, v in (changes or {}).items():
        if k not in SETTABLE:
            raise InvalidRequest(f"config key {k!r} cannot be set (settable: "
                                 f"{', '.join(SETTABLE)})", details={"key": k})
        if v is None:
            out.pop(k, None)
            continue
        if k == "Env" and isinstance(v, list) and all(isinstance(e, str) for e in v):
            names = {e.partition("=")[0] for e in v}
            v = [e for e in out.get("Env", []) if e.partition("=")[0] not in names] + list(v)
        elif k == "Labels" and isinstance(v, dict):
            v = {**out.get("Labels", {}), **v}
        out[k] = v
    if isinstance(out.get("ExposedPorts"), list):  # stored as a list, read as an object
        out["ExposedPorts"] = {str(p): {} for p in out["ExposedPorts"]}
    checked = pull.image_config({"config": out})
    bad = sorted(set(out) - set(checked))
    if bad:
        raise InvalidRequest(f"config {', '.join(bad)}: wrong type (Env, Entrypoint, Cmd: "
                             "lists of strings; Labels: an object; the rest: strings)",
                             details={"keys": bad})
    return checked


def store_layers(store: LayerStore, snaps: SnapshotStore, chain: list[str], tmp: str,
                 digest: str, out: list[str], share: list[tuple[str, int, bool]]) -> None:
    """An image commit's new layers: the snapshot chain's root parts and the captured upper
    dir (``tmp``/0, the capture's layout) as store layers (worker thread), each added to
    ``out`` and pinned (the caller unpins once the image lists them); an empty part adds no
    layer. A part the layer rules leave as it is (a read-only scan) is not copied: it goes
    to ``share`` as (digest, bytes, is the capture) for the caller to record, on the loop, as
    a layer that is that snapshot part (LayerStore.from_snapshot). A part the rules change
    is copied (``cp -a``: whiteouts, xattrs; the capture is taken over), cleaned and
    converted."""
    parts = [(d, snaps.layer_path(d, 0), False) for d in chain]
    parts.append((digest, os.path.join(tmp, "0"), True))
    for hexd, part, owned in parts:
        if not os.path.isdir(part) or not os.listdir(part):
            continue
        store.pin([hexd])
        out.append(hexd)
        if store.has(hexd):
            continue
        dirty, nbytes = sanitize(part, fix=False)
        if not dirty:
            share.append((hexd, nbytes, owned))
            continue
        tree = part
        if not owned:  # the snapshot keeps its own copy (cp -a: whiteouts, xattrs)
            tree = os.path.join(tmp, f"chain-{hexd[:16]}")
            subprocess.run(["cp", "-a", "--", part, tree], check=True,
                           capture_output=True, timeout=3600)
        skipped, nbytes = sanitize(tree)
        store.from_tree(hexd, tree, {"digest": "commit:" + hexd, "skipped": skipped,
                                     "unpacked_bytes": nbytes})


def share_layers(store: LayerStore, snaps: SnapshotStore, tmp: str,
                 share: list[tuple[str, int, bool]]) -> None:
    """Record the parts ``store_layers`` found clean as layers that are those snapshot parts
    (on the loop: placing the capture in the snapshot store and taking each new entry's
    reference happen with no snapshot removal in between). The capture's dir ``tmp`` moves
    into the snapshot store as a part no snapshot record lists, held by its layer entry."""
    for hexd, nbytes, owned in share:
        if owned:
            snaps.adopt(tmp, hexd)
        if store.from_snapshot(hexd, {"digest": "commit:" + hexd, "skipped": {},
                                      "unpacked_bytes": nbytes}):
            snaps.acquire([hexd])
