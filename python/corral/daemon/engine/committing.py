"""Image commits: a sandbox's files (what it changed over its image) as a new image whose
layers are its image's, its snapshot chain's and one new layer on top, all in the node's
layer store (corral.daemon.oci.layers), usable at once by ``Sandbox(image=name)``."""

from __future__ import annotations

import asyncio
import builtins
import logging
import os
import subprocess
import time
from typing import TYPE_CHECKING, Any

from corral.daemon import removal
from corral.daemon.oci import commit as oci_commit
from corral.daemon.oci.layers import LayerStore
from corral.daemon.snapshots import SnapshotStore
from corral.errors import Unsupported
from corral.models import ImageInfo

if TYPE_CHECKING:  # pragma: no cover
    from .host import EngineHost

log = logging.getLogger("corral.images")


class CommitOps:
    async def commit(self: EngineHost, sid: str, name: str,
                     changes: dict[str, Any] | None = None,
                     replace: bool = False) -> ImageInfo:
        """Commit sandbox ``sid`` as image ``name``."""
        t0 = time.monotonic()
        images = self.images
        sb = self.lookup(sid)
        substrate = self.substrates[sb.spec.substrate]
        if not substrate.capabilities.snapshot:
            raise self._lacks(substrate, "commit")
        if sb.spec.layers:
            raise Unsupported("a sandbox composed with layers= cannot be committed: its "
                              "layers live at their own paths; commit one made on an image "
                              "alone", details={"id": sid})
        key = images.target_name(name, replace)
        image = self._image(sb.spec.image)
        config = oci_commit.merge_config(image.config, changes)
        snaps = self._snaps()
        held = sb.layers  # its snapshot chain, converted below: the sandbox may end meanwhile
        snaps.acquire(held)
        base_layers: builtins.list[str] = []
        made: builtins.list[str] = []
        try:
            base_layers = await asyncio.to_thread(images.layers_of, image)
            images.layers.pin(base_layers)  # a rootfs image's new layer: listed by no image yet
            sb, chain, (tmp, digest, size) = await self._capture(sid)
        except BaseException:
            snaps.release(held)
            images.layers.unpin(base_layers)
            raise
        t_capture = time.monotonic()
        snaps.acquire(chain)
        snaps.release(held)
        try:
            await asyncio.to_thread(_commit_layers, images.layers, snaps, chain, tmp, digest,
                                    made)
            t_layers = time.monotonic()
            info = images.record_derived(key, [*base_layers, *made], config,
                                         f"commit of {sid}")
        finally:
            snaps.release(chain)
            images.layers.unpin([*base_layers, *made])
            if os.path.lexists(tmp):
                removal.quiet_remove(tmp)
        log.info("image committed", extra={
            "sandbox": sid, "image": key, "bytes": size,
            "capture_ms": round((t_capture - t0) * 1000, 2),
            "layer_ms": round((t_layers - t_capture) * 1000, 2),
            "total_ms": round((time.monotonic() - t0) * 1000, 2)})
        return info


def _commit_layers(store: LayerStore, snaps: SnapshotStore, chain: list[str], tmp: str,
                   digest: str, out: list[str]) -> None:
    """The snapshot chain's root parts and the captured upper as store layers (worker
    thread), each added to ``out`` and pinned (the caller unpins once the image lists
    them); an empty part adds no layer."""
    parts = [(d, snaps.layer_path(d, 0), False) for d in chain]
    parts.append((digest, os.path.join(tmp, "0"), True))
    for hexd, part, owned in parts:
        if not os.path.isdir(part) or not os.listdir(part):
            continue
        store.pin([hexd])
        out.append(hexd)
        if store.has(hexd):
            continue
        tree = part
        if not owned:  # the snapshot keeps its own copy (cp -a: whiteouts, xattrs)
            tree = os.path.join(tmp, f"chain-{hexd[:16]}")
            subprocess.run(["cp", "-a", "--", part, tree], check=True,
                           capture_output=True, timeout=3600)
        skipped, nbytes = oci_commit.sanitize(tree)
        store.from_tree(hexd, tree, {"digest": "commit:" + hexd, "skipped": skipped,
                                     "unpacked_bytes": nbytes})
