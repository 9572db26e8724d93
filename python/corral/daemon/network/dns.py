"""The sandboxes' resolver: a DNS proxy on the gateway address (UDP and TCP 53) that answers each
sandbox by its source address. A sandbox with a policy gets answers only for names its
policy allows, and the addresses of each answer (A and AAAA) are pinned into its kernel
allow-sets (with the answer's TTL) before the answer is sent, so a connect right after works
and an address it never resolved stays refused. A sandbox without IPv6 gets empty AAAA
answers; names of sandboxes in the asker's network group resolve to their addresses.
Everything else is refused (NXDOMAIN), so no query for a denied name leaves the host
(DNS tunnelling through any name but an allowed one is not possible)."""

from __future__ import annotations

import collections
import contextlib
import ipaddress
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from dnslib import AAAA, QTYPE, RCODE, RR, A, DNSHeader, DNSRecord

from .firewall import BLOCKED4, BLOCKED6, PRIVATE4, PRIVATE6

log = logging.getLogger("corral.network.dns")

IP_FREEBIND = 15
MIN_PIN_S, MAX_PIN_S = 5, 3600
UPSTREAM_TIMEOUT_S = 3.0
# UDP answers longer than the asker's EDNS buffer (512 bytes without EDNS) are sent truncated
# (TC set): the asker then asks again over TCP, where the same filtering and pinning apply.
UDP_PLAIN, UDP_MAX = 512, 4096
# A query from a sandbox is at most this long: without an additional record (EDNS), and with
# one. Anything longer (a query has one question and at most an OPT record) is refused unparsed.
QUERY_MAX, QUERY_MAX_EDNS = 512, 1232
# Addresses of one answer pinned (and answered): the first ones of the asked type.
PINS_PER_ANSWER = 64
# DNS over TCP: connections open per sandbox and in all, and how long an idle one stays
# (idle: no whole message received); a connection is closed after this many of its queries
# were refused by the rate limit.
TCP_PER_SOURCE, TCP_TOTAL, TCP_IDLE_S, TCP_REFUSED_MAX = 4, 4096, 10.0, 8
# Per sandbox: queries per second (a token bucket of twice that) and queries in flight
# (waiting for a worker or answered by one), so one sandbox flooding its resolver cannot take
# the workers every other one needs.
RATE_QPS, IN_FLIGHT = 50.0, 4
# The workers answering queries (each waits for the upstream: at most UPSTREAM_TIMEOUT_S, twice
# with a TCP retry after a truncated answer) and the most of them one sandbox's queries take at
# once; the queries waiting for a worker are served one sandbox at a time, in turn (_Fair).
WORKERS, WORKERS_PER_SOURCE = 32, 2


_INTERNAL = [ipaddress.ip_network(n) for n in (*PRIVATE4, *BLOCKED4, *PRIVATE6, *BLOCKED6)]


DROP = -1  # check_query: not a query, no answer


def check_query(data: bytes) -> int | None:
    """None if ``data`` is a query the proxy answers: a header saying one question and no
    answer or authority records, at most one additional record (an OPT: EDNS), no longer
    than QUERY_MAX (QUERY_MAX_EDNS with the OPT), a question name without compression
    pointers. Else the rcode to answer (FORMERR, NOTIMP for another opcode), or DROP for no
    answer (shorter than a header, or a response). Checked before any parse: dnslib decodes
    a pointer chain again for every question that points at it, so a 64 KiB message could
    cost seconds of the daemon's CPU."""
    if len(data) < 12 or data[2] & 0x80:
        return DROP
    if (data[2] >> 3) & 0xF:
        return int(RCODE.NOTIMP)
    qd, an, ns, ar = (int.from_bytes(data[i:i + 2], "big") for i in (4, 6, 8, 10))
    if qd != 1 or an or ns or ar > 1 or len(data) > (QUERY_MAX_EDNS if ar else QUERY_MAX):
        return int(RCODE.FORMERR)
    off, size = 12, 0
    while True:
        if off >= len(data):
            return int(RCODE.FORMERR)
        n = data[off]
        off += 1
        if n == 0:
            break
        size += n + 1
        if n & 0xC0 or size > 254:  # a pointer (or an obsolete label type); over 255 bytes
            return int(RCODE.FORMERR)
        off += n
    off += 4  # type, class
    if ar:
        # The OPT record: the root name, type 41, size, flags, and its options' length.
        if data[off:off + 3] != b"\x00\x00\x29" or len(data) < off + 11:
            return int(RCODE.FORMERR)
        off += 11 + int.from_bytes(data[off + 9:off + 11], "big")
    return None if off == len(data) else int(RCODE.FORMERR)


