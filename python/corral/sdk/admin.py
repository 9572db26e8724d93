"""Daemon-level calls (status, images) for the CLI and scripts; blocking."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from corral.models import (
    AllowlistInfo,
    DaemonStatus,
    ImageInfo,
    PruneResult,
    PushResult,
    SubstrateInfo,
)
from corral.sdk import api
from corral.sdk.endpoint import Endpoint
from corral.sdk.sync_transport import transport


def status(endpoint: str | Endpoint | None = None) -> DaemonStatus:
    return transport(Endpoint.parse(endpoint)).call(api.status())


def substrates(endpoint: str | Endpoint | None = None) -> list[SubstrateInfo]:
    """The substrates the daemon serves, each with its capability table."""
    return transport(Endpoint.parse(endpoint)).call(api.substrates())


def networks(endpoint: str | Endpoint | None = None) -> list[AllowlistInfo]:
    """The daemon's named allowlists."""
    return transport(Endpoint.parse(endpoint)).call(api.networks())


def network(name: str, endpoint: str | Endpoint | None = None) -> AllowlistInfo:
    return transport(Endpoint.parse(endpoint)).call(api.network(name))


def images(endpoint: str | Endpoint | None = None) -> list[ImageInfo]:
    return api.all_pages(transport(Endpoint.parse(endpoint)).call, api.images)


def import_image(name: str, source: str, endpoint: str | Endpoint | None = None) -> ImageInfo:
    """Register a host rootfs directory or tarball as image ``name``."""
    return transport(Endpoint.parse(endpoint)).call(api.import_image(name, source))


def pull_image(reference: str, progress: Callable[[dict[str, Any]], None] | None = None,
               endpoint: str | Endpoint | None = None,
               node_selector: Mapping[str, str] | None = None) -> ImageInfo:
    """Pull ``reference`` from its registry onto the daemon's node (credentials: the daemon's
    ``$DOCKER_CONFIG/config.json`` or ``~/.docker/config.json``). ``progress`` gets each
    event: ``{"event": "resolved", ...}``, ``{"event": "layer", "digest", "state", "done",
    "total"}``. Through a cluster gateway: on every node, or on those with the labels of
    ``node_selector``; each event then names its ``node``, and a node's end is
    ``{"event": "node_done"}`` (or ``node_error``)."""
    t = transport(Endpoint.parse(endpoint))
    if progress is None:
        return t.call(api.pull_image(reference, node_selector=node_selector))
    for line in t.lines(api.pull_image(reference, progress=True,
                                       node_selector=node_selector)):
        ev = api.pull_event(line)
        if ev.get("event") == "done":
            return ImageInfo.model_validate(ev["image"])
        progress(ev)
    raise ConnectionError("the pull's progress stream ended without a result")


def image_info(name: str, endpoint: str | Endpoint | None = None) -> ImageInfo:
    return transport(Endpoint.parse(endpoint)).call(api.image(name))


def remove_image(name: str, endpoint: str | Endpoint | None = None) -> dict[str, Any]:
    """Remove an image no sandbox or snapshot uses, and the layers no other image lists."""
    return transport(Endpoint.parse(endpoint)).call(api.remove_image(name))


def prune_images(endpoint: str | Endpoint | None = None) -> PruneResult:
    """Remove every layer no image lists."""
    return transport(Endpoint.parse(endpoint)).call(api.prune_images())


def tag_image(source: str, name: str, config: dict[str, Any] | None = None,
              replace: bool = False, endpoint: str | Endpoint | None = None) -> ImageInfo:
    """A new name for image ``source``'s layers, its config changed by ``config`` (Env,
    WorkingDir, User, Entrypoint, Cmd, Labels...): no file is copied."""
    return transport(Endpoint.parse(endpoint)).call(api.tag_image(source, name, config,
                                                                  replace))


def push_image(name: str, reference: str | None = None,
               endpoint: str | Endpoint | None = None) -> PushResult:
    """Push image ``name`` to ``reference`` (default: its name, a registry reference)."""
    return transport(Endpoint.parse(endpoint)).call(api.push_image(name, reference))
