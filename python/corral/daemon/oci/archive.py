"""Images from files instead of a registry: an OCI image layout (a directory or a tar of one)
and a ``docker save`` archive (manifest.json + config + layer tars, either the classic
layout or Docker 25's OCI one). Every blob goes through the same checks as a pulled one
(digest, size, the unpack rules: oci.layers)."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tarfile
from collections.abc import Callable
from typing import IO, Any

from corral.daemon import safetar
from corral.daemon.oci import registry, unpack
from corral.daemon.oci.layers import LayerStore
from corral.daemon.oci.pull import image_config
from corral.errors import DigestMismatch, InvalidImage

MAX_JSON = 8 << 20


class _Source:
    """Files of a directory or of an (uncompressed) tar, by relative path, never outside."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.tar: tarfile.TarFile | None = None
        self.members: dict[str, tarfile.TarInfo] = {}
        if not os.path.isdir(path):
            try:
                self.tar = tarfile.open(path, "r:", tarinfo=safetar.ImageTarInfo)
            except (tarfile.TarError, OSError) as e:
                raise InvalidImage(f"{path}: not a tar archive ({e})") from e
            for m in self.tar.getmembers():
                if m.isreg():
                    self.members[os.path.normpath(m.name.lstrip("/"))] = m

    def close(self) -> None:
        if self.tar is not None:
            self.tar.close()

    def has(self, rel: str) -> bool:
        if self.tar is not None:
            return os.path.normpath(rel) in self.members
        try:
            return stat.S_ISREG(os.lstat(self._real(rel)).st_mode)
        except (OSError, InvalidImage):
            return False

    def _real(self, rel: str) -> str:
        norm = os.path.normpath(rel)
        if norm.startswith("..") or os.path.isabs(norm):
            raise InvalidImage(f"{rel!r} points outside the archive")
        real = os.path.realpath(os.path.join(self.path, norm))
        if not real.startswith(os.path.realpath(self.path) + "/"):
            raise InvalidImage(f"{rel!r} points outside the archive")
        return real

    def open(self, rel: str) -> IO[bytes]:
        if self.tar is not None:
            m = self.members.get(os.path.normpath(rel))
            f = self.tar.extractfile(m) if m is not None else None
            if f is None:
                raise InvalidImage(f"the archive has no file {rel!r}")
            return f
        try:
            return open(self._real(rel), "rb")
        except OSError as e:
            raise InvalidImage(f"the archive has no file {rel!r}") from e

    def json(self, rel: str) -> Any:
        with self.open(rel) as f:
            data = f.read(MAX_JSON + 1)
        if len(data) > MAX_JSON:
            raise InvalidImage(f"{rel} is larger than {MAX_JSON} bytes")
        try:
            return json.loads(data)
        except ValueError as e:
            raise InvalidImage(f"{rel} is not JSON") from e


def kind(path: str) -> str | None:
    """"oci" (an image layout), "docker" (docker save) or None (a plain rootfs)."""
    try:
        src = _Source(path)
    except InvalidImage:
        return None
    try:
        if src.has("oci-layout") and src.has("index.json"):
            return "oci"
        if src.has("manifest.json"):
            return "docker"
        return None
    finally:
        src.close()


def _copier(src: _Source, rel: str, digest: str | None) -> Callable[[str], None]:
    """fetch(dest) for LayerStore.ensure: copies ``rel``, checks it hashes to ``digest``."""
    def fetch(dest: str) -> None:
        h = hashlib.sha256()
        with src.open(rel) as f, open(dest, "xb") as out:
            while chunk := f.read(1 << 20):
                h.update(chunk)
                out.write(chunk)
        if digest is not None and "sha256:" + h.hexdigest() != digest:
            os.unlink(dest)
            raise DigestMismatch(f"{rel} does not match its digest {digest}",
                                 details={"expected": digest})
    return fetch


def _media_of(src: _Source, rel: str) -> str:
    with src.open(rel) as f:
        magic = f.read(4)
    if magic[:2] == b"\x1f\x8b":
        return unpack.GZIP[0]
    if magic == b"\x28\xb5\x2f\xfd":
        return unpack.ZSTD[0]
    return unpack.PLAIN[0]


def _digest_of(src: _Source, rel: str) -> str:
    h = hashlib.sha256()
    with src.open(rel) as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def load(path: str, store: LayerStore, limits: unpack.Limits, pinned: list[str]) -> dict:
    """The metadata of the image in the layout or archive at ``path`` (layers stored and
    pinned: ``pinned`` lists them for the caller to unpin once the image is recorded)."""
    src = _Source(path)
    try:
        if src.has("oci-layout") and src.has("index.json"):
            return _load_oci(src, store, limits, pinned)
        if src.has("manifest.json"):
            return _load_docker(src, store, limits, pinned)
        raise InvalidImage(f"{path} is neither an OCI image layout nor a docker save archive")
    finally:
        src.close()


