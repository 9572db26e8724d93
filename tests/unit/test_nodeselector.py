"""The node selector header (corral.nodeselector): what the SDK writes, the gateway reads back
unchanged; what the header could not carry unchanged is refused before anything is sent."""

from __future__ import annotations

import random
import string

import pytest

from corral.errors import InvalidRequest
from corral.models import SandboxSpec
from corral.nodeselector import HEADER, format_selector, parse_selector
from corral.sdk import api

NAME_CHARS = string.ascii_letters + string.digits + "._-/:"
VALUE_CHARS = NAME_CHARS + "= "


def _word(rng: random.Random, chars: str, lo: int) -> str:
    w = "".join(rng.choice(chars) for _ in range(rng.randint(lo, 12)))
    return w.strip()


def test_every_selector_the_sdk_sends_reads_back_the_same():
    rng = random.Random(11)
    for _ in range(500):
        sel: dict[str, str] = {}
        for _ in range(rng.randint(1, 5)):
            name = _word(rng, NAME_CHARS, 1)
            if name:
                sel[name] = _word(rng, VALUE_CHARS, 0)
        assert parse_selector(format_selector(sel)) == sel, sel


@pytest.mark.parametrize("bad", [
    {"a=b": "c"}, {"a,b": "c"}, {"a": "b,c"}, {"": "x"}, {" a": "x"}, {"a": "x "},
    {"a": "x\r\nX-Corral-Tenant: bob"}, {"a": 1}, {1: "a"}, ["a", "b"], "a=b",
])
def test_what_the_header_cannot_carry_is_refused_before_sending(bad):
    with pytest.raises(InvalidRequest) as e:
        api.create(SandboxSpec(), node_selector=bad)
    assert e.value.code == "invalid_request" and e.value.details["field"] == "node_selector"


def test_a_create_carries_the_header_only_when_asked():
    call = api.create(SandboxSpec(), node_selector={"role": "gpu", "zone": "b"})
    assert call.headers == {HEADER: "role=gpu,zone=b"}
    assert api.create(SandboxSpec()).headers is None
    assert api.create(SandboxSpec(), node_selector={}).headers is None
    many = api.create_many(4, SandboxSpec(), spread=True, node_selector={"role": "gpu"})
    assert many.headers == {HEADER: "role=gpu"} and ("spread", "true") in (many.query or [])


@pytest.mark.parametrize("bad", ["=x", "novalue", "a=b,=c"])
def test_the_gateway_refuses_a_malformed_header(bad):
    with pytest.raises(InvalidRequest):
        parse_selector(bad)
