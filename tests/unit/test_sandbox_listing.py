"""Listing sandboxes a page at a time: the order and cursors of GET /v1/sandboxes, and what a
page costs (the sandboxes it looks at), on the engine with the fake substrate."""

from __future__ import annotations

from corral.daemon import listing
from corral.daemon.tenants import TENANT_LABEL

from .unitkit import engine_on, run, spec


def test_a_page_looks_at_its_own_entries_not_every_sandbox() -> None:
    """20,000 sandboxes of the admin and 3 of tenant t: t's page looks at its 3, and a page
    of 10 of all at 11 (before, every page of every caller passed over all 20,003)."""
    order = listing.ListOrder()
    for i in range(20_000):
        order.add(f"sb-a{i:05}", 1000.0 + i, None)
    for i in range(3):
        order.add(f"sb-t{i}", 500.0 + 10_000 * i, "t")
    seen: list[str] = []

    def keep(sid: str) -> bool:
        seen.append(sid)
        return True

    ids, nxt = listing.page(order, None, 10, "t", True, keep)
    assert ids == ["sb-t0", "sb-t1", "sb-t2"] and nxt is None and len(seen) == 3
    seen.clear()
    ids, nxt = listing.page(order, None, 10, None, False, keep)
    assert ids == ["sb-t0"] + [f"sb-a{i:05}" for i in range(9)] and len(seen) == 11
    assert nxt == listing.list_key(1008.0, "sb-a00008")
    seen.clear()
    ids, _ = listing.page(order, nxt, 2, None, False, keep)
    assert ids == ["sb-a00009", "sb-a00010"] and len(seen) == 3
    order.remove("sb-t1")
    order.remove("sb-t1")  # twice: nothing
    assert listing.page(order, None, 10, "t", True, keep)[0] == ["sb-t0", "sb-t2"]
    assert listing.page(order, None, 10, "nobody", True, keep) == ([], None)


def test_pages_list_each_live_sandbox_once_in_creation_order(state, clock) -> None:
    """Through the engine: pages of 3 over two tenants' and the admin's sandboxes, with
    kills between pages and a label filter; each live matching sandbox once, oldest first,
    a tenant's pages only its own."""
    async def go() -> None:
        async with engine_on(state, clock) as (eng, _):
            made = []
            for i in range(12):
                tenant = ("alice", "bob", None)[i % 3]
                labels = {"n": str(i % 2)} | ({TENANT_LABEL: tenant} if tenant else {})
                made.append(await eng.create(spec(labels=labels)))
                clock.advance(1)

            def walk(labels: dict[str, str | None], limit: int, kill: bool = False) -> list[str]:
                out, cursor = [], None
                while True:
                    page, cursor = eng.sandbox_page(labels, cursor, limit)
                    out += [sb.id for sb in page]
                    if kill and page:
                        killed.append(page[-1].id)
                        eng._unregister(page[-1].id)
                    if cursor is None:
                        return out

            ids = [sb.id for sb in made]
            killed: list[str] = []
            assert walk({}, 3) == ids
            assert walk({TENANT_LABEL: "alice"}, 3) == ids[0::3]
            assert walk({TENANT_LABEL: "bob", "n": "1"}, 1) == [ids[1], ids[7]]
            assert walk({"n": "0"}, 2) == ids[0::2]
            assert walk({}, 5, kill=True) == ids
            left = [i for i in ids if i not in killed]
            assert walk({}, 100) == left
    run(go())