# An upstream answer is checked before dnslib parses it (check_answer): dnslib decodes every
# name in full, following its compression pointers again each time, so 4,079 records whose
# names point at a 122-label name (a 64 KiB answer over TCP, the shape a resolver relays for a
# zone its asker controls) cost ~0.5 s of the daemon's CPU, a backward pointer chain ~19 s.
ANSWER_MAX_RRS = 512
NAME_LABELS_MAX = 160  # a name's labels and pointers followed (255 bytes: at most 127 labels)
NAME_WORK_MAX = 4096  # labels and pointers followed for the whole message
# Record types whose data holds names dnslib decodes: the offset of the first, how many (NS,
# CNAME, PTR, DNAME, MX, SOA, SRV, RP, RRSIG, NSEC; NAPTR's name follows three strings).
_RDATA_NAMES = {2: (0, 1), 5: (0, 1), 12: (0, 1), 39: (0, 1), 15: (2, 1), 6: (0, 2),
                33: (6, 1), 17: (0, 2), 46: (18, 1), 47: (0, 1)}
_NAPTR = 35


def check_answer(data: bytes) -> bool:
    """Whether ``data`` is an answer dnslib parses in time linear in its size: at most
    ANSWER_MAX_RRS records, every name (owners, and those in the data of the types in
    _RDATA_NAMES and NAPTR) at most NAME_LABELS_MAX labels with its pointers followed, each
    pointer pointing back, and NAME_WORK_MAX labels decoded in all."""
    if len(data) < 12:
        return False
    qd, an, ns, ar = (int.from_bytes(data[i:i + 2], "big") for i in (4, 6, 8, 10))
    if qd > 1 or an + ns + ar > ANSWER_MAX_RRS:
        return False
    work = 0

    def name(off: int) -> int:
        """The offset after the name at ``off``; -1 if it breaks a rule."""
        nonlocal work
        labels, end, at = 0, -1, off
        while True:
            if at >= len(data):
                return -1
            n = data[at]
            if n & 0xC0 == 0xC0:
                if at + 1 >= len(data):
                    return -1
                target = ((n & 0x3F) << 8) | data[at + 1]
                if end < 0:
                    end = at + 2
                labels += 1  # a pointer followed costs as a label does
                work += 1
                if target >= at or labels > NAME_LABELS_MAX or work > NAME_WORK_MAX:
                    return -1  # forward or self: a loop, or not a name yet
                at = target
                continue
            if n & 0xC0:
                return -1
            if n == 0:
                break
            labels += 1
            work += 1
            if labels > NAME_LABELS_MAX or work > NAME_WORK_MAX:
                return -1
            at += n + 1
        return end if end >= 0 else at + 1

    off = 12
    for _ in range(qd):
        off = name(off)
        if off < 0:
            return False
        off += 4
    for _ in range(an + ns + ar):
        off = name(off)
        if off < 0 or off + 10 > len(data):
            return False
        rtype = int.from_bytes(data[off:off + 2], "big")
        rdlen = int.from_bytes(data[off + 8:off + 10], "big")
        start, off = off + 10, off + 10 + rdlen
        if off > len(data):
            return False
        skip, count = _RDATA_NAMES.get(rtype, (0, 0))
        at = start + skip
        if rtype == _NAPTR:  # order, preference, then flags, service, regexp: strings
            at, count = start + 4, 1
            for _ in range(3):
                if at >= off:
                    return False
                at += 1 + data[at]
        for _ in range(count):
            at = name(at)
            if at < 0 or at > off:
                return False
    return True


