"""A create through a cluster gateway (corral.sdk.placed, corral.placing): the SDK asks the
gateway for a node, then sends the same create there. Driven through the sans-I/O steps with a
scripted ``send``: which endpoint gets which call, with which headers, and what happens when a
placed node cannot be reached (asked again without it) or drops the call (an infra error,
never a second sandbox)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest

from corral import placing
from corral.errors import CapacityExceeded, InvalidRequest, SandboxLost
from corral.models import SandboxInfo, SandboxSpec
from corral.sdk import api, placed
from corral.sdk import endpoint as ep_mod
from corral.sdk.call import Call, lost, unavailable
from corral.sdk.endpoint import Endpoint

GATEWAY = Endpoint("http://127.0.0.1:7001")
NODE_A, NODE_B = "http://127.0.0.1:7101", "http://127.0.0.1:7102"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(autouse=True)
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[Clock]:
    """Fresh tokens and spares for each test, the spares on a clock of the test's."""
    monkeypatch.setattr(ep_mod, "_tokens", {})
    monkeypatch.setattr(ep_mod, "_token_source", {})
    c = Clock()
    monkeypatch.setattr(placed, "_spares", placed.Spares(c))
    yield c


def _info(sid: str = "sb-1", **extra: Any) -> bytes:
    return json.dumps({"id": sid, "state": "running", "image": "host", "substrate": "container",
                       "cpu": 1.0, "memory_mb": 64, "pids": 64, "network": "none",
                       "hostname": sid, "created_at": 1.0, "expires_at": 2.0,
                       "last_active_at": 1.0, **extra}).encode()


def _placement(node: str, url: str, *ahead: tuple[str, str]) -> bytes:
    return json.dumps(placing.answer(node, url, [placing.where(*a) for a in ahead])).encode()


class Script:
    """A ``send`` that answers each call from a list of (bytes | exception) and records
    (endpoint, call)."""

    def __init__(self, *answers: bytes | BaseException) -> None:
        self.answers = list(answers)
        self.sent: list[tuple[Endpoint, Call[Any]]] = []

    def __call__(self, ep: Endpoint, call: Call[Any]) -> Any:
        self.sent.append((ep, call))
        got = self.answers.pop(0)
        if isinstance(got, BaseException):
            raise got
        return call.finish(200, got)


def _create(selector: dict[str, str] | None = None, key: str | None = "traj-1:create",
            **spec: Any) -> Call[SandboxInfo]:
    call = api.create(SandboxSpec(**{"image": "host", **spec}), node_selector=selector)
    call.key = key
    return call


def _make(send: Script, call: Call[SandboxInfo] | None = None) -> tuple[Endpoint, SandboxInfo]:
    return placed.drive(placed.create_steps(GATEWAY, call or _create(key=None)), send)


def test_a_daemon_endpoint_sends_the_create_as_is():
    for ep in (Endpoint("unix:///run/corral.sock"), Endpoint(NODE_A, "n1")):
        send = Script(_info())
        where, info = placed.drive(placed.create_steps(ep, _create()), send)
        assert where == ep and info.id == "sb-1"
        [(_, call)] = send.sent
        assert placing.HEADER not in (call.headers or {})


def test_the_gateway_places_and_the_node_makes_it_with_the_same_body_and_key():
    call = _create({"role": "gpu"})
    send = Script(_placement("n1", NODE_A), _info())
    where, info = placed.drive(placed.create_steps(GATEWAY, call), send)
    (to_gw, ask), (to_node, make) = send.sent
    assert to_gw == GATEWAY and ask.headers is not None
    assert ask.headers[placing.HEADER] == "node"
    assert ask.headers["X-Corral-Node-Selector"] == "role=gpu"
    assert to_node.url == NODE_A and to_node.node == "n1" and to_node.gateway == GATEWAY.url
    assert make.body == call.body == ask.body and make.key == ask.key == "traj-1:create"
    assert make.headers is None  # no placement ask, no selector: the node just makes it
    assert where == to_node and (info.node, info.endpoint) == ("n1", NODE_A)


def test_a_create_the_gateway_made_itself_is_taken_as_is():
    send = Script(_info(node="n2", endpoint=NODE_B))  # a create from a snapshot
    where, info = placed.drive(placed.create_steps(GATEWAY, _create()), send)
    assert len(send.sent) == 1 and (where.url, where.node) == (NODE_B, "n2")


