"""The TCP listener's accounting (corral.daemon.tcpguard.TcpGuard) over fake transports:
connections without a token cannot keep an authenticated client's new connection out."""

from __future__ import annotations

import asyncio
from typing import Any

from corral.daemon.tcpguard import TcpGuard, source_of


class Conn(asyncio.BaseTransport):
    """A connection the guard sees: its peer, and whether the guard closed it (the event
    loop would then tell the guard it is lost, as ``lose`` does)."""

    def __init__(self, guard: TcpGuard, addr: str = "10.0.0.1") -> None:
        super().__init__()
        self.guard, self.addr, self.shut, self.lost = guard, addr, False, False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return (self.addr, 40000) if name == "peername" else default

    def close(self) -> None:
        self.shut = True

    def lose(self) -> None:
        if not self.lost:
            self.lost = True
            self.guard.closed(self)


def run(body: Any) -> Any:
    async def main() -> Any:
        return body()
    return asyncio.run(main())


def opened(guard: TcpGuard, n: int, addr: str = "10.0.0.1") -> list[Conn]:
    conns = [Conn(guard, addr) for _ in range(n)]
    for c in conns:
        guard.opened(c)
    return conns


def settle(conns: list[Conn]) -> None:
    for c in conns:
        if c.shut:
            c.lose()


def test_squatters_at_the_cap_make_room_for_a_new_connection():
    """The whole cap held by connections that sent nothing (no token): a client's new
    connection gets in (the oldest squatter is closed), sends its request, is authenticated,
    and is not closed however many squatters come after it."""
    def body() -> None:
        g = TcpGuard(max_connections=16, headers_s=3600, sweep_s=3600, grace_s=0)
        squat = opened(g, 16)
        assert g.open == 16 and g.unauthenticated == 16 and not any(c.shut for c in squat)
        client = Conn(g)
        g.opened(client)
        assert not client.shut and squat[0].shut and g.evicted == 1 and g.refused == 0
        g.heard(client)  # its request's bytes: closed after every silent one
        more = opened(g, 14)
        assert not client.shut
        g.authenticate(client)
        assert g.authenticated == 1
        more += opened(g, 100)
        settle(squat + more)
        assert not client.shut and g.open == 16 and g.authenticated == 1
    run(body)


def test_a_full_cap_of_authenticated_connections_refuses_the_new_one():
    def body() -> None:
        g = TcpGuard(max_connections=4, headers_s=3600, sweep_s=3600, grace_s=0)
        tenants = opened(g, 4)
        for c in tenants:
            g.authenticate(c)
        new = Conn(g)
        g.opened(new)
        assert new.shut and g.refused == 1 and not any(c.shut for c in tenants)
    run(body)


def test_the_sweep_keeps_unauthenticated_connections_within_their_caps():
    """Past a quarter of the cap unauthenticated, or a quarter of that from one source, the
    sweep closes the oldest of them, silent ones first; another source's and the
    authenticated are left alone."""
    def body() -> None:
        g = TcpGuard(max_connections=64, headers_s=3600, sweep_s=3600, grace_s=0)
        assert (g.max_unauthenticated, g.per_source) == (16, 4)
        tenant = opened(g, 1, "10.0.0.9")[0]
        g.authenticate(tenant)
        other = opened(g, 3, "10.0.0.2")
        squat = opened(g, 30, "10.0.0.1")
        g.heard(squat[0])  # it sent something: closed after the silent ones
        assert g._sweep is not None
        g.sweep()
        settle(squat + other)
        left = [c for c in squat if not c.shut]
        assert left == [squat[0]] + squat[-3:], [squat.index(c) for c in left]
        assert not any(c.shut for c in other) and not tenant.shut
        assert g.unauthenticated == 7 and g.authenticated == 1
        # many sources, each within its own cap: past the total, the oldest silent ones are
        # closed (other's 3, squat's 3 silent, the first 3 of these), then squat[0]
        many = [c for i in range(6) for c in opened(g, 3, f"10.1.0.{i}")]
        g.sweep()
        settle(squat + other + many)
        assert g.unauthenticated == 16 and not tenant.shut
        assert all(c.shut for c in other + squat[-3:] + many[:3])
        assert not squat[0].shut and not any(c.shut for c in many[3:])
    run(body)


def test_a_request_without_a_token_leaves_the_connection_unauthenticated():
    """A request that reaches the app without a token (``/v1/health``) stops the headers
    timer; the connection still counts among the unauthenticated until one has a token."""
    async def main() -> None:
        g = TcpGuard(max_connections=16, headers_s=0.05, sweep_s=3600, grace_s=0)
        slow, asked = opened(g, 2)
        g.started(asked)
        await asyncio.sleep(0.2)
        assert slow.shut and g.too_slow == 1 and not asked.shut
        settle([slow])
        assert g.unauthenticated == 1 and g.authenticated == 0
        g.authenticate(asked)
        assert g.unauthenticated == 0 and g.authenticated == 1
        asked.close()
        asked.lose()
        assert g.open == 0 and g.authenticated == 0
    asyncio.run(main())


