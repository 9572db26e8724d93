"""A snapshot's export stream carries whatever its sandbox left in its files, and the import
must rebuild a layer that hashes to the same digest: otherwise every cluster copy of the
snapshot fails as snapshot_copy_failed (infra), which a sandbox could set off at will. Both
ends also run in the daemon, so what they hold must not grow with the member count.

These run the real export (snapxfer.write_stream) and import (read_stream) over a layer made
in a temporary directory, with the real digest (snapshots.layer_digest)."""

from __future__ import annotations

import asyncio
import io
import json
import os
import tarfile
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from corral.daemon import snapxfer
from corral.daemon.oci import push, unpack
from corral.daemon.snapshots import layer_digest
from corral.errors import CapacityExceeded, InvalidImage, TooLarge

# xattr names a PAX keyword cannot hold as they are: not UTF-8, a '=', a newline.
ODD_NAMES = [b"user.\xff\xfe", b"user.a=b", b"user.new\nline", b"user.plain"]


class _Store:
    def __init__(self, root: Path) -> None:
        self.root = root

    def layer_path(self, digest: str, part: int) -> str:
        return str(self.root / digest / str(part))


def _layer(root: Path, fill: Any) -> tuple[_Store, dict[str, Any]]:
    """A one-part layer filled by ``fill(part_dir)``, under its digest; its export manifest."""
    made = root / "making"
    (made / "0").mkdir(parents=True)
    fill(made / "0")
    digest = layer_digest(str(made))
    made.rename(root / digest)
    man = {"format": snapxfer.FORMAT, "parts": {digest: [0]}, "sent": [digest],
           "snapshot": {"id": "snap-0123456789abcdef", "layers": [digest], "digest": digest,
                        "image": "host", "size": 0, "created_at": 0}}
    return _Store(root), man


def _odd_files(part: Path) -> None:
    for name in ("xa", "d"):
        p = part / name
        if name == "d":
            p.mkdir()
        else:
            p.write_bytes(b"xa")
        for n in ODD_NAMES:
            os.setxattr(p, n, b"v\xff" + n)
    for name, ns in (("old", -1), ("older", -3_000_000_000_123_456_789)):
        (part / name).write_bytes(name.encode())
        os.utime(part / name, ns=(0, ns))


def _xattrs(p: Path) -> list[tuple[bytes, bytes]]:
    return sorted((n, os.getxattr(p, n)) for n in map(os.fsencode, os.listxattr(p))
                  if n.startswith(b"user."))


# The import gives each member its owner (the part directories are root's): the daemon's.
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="the import chowns to root")


@as_root
def test_xattr_names_and_times_a_tar_has_no_plain_form_for_come_back_whole(
        tmp_path: Path) -> None:
    """An xattr name that is not UTF-8 failed the export's tar writer mid-stream; a time
    before 1970 came back as whole seconds and the import was snapshot_digest_mismatch."""
    try:
        os.setxattr(tmp_path, b"user.probe", b"1")
    except OSError:
        pytest.skip("no user xattrs on this filesystem")
    store, man = _layer(tmp_path / "src", _odd_files)
    out = io.BytesIO()
    snapxfer.write_stream(store, man, out)  # type: ignore[arg-type]
    staging = tmp_path / "staging"
    staging.mkdir()
    out.seek(0)
    got = snapxfer.read_stream(out, str(staging), unpack.Limits(1 << 30, 1000))
    digest = man["sent"][0]
    assert got["sent"] == [digest]  # it hashed to its digest
    part = staging / "layers" / digest / "0"
    want = sorted((n, b"v\xff" + n) for n in ODD_NAMES)
    assert _xattrs(part / "xa") == want and _xattrs(part / "d") == want
    src = store.root / digest / "0"  # as the source's filesystem holds them (ext4 clamps)
    for name in ("old", "older"):
        assert os.lstat(part / name).st_mtime_ns == os.lstat(src / name).st_mtime_ns < 0


def test_an_image_push_refuses_an_xattr_a_tar_cannot_name(tmp_path: Path) -> None:
    """An OCI layer has no form for such a name: the push says which file and xattr."""
    try:
        os.setxattr(tmp_path, b"user.probe", b"1")
    except OSError:
        pytest.skip("no user xattrs on this filesystem")
    for n in ODD_NAMES[:3]:
        root = tmp_path / f"tree{ODD_NAMES.index(n)}"
        (root / "opt").mkdir(parents=True)
        (root / "opt" / "xa").write_bytes(b"x")
        os.setxattr(root / "opt" / "xa", n, b"v")
        with pytest.raises(InvalidImage) as e:
            push.write_tar(str(root), io.BytesIO())
        assert e.value.details["path"] == "opt/xa", e.value.details
        assert os.fsencode(e.value.details["xattr"]) == n


MEMBERS = 12_000