def test_a_placed_node_that_cannot_be_reached_is_left_out_of_the_next_placement():
    a, b = Endpoint(NODE_A, "n1"), Endpoint(NODE_B, "n2")
    send = Script(_placement("n1", NODE_A), unavailable(a, ConnectionRefusedError()),
                  _placement("n2", NODE_B), _info())
    where, info = placed.drive(placed.create_steps(GATEWAY, _create()), send)
    asks = [c for ep, c in send.sent if ep == GATEWAY]
    assert [c.headers[placing.HEADER] for c in asks] == ["node", "node; exclude=n1"]
    assert where == b and info.node == "n2"


def test_a_full_node_sends_the_create_back_to_the_gateway_which_may_refuse_it():
    """A placement made ahead may find its node full (a report let the gateway fill the slot
    again): the gateway places the create elsewhere, or refuses it itself, which is the
    refusal its autoscaler counts as demand."""
    full = CapacityExceeded("sandbox limit reached")
    send = Script(_placement("n1", NODE_A, ("n2", NODE_B)), _info("sb-1"),
                  full, _placement("n1", NODE_A), _info("sb-2"),
                  _placement("n1", NODE_A), full, CapacityExceeded("every node is full"))
    assert _make(send)[1].id == "sb-1"
    assert _make(send)[1].id == "sb-2"  # n2 was full: placed again without it
    with pytest.raises(CapacityExceeded, match="every node is full"):
        _make(send)
    asks = [c.headers[placing.HEADER] for ep, c in send.sent if ep == GATEWAY]
    assert asks == [f"node; ahead={placed.AHEAD}", f"node; exclude=n2; ahead={placed.AHEAD}",
                    f"node; ahead={placed.AHEAD}", f"node; exclude=n1; ahead={placed.AHEAD}"]


def test_a_placed_node_that_drops_the_create_is_an_infra_error_not_a_second_sandbox():
    a = Endpoint(NODE_A, "n1")
    call = _create()
    send = Script(_placement("n1", NODE_A), lost(a, call, ConnectionResetError()))
    with pytest.raises(SandboxLost) as e:
        placed.drive(placed.create_steps(GATEWAY, call), send)
    assert e.value.details["connected"] is True and len(send.sent) == 2


def test_the_sdk_stops_after_a_few_nodes_did_not_answer():
    answers: list[bytes | BaseException] = []
    for i in range(placed.MAX_UNANSWERED + 1):
        answers += [_placement(f"n{i}", f"http://127.0.0.1:{7200 + i}"),
                    unavailable(Endpoint(f"http://127.0.0.1:{7200 + i}", f"n{i}"), OSError())]
    send = Script(*answers)
    with pytest.raises(SandboxLost) as e:
        placed.drive(placed.create_steps(GATEWAY, _create()), send)
    assert e.value.details["connected"] is False and not send.answers


def test_the_async_driver_takes_the_same_steps():
    send = Script(_placement("n1", NODE_A), _info())

    async def asend(ep: Endpoint, call: Call[Any]) -> Any:
        await asyncio.sleep(0)
        return send(ep, call)

    where, info = asyncio.run(placed.drive_async(placed.create_steps(GATEWAY, _create()),
                                                 asend))
    assert [ep.url for ep, _ in send.sent] == [GATEWAY.url, NODE_A]
    assert where.node == "n1" and info.endpoint == NODE_A


def test_a_node_reached_through_placement_gets_the_gateways_token():
    ep_mod.set_token(GATEWAY.url, "alice")
    send = Script(_placement("n1", NODE_A), _info())
    where, _ = placed.drive(placed.create_steps(GATEWAY, _create()), send)
    assert where.auth_header() == "Bearer alice"


@pytest.mark.parametrize("value, want", [
    ("", placing.Ask()),
    ("node", placing.Ask(True)),
    (" node ; exclude=a, b ,", placing.Ask(True, frozenset({"a", "b"}))),
    ("node; ahead=3; exclude=x", placing.Ask(True, frozenset({"x"}), 3)),
    (placing.format_request(["x", "y"], 2), placing.Ask(True, frozenset({"x", "y"}), 2)),
])
def test_the_placement_header_reads_back(value: str, want: placing.Ask):
    assert placing.parse_request(value) == want


