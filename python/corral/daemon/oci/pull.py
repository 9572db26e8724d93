"""Pull one image: resolve the reference to a linux/amd64 manifest, fetch its config, then
each layer the store lacks (verified, unpacked, converted: oci.layers). Runs in a worker
thread; ``progress`` gets one event dict per step (the API streams them as NDJSON)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from corral.daemon.oci import egress, registry, unpack
from corral.daemon.oci.layers import LayerStore
from corral.daemon.oci.ref import Reference
from corral.errors import InvalidImage

Progress = Callable[[dict[str, Any]], None]
# What of the image config a sandbox uses (docs/images.md).
CONFIG_KEYS = ("Env", "WorkingDir", "User", "Entrypoint", "Cmd", "Labels", "ExposedPorts",
               "StopSignal")


def image_config(cfg: dict) -> dict[str, Any]:
    """The runtime part of an image config, type-checked (a wrong type is dropped)."""
    c = cfg.get("config") or cfg.get("Config") or {}
    if not isinstance(c, dict):
        return {}
    out: dict[str, Any] = {}
    for k in CONFIG_KEYS:
        v = c.get(k)
        if v is None:
            continue
        if k in ("Env", "Entrypoint", "Cmd"):
            if isinstance(v, list) and all(isinstance(x, str) for x in v):
                out[k] = v
        elif k in ("Labels",):
            if isinstance(v, dict):
                out[k] = {str(a): str(b) for a, b in v.items()}
        elif k == "ExposedPorts":
            if isinstance(v, dict):
                out[k] = sorted(v)
        elif isinstance(v, str) and v:
            out[k] = v
    return out


def pull(ref: Reference, store: LayerStore, limits: unpack.Limits,
         policy: egress.Egress | None = None, progress: Progress | None = None,
         pinned: list[str] | None = None, created: list[str] | None = None) -> dict:
    """The new image's metadata (the caller records it). Every layer is in the store when
    this returns; a failure leaves no half-made layer (layers already complete stay, shared
    and content-addressed, for the next attempt; GC removes them if no image claims them)."""
    emit = progress or (lambda e: None)
    pinned = [] if pinned is None else pinned  # the caller unpins once the image is recorded
    created = [] if created is None else created  # new layers: removed if the pull fails
    t0 = time.monotonic()
    with registry.Registry(ref, policy) as reg:
        manifest, mtype, digest = reg.manifest(ref.reference)
        cfg_desc = manifest.get("config")
        if not isinstance(cfg_desc, dict) or not isinstance(cfg_desc.get("digest"), str):
            raise InvalidImage(f"{ref}: manifest without a config")
        cfg = reg.config(cfg_desc["digest"])
        layers = manifest.get("layers")
        if not isinstance(layers, list):
            raise InvalidImage(f"{ref}: manifest without layers")
        unpack.check_layer_count(len(layers))
        rootfs = cfg.get("rootfs") if isinstance(cfg.get("rootfs"), dict) else {}
        diff_ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
        if not isinstance(diff_ids, list) or len(diff_ids) != len(layers):
            raise InvalidImage(f"{ref}: the config lists {len(diff_ids or [])} diff_ids for "
                               f"{len(layers)} layers")
        if (cfg.get("os"), cfg.get("architecture")) not in ((None, None), registry.PLATFORM):
            raise InvalidImage(f"{ref} is {cfg.get('os')}/{cfg.get('architecture')}, this node "
                               "runs linux/amd64")
        descs = []
        for d in layers:
            if not isinstance(d, dict) or not isinstance(d.get("digest"), str) \
                    or not isinstance(d.get("size"), int) or d["size"] < 0:
                raise InvalidImage(f"{ref}: a layer descriptor without digest or size")
            descs.append((registry.check_digest(d["digest"], "layer"), int(d["size"]),
                          str(d.get("mediaType") or unpack.GZIP[0])))
        total = sum(s for _, s, _ in descs)
        # A blob is on disk whole before its digest can fail: one the image could not hold
        # once unpacked is not fetched (1/64 over: incompressible data grows a little).
        if total > limits.max_bytes + limits.max_bytes // 64:
            raise unpack._too_large(limits)
        emit({"event": "resolved", "reference": str(ref), "digest": digest,
              "layers": len(descs), "total_bytes": total})
        hexes = []
        for i, (hexd, size, media) in enumerate(descs):
            cached = store.has(hexd)

            def fetch(dest: str, hexd: str = hexd, size: int = size) -> None:
                done = 0

                def step(n: int) -> None:
                    nonlocal done
                    done += n
                    emit({"event": "layer", "digest": "sha256:" + hexd, "state": "downloading",
                          "done": done, "total": size})

                reg.blob("sha256:" + hexd, size, dest, step)

            def state(s: str, hexd: str = hexd, size: int = size) -> None:
                emit({"event": "layer", "digest": "sha256:" + hexd, "state": s,
                      "done": size, "total": size})

            did = diff_ids[i]
            if not isinstance(did, str):  # a layer is taken only as its config names it
                raise InvalidImage(f"{ref}: the config's diff_id {i} is not a digest")
            store.pin([hexd])
            pinned.append(hexd)
            store.ensure(hexd, media, did, fetch, limits, state)
            if not cached:
                created.append(hexd)
            emit({"event": "layer", "digest": "sha256:" + hexd,
                  "state": "cached" if cached else "done", "done": size, "total": size})
            hexes.append(hexd)
    return {"kind": "oci", "reference": str(ref), "digest": digest, "media_type": mtype,
            "oci_layers": hexes, "config": image_config(cfg),
            "compressed_bytes": total, "size_bytes": limits.used_bytes,
            "pull_seconds": round(time.monotonic() - t0, 3)}