def _error_reply(data: bytes, rcode: int) -> bytes:
    """A header-only answer to a query refused unparsed: its id, opcode and RD bit."""
    return data[:2] + bytes([0x80 | (data[2] & 0x79), rcode & 0xF]) + bytes(8)


def _owner(rr: RR) -> str:
    return str(rr.rname).rstrip(".").lower()


def _cname_chain(name: str, rrs: list[RR]) -> list[str]:
    """``name`` and the names its CNAME records in ``rrs`` lead to, in order (a loop or a
    record of another owner adds nothing)."""
    chain = [name]
    targets = {_owner(rr): str(rr.rdata).rstrip(".").lower()
               for rr in rrs if rr.rtype == QTYPE.CNAME}
    while chain[-1] in targets and targets[chain[-1]] not in chain:
        chain.append(targets[chain[-1]])
    return chain


def _internal(addr: str) -> bool:
    """A private, link-local, metadata or multicast address (IPv4 or IPv6)."""
    ip = ipaddress.ip_address(addr)
    return any(ip.version == n.version and ip in n for n in _INTERNAL)


class DnsProxy:
    """``lookup(source address)`` -> the asker's state (an object with ``policy`` (None:
    mode internet), ``generation`` (bumped by each change of its policy), ``address6`` (None:
    no IPv6), ``pin(addresses, ports, ttl, generation, only)`` and ``peer(name, version)``),
    or None to drop. ``port``: 53 but in tests (0: any free one, for UDP and TCP each)."""

    def __init__(self, bind: str, upstream: tuple[str, int],
                 lookup: Callable[[str], Any], port: int = 53) -> None:
        self.upstream = upstream
        self.lookup = lookup
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_IP, IP_FREEBIND, 1)  # before the first veth has it
        self.sock.bind((bind, port))
        self.tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.tcp.setsockopt(socket.SOL_IP, IP_FREEBIND, 1)
        try:
            self.tcp.bind((bind, port))
            self.tcp.listen(256)
        except OSError:
            self.sock.close()
            self.tcp.close()
            raise
        self.tcp.setblocking(False)
        self.counts = {"queries": 0, "refused": 0, "forwarded": 0, "failed": 0,
                       "rate_limited": 0, "tcp_queries": 0, "truncated": 0, "malformed": 0,
                       "pins_refused": 0, "stale": 0}
        # source address -> [tokens, last refill (monotonic), in flight]
        self._buckets: dict[str, list[float]] = {}
        self._block = threading.Lock()
        self._pool = _Fair(WORKERS, WORKERS_PER_SOURCE, "corral-dns")
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="corral-dns", daemon=True)
        self._thread.start()
        self._tcp_thread = threading.Thread(target=self._serve_tcp, name="corral-dns-tcp",
                                            daemon=True)
        self._tcp_thread.start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                data, src = self.sock.recvfrom(4096)
            except OSError:
                if self._closed:
                    return
                continue
            if src is None:  # the socket was shut down (close): no sender, no query
                if self._closed:
                    return
                continue
            self.counts["queries"] += 1
            if not self._admit(src[0]):
                self.counts["rate_limited"] += 1
                continue  # dropped, as a lossy link would: the client retries later
            try:
                self._pool.submit(src[0], self._answer, data, src)
            except RuntimeError:
                return  # closing

    def _admit(self, addr: str) -> bool:
        with self._block:
            return self._admit_locked(addr)

    def _admit_locked(self, addr: str) -> bool:
        now = time.monotonic()
        b = self._buckets.get(addr)
        if b is None:
            if len(self._buckets) > 100_000:
                self._buckets.clear()
            b = self._buckets[addr] = [2 * RATE_QPS, now, 0]
        b[0] = min(2 * RATE_QPS, b[0] + (now - b[1]) * RATE_QPS)
        b[1] = now
        if b[0] < 1 or b[2] >= IN_FLIGHT:
            return False
        b[0] -= 1
        b[2] += 1
        return True

    def _done(self, addr: str) -> None:
        with self._block:
            b = self._buckets.get(addr)
            if b is not None and b[2] > 0:
                b[2] -= 1

    # ---- TCP: one thread reads every connection (selectors), the workers answer ----------
    def _serve_tcp(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.tcp, selectors.EVENT_READ)
        conns: dict[socket.socket, _TcpConn] = {}
        per_source: collections.Counter[str] = collections.Counter()

        def drop(c: socket.socket) -> None:
            st = conns.pop(c, None)
            if st is None:
                return
            per_source[st.src] -= 1
            if per_source[st.src] <= 0:
                del per_source[st.src]
            with contextlib.suppress(KeyError, ValueError):
                sel.unregister(c)
            c.close()

        try:
            while not self._closed:
                events = sel.select(timeout=1.0)
                now = time.monotonic()
                for key, _ in events:
                    sock = key.fileobj
                    if sock is self.tcp:
                        self._accept_tcp(sel, conns, per_source, now)
                        continue
                    assert isinstance(sock, socket.socket)
                    st = conns[sock]
                    try:
                        chunk = sock.recv(65537)
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError:
                        chunk = b""
                    if not chunk:
                        drop(sock)
                        continue
                    if not self._read_tcp(st, chunk, now):
                        drop(sock)
                for c in [c for c, st in conns.items() if now - st.last > TCP_IDLE_S]:
                    drop(c)
        finally:
            for c in list(conns):
                drop(c)
            sel.close()

    def _read_tcp(self, st: _TcpConn, chunk: bytes, now: float) -> bool:
        """The whole messages of ``st`` with ``chunk`` read, each admitted and handed to the
        workers; what is left of a message waits for the next chunk. False: close the
        connection (a message shorter than a DNS header or longer than a query, or too many
        refused by the rate limit)."""
        buf = st.buf
        buf += chunk
        off, ok = 0, True
        while len(buf) - off >= 2:
            n = int.from_bytes(buf[off:off + 2], "big")
            if n < 12 or n > QUERY_MAX_EDNS:
                self.counts["malformed"] += 1
                ok = False
                break
            if len(buf) - off < 2 + n:
                break
            msg = bytes(buf[off + 2:off + 2 + n])
            off += 2 + n
            st.last = now  # idle: no whole message
            self.counts["queries"] += 1
            self.counts["tcp_queries"] += 1
            if not self._admit(st.src):
                self.counts["rate_limited"] += 1
                st.refused += 1
                if st.refused >= TCP_REFUSED_MAX:
                    ok = False
                    break
                continue
            try:
                self._pool.submit(st.src, self._answer_tcp, msg, st)
            except RuntimeError:
                return False  # closing
        del buf[:off]
        return ok

    def _accept_tcp(self, sel: selectors.BaseSelector, conns: dict[socket.socket, _TcpConn],
                    per_source: collections.Counter[str], now: float) -> None:
        try:
            c, src = self.tcp.accept()
        except OSError:
            return
        # Sandboxes only (their source address cannot be spoofed), a few connections each.
        if self.lookup(src[0]) is None or per_source[src[0]] >= TCP_PER_SOURCE or \
                len(conns) >= TCP_TOTAL:
            self.counts["rate_limited"] += 1
            c.close()
            return
        c.setblocking(False)
        conns[c] = _TcpConn(c, src[0], now)
        per_source[src[0]] += 1
        sel.register(c, selectors.EVENT_READ)

    def _answer_tcp(self, data: bytes, st: _TcpConn) -> None:
        try:
            reply = self._reply(data, st.src, 65535)
        except Exception:  # a malformed query: no answer, as a resolver would
            log.debug("bad DNS query over TCP from %s", st.src, exc_info=True)
            return
        finally:
            self._done(st.src)
        if reply is not None:
            with st.lock:
                _send_all(st.sock, len(reply).to_bytes(2, "big") + reply)

    def _answer(self, data: bytes, src: tuple[str, int]) -> None:
        try:
            reply = self._reply(data, src[0], None)
        except Exception:  # a malformed query: no answer, as a resolver would
            log.debug("bad DNS query from %s", src[0], exc_info=True)
            return
        finally:
            self._done(src[0])
        if reply is not None:
            try:
                self.sock.sendto(reply, src)
            except OSError:
                pass

    def _reply(self, data: bytes, src: str, limit: int | None) -> bytes | None:
        """The answer to ``data`` from ``src``; ``limit``: the largest answer the transport
        carries (None: UDP, the asker's EDNS buffer), a longer one is sent truncated."""
        who = self.lookup(src)
        if who is None:
            return None
        bad = check_query(data)
        if bad is not None:
            self.counts["malformed"] += 1
            return None if bad == DROP else _error_reply(data, bad)
        q = DNSRecord.parse(data)
        if limit is None:
            opt = [rr for rr in q.ar if rr.rtype == QTYPE.OPT]
            limit = min(UDP_MAX, max(UDP_PLAIN, opt[0].rclass if opt else 0))
        if len(q.questions) != 1:
            return self._refuse(q, RCODE.FORMERR)
        name = str(q.q.qname).rstrip(".").lower()
        qtype = q.q.qtype
        six = getattr(who, "address6", None) is not None
        peer = who.peer(name, 6 if qtype == QTYPE.AAAA else 4)
        if peer is not None:
            r = q.reply()
            if qtype == QTYPE.A:
                r.add_answer(RR(q.q.qname, QTYPE.A, rdata=A(peer), ttl=5))
            elif qtype == QTYPE.AAAA and peer and six:
                r.add_answer(RR(q.q.qname, QTYPE.AAAA, rdata=AAAA(peer), ttl=5))
            return r.pack()
        # The policy's generation before the policy itself (a policy update sets the policy,
        # then bumps the generation): an answer looked up under a policy that changed
        # meanwhile pins nothing (Attachment.pin).
        generation = getattr(who, "generation", None)
        policy = who.policy
        ports = None
        if policy is not None:
            ports = policy.name_ports(name)
            if ports is None:
                self.counts["refused"] += 1
                who.refused(name)
                return self._refuse(q, RCODE.NXDOMAIN)
        if qtype == QTYPE.AAAA and not six:
            return q.reply().pack()  # no IPv6 in this sandbox: an empty answer, not an error
        if policy is not None and qtype not in (QTYPE.A, QTYPE.AAAA, QTYPE.CNAME):
            return self._refuse(q, RCODE.NXDOMAIN)
        qid = q.header.id
        ans = self._forward(q)
        if ans is None:
            self.counts["failed"] += 1
            return self._refuse(q, RCODE.SERVFAIL)
        self.counts["forwarded"] += 1
        if policy is not None and ports is not None:
            # An allowed name answering with a private or link-local address (DNS rebinding
            # to an internal service) opens nothing but what an allow CIDR covering it opens:
            # such an address is pinned only for the name's ports that rule's ports cover.
            # Only the asked name's records are kept: its own and those of the names its
            # CNAME chain leads to (an answer carrying another name's addresses opens none of
            # them), and a chain through a denied name is refused as that name is (a deny
            # is not undone by an alias of it). Only the asked type is pinned (an A answer
            # carrying AAAA records opens none), and only its first PINS_PER_ANSWER
            # addresses, the only ones answered.
            chain = _cname_chain(name, ans.rr)
            denied = next((c for c in chain if policy.denies(c)), None)
            if denied is not None:
                self.counts["refused"] += 1
                who.refused(denied)
                return self._refuse(q, RCODE.NXDOMAIN)
            kept, n = [], 0
            for rr in ans.rr:
                if _owner(rr) not in chain:
                    continue
                if rr.rtype == QTYPE.CNAME or (rr.rtype == qtype and n < PINS_PER_ANSWER):
                    kept.append(rr)
                    n += rr.rtype == qtype
            ans.rr = kept
            pins: list[tuple[str, int]] = []
            only: dict[str, tuple[tuple[int, int], ...]] = {}
            for rr in ans.rr:
                if rr.rtype not in (QTYPE.A, QTYPE.AAAA) or rr.rtype != qtype:
                    continue
                addr = str(rr.rdata)
                if _internal(addr):
                    only[addr] = policy.address_ports(addr, ports)
                    if not only[addr]:
                        continue
                pins.append((addr, int(rr.ttl)))
            if pins:
                ttl = max(MIN_PIN_S, min(MAX_PIN_S, max(t for _, t in pins)))
                done = who.pin([a for a, _ in pins], ports, ttl, generation=generation,
                               only=only)
                if done is False:
                    # Past the sandbox's cap of live pins: refused, nothing opened.
                    self.counts["pins_refused"] += 1
                    return self._refuse(q, RCODE.REFUSED)
                if done is None:
                    # Its policy changed while the answer was on its way: nothing pinned;
                    # the asker's retry is answered under the new policy.
                    self.counts["stale"] += 1
                    return self._refuse(q, RCODE.SERVFAIL)
            ans.auth, ans.ar = [], []
        ans.header.id = qid
        out = ans.pack()
        if len(out) > limit:
            self.counts["truncated"] += 1
            t = DNSRecord(DNSHeader(id=qid, bitmap=ans.header.bitmap), questions=q.questions)
            t.header.tc = 1
            return t.pack()
        return out

    @staticmethod
    def _refuse(q: DNSRecord, rcode: int) -> bytes:
        r = q.reply()
        r.header.rcode = rcode
        return r.pack()

    def _forward(self, q: DNSRecord) -> DNSRecord | None:
        """The upstream's answer over UDP; asked again over TCP if that one is truncated. Each
        waits at most UPSTREAM_TIMEOUT_S in all, whatever the upstream sends meanwhile."""
        ans = self._forward_udp(q)
        if ans is not None and ans.header.tc:
            ans = self._forward_tcp(q)
        return ans

    def _forward_tcp(self, q: DNSRecord) -> DNSRecord | None:
        deadline = time.monotonic() + UPSTREAM_TIMEOUT_S
        try:
            s = socket.create_connection(self.upstream, timeout=UPSTREAM_TIMEOUT_S)
        except OSError:
            return None
        try:
            out = DNSRecord(DNSHeader(id=int.from_bytes(os.urandom(2), "big"), rd=1),
                            questions=q.questions).pack()
            _until(s, deadline)
            s.sendall(len(out).to_bytes(2, "big") + out)
            n = int.from_bytes(_recv_exact(s, 2, deadline), "big")
            data = _recv_exact(s, n, deadline)
            if not check_answer(data):
                return None
            ans = DNSRecord.parse(data)
            return ans if ans.header.id == int.from_bytes(out[:2], "big") else None
        except Exception:  # noqa: BLE001 - unreachable, timed out, or not DNS
            return None
        finally:
            s.close()

    def _forward_udp(self, q: DNSRecord) -> DNSRecord | None:
        if not self.upstream[0]:
            return None
        deadline = time.monotonic() + UPSTREAM_TIMEOUT_S
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.connect(self.upstream)
            out = DNSRecord(DNSHeader(id=int.from_bytes(os.urandom(2), "big"), rd=1),
                            questions=q.questions)
            s.send(out.pack())
            while True:
                _until(s, deadline)
                data = s.recv(4096)
                if data[:2] == out.header.id.to_bytes(2, "big") and not check_answer(data):
                    return None
                with contextlib.suppress(Exception):  # not DNS: not the answer
                    ans = DNSRecord.parse(data)
                    if ans.header.id == out.header.id:
                        return ans
        except Exception:  # noqa: BLE001 - unreachable, timed out, or not DNS
            return None
        finally:
            s.close()

    def close(self) -> None:
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self._thread.join(timeout=2)
        self._tcp_thread.join(timeout=2)  # it wakes at least once a second
        self.tcp.close()
        self._pool.close()


