"""A warm pool follows its image's name to new content, and only to new content
(corral.daemon.pools.WarmPools.take): an OCI image recorded again with the same layers and
config (a pull of an unchanged tag, any tenant's) is the same image; a rootfs image replaced
in place keeps its path, so its record's time tells."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from corral.daemon import pools
from corral.models import SandboxSpec


@dataclasses.dataclass
class _Image:
    kind: str
    overlays: list[tuple[str, list[str]]]
    config: dict[str, Any]
    created_at: float


class _Images:
    def __init__(self, img: _Image) -> None:
        self.img: _Image | None = img

    def get(self, name: str) -> _Image | None:
        return self.img


class _Runtime:
    def __init__(self, sid: str) -> None:
        self.sandbox_id = sid


class _Substrate:
    class capabilities:
        warm_pool = True

    def is_alive(self, rt: Any) -> bool:
        return True


def _takes(first: _Image, then: _Image | None, static: int = 0) -> tuple[Any, int, bool]:
    """A pool of ``first`` with 8 ready, its image's name then standing for ``then``: what
    the next take gets, how many were discarded, whether the pool is still there."""
    async def run() -> tuple[Any, int, bool]:
        images = _Images(first)
        wp = pools.WarmPools(pools.PoolConfig(), {"container": _Substrate()}, images,
                             "/nonexistent", lambda: 100, lambda: "x")
        discarded: list[str] = []

        async def discard(sub: Any, rt: Any) -> None:
            discarded.append(rt.sandbox_id)
        wp._discard = discard  # type: ignore[method-assign]
        spec = SandboxSpec(image="registry.test/team/img:1")
        wp.take(spec)  # makes the pool
        key, pool = next(iter(wp.pools.items()))
        pool.static = static
        pool.ready.extend(_Runtime(f"warm{i}") for i in range(8))
        images.img = then
        got = wp.take(spec)
        await asyncio.sleep(0)
        return got, len(discarded), key in wp.pools
    return asyncio.run(run())


def _oci(layers: list[str], created: float, env: str = "A=1") -> _Image:
    return _Image("oci", [("/", layers)], {"Env": [env]}, created)


def test_the_same_oci_content_recorded_again_keeps_the_pool():
    got, discarded, _ = _takes(_oci(["/l/a", "/l/s"], 1.0), _oci(["/l/a", "/l/s"], 2.0))
    assert got is not None and discarded == 0


def test_new_layers_or_config_empty_the_pool():
    for then in (_oci(["/l/b", "/l/s"], 1.0), _oci(["/l/a", "/l/s"], 1.0, env="A=2")):
        got, discarded, kept = _takes(_oci(["/l/a", "/l/s"], 1.0), then)
        assert got is None and discarded == 8 and kept


def test_a_rootfs_image_replaced_in_place_empties_the_pool():
    first = _Image("rootfs", [("/", ["/images/r/rootfs"])], {}, 1.0)
    got, discarded, _ = _takes(first, dataclasses.replace(first, created_at=2.0))
    assert got is None and discarded == 8


def test_a_name_gone_drops_an_auto_pool_and_empties_a_static_one():
    got, discarded, kept = _takes(_oci(["/l/a"], 1.0), None)
    assert got is None and discarded == 8 and not kept
    got, discarded, kept = _takes(_oci(["/l/a"], 1.0), None, static=2)
    assert got is None and discarded == 8 and kept
