"""DNS pins (docs/network.md, "DNS"): what an answer opens, given the sandbox's policy at the
time it is pinned, the private addresses a CIDR rule names and the cap of pinned entries. No
root: the proxy's answer path runs with its upstream replaced, the firewall is a recorder."""

from __future__ import annotations

import ipaddress
from typing import Any

import pytest
from dnslib import QTYPE, RCODE, RR, A, DNSRecord

from corral import Network
from corral.daemon.network import policy as policy_mod
from corral.daemon.network import settings as settings_mod
from corral.daemon.network.dns import DnsProxy
from corral.daemon.network.manager import Attachment, NetworkManager
from corral.daemon.network.policy import compile_policy
from corral.errors import InvalidNetwork


class _Recorder:
    """The firewall as the manager uses it: what it was told to add."""

    def __init__(self) -> None:
        self.added: list[dict[str, list[str]]] = []

    def add_sets(self, ifname: str, by_set: dict[str, list[str]]) -> None:
        self.added.append(by_set)

    def swap(self, ifname: str, old: dict, new: dict) -> None:
        pass


def _manager(network: Any, max_pins: int = 4096) -> tuple[NetworkManager, Attachment,
                                                          _Recorder]:
    mgr = NetworkManager.__new__(NetworkManager)
    mgr.s = settings_mod.NetSettings(uplink="lo", max_pins=max_pins)
    fw = _Recorder()
    mgr.fw = fw  # type: ignore[assignment]
    policy, label = mgr.resolve(network)
    att = Attachment("sb", 1, "crl1", ipaddress.IPv4Address("10.213.0.2"), None, policy, None,
                     label, mgr)
    mgr.attachments = {"sb": att}
    return mgr, att, fw


def _proxy(att: Attachment, answers: dict[str, list[str]], during: Any = None) -> DnsProxy:
    """The proxy's answer path for ``att``, its upstream answering from ``answers`` (and
    running ``during`` first, as if it happened while the query was on its way)."""
    p = DnsProxy.__new__(DnsProxy)
    p.lookup = lambda src: att
    p.counts = dict.fromkeys(("queries", "refused", "forwarded", "failed", "pins_refused",
                              "stale", "malformed", "truncated"), 0)

    def forward(q: DNSRecord) -> DNSRecord:
        if during is not None:
            during()
        r = q.reply()
        for a in answers.get(str(q.q.qname).rstrip("."), []):
            r.add_answer(RR(q.q.qname, QTYPE.A, rdata=A(a), ttl=30))
        return r

    p._forward = forward  # type: ignore[method-assign]
    return p


def _ask(p: DnsProxy, name: str) -> DNSRecord:
    out = p._reply(DNSRecord.question(name, "A").pack(), "10.213.0.2", None)
    assert out is not None
    return DNSRecord.parse(out)


def _elements(fw: _Recorder) -> list[str]:
    return [e for by_set in fw.added for v in by_set.values() for e in v]


def test_an_answer_in_flight_across_a_policy_update_pins_nothing() -> None:
    """The policy changes while the upstream answers a name only the old one allows: the
    answer opens nothing (the update dropped the old pins; a pin made after it with the old
    policy's ports reached an address the new policy forbids for the answer's TTL)."""
    mgr, att, fw = _manager(Network(allow=["slow.test:80"]))
    p = _proxy(att, {"slow.test": ["198.51.100.7"]},
               during=lambda: mgr.update("sb", Network(allow=["other.test:80"])))
    r = _ask(p, "slow.test")
    assert r.header.rcode == RCODE.SERVFAIL and not r.rr, r
    assert att.pins == {} and att.pinned == {} and _elements(fw) == []
    assert p.counts["stale"] == 1
    # The same lookup with no update meanwhile pins its answer.
    p = _proxy(att, {"other.test": ["198.51.100.8"]})
    r = _ask(p, "other.test")
    assert r.header.rcode == RCODE.NOERROR and list(att.pins) == ["198.51.100.8"]
    assert _elements(fw) == ['"crl1" . 198.51.100.8 . tcp . 80 timeout 30s',
                             '"crl1" . 198.51.100.8 . udp . 80 timeout 30s']


def test_a_pin_of_an_older_generation_is_refused() -> None:
    mgr, att, fw = _manager(Network(allow=["a.test:80"]))
    gen = att.generation
    mgr.update("sb", Network(allow=["a.test:443"]))
    assert att.generation == gen + 1
    assert att.pin(["198.51.100.9"], ((80, 80),), 30, generation=gen) is None
    assert att.pins == {} and fw.added == []
    assert att.pin(["198.51.100.9"], ((443, 443),), 30, generation=att.generation) is True


