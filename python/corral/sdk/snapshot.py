"""``corral.Snapshot`` / ``corral.AsyncSnapshot``: a sandbox's files frozen as a read-only layer.

Made by ``sandbox.snapshot()`` (or ``fork``); start sandboxes on one with
``Sandbox(snapshot=snap)``; roll a sandbox back with ``sandbox.restore(snap)``. A snapshot
outlives its sandbox until deleted; its layers live as long as a sandbox or a child snapshot
stands on them. Filesystem state only: processes are not captured (docs/snapshots.md).
"""

from __future__ import annotations

import builtins
from typing import Any

from corral.models import SnapshotInfo
from corral.sdk import api
from corral.sdk.endpoint import Endpoint


def transport(endpoint: Endpoint) -> Any:
    from corral.sdk.sync_transport import transport as sync_transport  # (import cycle)

    return sync_transport(endpoint)


class SnapshotBase:
    """The fields of a snapshot plus the endpoint it lives on (picklable)."""

    id: str
    name: str | None
    parent: str | None
    image: str
    digest: str
    layers: list[str]
    size: int
    created_at: float
    sandbox_id: str | None

    def __init__(self, info: SnapshotInfo, endpoint: Endpoint) -> None:
        self._endpoint = endpoint
        self.info = info
        for k, v in info.model_dump().items():
            setattr(self, k, v)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_restore, (type(self), self.info.model_dump(), self._endpoint.url,
                           self._endpoint.node))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SnapshotBase) and (other.id, other._endpoint) == \
            (self.id, self._endpoint)

    def __hash__(self) -> int:
        return hash((self.id, self._endpoint))

    def __repr__(self) -> str:
        name = f" {self.name!r}" if self.name else ""
        return f"<{type(self).__name__} {self.id}{name} image={self.image} size={self.size}>"


def _restore(cls: type[SnapshotBase], info: dict[str, Any], url: str,
             node: str | None = None) -> SnapshotBase:
    return cls(SnapshotInfo.model_validate(info), Endpoint(url, node))


class Snapshot(SnapshotBase):
    """A snapshot (blocking API)."""

    @classmethod
    def list(cls, *, endpoint: str | Endpoint | None = None) -> builtins.list[Snapshot]:
        """Every snapshot on the daemon, oldest first."""
        ep = Endpoint.parse(endpoint)
        return [cls(i, ep.placed(i)) for i in api.all_pages(transport(ep).call, api.snapshots)]

    @classmethod
    def get(cls, key: str, *, endpoint: str | Endpoint | None = None) -> Snapshot:
        """A snapshot by id or name (raises corral.SnapshotNotFound)."""
        ep = Endpoint.parse(endpoint)
        info = transport(ep).call(api.snapshot_get(key))
        return cls(info, ep.placed(info))  # through a cluster gateway: its node

    def delete(self) -> bool:
        """Delete it; layers still used by sandboxes or child snapshots stay until they end."""
        return transport(self._endpoint).call(api.snapshot_delete(self.id))


class AsyncSnapshot(SnapshotBase):
    """A snapshot (asyncio API)."""

    @classmethod
    async def list(cls, *,
                   endpoint: str | Endpoint | None = None) -> builtins.list[AsyncSnapshot]:
        from corral.sdk.async_sandbox import transport as atransport

        ep = Endpoint.parse(endpoint)
        return [cls(i, ep.placed(i))
                for i in await api.all_pages_async(atransport(ep).call, api.snapshots)]

    @classmethod
    async def get(cls, key: str, *, endpoint: str | Endpoint | None = None) -> AsyncSnapshot:
        from corral.sdk.async_sandbox import transport as atransport

        ep = Endpoint.parse(endpoint)
        info = await atransport(ep).call(api.snapshot_get(key))
        return cls(info, ep.placed(info))  # through a cluster gateway: its node

    async def delete(self) -> bool:
        from corral.sdk.async_sandbox import transport as atransport

        return await atransport(self._endpoint).call(api.snapshot_delete(self.id))
