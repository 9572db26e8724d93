"""The substrates a daemon can run, by name: adding one is a package under ``substrates/`` and
a ``register`` call here (or, for a test, at run time). The engine builds the ones it serves
from this table and knows them only through ``corral.daemon.substrates.base.Substrate``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from corral.config import Config
from corral.daemon.substrates.base import Substrate
from corral.errors import InvalidRequest, Unsupported
from corral.models import SUBSTRATES


@dataclass
class Context:
    """What a substrate is made from: the daemon's config, its image store, and host-wide
    resources one substrate makes and others may share (``shared``: e.g. the cgroup tree,
    which the daemon's own protection uses too)."""

    config: Config
    images: Any
    shared: dict[str, Any]


Factory = Callable[[Context], Substrate]


@dataclass(frozen=True)
class Entry:
    factory: Factory
    default: bool  # served unless the daemon is told which ones to serve


_TABLE: dict[str, Entry] = {}


def register(name: str, factory: Factory, *, default: bool = False) -> None:
    _TABLE[name] = Entry(factory, default)


def unregister(name: str) -> None:
    _TABLE.pop(name, None)


def names() -> list[str]:
    return sorted(_TABLE)


def defaults() -> list[str]:
    return sorted(n for n, e in _TABLE.items() if e.default)


def build(wanted: Sequence[str], ctx: Context) -> dict[str, Substrate]:
    """Make each substrate of ``wanted``; one that cannot start on this host is an error."""
    out: dict[str, Substrate] = {}
    try:
        for name in wanted:
            entry = _TABLE.get(name)
            if entry is None:
                raise ValueError(f"no substrate {name!r} is registered ({', '.join(names())})")
            sub = entry.factory(ctx)
            sub.name = name
            out[name] = sub
    except BaseException:
        for sub in out.values():
            sub.close(retire=True)
        raise
    return out


def unknown(name: str, available: Sequence[str]) -> InvalidRequest | Unsupported:
    """The error for a create naming a substrate this daemon does not serve: ``unsupported``
    for one corral names (SUBSTRATES) that is not served here, else ``invalid_request``."""
    have = ", ".join(sorted(available)) or "none"
    if name in SUBSTRATES or name in _TABLE:
        return Unsupported(f"substrate {name!r} is not available on this daemon; "
                           f"available: {have}", details={"substrate": name})
    return InvalidRequest(f"unknown substrate {name!r}; available: {have}",
                          details={"substrate": name})


def _container(ctx: Context) -> Substrate:
    # Imported here: the HTTP layer and the OpenAPI generator load without the Rust core.
    from corral.daemon import cgroups as cgroup_impl
    from corral.daemon.substrates.container import ContainerSubstrate

    cgroups = ctx.shared.get("cgroups")
    if cgroups is None:
        cgroups = ctx.shared["cgroups"] = cgroup_impl.for_host(ctx.config.cgroup_name)
    sub = ContainerSubstrate(ctx.config.state_dir, cgroups, ctx.images)
    sub.upload_max_bytes = ctx.config.upload_max_bytes
    return sub


register("container", _container, default=True)
