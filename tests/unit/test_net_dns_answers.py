"""Upstream answers are checked before dnslib parses them (corral.daemon.network.dns.
check_answer): dnslib decodes each name in full, following its pointers again each time, so
an answer a resolver relays for a zone its asker controls held the daemon's CPU for ~0.5 s
(4,079 records named by a pointer to a 122-label name), a backward pointer chain ~19 s."""

from __future__ import annotations

import time

from dnslib import AAAA, CNAME, MX, QTYPE, RR, SOA, TXT, A, DNSRecord

from corral.daemon.network.dns import ANSWER_MAX_RRS, check_answer


def _answer(qname: str, rrs: list[RR]) -> bytes:
    q = DNSRecord.question(qname)
    a = q.reply()
    for rr in rrs:
        a.add_answer(rr)
    return a.pack()


def test_ordinary_answers_pass():
    name = "www.example.test"
    cases = [
        [RR(name, QTYPE.A, rdata=A("192.0.2.1"), ttl=60)],
        [RR(name, QTYPE.CNAME, rdata=CNAME("edge.cdn.example.test")),
         RR("edge.cdn.example.test", QTYPE.CNAME, rdata=CNAME("a.b.cdn.example.test")),
         *[RR("a.b.cdn.example.test", QTYPE.A, rdata=A(f"192.0.2.{i}")) for i in range(1, 40)]],
        [RR(name, QTYPE.AAAA, rdata=AAAA("2001:db8::1"))],
        [RR(name, QTYPE.MX, rdata=MX("mail.example.test", 10)),
         RR(name, QTYPE.TXT, rdata=TXT("v=spf1 -all" * 20)),
         RR("example.test", QTYPE.SOA, rdata=SOA("ns1.example.test", "admin.example.test",
                                                 (1, 2, 3, 4, 5)))],
    ]
    for rrs in cases:
        data = _answer(name, rrs)
        assert check_answer(data), rrs
        assert DNSRecord.parse(data).rr  # and dnslib reads it


def _bomb(records: int, labels: int) -> bytes:
    """An answer of ``records`` A records each named by a pointer to a question name of
    ``labels`` labels (what a relaying resolver sends for an RRset under a deep name)."""
    qname = ".".join(["a"] * labels) + ".bomb.test"
    header = (0x1234).to_bytes(2, "big") + b"\x81\x80" + (1).to_bytes(2, "big") + \
        records.to_bytes(2, "big") + bytes(4)
    q = b"".join(bytes([len(p)]) + p.encode() for p in qname.split(".")) + b"\0" + \
        b"\x00\x01\x00\x01"
    rr = b"\xc0\x0c" + b"\x00\x01\x00\x01" + (60).to_bytes(4, "big") + b"\x00\x04" + \
        bytes([198, 51, 100, 7])
    return header + q + rr * records


def test_answers_that_cost_dnslib_quadratic_time_are_refused_fast():
    for data in (_bomb(4079, 122), _bomb(ANSWER_MAX_RRS, 122), _bomb(200, 122)):
        t = time.monotonic()
        assert not check_answer(data)
        assert time.monotonic() - t < 0.1


def test_pointer_chains_and_loops_are_refused():
    header = b"\x12\x34\x81\x80" + (0).to_bytes(2, "big") + (1).to_bytes(2, "big") + bytes(4)
    # a record whose name is a pointer to itself (a loop), and a forward pointer
    for target in (12, 200):
        rr = bytes([0xC0 | (target >> 8), target & 0xFF]) + b"\x00\x01\x00\x01" + bytes(4) + \
            b"\x00\x04" + bytes(4)
        assert not check_answer(header + rr)
    # a long chain of pointers each to the one before (held in a TXT record's data, where
    # nothing reads it as a name), then records named by its end
    base = 12 + 1 + 10  # the header, the TXT record's root name and its fixed fields
    chain = bytearray(b"\x01a\x00")
    prev = base
    for _ in range(900):
        here = base + len(chain)
        chain += bytes([0xC0 | (prev >> 8), prev & 0xFF])
        prev = here
    txt = b"\x00" + b"\x00\x10\x00\x01" + bytes(4) + len(chain).to_bytes(2, "big") + chain
    n = 300
    rr = bytes([0xC0 | (prev >> 8), prev & 0xFF]) + b"\x00\x01\x00\x01" + bytes(4) + \
        b"\x00\x04" + bytes(4)
    head = b"\x12\x34\x81\x80" + bytes(2) + (n + 1).to_bytes(2, "big") + bytes(4)
    assert check_answer(head[:6] + (1).to_bytes(2, "big") + bytes(4) + txt)  # the TXT alone
    assert check_answer(head[:6] + (2).to_bytes(2, "big") + bytes(4) + txt + rr) is False
    t = time.monotonic()
    assert not check_answer(head + txt + rr * n)
    assert time.monotonic() - t < 0.1


def test_a_header_alone_or_a_cut_record_is_refused():
    assert not check_answer(b"\x12\x34")
    data = _answer("x.example.test", [RR("x.example.test", QTYPE.A, rdata=A("192.0.2.1"))])
    assert not check_answer(data[:-2])


def test_names_in_the_data_of_every_type_dnslib_decodes_are_counted():
    """RRSIG's signer, NSEC's next name, RP's two names and NAPTR's replacement are decoded
    by dnslib too: a 16,000-label name in one RRSIG's data, pointed at by 200 others' signers,
    took 3.4 s to parse and passed the check when only owners and NS/CNAME/MX... were walked."""
    from dnslib import NAPTR, NSEC, RP, RRSIG

    name = "sig.example.test"
    ordinary = _answer(name, [
        RR(name, QTYPE.RRSIG, rdata=RRSIG(1, 8, 3, 60, 1, 2, 3, "example.test", b"s" * 64)),
        RR(name, QTYPE.NSEC, rdata=NSEC("next.example.test", ["A", "RRSIG"])),
        RR(name, QTYPE.RP, rdata=RP("admin.example.test", "txt.example.test")),
        RR(name, QTYPE.NAPTR, rdata=NAPTR(10, 20, b"U", b"E2U+sip", b"!^.*$!sip:x@y!",
                                          "_sip._udp.example.test")),
    ])
    assert check_answer(ordinary)
    assert len(DNSRecord.parse(ordinary).rr) == 4
    # an RRSIG whose signer is a 120-label name, then 100 records whose signers point at
    # it: each decodes the 120 labels again
    deep = ".".join(["a"] * 120)
    data = bytearray(_answer(name, [RR(name, QTYPE.RRSIG, rdata=RRSIG(
        1, 8, 3, 60, 1, 2, 3, deep, b"s"))]))
    at = data.find(b"\x01a\x01a")  # the signer name's offset
    name_ptr = bytes([0xC0 | (at >> 8), at & 0xFF])
    rdata = bytes(18) + name_ptr + b"s"
    rr = b"\xc0\x0c" + (46).to_bytes(2, "big") + b"\x00\x01" + bytes(4) + \
        len(rdata).to_bytes(2, "big") + rdata

    def answer(k: int) -> bytes:
        head = bytes(data[:6]) + (1 + k).to_bytes(2, "big") + bytes(data[8:])
        return head + rr * k
    assert check_answer(answer(1))  # one pointing record: within the bounds
    assert not check_answer(answer(100))
