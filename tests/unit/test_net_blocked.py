"""Blocked addresses (a cluster's other nodes): read from the settings, written into the
firewall's always-deny sets with the fixed ones. No root: the ruleset is text."""

from __future__ import annotations

import ipaddress
import json

import pytest

from corral.daemon.network import settings as settings_mod


def test_blocked_from_the_environment_or_the_file(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    conf = tmp_path / "network.json"
    conf.write_text(json.dumps({"blocked": ["192.0.2.7", "2001:db8::/48"]}))
    monkeypatch.setenv("CORRAL_NETWORK_CONFIG", str(conf))
    monkeypatch.setenv("CORRAL_UPLINK", "lo")
    monkeypatch.delenv("CORRAL_NET_BLOCKED", raising=False)
    s = settings_mod.load()
    assert s.blocked == (ipaddress.ip_network("192.0.2.7/32"),
                         ipaddress.ip_network("2001:db8::/48"))
    monkeypatch.setenv("CORRAL_NET_BLOCKED", "198.51.100.9/24, 203.0.113.1")
    assert [str(n) for n in settings_mod.load().blocked] == [
        "198.51.100.0/24", "203.0.113.1/32", "192.0.2.7/32", "2001:db8::/48"]  # both
    monkeypatch.setenv("CORRAL_NET_BLOCKED", "not-an-address")
    with pytest.raises(ValueError):
        settings_mod.load()
    with pytest.raises(ValueError):
        settings_mod.parse_blocked(["10.0.0.1"] * (settings_mod.MAX_BLOCKED + 1))
    with pytest.raises(ValueError):
        settings_mod.parse_blocked("10.0.0.1")  # a string is not a list
    with pytest.raises(ValueError):
        settings_mod.parse_blocked(["fe80::1%eth0"])  # ipaddress takes it; nftables not


def test_the_ruleset_denies_blocked_addresses_before_any_policy() -> None:
    firewall = pytest.importorskip("corral.daemon.network.firewall")
    s = settings_mod.NetSettings(uplink="lo", blocked=(ipaddress.ip_network("192.0.2.7"),))
    try:
        fw = firewall.Firewall(s, (ipaddress.ip_network("2001:db8::/48"),))
    except Exception as e:  # noqa: BLE001 - no libnftables here: nothing to check
        pytest.skip(f"libnftables: {e}")
    rules = fw.ruleset()
    blocked4 = next(ln for ln in rules.splitlines() if "set blocked4" in ln)
    blocked6 = next(ln for ln in rules.splitlines() if "set blocked6" in ln)
    assert "192.0.2.7/32" in blocked4 and "169.254.0.0/16" in blocked4
    assert "2001:db8::/48" in blocked6 and "fe80::/10" in blocked6
    chain = rules[rules.index("chain from_sandbox"):]
    assert chain.index("@blocked4") < chain.index("iifname vmap @shard")  # before a policy
    fw.nft.close()