def _blob(digest: str) -> str:
    return "blobs/sha256/" + registry.check_digest(digest, "blob")


def _load_oci(src: _Source, store: LayerStore, limits: unpack.Limits,
              pinned: list[str]) -> dict:
    doc = src.json("index.json")
    digest = ""
    for _ in range(3):  # index.json -> (an image index ->) a manifest
        if isinstance(doc, dict) and "layers" in doc and digest:
            break
        items = doc.get("manifests") if isinstance(doc, dict) else None
        if not isinstance(items, list) or not items or not isinstance(items[0], dict):
            raise InvalidImage("an OCI layout without a manifest")
        platforms = any(isinstance(m, dict) and m.get("platform") for m in items)
        pick = registry.pick_platform(doc, src.path) if platforms else str(items[0]["digest"])
        with src.open(_blob(pick)) as f:
            raw = f.read(MAX_JSON)
        if "sha256:" + hashlib.sha256(raw).hexdigest() != pick:
            raise DigestMismatch(f"manifest {pick} does not match its digest",
                                 details={"expected": pick})
        try:
            doc = json.loads(raw)
        except ValueError as e:
            raise InvalidImage(f"manifest {pick} is not JSON") from e
        digest = pick
    if not (isinstance(doc, dict) and "layers" in doc and isinstance(doc.get("config"), dict)):
        raise InvalidImage("an OCI layout whose index does not lead to an image manifest")
    cfg_d = doc["config"]["digest"]
    with src.open(_blob(cfg_d)) as f:
        cfg_raw = f.read(MAX_JSON)
    if "sha256:" + hashlib.sha256(cfg_raw).hexdigest() != cfg_d:
        raise DigestMismatch(f"config {cfg_d} does not match its digest")
    cfg = json.loads(cfg_raw)
    diff_ids = (cfg.get("rootfs") or {}).get("diff_ids") or []
    if len(diff_ids) != len(doc["layers"]):
        raise InvalidImage("the config's diff_ids do not match the layers")
    unpack.check_layer_count(len(diff_ids))
    if not all(isinstance(d, str) for d in diff_ids):
        raise InvalidImage("the config's diff_ids are not all digests")
    hexes = []
    for d, did in zip(doc["layers"], diff_ids, strict=True):
        hexd = registry.check_digest(d["digest"], "layer")
        store.pin([hexd])
        pinned.append(hexd)
        store.ensure(hexd, d.get("mediaType") or unpack.GZIP[0], did,
                     _copier(src, _blob(d["digest"]), d["digest"]), limits)
        hexes.append(hexd)
    return {"kind": "oci", "digest": digest, "oci_layers": hexes,
            "config": image_config(cfg), "size_bytes": limits.used_bytes}


def _load_docker(src: _Source, store: LayerStore, limits: unpack.Limits,
                 pinned: list[str]) -> dict:
    man = src.json("manifest.json")
    if not isinstance(man, list) or not man or not isinstance(man[0], dict):
        raise InvalidImage("docker save archive: manifest.json lists no image")
    entry = man[0]
    cfg_rel = entry.get("Config")
    layers = entry.get("Layers")
    if not isinstance(cfg_rel, str) or not isinstance(layers, list):
        raise InvalidImage("docker save archive: no Config or Layers")
    cfg = src.json(cfg_rel)
    diff_ids = (cfg.get("rootfs") or {}).get("diff_ids") or []
    if len(diff_ids) != len(layers):
        raise InvalidImage("the config's diff_ids do not match the layers")
    unpack.check_layer_count(len(diff_ids))
    if not all(isinstance(d, str) for d in diff_ids):
        raise InvalidImage("the config's diff_ids are not all digests")
    hexes = []
    for rel, did in zip(layers, diff_ids, strict=True):
        if not isinstance(rel, str):
            raise InvalidImage("docker save archive: a bad layer path")
        hexd = _digest_of(src, rel)  # the stored blob's own digest (a plain tar here)
        store.pin([hexd])
        pinned.append(hexd)
        store.ensure(hexd, _media_of(src, rel), did, _copier(src, rel, "sha256:" + hexd),
                     limits)
        hexes.append(hexd)
    cfg_digest = "sha256:" + _digest_of(src, cfg_rel)
    return {"kind": "oci", "digest": cfg_digest, "oci_layers": hexes,
            "config": image_config(cfg), "size_bytes": limits.used_bytes,
            "repo_tags": [t for t in entry.get("RepoTags") or [] if isinstance(t, str)]}

