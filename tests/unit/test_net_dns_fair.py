"""The DNS proxy's workers shared by the sandboxes (docs/network.md, "DNS"): queries whose
upstream never answers, from many sandboxes at once, do not starve another sandbox's
lookups. No root: the proxy listens on a free loopback port, its upstream is a fake server
on another, and each "sandbox" is a loopback address of its own (127.0.0.0/8)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
from dnslib import QTYPE, RCODE, RR, A, DNSRecord

from corral.daemon.network import dns as dns_mod
from corral.daemon.network.dns import DnsProxy, _Fair

UPSTREAM_S = 1.0  # the proxy's wait for its upstream, here (3 s in a daemon)
ATTACKERS = 20  # sandboxes keeping their queries in flight on never-answered names


class _Asker:
    """What the proxy's lookup gives for a sandbox in mode internet."""
    policy = None
    address6 = None
    generation = 0

    def peer(self, name: str, version: int = 4) -> None:
        return None

    def refused(self, name: str) -> None:
        pass


@pytest.fixture
def upstream() -> Iterator[tuple[str, int]]:
    """A resolver answering every name with 192.0.2.1 but those under void.test: never."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    s.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                data, src = s.recvfrom(4096)
            except OSError:
                continue
            q = DNSRecord.parse(data)
            if str(q.q.qname).rstrip(".").endswith("void.test"):
                continue
            r = q.reply()
            r.add_answer(RR(q.q.qname, QTYPE.A, rdata=A("192.0.2.1"), ttl=30))
            s.sendto(r.pack(), src)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield s.getsockname()
    finally:
        stop.set()
        t.join()
        s.close()


def _sender(addr: str) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((addr, 0))
    return s


def test_sandboxes_flooding_never_answered_names_do_not_starve_another(
        upstream: tuple[str, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """20 sandboxes each send a name whose upstream never answers every 50 ms (20 a second,
    within the rate limit; 4 of each in flight at once, each holding a worker until the
    upstream wait ends), while another resolves a name the upstream answers at once: each of
    its lookups is answered within its resolver's 2.5 s. With the 16 workers serving every
    sandbox's queries first come, first served, 64 of the flooders' queries waited ahead of
    each of its lookups (~4 upstream waits) and all of them timed out."""
    monkeypatch.setattr(dns_mod, "UPSTREAM_TIMEOUT_S", UPSTREAM_S)
    proxy = DnsProxy("127.0.0.1", upstream, lambda src: _Asker(), port=0)
    where = proxy.sock.getsockname()
    stop = threading.Event()

    def flood(k: int) -> None:
        s = _sender(f"127.0.1.{k}")
        i = 0
        try:
            while not stop.is_set():
                s.sendto(DNSRecord.question(f"n{i}.s{k}.void.test").pack(), where)
                i += 1
                stop.wait(0.05)
        finally:
            s.close()

    flooders = [threading.Thread(target=flood, args=(k,), daemon=True)
                for k in range(1, ATTACKERS + 1)]
    victim = _sender("127.0.2.1")
    victim.settimeout(2.5 * UPSTREAM_S)
    got: list[str] = []
    try:
        for t in flooders:
            t.start()
        time.sleep(2 * UPSTREAM_S)  # every flooder's queries in flight, the workers taken
        for i in range(6):
            q = DNSRecord.question(f"good{i}.test")
            victim.sendto(q.pack(), where)
            try:
                while True:
                    r = DNSRecord.parse(victim.recv(4096))
                    if r.header.id == q.header.id:
                        break
                got.append(f"{RCODE[r.header.rcode]} {r.rr[0].rdata if r.rr else ''}")
            except TimeoutError:
                got.append("timed out")
            time.sleep(0.2)
        failed = proxy.counts["failed"]
    finally:
        stop.set()
        for t in flooders:
            t.join()
        victim.close()
        proxy.close()
    assert got == ["NOERROR 192.0.2.1"] * 6, got
    assert failed >= ATTACKERS, failed  # the flooders' queries did hold workers upstream


def test_sources_are_served_in_turn() -> None:
    """One worker, one call of a source at a time: the calls waiting run one source at a
    time in turn, whatever order they came in."""
    pool = _Fair(1, 1, "test-fair")
    gate, order, done = threading.Event(), [], threading.Event()

    def call(name: str) -> None:
        if name == "a1":
            gate.wait(10)
        order.append(name)
        if len(order) == 6:
            done.set()

    try:
        for name in ("a1", "a2", "a3", "b1", "b2", "c1"):
            pool.submit(name[0], call, name)
        gate.set()
        assert done.wait(10)
    finally:
        pool.close()
    assert order == ["a1", "b1", "c1", "a2", "b2", "a3"]


def test_one_source_takes_at_most_its_share_of_the_workers() -> None:
    """Four workers, two a source: a source with four calls blocked runs two of them, and
    another source's call runs meanwhile."""
    pool = _Fair(4, 2, "test-fair")
    gate, lock = threading.Event(), threading.Lock()
    running, most, other = [0], [0], threading.Event()

    def stuck() -> None:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        gate.wait(10)
        with lock:
            running[0] -= 1

    try:
        for _ in range(4):
            pool.submit("a", stuck)
        pool.submit("b", other.set)
        assert other.wait(5)  # while a's calls are all blocked
        time.sleep(0.2)
        assert most[0] == 2 and running[0] == 2
        gate.set()
    finally:
        gate.set()
        pool.close()
