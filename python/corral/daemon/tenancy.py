"""What a tenant's request may reach (corral.daemon.tenants has who the tenant is).

Another tenant's sandbox, snapshot or trajectory answers exactly what an unknown one answers
(404 sandbox_not_found, snapshot_not_found, not_found): never 403, so ids do not leak. The
checks cost a dict lookup for a live sandbox; only an id the engine no longer holds asks the
trajectory log who made it.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

from aiohttp import web

from corral.daemon.app_errors import TENANT
from corral.daemon.tenants import TENANT_LABEL
from corral.errors import Forbidden, InvalidRequest, SandboxNotFound, SnapshotNotFound
from corral.models import SandboxSpec

if TYPE_CHECKING:
    from corral.daemon.engine import Engine

# Routes a tenant may not call (the host's shared image store, the daemon's metrics and
# status: host facts and every tenant's counts): by handler name (corral.daemon.app ROUTES,
# image_api.ROUTES).
MAX_GROUP_LEN = 63  # SandboxSpec.network_group
ADMIN_ONLY = frozenset({"import_image", "upload_image", "tag_image", "push_image",
                        "prune_images", "delete_image", "commit_sandbox", "metrics", "status",
                        "get_blocked", "put_blocked",
                        # node to node (the cluster gateway): the import names the owner
                        "export_snapshot", "import_snapshot"})


def tenant_of(request: web.Request) -> str | None:
    """The tenant a request acts for; None for the admin."""
    return request.get(TENANT)


def unknown_sandbox(sid: str) -> SandboxNotFound:
    return SandboxNotFound(f"no sandbox {sid}", details={"id": sid})


def unknown_snapshot(key: str) -> SnapshotNotFound:
    return SnapshotNotFound(f"no snapshot {key!r}", details={"snapshot": key})


async def owner(engine: Engine, sid: str) -> str | None:
    """The tenant of sandbox ``sid`` (None: the admin's, or unknown)."""
    sb = engine.sandboxes.get(sid)
    if sb is not None:
        return sb.spec.labels.get(TENANT_LABEL)
    tenant = engine.ended_tenants.get(sid)
    if tenant is not None or not engine.trajlog.enabled:
        return tenant
    await engine.trajlog.flushed()  # its create entry may be journaled, not yet ingested
    info = engine.trajlog.logged_result(sid, "create")
    labels = (info or {}).get("labels") or {}
    return labels.get(TENANT_LABEL) if isinstance(labels, dict) else None


def owns(engine: Engine, sid: str, tenant: str) -> bool:
    """For batch calls: a sandbox of ``tenant`` the engine holds or has a tombstone of."""
    sb = engine.sandboxes.get(sid)
    if sb is not None:
        return sb.spec.labels.get(TENANT_LABEL) == tenant
    return engine.ended_tenants.get(sid) == tenant


def snapshot(engine: Engine, key: str, tenant: str | None) -> dict[str, Any]:
    """Snapshot ``key`` (id or name) if ``tenant`` (None: the admin) may use it."""
    rec = engine.snapshot_get(key)
    if tenant is not None and rec.get("tenant") != tenant:
        raise unknown_snapshot(key)
    return rec


def own_spec(request: web.Request, engine: Engine, spec: SandboxSpec) -> SandboxSpec:
    """A tenant's create: its snapshot must be its own; the sandbox is labelled as the
    tenant's whatever the request says, and its network group is the tenant's own."""
    tenant = tenant_of(request)
    if tenant is None:
        return spec
    if spec.snapshot is not None:
        snapshot(engine, spec.snapshot, tenant)
    update: dict[str, Any] = {"labels": {**spec.labels, TENANT_LABEL: tenant}}
    if spec.network_group is not None:
        update["network_group"] = tenant_group(tenant, spec.network_group)
    return spec.model_copy(update=update)


def as_given(request: web.Request, spec: SandboxSpec) -> SandboxSpec:
    """A sandbox's spec as its tenant would send it again (``own_spec`` undone: no tenant
    label, the network group's own name), so a create with it makes the same sandbox."""
    tenant = tenant_of(request)
    if tenant is None:
        return spec
    update: dict[str, Any] = {"labels": {k: v for k, v in spec.labels.items()
                                         if k != TENANT_LABEL}}
    if spec.network_group is not None:
        update["network_group"] = spec.network_group[GROUP_TAG_LEN:]
    return spec.model_copy(update=update)


GROUP_TAG_LEN = 14  # "t" + 12 hex digits + "."


def tenant_group(tenant: str, group: str) -> str:
    """A tenant's network group: its name behind a fixed-length tag of the tenant, so two
    tenants never share one and the result is still a valid group name (recovery re-reads
    the spec)."""
    if len(group) > MAX_GROUP_LEN - GROUP_TAG_LEN:
        raise InvalidRequest(f"a tenant's network_group has at most "
                             f"{MAX_GROUP_LEN - GROUP_TAG_LEN} characters")
    return f"t{hashlib.sha256(tenant.encode()).hexdigest()[:12]}.{group}"


def guard(engine: Engine) -> Any:
    """The middleware's check of a tenant's request, before its handler."""

    async def check(request: web.Request, tenant: str) -> None:
        sid = request.match_info.get("id")
        if sid is not None and await owner(engine, sid) != tenant:
            raise unknown_sandbox(sid)
        handler = request.match_info.handler
        if getattr(handler, "__name__", "") in ADMIN_ONLY:
            raise Forbidden("this call is the daemon admin's (the local socket or the admin "
                            "token), not a tenant's")

    return check
