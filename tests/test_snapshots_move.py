"""A snapshot moved between two daemons (docs/snapshots.md, "Moving a snapshot"): exported
from the session's corrald, imported into a private one, children made there see its files.
The import is attacked with hostile streams: each is refused with a stable code and leaves
nothing behind (no layer, no record, no staging dir, nothing written outside)."""

from __future__ import annotations

import io
import json
import os
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from test_snapshots import check_prepared, prepare

from corral import Sandbox
from corral.daemon.snapshots import layer_digest

from apiclient import client, expect_error
from conftest import CGROUP_NAME, private_daemon, wait_until


@pytest.fixture(scope="module")
def target() -> Iterator[object]:
    with private_daemon("corral-test-xnode-", f"{CGROUP_NAME}-xnode") as d:
        yield d


def _export(snap: str, have: tuple[str, ...] = ()) -> bytes:
    with client() as c:
        r = c.get(f"/v1/snapshots/{snap}/export", params=[("have", h) for h in have])
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("application/x-tar")
        return r.content


def _import(d: object, data: bytes | Iterator[bytes]) -> httpx.Response:
    with client(d.socket_path) as c:  # type: ignore[attr-defined]
        return c.post("/v1/snapshots", content=data,
                      headers={"Content-Type": "application/x-tar"})


def _layers(state: str) -> set[str]:
    return {p.name for p in Path(state, "layers").iterdir()}


def _members(data: bytes) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r|") as tf:
        return [m.name for m in tf]


def test_a_snapshot_moves_to_another_daemon_and_children_see_its_files(target):
    d = target
    with Sandbox(timeout=120) as sb:
        prepare(sb)
        blob = os.urandom(300_000)
        sb.files.write("/work/blob", blob)
        sb.exec("ln /work/blob /work/blob-link && touch -d '2001-02-03 04:05:06.123456789' "
                "/work/blob").check()
        snap = sb.snapshot(name=f"mover-{os.getpid()}")
    data = _export(snap.id)
    assert _members(data)[0] == "snapshot.json"
    before = _layers(d.state_dir)
    r = _import(d, data)
    assert r.status_code == 201, r.text
    got = r.json()
    assert got["id"] == snap.id and got["layers"] == snap.layers and got["image"] == "host"
    assert got["name"] == snap.name
    # Stored under the same digest, which the target recomputed from the files it wrote.
    for digest in snap.layers:
        assert layer_digest(os.path.join(d.state_dir, "layers", digest)) == digest
    assert _layers(d.state_dir) - before == set(snap.layers)
    ep = f"unix://{d.socket_path}"
    with Sandbox(snapshot=snap.id, endpoint=ep, timeout=120) as kid:
        check_prepared(kid)
        assert kid.files.read_bytes("/work/blob") == blob
        st = kid.exec("stat -c '%i %h %y' /work/blob /work/blob-link").stdout.split("\n")
        assert st[0].split()[:2] == st[1].split()[:2] and st[0].split()[1] == "2"
        assert "04:05:06.123456789" in st[0]
        # A child snapshot on top moves too, without the layer the target has.
        with Sandbox(snapshot=snap.id, timeout=120) as src_kid:
            src_kid.files.write("/work/second", "level two\n")
            snap2 = src_kid.snapshot()
        assert snap2.parent == snap.id and snap2.layers[:-1] == snap.layers
        data2 = _export(snap2.id, have=tuple(snap.layers))
        assert not any(m.startswith(f"layers/{snap.layers[0]}") for m in _members(data2))
        r = _import(d, data2)
        assert r.status_code == 201, r.text
        assert _layers(d.state_dir) - before == set(snap2.layers)
    with Sandbox(snapshot=snap2.id, endpoint=ep, timeout=120) as kid2:
        assert kid2.files.read("/work/second") == "level two\n"
        check_prepared(kid2)
    # The same id again: answered as it is (200), nothing stored twice.
    r = _import(d, data)
    assert r.status_code == 200 and r.json()["id"] == snap.id
    # A layer the stream leaves out must be on the target.
    with client(d.socket_path) as c:
        for s in (snap2.id, snap.id):
            assert c.delete(f"/v1/snapshots/{s}").status_code == 200
    expect_error(_import(d, data2), "invalid_snapshot_stream", 400)
    _nothing_left(d, before)
    snap2.delete()
    snap.delete()


