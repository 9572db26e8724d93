"""Daemon-level calls (status, images) for the CLI and scripts; blocking."""

from __future__ import annotations

from corral.models import AllowlistInfo, DaemonStatus, ImageInfo, SubstrateInfo
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
