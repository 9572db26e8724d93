"""Fuzz target: tar uploads through the API (``PUT /v1/sandboxes/{id}/files/tar``), in the
manner of Cloud Hypervisor's fuzzers.

Hypothesis builds archives of random members: every type (regular, directory, symlink, hard
link, devices, FIFOs, unknown type bytes), names with ``..``, absolute names, NULs and odd
bytes, links pointing out of the tree, sizes far larger than the data (up to 2^40), random
modes with setuid bits; then USTAR, GNU or PAX headers, with or without the end blocks,
truncated, with flipped bytes, gzip/bz2/xz compressed. For each upload: the answer is never a
5xx (a bad archive is a 4xx with a stable code), nothing the fuzzer named appears anywhere
outside the sandbox (every name carries a marker; the host directories a traversal could reach
are scanned after each upload), no setuid file lands inside, and the daemon keeps answering.

``CORRAL_FUZZ_EXAMPLES`` (default 150) sets the number of examples, e.g. 5000 for a long run.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import os
import tarfile

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from apiclient import client, create, kill
from conftest import STATE_DIR

EXAMPLES = int(os.environ.get("CORRAL_FUZZ_EXAMPLES", "150"))
MARK = f"fz{os.getpid()}"  # in every name the fuzzer makes: found anywhere outside = escape
DEST = "/fz/in"
# Host directories an escape would write to: the daemon's cwd and root, its state, the usual
# targets of ../ and absolute names.
HOST_DIRS = ["/", "/tmp", "/var/tmp", "/etc", "/root", "/run", "/fz", "/fz/in", "/usr",
             "/usr/local", "/var", "/var/lib", STATE_DIR, os.path.join(STATE_DIR, "sandboxes")]

TYPES = [tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE,
         tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE, tarfile.CONTTYPE, b"Z", b"\xff"]
LINKS = ["/", "..", "../..", "../../../../../../..", "/etc", "/etc/passwd", "/proc/1/root",
         "/proc/self/root/etc", f"/tmp/{MARK}", f"../../../../../../tmp/{MARK}", f"{MARK}a",
         f"d/{MARK}b", "/dev/null", "/sys/kernel", "/root"]
COMPONENTS = [f"{MARK}a", f"{MARK}b", f"d{MARK}", "d", "etc", "tmp", "proc", ".", "..", "",
              "...", " ", "a\\b", "\u00e9", "x" * 200]


@st.composite
def member_name(draw: st.DrawFn) -> str:
    if draw(st.booleans()):
        parts = draw(st.lists(st.sampled_from(COMPONENTS), min_size=1, max_size=6))
        name = "/".join(parts)
    else:
        name = draw(st.text(max_size=40)) + MARK
    if MARK not in name:
        name += "/" + MARK
    return draw(st.sampled_from(["", "/", "./", "//", "../"])) + name


@st.composite
def member(draw: st.DrawFn) -> bytes:
    """One member: its header(s) and data, possibly lying about its size."""
    ti = tarfile.TarInfo(draw(member_name()))
    ti.type = draw(st.sampled_from(TYPES))
    ti.mode = draw(st.integers(0, 0o7777))
    ti.uid = draw(st.sampled_from([0, 1000, 65534, 2**21 - 1]))
    ti.gid = draw(st.sampled_from([0, 1000, 65534]))
    ti.mtime = draw(st.integers(0, 2**33 - 1))
    if ti.type in (tarfile.SYMTYPE, tarfile.LNKTYPE):
        ti.linkname = draw(st.one_of(st.sampled_from(LINKS), member_name()))
    if ti.type in (tarfile.CHRTYPE, tarfile.BLKTYPE):
        ti.devmajor, ti.devminor = draw(st.sampled_from([(1, 3), (8, 0), (1, 1)]))
    data = draw(st.binary(max_size=2048))
    claim = draw(st.sampled_from([None, None, None, 2**33, 2**40, len(data) + 1, 0]))
    ti.size = len(data) if claim is None else claim
    fmt = draw(st.sampled_from([tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]))
    head = None
    for f in (fmt, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        try:
            head = ti.tobuf(f, "utf-8", "surrogateescape")
            break
        except ValueError:
            continue
    if head is None:
        head = tarfile.TarInfo(MARK).tobuf(tarfile.GNU_FORMAT)
    pad = (-len(data)) % 512
    return head + data + b"\0" * pad


@st.composite
def archive(draw: st.DrawFn) -> bytes:
    body = b"".join(draw(st.lists(member(), min_size=1, max_size=8)))
    if draw(st.booleans()):
        body += b"\0" * 1024  # the end-of-archive blocks
    cut = draw(st.sampled_from(["none", "none", "truncate", "flip", "garbage"]))
    if cut == "truncate":
        body = body[:draw(st.integers(0, len(body)))]
    elif cut == "flip" and body:
        for _ in range(draw(st.integers(1, 8))):
            i = draw(st.integers(0, len(body) - 1))
            body = body[:i] + bytes([body[i] ^ draw(st.integers(1, 255))]) + body[i + 1:]
    elif cut == "garbage":
        body += draw(st.binary(min_size=1, max_size=600))
    pack = draw(st.sampled_from(["raw", "raw", "gz", "bz2", "xz", "gz_truncated"]))
    if pack == "gz":
        body = gzip.compress(body)
    elif pack == "bz2":
        body = bz2.compress(body)
    elif pack == "xz":
        body = lzma.compress(body)
    elif pack == "gz_truncated":
        z = gzip.compress(body)
        body = z[:draw(st.integers(0, len(z)))]
    return body


def escaped() -> list[str]:
    """Paths outside the sandbox that carry the fuzzer's marker."""
    found = []
    for d in HOST_DIRS:
        try:
            found += [os.path.join(d, n) for n in os.listdir(d) if MARK in n]
        except OSError:
            continue
    sandboxes = os.path.join(STATE_DIR, "sandboxes")
    for root, dirs, files in os.walk(STATE_DIR):
        if root == sandboxes:
            dirs[:] = []  # sandboxes' own files (the upper dirs): inside by definition
            continue
        found += [os.path.join(root, n) for n in files + dirs if MARK in n]
    return found


@pytest.fixture(scope="module")
def box(daemon):
    with client() as c:
        sid = create(c, timeout=900)["id"]
        try:
            yield c, sid
        finally:
            kill(c, sid)


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          phases=[Phase.explicit, Phase.generate, Phase.shrink],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(data=archive())
def test_fuzz_tar_upload(box, data):
    c, sid = box
    r = c.put(f"/v1/sandboxes/{sid}/files/tar", params={"path": DEST}, content=data,
              headers={"Content-Type": "application/x-tar"})
    assert r.status_code < 500, (r.status_code, r.text)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["code"] and err["message"], r.text
    assert escaped() == []
    assert c.get("/v1/health").status_code == 200
    info = c.get(f"/v1/sandboxes/{sid}")
    assert info.status_code == 200 and info.json()["state"] == "running", info.text


def test_after_the_fuzz_nothing_escaped_and_no_setuid_inside(box):
    c, sid = box
    assert escaped() == []
    r = c.post(f"/v1/sandboxes/{sid}/exec",
               json={"cmd": f"find {DEST} -xdev -perm /6000 -type f 2>/dev/null | head"})
    assert r.status_code == 200, r.text
    assert r.json()["stdout"] == "", r.json()
    with client() as c2:  # and a fresh sandbox works
        other = create(c2)["id"]
        try:
            r = c2.post(f"/v1/sandboxes/{other}/exec", json={"cmd": "echo ok"})
            assert r.json()["stdout"] == "ok\n"
        finally:
            kill(c2, other)