def test_long_paths_move_whole(target):
    """A sandbox may make paths up to PATH_MAX (and deeper, by directory fds); stored under
    the state dir they grow past what a call by path takes, and the export of a snapshot
    holding a 4,020-byte one was cut short (its copies to other nodes failed as infra, and a
    node drain with them). The export walks by fds: a path of ~3,000 bytes moves whole."""
    d = target
    deep = "/work/" + "/".join(["p" * 200] * 15)  # ~3,000 bytes from the layer's root
    with Sandbox(timeout=120) as sb:
        sb.exec(["mkdir", "-p", deep]).check()
        sb.files.write(deep + "/f", "deep\n")
        snap = sb.snapshot()
    try:
        data = _export(snap.id)
        assert any(m.endswith("/f") and len(m) > 3000 for m in _members(data))
        r = _import(d, data)
        assert r.status_code == 201, r.text
        try:
            with Sandbox(snapshot=snap.id, endpoint=f"unix://{d.socket_path}",
                         timeout=120) as kid:
                assert kid.files.read(deep + "/f") == "deep\n"
        finally:  # the target's store as the other tests find it
            with client(d.socket_path) as c:
                assert c.delete(f"/v1/snapshots/{snap.id}").status_code in (200, 204)
    finally:
        snap.delete()


def test_export_of_an_unknown_snapshot_and_bad_have(target):
    with client() as c:
        expect_error(c.get("/v1/snapshots/snap-0000000000000000/export"),
                     "snapshot_not_found", 404)
        with Sandbox(timeout=120) as sb:
            snap = sb.snapshot()
        try:
            expect_error(c.get(f"/v1/snapshots/{snap.id}/export", params={"have": "../x"}),
                         "invalid_request", 400)
        finally:
            snap.delete()


# ---- hostile streams ----------------------------------------------------------------------
D = "ab" * 32  # a well-formed digest nothing hashes to here


def _manifest(layers: list[str], sent: list[str], parts: dict[str, list[int]] | None = None,
              image: str = "host") -> bytes:
    rec = {"id": "snap-" + os.urandom(8).hex(), "name": None, "parent": None, "image": image,
           "digest": layers[-1], "layers": layers, "size": 1, "created_at": time.time(),
           "sandbox_id": "sb-x"}
    return json.dumps({"format": "corral-snapshot/1", "snapshot": rec,
                       "parts": parts or {d: [0] for d in layers}, "sent": sent}).encode()


