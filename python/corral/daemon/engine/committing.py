"""Image commits: a sandbox's files (what it changed over its image) as a new image whose
layers are its image's, its snapshot chain's and one new layer on top, all in the node's
layer store (corral.daemon.oci.layers), usable at once by ``Sandbox(image=name)``. Parts
that need no cleaning are the snapshot store's own files, not copies (oci.commit)."""

from __future__ import annotations

import asyncio
import builtins
import logging
import os
import time
from typing import TYPE_CHECKING, Any

from corral.daemon import removal
from corral.daemon.oci import commit as oci_commit
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
        share: builtins.list[tuple[str, int, bool]] = []
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
            await asyncio.to_thread(oci_commit.store_layers, images.layers, snaps, chain, tmp,
                                    digest, made, share)
            # On the loop, while this commit still holds the chain: a shared part takes its
            # image entry's reference before the chain's holders may let go.
            oci_commit.share_layers(images.layers, snaps, tmp, share)
            t_layers = time.monotonic()
            info = images.record_derived(key, [*base_layers, *made], config,
                                         f"commit of {sid}", replace)
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