class _TcpConn:
    """One DNS-over-TCP connection: what is read of its next message, its sandbox."""

    def __init__(self, sock: socket.socket, src: str, now: float) -> None:
        self.sock, self.src, self.last = sock, src, now
        self.buf = bytearray()
        self.refused = 0  # queries refused by the rate limit
        self.lock = threading.Lock()  # answers of pipelined queries, one at a time


def _send_all(sock: socket.socket, data: bytes) -> None:
    """Write ``data`` to a non-blocking socket without waiting: a peer that does not read its
    answers (its socket buffer is full) loses the connection, never holds a worker."""
    try:
        n = sock.send(data)
    except (BlockingIOError, InterruptedError):
        n = 0
    except OSError:
        return
    if n < len(data):
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)  # the reader thread sees it end and drops it


def _until(s: socket.socket, deadline: float) -> None:
    """The timeout of ``s``'s next call: what is left until ``deadline`` (past it: timed out)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the upstream took too long")
    s.settimeout(left)


def _recv_exact(s: socket.socket, n: int, deadline: float) -> bytes:
    buf = b""
    while len(buf) < n:
        _until(s, deadline)
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the upstream closed the connection")
        buf += chunk
    return buf


class _Fair:
    """Calls of many sources (sandboxes' addresses) run by at most ``workers`` threads (made
    when first needed): each source's calls in the order given, at most ``per_source`` of
    one source at once, and the sources with calls waiting served in turn. They wait in a
    ring (``ready``: each source with a call waiting and fewer than ``per_source`` running,
    once): a free worker takes the first call of the ring's first source, which goes to the
    back if it can run another. So a call waits for a worker behind at most one call of each
    other source with calls waiting, and no call waits while fewer than
    ``workers // per_source`` sources have calls running."""

    def __init__(self, workers: int, per_source: int, name: str) -> None:
        self.workers, self.per_source, self.name = workers, per_source, name
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._waiting: dict[str, collections.deque[Callable[[], None]]] = {}
        self._running: collections.Counter[str] = collections.Counter()
        self._ready: collections.deque[str] = collections.deque()
        self._threads: list[threading.Thread] = []
        self._idle = 0  # threads waiting for a call that no one woke yet
        self._closed = False

    def submit(self, source: str, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` as one of ``source``'s calls. RuntimeError once closed."""
        with self._lock:
            if self._closed:
                raise RuntimeError("closed")
            q = self._waiting.get(source)
            if q is None:
                q = self._waiting[source] = collections.deque()
            q.append(lambda: fn(*args))
            if len(q) == 1 and self._running[source] < self.per_source:
                self._ready.append(source)
                self._wake()

    def _wake(self) -> None:
        """A source joined the ring: an idle worker takes it, else a new one while there is
        room (else every worker is running a call: the first one done takes it). Under the
        lock."""
        if self._idle:
            self._idle -= 1
            self._cv.notify()
        elif len(self._threads) < self.workers:
            t = threading.Thread(target=self._work, daemon=True,
                                 name=f"{self.name}-{len(self._threads)}")
            self._threads.append(t)
            t.start()

    def _work(self) -> None:
        self._lock.acquire()
        try:
            while True:
                while not self._ready and not self._closed:
                    self._idle += 1
                    self._cv.wait()
                if self._closed:
                    return
                source = self._ready.popleft()
                q = self._waiting[source]
                call = q.popleft()
                self._running[source] += 1
                if not q:
                    del self._waiting[source]
                elif self._running[source] < self.per_source:
                    self._ready.append(source)  # its next call may run beside this one
                    self._wake()
                self._lock.release()
                try:
                    call()
                except Exception:  # noqa: BLE001 - a bug in one answer; the worker goes on
                    log.exception("DNS worker")
                finally:
                    self._lock.acquire()
                running = self._running[source] = self._running[source] - 1
                if running <= 0:
                    del self._running[source]
                if running == self.per_source - 1 and source in self._waiting:
                    self._ready.append(source)  # it was at its cap with calls waiting
        finally:
            self._lock.release()

    def close(self) -> None:
        """Calls waiting are dropped, the running ones end on their own."""
        with self._lock:
            self._closed = True
            self._waiting.clear()
            self._ready.clear()
            self._cv.notify_all()
