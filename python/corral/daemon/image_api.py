"""The image routes beyond list/import/upload (app.py): pull (with NDJSON progress), inspect,
remove, prune, commit (a sandbox's files as an image), tag, push. Images named by a registry
reference carry ``/`` and ``:``: the ``{name}`` path segment takes the rest of the path."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from corral.daemon import ops, tenancy
from corral.daemon.bodies import parse
from corral.daemon.routes import SB, Route
from corral.errors import Conflict, CorralError
from corral.models import (
    CommitRequest,
    ImageInfo,
    PruneResult,
    PullImageRequest,
    PushImageRequest,
    PushResult,
    TagImageRequest,
)

NAME_PATH = "/v1/images/{name}"


def _engine(request: web.Request) -> Any:
    from corral.daemon.app import ENGINE  # app imports this module

    return request.app[ENGINE]


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=json.dumps(obj, separators=(",", ":")).encode(), status=status,
                        content_type="application/json")


def _line(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def in_use(engine: Any) -> set[str]:
    """Dir layers live sandboxes were composed with (image layers are kept by their image),
    and the layers of the images warm pools hold sandboxes of (a removed image's layers stay
    until its pool is gone: a layer that is a snapshot part has no mount to outlive it)."""
    keep = {lay.digest[4:] for sb in list(engine.sandboxes.values()) for lay in sb.spec.layers
            if lay.digest and lay.digest.startswith("dir:")}
    pools = getattr(engine.pools, "pools", None) or {}
    for pool in list(pools.values()):
        keep.update(getattr(pool.image, "meta", {}).get("oci_layers", ()))
    return keep


async def gc_layers(engine: Any) -> list[str]:
    """Remove the layers no image lists; the snapshot parts among them go back to the
    snapshot store (freed there once no snapshot or sandbox holds them either)."""
    removed: list[str] = await asyncio.to_thread(engine.images.gc_layers, in_use(engine))
    released = engine.images.layers.drain_released()
    if engine.snaps is not None:
        engine.snaps.release(released)
    return removed


async def pull_image(request: web.Request) -> web.StreamResponse:
    """Pull a reference from its registry (one pull per reference at a time on this node)."""
    req: PullImageRequest = parse(await request.read(), PullImageRequest)
    engine = _engine(request)
    store = engine.images
    if engine.disk is not None:  # the pull's layers land on the state dir's disk
        engine.disk.check("an image pull")
    tenant = tenancy.tenant_of(request)  # its pulls are bounded (images.PULLS_PER_TENANT)
    if not req.progress:
        return _json(ops.entry(await store.pull(req.reference, tenant=tenant)), 201)
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    task = asyncio.ensure_future(store.pull(req.reference, queue.put_nowait, tenant=tenant))
    # One turn of the loop runs the pull's checks (reference, registry, the tenant's pull
    # quota: no await before them): a refusal gets its own status, not a 201 stream.
    await asyncio.sleep(0)
    if task.done() and task.exception() is not None:
        task.result()  # raises
    resp = web.StreamResponse(status=201, headers={"Content-Type": "application/x-ndjson"})
    await resp.prepare(request)
    try:
        while True:
            get = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
            if get in done:
                await resp.write(_line(get.result()))
                continue
            get.cancel()
            while not queue.empty():
                await resp.write(_line(queue.get_nowait()))
            break
        try:
            await resp.write(_line({"event": "done", "image": ops.entry(task.result())}))
        except CorralError as e:
            await resp.write(_line(e.to_payload()))
        await resp.write_eof()
    finally:
        if not task.done():
            task.cancel()  # this caller only: the pull itself is shielded (oci.flight)
    return resp


async def inspect_image(request: web.Request) -> web.Response:
    img = _engine(request).images.get(request.match_info["name"])
    return _json(ops.entry(img.info()))


async def delete_image(request: web.Request) -> web.Response:
    """Remove an image no live sandbox or snapshot uses, then the layers no image lists."""
    engine = _engine(request)
    store = engine.images
    img = store.get(request.match_info["name"])
    users = sorted(sb.id for sb in list(engine.sandboxes.values())
                   if sb.spec.image == img.name
                   or any(lay.image == img.name for lay in sb.spec.layers))
    snaps: list[str] = []
    if engine.snaps is not None:
        snaps = sorted(r["id"] for r in engine.snapshot_list() if r.get("image") == img.name)
    if users or snaps:
        raise Conflict(f"image {img.name!r} is in use by {len(users)} sandbox(es) and "
                       f"{len(snaps)} snapshot(s)",
                       details={"image": img.name, "sandboxes": users[:20],
                                "snapshots": snaps[:20]})
    await asyncio.to_thread(store.remove, img.name)
    removed = await gc_layers(engine)
    return _json({"name": img.name, "deleted": True,
                  "layers_removed": ["sha256:" + h for h in removed]})


async def prune_images(request: web.Request) -> web.Response:
    engine = _engine(request)
    removed = await gc_layers(engine)
    return _json({"layers_removed": ["sha256:" + h for h in removed]})


async def commit_sandbox(request: web.Request) -> web.Response:
    """A sandbox's files as a new image (its image's layers + one layer of its changes)."""
    req: CommitRequest = parse(await request.read(), CommitRequest)
    changes = req.config.model_dump(exclude_unset=True) if req.config else None
    info = await _engine(request).commit(request.match_info["id"], req.name, changes,
                                            req.replace)
    return _json(ops.entry(info), 201)


async def tag_image(request: web.Request) -> web.Response:
    req: TagImageRequest = parse(await request.read(), TagImageRequest)
    store = _engine(request).images
    changes = req.config.model_dump(exclude_unset=True) if req.config else None
    info = await asyncio.to_thread(store.tag, req.source, req.name, changes, req.replace)
    return _json(ops.entry(info), 201)


async def push_image(request: web.Request) -> web.Response:
    req: PushImageRequest = parse(await request.read(), PushImageRequest)
    store = _engine(request).images
    return _json(await asyncio.to_thread(store.push, req.name, req.reference))


_DELETED = {"type": "object", "required": ["name", "deleted", "layers_removed"], "properties": {
    "name": {"type": "string"}, "deleted": {"type": "boolean"},
    "layers_removed": {"type": "array", "items": {"type": "string"}}}}

ROUTES: tuple[Route, ...] = (
    Route("POST", "/v1/images/pull", pull_image, "Pull an image from an OCI registry (once per "
          "reference at a time on this node; progress: NDJSON events)", body=PullImageRequest,
          response=ImageInfo, status=201, errors=(403, 404, 413, 502), also=("ndjson",)),
    Route("POST", "/v1/images/tag", tag_image, "A new name for an image's layers, with "
          "config changes (no file is copied)", body=TagImageRequest, response=ImageInfo,
          status=201, errors=(404, 409, 501)),
    Route("POST", "/v1/images/push", push_image, "Push an image to an OCI registry (layers "
          "the registry lacks are sent as gzip tars)", body=PushImageRequest,
          response=PushResult, errors=(403, 404, 409, 501, 502)),
    Route("POST", SB + "/commit", commit_sandbox, "The sandbox's files as a new image: its "
          "image's layers and one new layer of what it changed", body=CommitRequest,
          response=ImageInfo, status=201, errors=(404, 409, 413, 501)),
    Route("POST", "/v1/images/prune", prune_images, "Remove every layer no image lists",
          response=PruneResult),
    Route("GET", NAME_PATH, inspect_image, "An image's details (OCI: digest, layers, config)",
          response=ImageInfo, errors=(404,)),
    Route("DELETE", NAME_PATH, delete_image, "Remove an image no sandbox or snapshot uses, and "
          "the layers no other image lists", response=_DELETED, errors=(404, 409)),
)
