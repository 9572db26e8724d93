"""Tenants' quotas without a daemon: the tokens file's entries, the default's syntax, and the
count kept per tenant (corral.daemon.tenants, corral.daemon.engine.quota)."""

from __future__ import annotations

import json

import pytest

from corral.daemon.engine.quota import LabelQuota, parse_limit
from corral.daemon.tenants import TENANT_LABEL, TokensError, parse_table, token_hash
from corral.errors import InvalidRequest, QuotaExceeded

TOKEN = "a-token-of-sixteen-chars"


def test_an_entry_is_a_token_or_an_object_with_its_quotas() -> None:
    by_hash, limits = parse_table(json.dumps({
        "alice": TOKEN, "bob": {"token": TOKEN + "-bob", "max_sandboxes": 3},
        "carol": {"token": TOKEN + "-carol"},
        "dave": {"token": TOKEN + "-dave", "max_snapshots": 0, "snapshot_mb": 64,
                 "log_mb": 16}}))
    assert by_hash[token_hash(TOKEN + "-bob")] == "bob"
    assert by_hash[token_hash(TOKEN + "-carol")] == "carol"
    assert limits == {"bob": {"max_sandboxes": 3},
                      "dave": {"max_snapshots": 0, "snapshot_mb": 64, "log_mb": 16}}


@pytest.mark.parametrize("entry", [
    {"token": TOKEN, "max_sandboxes": -1},
    {"token": TOKEN, "max_sandboxes": 1.5},
    {"token": TOKEN, "max_sandboxes": True},
    {"token": TOKEN, "max_sandboxes": "3"},
    {"token": TOKEN, "quota": 3},
    {"token": TOKEN, "log_mb": -1},
    {"token": TOKEN, "snapshot_mb": 0.5},
    {"token": TOKEN, "max_snapshots": False},
    {"max_sandboxes": 3},
])
def test_a_bad_entry_is_refused(entry: dict[str, object]) -> None:
    with pytest.raises(TokensError):
        parse_table(json.dumps({"bob": entry}))


def test_the_default_is_a_count_or_a_share_of_the_daemons_limit() -> None:
    assert parse_limit("200", 1000) == 200
    assert parse_limit("0", 1000) == 0
    assert parse_limit("50%", 1000) == 500
    assert parse_limit("0.01%", 1000) == 1  # a share is at least one sandbox
    for bad in ("", "-1", "0%", "101%", "half", "1e3"):
        with pytest.raises(InvalidRequest):
            parse_limit(bad, 1000)


def test_the_count_admits_up_to_the_limit_per_tenant() -> None:
    limits = {"bob": 2}
    q = LabelQuota(TENANT_LABEL, limits.get)
    bob, alice = {TENANT_LABEL: "bob"}, {TENANT_LABEL: "alice"}
    q.admit(bob, 2)
    q.add(bob)
    q.add(bob)
    with pytest.raises(QuotaExceeded) as e:
        q.admit(bob, 1)
    assert e.value.details == {"tenant": "bob", "in_use": 2, "limit": 2, "requested": 1}
    assert e.value.infra and e.value.code == "quota_exceeded" and e.value.status == 429
    for _ in range(5):  # no limit of her own: none; the admin's (no label): none
        q.admit(alice, 1)
        q.add(alice)
        q.admit({}, 1)
    q.remove(bob)
    q.admit(bob, 1)
    q.remove(bob)
    q.remove(bob)  # more removes than adds (a double destroy) never go below zero
    assert "bob" not in q.counts
    q.admit(bob, 2)
