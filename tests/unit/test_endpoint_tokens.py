"""Which bearer token the SDK sends where (corral.sdk.endpoint): a token set for a cluster
gateway goes to the nodes reached through it, and a new token for that gateway (a Ray worker
process reused by another tenant's job) replaces it at those nodes too; a token set for a
node itself is never overwritten by a gateway's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from corral.sdk import endpoint as ep_mod
from corral.sdk.endpoint import Endpoint, set_token

GATEWAY = "http://127.0.0.1:7001"
NODE_A = "http://127.0.0.1:7101"
NODE_B = "http://127.0.0.1:7102"


@pytest.fixture(autouse=True)
def _fresh_tokens(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(ep_mod, "_tokens", {})
    monkeypatch.setattr(ep_mod, "_token_source", {})
    monkeypatch.delenv("CORRAL_TOKEN", raising=False)
    yield


def test_a_node_reached_through_a_gateway_gets_its_token():
    set_token(GATEWAY, "alice")
    node = Endpoint(GATEWAY).on_node(NODE_A + "/", "n1")
    assert node.url == NODE_A and node.gateway == GATEWAY
    assert node.auth_header() == "Bearer alice"
    # A node reached from a node handle (a fork placed by the gateway) keeps the source.
    assert node.on_node(NODE_B, "n2").auth_header() == "Bearer alice"


def test_a_new_token_for_the_gateway_is_the_token_at_its_nodes():
    set_token(GATEWAY, "alice")
    a = Endpoint(GATEWAY).on_node(NODE_A, "n1")
    b = a.on_node(NODE_B, "n2")
    set_token(GATEWAY + "/", "bob")
    assert Endpoint(GATEWAY).auth_header() == "Bearer bob"
    assert a.auth_header() == "Bearer bob" and b.auth_header() == "Bearer bob"
    # And a node first reached after the switch.
    set_token(GATEWAY, "carol")
    assert Endpoint(GATEWAY).on_node(NODE_A, "n1").auth_header() == "Bearer carol"


def test_a_token_set_for_a_node_itself_is_kept():
    set_token(NODE_A, "direct")
    set_token(GATEWAY, "alice")
    assert Endpoint(GATEWAY).on_node(NODE_A, "n1").auth_header() == "Bearer direct"
    set_token(GATEWAY, "bob")
    assert Endpoint(NODE_A).auth_header() == "Bearer direct"
    # A node token set after it was reached through the gateway is the node's own from then.
    Endpoint(GATEWAY).on_node(NODE_B, "n2")
    set_token(NODE_B, "own")
    set_token(GATEWAY, "carol")
    assert Endpoint(NODE_B).auth_header() == "Bearer own"


def test_no_token_set_falls_back_to_the_environment(monkeypatch: pytest.MonkeyPatch):
    assert Endpoint(GATEWAY).on_node(NODE_A, "n1").auth_header() is None
    monkeypatch.setenv("CORRAL_TOKEN", "env")
    assert Endpoint(NODE_A).auth_header() == "Bearer env"
    assert Endpoint("unix:///run/corral.sock").auth_header() is None


def test_each_credential_has_its_own_e2b_base_template():
    """A tenant's E2B front cannot see another tenant's snapshot nor take its name: the base
    template's snapshot is named per credential (the same token, the same snapshot)."""
    from corral.e2b.templates import BASE_SNAPSHOT, Templates
    from corral.sdk.endpoint import Endpoint, set_token

    set_token("http://127.0.0.1:7001", "alice-token")
    set_token("http://127.0.0.1:7002", "bob-token")
    set_token("http://127.0.0.1:7003", "alice-token")
    alice, bob, alice2 = (Templates(Endpoint.parse(f"http://127.0.0.1:{p}"))
                          for p in (7001, 7002, 7003))
    assert alice.base_snapshot != bob.base_snapshot
    assert alice.base_snapshot == alice2.base_snapshot
    assert alice.base_snapshot.startswith(BASE_SNAPSHOT + "-")
    assert "alice" not in alice.base_snapshot
    assert Templates(Endpoint.parse("unix:///run/x.sock")).base_snapshot == BASE_SNAPSHOT
