"""Tars whose headers the stdlib's tarfile parses in quadratic time with the GIL held
(CVE-2024-6232), whose headers are huge, or whose sparse members claim a GiB of holes, sent
to a real daemon: by a tenant's upload into its sandbox and by an image import (the layer
unpacker a pull uses). Each is refused with a stable error, and another tenant's health
checks stay answered meanwhile (corral.daemon.safetar, docs/security.md)."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

from corral.errors import CorralError
from corral.sdk import admin

from conftest import CGROUP_NAME, tenant_client, tenant_daemon
from healthprobe import HealthProbe

TOKENS = {"mallory": "mallory-token-0123456789", "victor": "victor-token-0123456789"}
MAX_BYTES = 64 << 20
# Generous for a loaded machine: against the code before safetar, 100,000 digits stalled
# the daemon ~20 s.
STALL_S = 2.0


@pytest.fixture(scope="module")
def served() -> Iterator[dict[str, Any]]:
    with tenant_daemon("corral-test-tarhdr-", f"{CGROUP_NAME}-tarhdr", TOKENS,
                       CORRAL_IMAGE_MAX_BYTES=str(MAX_BYTES)) as (d, base):
        yield {"base": base, "daemon": d}


@pytest.fixture
def workdir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="corral-tarhdr-", dir="/var/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _probe(base: str) -> HealthProbe:
    """victor's health checks while the block runs."""
    return HealthProbe(base, TOKENS["victor"])


def _digits_tar(n: int) -> bytes:
    """A PAX header of ``n`` ASCII digits, then a small file."""
    hdr = tarfile.TarInfo("././@PaxHeader")
    hdr.type, hdr.size = tarfile.XHDTYPE, n
    ti = tarfile.TarInfo("hello")
    ti.size = 3
    return (hdr.tobuf(tarfile.USTAR_FORMAT) + b"1" * n + b"\0" * (-n % 512)
            + ti.tobuf(tarfile.USTAR_FORMAT) + b"hi\n" + b"\0" * 509 + b"\0" * 1024)


def _layout(root: str, plain: bytes, zstd: bool = False) -> str:
    """An OCI image layout at ``root`` of one layer, the tar ``plain``."""
    blobs = os.path.join(root, "blobs", "sha256")
    os.makedirs(blobs)

    def put(data: bytes) -> dict[str, Any]:
        digest = hashlib.sha256(data).hexdigest()
        with open(os.path.join(blobs, digest), "wb") as f:
            f.write(data)
        return {"digest": "sha256:" + digest, "size": len(data)}

    if zstd:
        import zstandard

        layer = {"mediaType": "application/vnd.oci.image.layer.v1.tar+zstd",
                 **put(zstandard.ZstdCompressor().compress(plain))}
    else:
        layer = {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                 **put(gzip.compress(plain, 1))}
    config = {"architecture": "amd64", "os": "linux", "config": {},
              "rootfs": {"type": "layers",
                         "diff_ids": ["sha256:" + hashlib.sha256(plain).hexdigest()]}}
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                           **put(json.dumps(config).encode())},
                "layers": [layer]}
    index = {"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json",
         **put(json.dumps(manifest).encode())}]}
    with open(os.path.join(root, "index.json"), "w") as f:
        json.dump(index, f)
    with open(os.path.join(root, "oci-layout"), "w") as f:
        json.dump({"imageLayoutVersion": "1.0.0"}, f)
    return root


def _import(served: dict, name: str, source: str) -> dict[str, Any]:
    """The admin's import of ``source`` (host paths: the unix socket only): its error."""
    with pytest.raises(CorralError) as e:  # PROBE
        print("HWM", _hwm_kib(served["daemon"].proc.pid))
        admin.import_image(name, source, endpoint=f"unix://{served['daemon'].socket_path}")
    return {"code": e.value.code, "details": e.value.details}


def _leftovers(state: str) -> list[str]:
    return os.listdir(os.path.join(state, "oci", "tmp"))


def _hwm_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def test_an_upload_with_a_header_of_digits_is_refused_and_stalls_no_one(served: dict) -> None:
    base = served["base"]
    with tenant_client(base, TOKENS["mallory"], timeout=600) as m:
        r = m.post("/v1/sandboxes", json={})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        try:
            with _probe(base) as p:
                r = m.put(f"/v1/sandboxes/{sid}/files/tar", params={"path": "/tmp/up"},
                          content=gzip.compress(_digits_tar(100_000)))
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["code"] == "invalid_request"
            assert err["details"]["reason"] == "header_framing"
            assert p.worst < STALL_S, p.took
        finally:
            m.delete(f"/v1/sandboxes/{sid}")


def test_a_layer_with_a_header_of_digits_is_refused_and_stalls_no_one(
        served: dict, workdir: str) -> None:
    src = _layout(os.path.join(workdir, "digits"), _digits_tar(100_000))
    with _probe(served["base"]) as p:
        err = _import(served, "tarhdr-digits", src)
    assert err["code"] == "invalid_image" and err["details"]["reason"] == "header_framing"
    assert p.worst < STALL_S, p.took
    assert _leftovers(served["daemon"].state_dir) == []


def test_a_layer_with_a_huge_header_is_refused_unread(served: dict, workdir: str) -> None:
    # 48 MiB of PAX header (under the image's bound) in a few KB of zstd: read, the daemon
    # held it ~3 times over
    body = b"x" * (48 << 20)
    hdr = tarfile.TarInfo("././@PaxHeader")
    hdr.type, hdr.size = tarfile.XHDTYPE, len(body)
    plain = hdr.tobuf(tarfile.USTAR_FORMAT) + body + b"\0" * (-len(body) % 512 + 1024)
    src = _layout(os.path.join(workdir, "huge"), plain, zstd=True)
    del plain, body
    pid = served["daemon"].proc.pid
    before = _hwm_kib(pid)
    with _probe(served["base"]) as p:
        err = _import(served, "tarhdr-huge", src)
    assert err["code"] == "invalid_image" and err["details"]["limit"] == "header_bytes"
    assert _hwm_kib(pid) - before < 32 << 10, (before, _hwm_kib(pid))
    assert p.worst < STALL_S, p.took
    assert _leftovers(served["daemon"].state_dir) == []


@pytest.mark.skipif(shutil.which("tar") is None, reason="needs GNU tar")
def test_a_layer_with_a_sparse_member_is_refused_before_it_is_written(
        served: dict, workdir: str) -> None:
    sp = os.path.join(workdir, "sp")
    os.mkdir(sp)
    with open(os.path.join(sp, "big"), "wb") as f:
        f.truncate(256 << 20)  # all hole, ~10 KB of tar: 4 times the image's bound
    plain = subprocess.run(["tar", "--sparse", "--format=pax", "-C", sp, "-cf", "-", "big"],
                           check=True, capture_output=True).stdout
    src = _layout(os.path.join(workdir, "sparse"), plain)
    state = served["daemon"].state_dir
    err = _import(served, "tarhdr-sparse", src)
    assert err["code"] == "invalid_image" and err["details"]["reason"] == "sparse"
    assert _leftovers(state) == []
    used = subprocess.run(["du", "-sm", os.path.join(state, "oci")], capture_output=True,
                          text=True, check=True).stdout.split()[0]
    assert int(used) < 64, used
