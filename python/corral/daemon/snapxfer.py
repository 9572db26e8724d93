"""A snapshot moved between nodes: its whole chain as one stream, out of one daemon and into
another (a cluster places a create from a snapshot on a node that lacks it: docs/cluster.md).

The stream is a plain tar (``application/x-tar``):
  snapshot.json             first: {"format", "snapshot": the record, "parts": {digest: [n]},
                            "sent": [digests in this stream]}
  layers/<digest>/<n>/...   each sent layer's parts in OCI layer form (corral.daemon.oci.push:
                            whiteouts as ``.wh.`` entries, user xattrs as PAX headers), plus a
                            file's mtime to the nanosecond and a whiteout's mode and owner, so
                            the files hash to the same digest on the other side.
A layer the importer already has is left out (``?have=`` on the export), and stored once.

The import is untrusted input: every member goes through the OCI unpacker
(corral.daemon.oci.unpack: no ``..``, nothing through a symlink, hard links only within their
own part, devices dropped, bytes and members bounded) into a staging dir under ``spares/``
(removed on any failure, swept at start after a crash); every member must be under a part
the manifest declares; each sent layer's digest is recomputed from the unpacked files and a
mismatch is refused. Only then, on the event loop, are the layers moved into place and the
record written (same id; its name kept unless the node has that name already).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import tarfile
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from corral.daemon import removal, safetar
from corral.daemon.oci import push, unpack
from corral.daemon.snapshots import SnapshotStore, info, layer_digest
from corral.errors import (
    Conflict,
    InvalidImage,
    InvalidSnapshotStream,
    SnapshotDigestMismatch,
    TooLarge,
)

FORMAT = "corral-snapshot/1"
MANIFEST = "snapshot.json"
MAX_MANIFEST = 1 << 20
MAX_PARTS = 256      # overlay targets of one image (far more than any image has)
MAX_CHAIN = 4096     # layers in a chain (a mount page bounds real chains well below)
CHUNK = 1 << 20      # bytes handed between the loop and the worker thread at once
DIGEST = re.compile(r"^[0-9a-f]{64}$")
SNAP_ID = re.compile(r"^snap-[0-9a-f]{16}$")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")


def _bad(reason: str, message: str, **details: Any) -> InvalidSnapshotStream:
    return InvalidSnapshotStream(message, details={"reason": reason, **details})


# ---- export -------------------------------------------------------------------------------
def plan(store: SnapshotStore, rec: dict[str, Any], have: set[str]) -> dict[str, Any]:
    """The manifest of ``rec``'s export: every layer of its chain with its parts, and those
    sent (the ones not in ``have``)."""
    chain = list(dict.fromkeys(rec["layers"]))
    parts = {d: sorted(int(x) for x in os.listdir(store.layer_path(d)) if x.isdigit())
             for d in chain}
    return {"format": FORMAT, "snapshot": info(rec), "parts": parts,
            "sent": [d for d in chain if d not in have]}


def write_stream(store: SnapshotStore, manifest: dict[str, Any], out: Any) -> None:
    """The export stream of ``manifest`` written to ``out`` (a worker thread)."""
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tf:
        data = json.dumps(manifest).encode()
        ti = tarfile.TarInfo(MANIFEST)
        ti.size = len(data)
        tf.addfile(ti, io.BytesIO(data))
        for d in manifest["sent"]:
            for n in manifest["parts"][d]:
                part = store.layer_path(d, n)
                ti = tarfile.TarInfo(f"layers/{d}/{n}")
                ti.type, ti.mode = tarfile.DIRTYPE, 0o755
                tf.addfile(ti)
                push.add_tree(tf, part, f"layers/{d}/{n}/", exact=True)


class Cancelled(Exception):
    """The other end left: the worker thread stops."""


class LoopWriter:
    """A file the worker thread writes to and the event loop sends on: ``send`` (a
    coroutine, e.g. a response's write, which waits while the peer is slow) gets chunks of
    up to CHUNK bytes, so memory stays bounded whatever the snapshot's size."""

    def __init__(self, send: Callable[[bytes], Coroutine[Any, Any, Any]],
                 loop: asyncio.AbstractEventLoop) -> None:
        self.send, self.loop = send, loop
        self.buf = bytearray()
        self.cancelled = threading.Event()

    def write(self, data: bytes) -> int:
        self.buf += data
        if len(self.buf) >= CHUNK:
            self.flush()
        return len(data)

    def flush(self) -> None:
        if self.cancelled.is_set():
            raise Cancelled
        if self.buf:
            chunk, self.buf = bytes(self.buf), bytearray()
            asyncio.run_coroutine_threadsafe(self.send(chunk), self.loop).result()


# ---- import -------------------------------------------------------------------------------
class LoopReader:
    """A file the worker thread reads from, fed by ``recv`` on the event loop (a request
    body's ``read``), CHUNK bytes at a time."""

    def __init__(self, recv: Callable[[int], Coroutine[Any, Any, bytes]],
                 loop: asyncio.AbstractEventLoop) -> None:
        self.recv, self.loop = recv, loop
        self.buf, self.pos = b"", 0  # an offset: no copy of the rest at each small read
        self.cancelled = threading.Event()

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = CHUNK
        if self.pos >= len(self.buf):
            if self.cancelled.is_set():
                raise Cancelled
            try:
                self.buf = asyncio.run_coroutine_threadsafe(self.recv(CHUNK),
                                                            self.loop).result()
            except Exception as e:  # noqa: BLE001 - the sender's connection broke
                raise _bad("truncated", f"the snapshot stream broke off: {e}") from None
            self.pos = 0
        out = self.buf[self.pos:self.pos + n]
        self.pos += len(out)
        return out


def parse_manifest(data: bytes) -> dict[str, Any]:
    """The manifest, checked field by field (it is the sender's word)."""
    try:
        man = json.loads(data)
    except ValueError:
        raise _bad("manifest", f"{MANIFEST} is not JSON") from None
    if not isinstance(man, dict) or man.get("format") != FORMAT:
        raise _bad("format", f"not a snapshot stream of format {FORMAT}")
    rec, parts, sent = man.get("snapshot"), man.get("parts"), man.get("sent")
    if not isinstance(rec, dict) or not isinstance(parts, dict) or not isinstance(sent, list):
        raise _bad("manifest", "the manifest needs snapshot, parts and sent")
    layers = rec.get("layers")
    if not (isinstance(layers, list) and 0 < len(layers) <= MAX_CHAIN
            and all(isinstance(d, str) and DIGEST.match(d) for d in layers)):
        raise _bad("manifest", "the snapshot's layers must be 1 to "
                   f"{MAX_CHAIN} hex digests")
    if not isinstance(rec.get("id"), str) or not SNAP_ID.match(rec["id"]):
        raise _bad("manifest", "bad snapshot id")
    name = rec.get("name")
    if name is not None and not (isinstance(name, str) and NAME.match(name)):
        raise _bad("manifest", "bad snapshot name")
    parent = rec.get("parent")
    if parent is not None and not (isinstance(parent, str) and SNAP_ID.match(parent)):
        raise _bad("manifest", "bad parent snapshot id")
    image = rec.get("image")
    if not isinstance(image, str) or not 0 < len(image) <= 512 or "\0" in image:
        raise _bad("manifest", "bad image name")
    if rec.get("digest") != layers[-1]:
        raise _bad("manifest", "the snapshot's digest is not the top of its chain")
    if set(parts) != set(layers) or not set(sent) <= set(layers) or len(set(sent)) != len(sent):
        raise _bad("manifest", "parts must list each layer of the chain, sent some of them")
    for d, ns in parts.items():
        if not (isinstance(ns, list) and len(ns) <= MAX_PARTS and len(set(ns)) == len(ns)
                and all(isinstance(n, int) and 0 <= n < MAX_PARTS for n in ns)):
            raise _bad("manifest", f"bad part list of layer {d}")
    for k in ("size", "created_at"):
        if not isinstance(rec.get(k), (int, float)) or isinstance(rec.get(k), bool):
            raise _bad("manifest", f"bad snapshot {k}")
    sid = rec.get("sandbox_id")
    return {"snapshot": {"id": rec["id"], "name": name, "parent": parent, "image": image,
                         "digest": layers[-1], "layers": layers, "size": int(rec["size"]),
                         "created_at": float(rec["created_at"]),
                         "sandbox_id": sid if isinstance(sid, str) and len(sid) < 64 else None},
            "parts": {d: sorted(ns) for d, ns in parts.items()}, "sent": sent}


def _place(name: str, man: dict[str, Any]) -> list[str]:
    """A member's path parts, which must be inside a declared part of a sent layer."""
    try:
        rel = unpack._rel(name)
    except InvalidImage as e:
        raise _bad("member", e.message, member=name[:200]) from None
    if len(rel) < 3 or rel[0] != "layers" or rel[1] not in man["sent"] or \
            not rel[2].isdigit() or int(rel[2]) not in man["parts"][rel[1]] or \
            rel[2] != str(int(rel[2])):
        raise _bad("member", f"member {name[:200]!r} is not inside a part the manifest "
                   "declares", member=name[:200])
    return rel


def read_stream(src: Any, staging: str, limits: unpack.Limits,
                on_manifest: Callable[[dict[str, Any]], None] = lambda _: None,
                ) -> dict[str, Any]:
    """Unpack an import stream into ``staging`` (an empty dir) and check it: the manifest
    (given to ``on_manifest`` before any layer is read: it may refuse it), every sent layer
    complete and hashing to its digest. Raises InvalidSnapshotStream /
    SnapshotDigestMismatch / TooLarge; the caller removes ``staging``. A worker thread."""
    hashed = unpack._Hashing(src, limits)  # bounds the stream's bytes
    files = 0  # and, apart, the bytes its files claim (a sparse member writes its holes)
    try:
        with tarfile.open(fileobj=hashed, mode="r|",  # type: ignore[call-overload]
                          tarinfo=safetar.ImageTarInfo) as tf:
            first = tf.next()
            if first is None or first.name != MANIFEST or not first.isreg() or \
                    not 0 < first.size <= MAX_MANIFEST:
                raise _bad("format", f"a snapshot stream starts with {MANIFEST}")
            f = tf.extractfile(first)
            assert f is not None
            man = parse_manifest(f.read())
            on_manifest(man)
            layer = unpack._Layer(staging, limits, unpack.Result(), exact=True)
            while (m := tf.next()) is not None:
                tf.members.clear()  # kept by tarfile for nothing: ~550 bytes a member
                rel = _place(m.name, man)
                if m.isreg():  # a sparse member claims its whole size: its holes are hashed
                    files += (unpack._sparse(m, limits)[0] if unpack.SPARSE in m.pax_headers
                              else m.size)
                if files > limits.max_bytes:
                    raise unpack._too_large(limits)
                if len(rel) == 3 and not m.isdir():
                    raise _bad("member", f"part {m.name!r} is not a directory")
                if not (m.isdir() or m.isreg() or m.issym() or m.islnk() or m.isfifo()):
                    # An export never holds one (whiteouts travel as .wh. files).
                    raise _bad("member", f"member {m.name[:200]!r} is a device or of an "
                               "unknown type", member=m.name[:200])
                if m.islnk() and _place(m.linkname, man)[:3] != rel[:3]:
                    raise _bad("member", f"hard link {m.name!r} leaves its part",
                               member=m.name[:200])
                layer.apply(tf, m)
            layer.close()
    except InvalidImage as e:  # the unpacker's refusals, in this API's words
        if isinstance(e, InvalidSnapshotStream):
            raise
        raise _bad("member", e.message, **e.details) from None
    except (tarfile.TarError, EOFError) as e:
        raise _bad("truncated", f"the snapshot stream is not a whole tar: {e}") from None
    except (OverflowError, ValueError) as e:  # an owner or time no syscall takes
        raise _bad("member", f"a member the node cannot store: {e}") from None
    for d in man["sent"]:
        root = os.path.join(staging, "layers", d)
        for n in man["parts"][d]:
            if not os.path.isdir(os.path.join(root, str(n))):
                raise _bad("truncated", f"layer {d} lacks its part {n}", layer=d, part=n)
        got = layer_digest(root) if os.path.isdir(root) else ""
        if got != d:
            raise SnapshotDigestMismatch(f"layer {d} does not hash to its digest (it hashes "
                                         f"to {got or 'nothing'})",
                                         details={"layer": d, "got": got})
    return man


def commit(store: SnapshotStore, man: dict[str, Any], staging: str,
           tenant: str | None = None) -> tuple[dict[str, Any], bool]:
    """Move the checked layers into place and record the snapshot, owned by ``tenant`` (on
    the loop: no collection or delete runs in between). (record, made): an id the node has
    already is answered as it is if it is the same tenant's (else a conflict that tells
    nothing of it)."""
    rec = man["snapshot"]
    have = store.records.get(rec["id"])
    if have is not None:
        if have.get("tenant") != tenant:
            raise Conflict("this node has another snapshot of that id",
                           details={"snapshot": rec["id"]})
        return have, False
    for d in rec["layers"]:
        if d not in man["sent"] and not os.path.isdir(store.layer_path(d)):
            raise _bad("missing_layer", f"layer {d} is neither in the stream nor on this node "
                       "(it was deleted meanwhile: export again)", layer=d)
    for d in man["sent"]:
        final = store.layer_path(d)
        if not os.path.isdir(final):
            os.rename(os.path.join(staging, "layers", d), final)
    name = rec["name"] if rec["name"] and rec["name"] not in store.by_name else None
    new = dict(rec, name=name)
    if tenant is not None:
        new["tenant"] = tenant
    store.refs.update(new["layers"])
    try:
        store.db.put(new)
    except BaseException:
        store.release(new["layers"])
        raise
    store.records[new["id"]] = new
    store.note_sizes(new)  # for its tenant's snapshot quota (snapshots.usage)
    if name:
        store.by_name[name] = new["id"]
    return new, True


async def receive(store: SnapshotStore, recv: Callable[[int], Coroutine[Any, Any, bytes]],
                  check_image: Callable[[str], Coroutine[Any, Any, str]],
                  tenant: str | None = None,
                  disk_check: Callable[[str, int], None] | None = None,
                  ) -> tuple[dict[str, Any], bool]:
    """Import a stream read with ``recv``: unpacked and checked in a worker thread, its image
    made present (``check_image``: the name the node knows it by, pulled if need be), then
    committed. ``disk_check``: the state dir's disk (DiskGuard.check), asked before every
    32 MiB unpacked and every big file (a stream sent chunked declares no size to check at
    its start). Cancelled (the client left) or failed, nothing of it stays."""
    staging = os.path.join(store.spares_dir, "imp-" + os.urandom(8).hex())
    os.mkdir(staging, 0o700)
    loop = asyncio.get_running_loop()
    reader = LoopReader(recv, loop)
    limits = unpack.Limits(store.max_bytes, store.max_entries, disk_check=disk_check,
                           disk_what="a snapshot import")

    def on_manifest(man: dict[str, Any]) -> None:  # the image first, before any layer
        rec = man["snapshot"]
        rec["image"] = asyncio.run_coroutine_threadsafe(
            check_image(rec["image"]), loop).result()

    try:
        work = asyncio.ensure_future(asyncio.to_thread(read_stream, reader, staging, limits,
                                                       on_manifest))
        try:
            man = await asyncio.shield(work)
        except asyncio.CancelledError:
            reader.cancelled.set()
            while not work.done():
                with contextlib.suppress(BaseException):
                    await asyncio.shield(work)
            raise
        except TooLarge as e:
            raise TooLarge(f"the snapshot is too large to import: {e.message}",
                           details=e.details) from None
        except Cancelled:
            raise _bad("truncated", "the snapshot stream broke off") from None
        return commit(store, man, staging, tenant)
    finally:
        if os.path.isdir(staging):  # what was not moved into place: gone from spares/ now
            trash = os.path.join(store.trash_dir, os.path.basename(staging))
            os.rename(staging, trash)
            removal.remove_later(trash)


async def send(store: SnapshotStore, manifest: dict[str, Any],
               write: Callable[[bytes], Coroutine[Any, Any, Any]]) -> None:
    """Write ``manifest``'s export stream with ``write`` (a response's), from a worker
    thread, a chunk at a time. Cancelled (the client left), the thread stops at its next
    chunk."""
    writer = LoopWriter(write, asyncio.get_running_loop())

    def run() -> None:
        write_stream(store, manifest, writer)
        writer.flush()

    work = asyncio.ensure_future(asyncio.to_thread(run))
    try:
        await asyncio.shield(work)
    except asyncio.CancelledError:
        writer.cancelled.set()
        while not work.done():
            with contextlib.suppress(BaseException):
                await asyncio.shield(work)
        raise
