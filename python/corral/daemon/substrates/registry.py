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


class Unavailable(Exception):
    """Raised by a factory when this host cannot run the substrate (a missing tool, a probe
    that failed): the daemon starts without it and reports the reason (GET /v1/substrates)."""


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


def build(wanted: Sequence[str], ctx: Context,
          unavailable: dict[str, str] | None = None) -> dict[str, Substrate]:
    """Make each substrate of ``wanted``. One whose factory raises ``Unavailable`` is left out
    with its reason in ``unavailable`` when that is given; any other failure is an error."""
    out: dict[str, Substrate] = {}
    try:
        for name in wanted:
            entry = _TABLE.get(name)
            if entry is None:
                raise ValueError(f"no substrate {name!r} is registered ({', '.join(names())})")
            try:
                sub = entry.factory(ctx)
            except Unavailable as e:
                if unavailable is None:
                    raise
                unavailable[name] = str(e)
                continue
            sub.name = name
            out[name] = sub
    except BaseException:
        for sub in out.values():
            sub.close(retire=True)
        raise
    return out


def unknown(name: str, available: Sequence[str],
            reasons: dict[str, str] | None = None) -> InvalidRequest | Unsupported:
    """The error for a create naming a substrate this daemon does not serve: ``unsupported``
    for one corral names (SUBSTRATES) that is not served here (with why, if its factory said),
    else ``invalid_request``."""
    have = ", ".join(sorted(available)) or "none"
    if name in SUBSTRATES or name in _TABLE:
        why = (reasons or {}).get(name)
        details = {"substrate": name} if why is None else {"substrate": name, "reason": why}
        return Unsupported(f"substrate {name!r} is not available on this daemon"
                           f"{f' ({why})' if why else ''}; available: {have}", details=details)
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


def _gvisor(ctx: Context) -> Substrate:
    from corral.daemon.substrates.gvisor import make

    return make(ctx)


def _process(ctx: Context) -> Substrate:
    from corral.daemon.substrates.process import make

    return make(ctx)


register("container", _container, default=True)
register("gvisor", _gvisor, default=True)
register("process", _process, default=True)