def _stream(manifest: bytes, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w|", format=tarfile.PAX_FORMAT) as tf:
        ti = tarfile.TarInfo("snapshot.json")
        ti.size = len(manifest)
        tf.addfile(ti, io.BytesIO(manifest))
        for ti, data in members:
            if data is not None:
                ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _m(name: str, kind: bytes = tarfile.REGTYPE, link: str = "", **kw: int) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type, ti.linkname, ti.mode = kind, link, 0o644
    for k, v in kw.items():
        setattr(ti, k, v)
    return ti


def _pax(name: str, **headers: str) -> tarfile.TarInfo:
    ti = _m(name)
    ti.pax_headers = headers
    return ti


def _part(digest: str = D) -> tuple[tarfile.TarInfo, None]:
    return (_m(f"layers/{digest}/0", tarfile.DIRTYPE), None)


def _nothing_left(d: object, layers_before: set[str]) -> None:
    state = d.state_dir  # type: ignore[attr-defined]
    assert _layers(state) <= layers_before
    assert not [p for p in os.listdir(os.path.join(state, "spares")) if p.startswith("imp-")]
    with client(d.socket_path) as c:  # type: ignore[attr-defined]
        assert c.get("/v1/snapshots").json()["snapshots"] == []


def test_hostile_import_streams_are_refused_and_leave_nothing(target):
    d = target
    before = _layers(d.state_dir)
    victim = tempfile.mkdtemp(prefix="corral-test-victim-", dir="/var/tmp")
    up = "../" * 12
    try:
        cases: dict[str, tuple[bytes, str]] = {
            "dotdot": (_stream(_manifest([D], [D]), [
                _part(), (_m(f"layers/{D}/0/{up}{victim[1:]}/evil"), b"x")]),
                "invalid_snapshot_stream"),
            "dotdot_in_part": (_stream(_manifest([D], [D]), [
                _part(), (_m(f"layers/{D}/0/a/../../../{D}x/0/f"), b"x")]),
                "invalid_snapshot_stream"),
            "outside_layers": (_stream(_manifest([D], [D]), [
                (_m(f"/{victim[1:]}/evil"), b"x")]), "invalid_snapshot_stream"),
            "through_symlink": (_stream(_manifest([D], [D]), [
                _part(), (_m(f"layers/{D}/0/lnk", tarfile.SYMTYPE, victim), None),
                (_m(f"layers/{D}/0/lnk/evil"), b"x")]), "invalid_snapshot_stream"),
            "device": (_stream(_manifest([D], [D]), [
                _part(), (_m(f"layers/{D}/0/mem", tarfile.CHRTYPE, devmajor=1, devminor=1),
                          None)]), "invalid_snapshot_stream"),
            "hard_link_out": (_stream(_manifest([D, "cd" * 32], [D, "cd" * 32]), [
                _part(), (_m(f"layers/{D}/0/f"), b"x"), _part("cd" * 32),
                (_m(f"layers/{'cd' * 32}/0/g", tarfile.LNKTYPE, f"layers/{D}/0/f"), None)]),
                "invalid_snapshot_stream"),
            "hard_link_host": (_stream(_manifest([D], [D]), [
                _part(), (_m(f"layers/{D}/0/g", tarfile.LNKTYPE, "/etc/shadow"), None)]),
                "invalid_snapshot_stream"),
            "undeclared_part": (_stream(_manifest([D], [D]), [
                _part(), (_m(f"layers/{D}/7/f"), b"x")]), "invalid_snapshot_stream"),
            "digest_mismatch": (_stream(_manifest([D], [D]), [
                _part(), (_m(f"layers/{D}/0/f"), b"not what the digest says")]),
                "snapshot_digest_mismatch"),
            "missing_part": (_stream(_manifest([D], [D]), []), "invalid_snapshot_stream"),
            "missing_layer": (_stream(_manifest(["ef" * 32], []), []),
                              "invalid_snapshot_stream"),
            "no_manifest": (_stream(b"{}", [])[512 * 2:], "invalid_snapshot_stream"),
            "bad_manifest": (_stream(b'{"format": "corral-snapshot/1", "snapshot": '
                                     b'{"layers": ["../x"]}}', []), "invalid_snapshot_stream"),
            "unknown_image": (_stream(_manifest([D], [D], image="nowhere-image"), [
                _part(), (_m(f"layers/{D}/0/f"), b"x")]), "image_not_found"),
            "not_tar": (b"\x00garbage" * 200, "invalid_snapshot_stream"),
            "huge_owner": (_stream(_manifest([D], [D]), [
                _part(), (_pax(f"layers/{D}/0/f", uid=str(1 << 40)), b"x")]),
                "invalid_snapshot_stream"),
            # a sparse member's segments overlapping, past its size, or not its data's
            "sparse_overlap": (_stream(_manifest([D], [D]), [
                _part(), (_pax(f"layers/{D}/0/f", **{"CORRAL.sparse": "100;10:1,5:0"}), b"x")]),
                "invalid_snapshot_stream"),
            "sparse_past_size": (_stream(_manifest([D], [D]), [
                _part(), (_pax(f"layers/{D}/0/f", **{"CORRAL.sparse": "4;10:1"}), b"x")]),
                "invalid_snapshot_stream"),
            "sparse_huge": (_stream(_manifest([D], [D]), [
                _part(), (_pax(f"layers/{D}/0/f", **{"CORRAL.sparse": f"{1 << 60};0:1"}),
                          b"x")]), "too_large"),
            # (the kernel clamps the time; the file then does not hash to the digest)
            "huge_mtime": (_stream(_manifest([D], [D]), [
                _part(), (_pax(f"layers/{D}/0/f", **{"CORRAL.mtime_ns": "9" * 24}), b"x")]),
                "snapshot_digest_mismatch"),
        }
        for name, (data, code) in cases.items():
            r = _import(d, data)
            assert r.status_code in (400, 404), (name, r.status_code, r.text)
            assert r.json()["error"]["code"] == code, (name, r.text)
            assert os.listdir(victim) == [], name
            _nothing_left(d, before)
        # A real export cut short: refused, nothing kept.
        with Sandbox(timeout=120) as sb:
            sb.files.write("/work/big", os.urandom(2 << 20))
            snap = sb.snapshot()
        try:
            whole = _export(snap.id)
            for cut in (len(whole) // 2, len(whole) - 20_000, 700):  # inside data
                r = _import(d, whole[:cut])
                assert r.json()["error"]["code"] in ("invalid_snapshot_stream",
                                                     "snapshot_digest_mismatch"), (cut, r.text)
                _nothing_left(d, before)
        finally:
            snap.delete()
    finally:
        os.rmdir(victim)  # fails if anything was written there


def test_an_import_cut_by_its_client_leaves_nothing(target):
    """The importer's client goes away mid-body (a copy whose source broke): the daemon
    drops the partial import."""
    d = target
    before = _layers(d.state_dir)
    with Sandbox(timeout=120) as sb:
        sb.files.write("/work/big", os.urandom(4 << 20))
        snap = sb.snapshot()
    try:
        whole = _export(snap.id)

        def body() -> Iterator[bytes]:
            yield whole[:len(whole) // 2]
            raise ConnectionError("the source broke")
        with pytest.raises((ConnectionError, httpx.HTTPError)):
            _import(d, body())

        def clean() -> bool:
            try:
                _nothing_left(d, before)
                return True
            except AssertionError:
                return False
        assert wait_until(clean, timeout=10)
    finally:
        snap.delete()


# What a sandbox may leave in its files that a tar has no plain form for: a socket (a server's
# leftover), names that read as whiteouts or an opaque marker, a POSIX ACL, a setuid directory,
# a sticky FIFO, and the whiteout of a file named ".wh..opq" (which reads as ".wh..wh..opq").
_ODD_FILES = r"""
import os, socket, stat
os.makedirs('/work/odd/d', exist_ok=True)
socket.socket(socket.AF_UNIX).bind('/work/odd/sock')
open('/work/odd/.wh.foo', 'w').write('not a whiteout')
open('/work/odd/d/.wh..wh..opq', 'w').write('not an opaque marker')
open('/work/odd/acl', 'w').write('acl')
# user::rw- user:1000:rw- group::r-- mask::rw- other::r--
os.setxattr('/work/odd/acl', 'system.posix_acl_access', bytes.fromhex(
    '0200000001000600ffffffff02000600e803000004000400ffffffff10000600ffffffff20000400ffffffff'))
os.makedirs('/work/odd/su', exist_ok=True)
os.chmod('/work/odd/su', 0o4755)
os.mkfifo('/work/odd/fifo')
os.chmod('/work/odd/fifo', 0o1644)
os.remove('/work/odd/.wh..opq')   # a file of the parent snapshot: its whiteout is in this layer
# xattr names a PAX keyword cannot hold (not UTF-8, a '=', a newline), on a file and a dir
open('/work/odd/xa', 'w').write('xa')
for target in (b'/work/odd/xa', b'/work/odd/d'):
    for name in (b'user.\xff\xfe', b'user.a=b', b'user.new\nline', b'user.plain'):
        os.setxattr(target, name, b'v\xff' + name)
# mtimes before 1970 (one before 1901: past a 32-bit time)
open('/work/odd/old', 'w').write('old')
os.utime('/work/odd/old', ns=(0, -1))
open('/work/odd/older', 'w').write('older')
os.utime('/work/odd/older', ns=(0, -3_000_000_000_123_456_789))
"""


def test_a_snapshot_of_files_a_tar_has_no_plain_form_for_moves_whole(target):
    """Each of these made the export's layer hash differently on arrival: the import was
    snapshot_digest_mismatch, and the cluster's copy of the snapshot (a spread fork, a create
    placed on a node that lacks it) snapshot_copy_failed, infra: a sandbox could make every
    such fork of its own fail as the platform's and be masked."""
    d = target
    before = _layers(d.state_dir)
    with Sandbox(timeout=120) as sb:
        sb.exec("mkdir -p /work/odd && echo parent > /work/odd/.wh..opq").check()
        base = sb.snapshot()
    snap = None
    try:
        with Sandbox(snapshot=base.id, timeout=120) as sb:
            sb.exec(["python3", "-c", _ODD_FILES]).check()
            # as the sandbox's filesystem holds them (one may clamp a time past 32 bits)
            times = sb.exec(["python3", "-c", "import os; print(os.lstat('/work/odd/old')"
                             ".st_mtime_ns, os.lstat('/work/odd/older').st_mtime_ns)"]).stdout
            snap = sb.snapshot()
        r = _import(d, _export(snap.id))
        assert r.status_code == 201, r.text
        for digest in snap.layers:
            assert layer_digest(os.path.join(d.state_dir, "layers", digest)) == digest
        with Sandbox(snapshot=snap.id, endpoint=f"unix://{d.socket_path}", timeout=120) as kid:
            out = kid.exec("cd /work/odd && stat -c '%n %F %a' sock .wh.foo d/.wh..wh..opq su "
                           "fifo && cat .wh.foo d/.wh..wh..opq && "
                           "(test -e .wh..opq && echo present || echo gone)").stdout
            acl = kid.exec(["python3", "-c", "import os; print(os.getxattr('/work/odd/acl', "
                            "'system.posix_acl_access').hex())"]).stdout
            odd = kid.exec(["python3", "-c", "import os\n"
                            "for t in (b'/work/odd/xa', b'/work/odd/d'):\n"
                            "    ns = [os.fsencode(n) for n in os.listxattr(t)]\n"
                            "    print(sorted((n, os.getxattr(t, n)) for n in ns"
                            " if n.startswith(b'user.')))\n"
                            "print(os.lstat('/work/odd/old').st_mtime_ns, "
                            "os.lstat('/work/odd/older').st_mtime_ns)"]).stdout
        assert "sock socket 755" in out, out
        assert ".wh.foo regular file 644" in out and "not a whiteout" in out, out
        assert "d/.wh..wh..opq regular file 644" in out and "not an opaque marker" in out, out
        assert "su directory 4755" in out and "fifo fifo 1644" in out, out
        assert out.endswith("gone\n"), out
        assert acl.startswith("0200000001000600ffffffff02000600e8030000"), acl
        names = [b"user.\xff\xfe", b"user.a=b", b"user.new\nline", b"user.plain"]
        want = repr(sorted((n, b"v\xff" + n) for n in names))
        # -1 ns exactly; before 1901 as each filesystem holds it (ext4 clamps to 1901)
        assert odd.splitlines()[:2] == [want, want], odd
        got, sent = odd.splitlines()[2].split(), times.split()
        assert got[0] == sent[0] == "-1", (got, sent)
        assert int(got[1]) <= -(1 << 31) * 10**9 and int(sent[1]) <= -(1 << 31) * 10**9
        with client(d.socket_path) as c:
            for s in (snap.id, base.id):
                c.delete(f"/v1/snapshots/{s}")
    finally:
        if snap is not None:
            snap.delete()
        base.delete()
    _nothing_left(d, before)


def test_a_sparse_file_moves_as_its_data(target):
    """A file of holes costs its sandbox nothing; its export sent the holes as zeros (a
    cluster's copy of a 15 GiB one: 15 GiB through the gateway, written in full on the
    target's disk). Only the data travels, and the copy keeps the holes."""
    d = target
    with Sandbox(timeout=120) as sb:
        sb.exec("mkdir -p /work && truncate -s 2G /work/holes && echo mid | dd of=/work/holes "
                "bs=1 seek=1073741824 conv=notrunc 2>/dev/null && echo tail >> /work/holes"
                ).check()
        snap = sb.snapshot()
    try:
        sent = bytearray()
        with client() as c, c.stream("GET", f"/v1/snapshots/{snap.id}/export") as r:
            assert r.status_code == 200
            for chunk in r.iter_bytes():
                sent += chunk
                assert len(sent) < 16 * 2**20, "the holes were sent as data"
        r = _import(d, bytes(sent))
        assert r.status_code == 201, r.text
        f = os.path.join(d.state_dir, "layers", snap.digest, "0", "work", "holes")
        st = os.stat(f)
        assert st.st_size == (2 << 30) + 5 and st.st_blocks * 512 < 16 * 2**20
        with Sandbox(snapshot=snap.id, endpoint=f"unix://{d.socket_path}", timeout=120) as kid:
            out = kid.exec("dd if=/work/holes bs=1 skip=1073741824 count=4 2>/dev/null; "
                           "tail -c 5 /work/holes").stdout
        assert out == "mid\ntail\n", out
        with client(d.socket_path) as c:
            c.delete(f"/v1/snapshots/{snap.id}")
    finally:
        snap.delete()