@pytest.mark.parametrize("value", [
    "sandbox", "node; only=a", "node; exclude", "node; ahead=-1", "node; ahead=99",
    "node; ahead=1; ahead=2", ",".join(["node; exclude=a"] + [
        f"n{i}" for i in range(placing.MAX_EXCLUDED + 1)])])
def test_a_bad_placement_header_is_invalid_request(value: str):
    with pytest.raises(InvalidRequest) as e:
        placing.parse_request(value)
    assert e.value.code == "invalid_request" and e.value.details["header"] == placing.HEADER


# ---- placements made ahead ------------------------------------------------------------------
def test_placements_made_ahead_send_the_next_creates_straight_to_their_nodes():
    send = Script(_placement("n1", NODE_A, ("n2", NODE_B), ("n1", NODE_A)), _info("sb-1"),
                  _info("sb-2"), _info("sb-3"),
                  _placement("n2", NODE_B), _info("sb-4"))
    made = [_make(send) for _ in range(4)]
    assert [(ep.node, info.id) for ep, info in made] == [
        ("n1", "sb-1"), ("n2", "sb-2"), ("n1", "sb-3"), ("n2", "sb-4")]
    to = [(ep.url, (c.headers or {}).get(placing.HEADER)) for ep, c in send.sent]
    assert to == [(GATEWAY.url, f"node; ahead={placed.AHEAD}"), (NODE_A, None),
                  (NODE_B, None), (NODE_A, None),
                  (GATEWAY.url, f"node; ahead={placed.AHEAD}"), (NODE_B, None)]


def test_a_placement_made_ahead_is_used_only_while_fresh(clock: Clock):
    send = Script(_placement("n1", NODE_A, ("n2", NODE_B)), _info("sb-1"),
                  _placement("n1", NODE_A), _info("sb-2"))
    _make(send)
    clock.now += placed.SPARE_TTL_S + 0.01
    where, _ = _make(send)
    assert where.node == "n1" and [ep.url for ep, _ in send.sent][2] == GATEWAY.url


def test_keyed_and_snapshot_creates_are_placed_by_the_gateway_every_time():
    send = Script(_placement("n1", NODE_A, ("n2", NODE_B)), _info("sb-1"))
    _make(send)  # leaves a spare on n2
    for call in (_create(key="t:create"), _create(key=None, snapshot="snap-1")):
        send.answers += [_placement("n1", NODE_A), _info("sb-x")]
        _make(send, call)
        ask = send.sent[-2][1]
        assert send.sent[-2][0] == GATEWAY and ask.headers[placing.HEADER] == "node"
    # the spare is still there for the next plain create
    send.answers.append(_info("sb-2"))
    assert _make(send)[0].node == "n2"


def test_spares_are_kept_per_image_selector_and_token():
    send = Script(_placement("n1", NODE_A, ("n2", NODE_B)), _info("sb-1"))
    _make(send)
    for call in (_create(key=None, image="python:3.12"), _create({"role": "gpu"}, key=None)):
        send.answers += [_placement("n1", NODE_A), _info("sb-x")]
        _make(send, call)
        assert send.sent[-2][0] == GATEWAY
    ep_mod.set_token(GATEWAY.url, "bob")
    send.answers += [_placement("n1", NODE_A), _info("sb-y")]
    _make(send)
    assert send.sent[-2][0] == GATEWAY


def test_a_spares_node_that_does_not_answer_loses_its_spares_and_is_left_out():
    a = Endpoint(NODE_A, "n1")
    send = Script(_placement("n2", NODE_B, ("n1", NODE_A), ("n1", NODE_A)), _info("sb-1"),
                  unavailable(a, ConnectionRefusedError()),
                  _placement("n2", NODE_B), _info("sb-2"))
    _make(send)
    where, info = _make(send)
    assert (where.node, info.id) == ("n2", "sb-2")
    asks = [c.headers[placing.HEADER] for ep, c in send.sent if ep == GATEWAY]
    assert asks == [f"node; ahead={placed.AHEAD}", f"node; exclude=n1; ahead={placed.AHEAD}"]
    assert placed._spares.take(placed.kind_of(GATEWAY, _create(key=None))) is None