def _many_files(part: Path) -> None:
    """In directories of 100 (the digest lists a directory's names at once)."""
    for i in range(MEMBERS):
        if i % 100 == 0:
            (part / f"d{i // 100:03}").mkdir()
        (part / f"d{i // 100:03}" / f"f{i:05}").touch()


class _Sink(io.RawIOBase):
    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        return len(b)


@as_root
def test_export_and_import_hold_one_member_not_all_of_them(tmp_path: Path) -> None:
    """tarfile keeps every member it wrote or read, also on a stream: an export and an import
    of 200,000 files each grew the daemon by ~120 MB."""
    store, man = _layer(tmp_path / "src", _many_files)
    out = io.BytesIO()
    snapxfer.write_stream(store, man, out)  # type: ignore[arg-type]
    tracemalloc.start()
    try:
        snapxfer.write_stream(store, man, _Sink())  # type: ignore[arg-type]
        _, wrote = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        staging = tmp_path / "staging"
        staging.mkdir()
        out.seek(0)
        snapxfer.read_stream(out, str(staging), unpack.Limits(1 << 30, 2 * MEMBERS))
        _, read = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Kept, the members are ~500 bytes each (~6 MB here); let go, one at a time.
    assert wrote < 3 << 20, wrote
    assert read < 3 << 20, read
    part = staging / "layers" / man["sent"][0] / "0"
    assert sum(len(os.listdir(d)) for d in part.iterdir()) == MEMBERS
    with tarfile.open(fileobj=io.BytesIO(out.getvalue()), mode="r:") as tf:
        # and the manifest, the part, its directories
        assert len(tf.getnames()) == MEMBERS + 2 + MEMBERS // 100


def test_an_import_counts_what_sparse_members_claim(tmp_path: Path) -> None:
    """A sparse member sends its data and claims its size; the import writes and hashes the
    holes. Counted by their data, 20 KB of members claiming 16 GiB each held a core for
    minutes hashing zeros; what they claim counts against the snapshot's byte cap."""
    digest = "0" * 64
    man = {"format": snapxfer.FORMAT, "parts": {digest: [0]}, "sent": [digest],
           "snapshot": {"id": "snap-0123456789abcdef", "layers": [digest], "digest": digest,
                        "image": "host", "size": 0, "created_at": 0}}
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tf:
        data = json.dumps(man).encode()
        ti = tarfile.TarInfo(snapxfer.MANIFEST)
        ti.size = len(data)
        tf.addfile(ti, io.BytesIO(data))
        ti = tarfile.TarInfo(f"layers/{digest}/0")
        ti.type, ti.mode = tarfile.DIRTYPE, 0o755
        tf.addfile(ti)
        for i in range(3):
            ti = tarfile.TarInfo(f"layers/{digest}/0/f{i}")
            ti.size, ti.uid, ti.gid = 1, os.getuid(), os.getgid()
            ti.pax_headers = {unpack.SPARSE: f"{1 << 30};0:1"}
            tf.addfile(ti, io.BytesIO(b"x"))
    staging = tmp_path / "staging"
    staging.mkdir()
    out.seek(0)
    with pytest.raises(TooLarge):
        snapxfer.read_stream(out, str(staging), unpack.Limits(2 << 30, 1000))


def test_an_import_sent_chunked_asks_the_disk_as_it_unpacks(tmp_path: Path) -> None:
    """The cluster copies a tenant's snapshot to another node as a chunked body, which
    declares no size: checked only at its start (for 0 bytes), an import unpacked up to the
    snapshot bound (16 GiB) into the node's reserve. It asks the disk as it goes."""
    store, man = _layer(tmp_path / "src",
                        lambda part: (part / "big").write_bytes(os.urandom(40 << 20)))
    out = io.BytesIO()
    snapxfer.write_stream(store, man, out)  # type: ignore[arg-type]
    out.seek(0)
    asked: list[tuple[str, int]] = []

    def disk_check(what: str, need: int) -> None:
        asked.append((what, need))
        raise CapacityExceeded(f"the daemon's disk is short of room: {what}")

    class _Into:
        spares_dir = str(tmp_path / "spares")
        trash_dir = str(tmp_path / "trash")
        max_bytes, max_entries = 1 << 34, 1_000_000

    os.mkdir(_Into.spares_dir)
    os.mkdir(_Into.trash_dir)

    async def recv(n: int) -> bytes:
        return out.read(n)

    async def check_image(name: str) -> str:
        return name

    with pytest.raises(CapacityExceeded):
        asyncio.run(snapxfer.receive(_Into(), recv, check_image,  # type: ignore[arg-type]
                                     disk_check=disk_check))
    assert asked and asked[0][0] == "a snapshot import", asked
    assert not os.listdir(_Into.spares_dir)  # nothing of it stays
