"""Servers of the tests' own small internet (tests/netlab.py), run inside its namespace: a
DNS server answering from a zone (A and AAAA, CNAME chains, records of other owners added
to an answer; UDP, truncating answers over 512 bytes, and TCP), TCP servers (IPv4 and IPv6)
that say who connected to which address, and a UDP sink;
every query and connection is logged, one JSON line each, to the log file."""

from __future__ import annotations

import json
import socket
import sys
import threading

from dnslib import AAAA, CNAME, QTYPE, RCODE, RR, TXT, A, DNSRecord


def main() -> None:
    cfg = json.loads(sys.argv[1])
    log = open(cfg["log"], "a", buffering=1)  # noqa: SIM115 - for the process's life
    lock = threading.Lock()

    def note(**kw: object) -> None:
        with lock:
            log.write(json.dumps(kw) + "\n")

    def answer(data: bytes, src: str, addr: str, proto: str) -> DNSRecord | None:
        try:
            q = DNSRecord.parse(data)
        except Exception:  # noqa: BLE001 - not DNS: ignored, as a server would
            return None
        name = str(q.q.qname).rstrip(".").lower()
        note(kind="dns", name=name, qtype=QTYPE[q.q.qtype], src=src, server=addr, proto=proto)
        if any(name == z or name.endswith("." + z) for z in cfg.get("silent", [])):
            return None  # a domain whose servers never answer
        r = q.reply()
        ttl = cfg.get("ttl", 30)
        owner, cnames = name, cfg.get("cname", {})
        while owner in cnames:  # an alias: its CNAME, then the records of where it leads
            r.add_answer(RR(owner, QTYPE.CNAME, rdata=CNAME(cnames[owner]), ttl=ttl))
            owner = cnames[owner]
        ips = cfg["zone"].get(owner)
        if ips is None:
            r.header.rcode = RCODE.NXDOMAIN
        elif q.q.qtype in (QTYPE.A, QTYPE.AAAA):
            six = q.q.qtype == QTYPE.AAAA
            for ip in [ips] if isinstance(ips, str) else ips:
                if (":" in ip) == six:
                    r.add_answer(RR(owner, q.q.qtype, rdata=AAAA(ip) if six else A(ip),
                                    ttl=ttl))
            for other, ip in cfg.get("extra", {}).get(name, []):  # another name's, added
                if (":" in ip) == six:
                    r.add_answer(RR(other, q.q.qtype, rdata=AAAA(ip) if six else A(ip),
                                    ttl=ttl))
        elif q.q.qtype == QTYPE.TXT:
            r.add_answer(RR(q.q.qname, QTYPE.TXT, rdata=TXT("leak"), ttl=30))
        return r

    def dns(s: socket.socket) -> None:
        addr = s.getsockname()[0]
        while True:
            data, src = s.recvfrom(4096)
            r = answer(data, src[0], addr, "udp")
            if r is not None:
                out = r.pack()
                if len(out) > 512:  # no EDNS here: truncated, the asker retries over TCP
                    r.rr = []
                    r.header.tc = 1
                    out = r.pack()
                delay = cfg.get("delay", {}).get(str(r.q.qname).rstrip(".").lower())
                if delay:  # a slow upstream for this name: answered later, others meanwhile
                    threading.Timer(delay, s.sendto, args=(out, src)).start()
                else:
                    s.sendto(out, src)

    def dns_tcp(s: socket.socket) -> None:
        addr = s.getsockname()[0]
        while True:
            c, src = s.accept()
            try:
                c.settimeout(5)
                n = int.from_bytes(c.recv(2, socket.MSG_WAITALL), "big")
                r = answer(c.recv(n, socket.MSG_WAITALL), src[0], addr, "tcp")
                if r is not None:
                    out = r.pack()
                    c.sendall(len(out).to_bytes(2, "big") + out)
            except OSError:
                pass
            c.close()

    def tcp(s: socket.socket) -> None:
        port = s.getsockname()[1]
        while True:
            c, src = s.accept()
            here = c.getsockname()[0]
            note(kind="tcp", src=src[0], dst=here, port=port)
            try:
                c.sendall(f"hello {here}:{port} from {src[0]}\n".encode())
            except OSError:
                pass
            c.close()

    def serve_kind(s: socket.socket, kind: str) -> None:
        """bulk: send cfg["bulk"] bytes; sink: read to EOF, log the count; hold: keep it open."""
        while True:
            c, src = s.accept()
            threading.Thread(target=bulk_or_sink, args=(c, src, kind), daemon=True).start()

    def bulk_or_sink(c: socket.socket, src: tuple, kind: str) -> None:
        try:
            if kind == "bulk":
                c.sendall(bytes(cfg["bulk"]))
            elif kind == "hold":  # open until the peer closes
                while c.recv(4096):
                    pass
            else:
                n = 0
                while data := c.recv(1 << 16):
                    n += len(data)
                note(kind="sink", src=src[0], bytes=n)
        except OSError:
            pass
        c.close()

    def udp(s: socket.socket) -> None:
        while True:
            data, src = s.recvfrom(4096)
            note(kind="udp", src=src[0], data=data.decode(errors="replace"))

    threads = []
    for a in cfg["dns"]:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind((a, 53))
        threads.append(threading.Thread(target=dns, args=(s,), daemon=True))
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((a, 53))
        s.listen(64)
        threads.append(threading.Thread(target=dns_tcp, args=(s,), daemon=True))
    def bound(family: int, kind: int, port: int) -> socket.socket:
        s = socket.socket(family, kind)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:  # IPv6 only: IPv4 peers keep their plain addresses
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        s.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
        return s

    for fam in (socket.AF_INET, socket.AF_INET6):
        for p in cfg["tcp"]:
            s = bound(fam, socket.SOCK_STREAM, p)
            s.listen(128)
            threads.append(threading.Thread(target=tcp, args=(s,), daemon=True))
        for kind, p in cfg.get("special", {}).items():
            s = bound(fam, socket.SOCK_STREAM, p)
            s.listen(1024)
            threads.append(threading.Thread(target=serve_kind, args=(s, kind), daemon=True))
        s = bound(fam, socket.SOCK_DGRAM, cfg["udp"])
        threads.append(threading.Thread(target=udp, args=(s,), daemon=True))
    for t in threads:
        t.start()
    note(kind="ready")
    threading.Event().wait()


if __name__ == "__main__":
    main()