@pytest.mark.parametrize("name_ports", ["1-65535", "5432", "5000-6000", ""])
def test_a_private_address_is_pinned_only_on_its_cidr_rules_ports(name_ports: str) -> None:
    """A name resolving to a private address an allow CIDR names on one port: pinned for that
    port at most, whatever the name's ports (a range pin went to the interval set, checked
    before the private ranges: every port of the range was open)."""
    rule = f"priv.test:{name_ports}" if name_ports else "priv.test"
    mgr, att, fw = _manager(Network(allow=["10.78.77.10/32:5432", rule]))
    r = _ask(_proxy(att, {"priv.test": ["10.78.77.10"]}), "priv.test")
    assert r.header.rcode == RCODE.NOERROR and len(r.rr) == 1  # answered
    for e in _elements(fw):
        port = e.split(" . ")[3].split()[0] if e.count(" . ") == 3 else "all"
        assert port == "5432", e
    assert att.entries and all(p == (5432, 5432) for _, p in att.entries)


def test_a_private_address_outside_the_names_ports_pins_nothing() -> None:
    mgr, att, fw = _manager(Network(allow=["10.78.77.10/32:5432", "priv.test:80-90"]))
    _ask(_proxy(att, {"priv.test": ["10.78.77.10", "198.51.100.3"]}), "priv.test")
    assert list(att.pins) == ["198.51.100.3"]
    assert all("10.78.77.10" not in e for e in _elements(fw))


def test_address_ports_intersect_the_covering_rules() -> None:
    pol = compile_policy(["10.0.0.0/8:22", "10.1.0.0/16:5432,6000-6010", "x.test"], [], {})
    assert pol.address_ports("10.1.2.3", ((0, 65535),)) == ((22, 22), (5432, 5432),
                                                              (6000, 6010))
    assert pol.address_ports("10.1.2.3", ((6005, 7000), (22, 23))) == ((6005, 6010), (22, 22))
    assert pol.address_ports("10.2.0.1", ((5432, 5432),)) == ()
    assert pol.address_ports("192.168.0.1", ((0, 65535),)) == ()


def test_a_policy_with_too_many_name_ports_is_invalid() -> None:
    """256 rules of ~55 ports each (14,060 distinct): each DNS query cost ~2 s of the daemon's
    CPU (a quadratic de-dup) and each pinned address ~28,000 elements; refused at compile."""
    rules, p = [], 1
    for _ in range(256):  # each rule as many ports as 300 characters hold
        ports: list[str] = []
        while len("*.good.test:" + ",".join([*ports, str(p)])) <= 300:
            ports, p = [*ports, str(p)], p + 1
        rules.append("*.good.test:" + ",".join(ports))
    assert p - 1 == 14060
    with pytest.raises(InvalidNetwork) as e:
        compile_policy(rules, [], {})
    assert e.value.details["limit"] == "name_ports"
    # At the bound: fine, and a name's ports are each once.
    ok = [f"*.good.test:{','.join(str(p) for p in range(i, policy_mod.MAX_NAME_PORTS + 1, 4))}"
          for i in (1, 2, 3, 4)] + ["*.good.test:1,2,3"]
    pol = compile_policy(ok, [], {})
    assert len(pol.name_ports("a.good.test") or ()) == policy_mod.MAX_NAME_PORTS
    with pytest.raises(InvalidNetwork):
        compile_policy([*ok, f"b.test:{policy_mod.MAX_NAME_PORTS + 1}"], [], {})
    # CIDR rules' ports are the kernel's interval elements, not pins: not counted here.
    twelve = ",".join(str(p) for p in range(1000, 1120, 10))
    compile_policy([f"203.0.113.{i}:{twelve}" for i in range(40)], [], {})


def test_the_pin_cap_counts_address_and_port_entries() -> None:
    """CORRAL_NET_MAX_PINS counts an address once per port entry it is pinned for: 10
    addresses on 5 ports are 50 entries (each 2 elements, TCP and UDP)."""
    mgr, att, fw = _manager("internet", max_pins=40)
    five = tuple((p, p) for p in (80, 443, 8080, 8443, 9000))
    addrs = [f"198.51.100.{i}" for i in range(10)]
    assert att.pin(addrs, five, 30) is False and att.pins_refused == 1 and fw.added == []
    assert att.pin(addrs, five[:4], 30) is True
    assert len(att.entries) == 40 and len(_elements(fw)) == 80
    assert att.pin(addrs[:1], five[:4], 30) is True  # the same entries again: no more
    assert att.pin(addrs[:1], five[4:], 30) is False  # one more entry: past the cap
    mgr.update("sb", "internet")
    assert att.entries == {} and att.pin(addrs[:1], five, 30) is True


def test_settings_refuse_an_uplink_named_like_the_sandboxes_links(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("CORRAL_NETWORK_CONFIG", "")
    monkeypatch.setenv("CORRAL_NET_IFPREFIX", "crl")
    monkeypatch.setenv("CORRAL_UPLINK", "crl0")
    with pytest.raises(ValueError, match="uplink"):
        settings_mod.load()
    monkeypatch.setenv("CORRAL_UPLINK", "eth0")
    assert settings_mod.load().uplink == "eth0"