def test_sources():
    assert source_of(("192.0.2.7", 5)) == "192.0.2.7"
    assert source_of(("::ffff:192.0.2.7", 5, 0, 0)) == "192.0.2.7"
    assert source_of(("2001:db8:1:2:3:4:5:6", 5, 0, 0)) == "2001:db8:1:2::/64"
    assert source_of(("fe80::1%eth0", 5, 0, 2)) == "fe80::/64"
    assert source_of(None) == ""


def test_a_young_connection_outlasts_the_squatters_reconnecting_after_it():
    """A client's new connection may not have sent its request by the sweep (a loaded host:
    the test's own clients lost requests to it). Within its grace it is closed only when no
    older connection can be: squatters reconnecting after it go first, at the cap and in the
    sweep, and the sweep comes back for the young ones that stay past their caps."""
    async def main() -> None:
        g = TcpGuard(max_connections=16, headers_s=3600, sweep_s=0.05, grace_s=0.3)
        old = opened(g, 16, "10.0.0.1")
        await asyncio.sleep(0.35)  # past their grace
        client = Conn(g, "10.0.0.2")
        g.opened(client)
        young = opened(g, 15, "10.0.0.1")  # reconnects, each taking an old one's place
        settle(old + young)
        assert not client.shut and sum(c.shut for c in old) == 16
        g.sweep()  # the caps (4 unauthenticated, 1 a source) wait for the grace to pass
        assert not any(c.shut for c in young) and not client.shut
        await asyncio.sleep(0.5)  # the sweep came back once they were past it
        settle(young + [client])
        assert (g.max_unauthenticated, g.per_source) == (4, 1)
        assert sum(not c.shut for c in young) == 1 and not client.shut  # one a source
        assert g.unauthenticated == 2
    asyncio.run(main())


def test_connections_being_served_are_never_swept():
    """A cluster gateway's connections to a node all come from one address, and on a busy
    node many have sent a request not yet handled: the sweep closed them past the per-source
    cap, and the gateway's calls failed as sandbox_lost (infra). The sweep closes only
    connections that sent nothing; one that sent something goes at the hard cap only."""
    def body() -> None:
        g = TcpGuard(max_connections=64, headers_s=3600, sweep_s=3600, grace_s=0)
        gateway = opened(g, 40, "10.0.0.5")
        for c in gateway:
            g.heard(c)
        squat = opened(g, 10, "10.0.0.6")
        g.sweep()
        settle(gateway + squat)
        assert not any(c.shut for c in gateway)
        assert all(c.shut for c in squat)  # silent, and the unauthenticated past their cap
        more = opened(g, 30, "10.0.0.7")  # past the hard cap: the oldest silent make room
        settle(gateway + more)
        assert g.open == 64 and not any(c.shut for c in gateway)
        last = []  # each sends its request at once: once none is silent, the oldest that
        for _ in range(30):  # sent something makes room
            last += opened(g, 1, "10.0.0.8")
            g.heard(last[-1])
            settle(gateway + more + last)
        assert g.open == 64 and all(c.shut for c in more)
        assert [c.shut for c in gateway] == [True] * 6 + [False] * 34
    run(body)


def test_two_tenants_holding_every_connection_leave_room_for_a_third():
    """Two tenants within their halves held every connection: a third's new ones were closed
    at once. The tenant holding more than an equal share among the tenants and one more
    gives up its oldest idle connection (one with a request in it is never closed)."""
    def body() -> None:
        g = TcpGuard(max_connections=8, headers_s=3600, sweep_s=3600, grace_s=0)
        a, b = opened(g, 4), opened(g, 4)
        for c, who in [(c, "a") for c in a] + [(c, "b") for c in b]:
            g.authenticate(c)
            assert g.claim(c, who)
        g._busy[a[0]] += 1  # a request in it
        carol = Conn(g, "10.0.0.3")
        g.opened(carol)
        assert not carol.shut and g.refused == 0
        assert not a[0].shut and a[1].shut and not any(c.shut for c in b)
        settle(a + b)
        g.authenticate(carol)
        assert g.claim(carol, "carol") and g.open == 8
        g._busy.clear()
        late = Conn(g, "10.0.0.4")  # a, b and carol hold 3, 4, 1 of 8: b's oldest idle goes
        g.opened(late)
        assert not late.shut and b[0].shut
    run(body)
