"""The servers of the network scenario's uplink (run inside its namespace by corral.bench.netlab):
a DNS server answering A queries from a fixed zone, a TCP sink (reads to EOF, answers the byte
count) and a TCP echo (one request, its echo, close). Prints "ready" once every socket listens.

    python -m corral.bench.netsrv '{"dns": "198.19.7.53", "zone": {...}, "sink": 8082, ...}'
"""

from __future__ import annotations

import json
import socket
import sys
import threading

from dnslib import QTYPE, RCODE, RR, A, DNSRecord


def _dns(s: socket.socket, zone: dict[str, str]) -> None:
    while True:
        data, src = s.recvfrom(4096)
        try:
            q = DNSRecord.parse(data)
        except Exception:  # noqa: BLE001 - not DNS: ignored, as a server would
            continue
        r = q.reply()
        ip = zone.get(str(q.q.qname).rstrip(".").lower())
        if ip is None:
            r.header.rcode = RCODE.NXDOMAIN
        elif q.q.qtype == QTYPE.A:
            r.add_answer(RR(q.q.qname, QTYPE.A, rdata=A(ip), ttl=3600))
        s.sendto(r.pack(), src)


def _sink_one(c: socket.socket) -> None:
    buf = bytearray(1 << 20)
    n = 0
    try:
        while k := c.recv_into(buf):
            n += k
        c.sendall(str(n).encode())
    except OSError:
        pass
    c.close()


def _sink(s: socket.socket) -> None:
    while True:
        c, _ = s.accept()
        threading.Thread(target=_sink_one, args=(c,), daemon=True).start()


def _echo(s: socket.socket) -> None:
    """One connection at a time, in this thread: the client is sequential, and a thread per
    connection would add its start-up to every sample."""
    while True:
        c, _ = s.accept()
        try:
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if data := c.recv(4096):
                c.sendall(data)
        except OSError:
            pass
        c.close()


def _listen(port: int, udp: bool = False, addr: str = "0.0.0.0") -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM if udp else socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, port))
    if not udp:
        s.listen(1024)
    return s


def main() -> None:
    cfg = json.loads(sys.argv[1])
    threads = [threading.Thread(target=_dns, args=(_listen(53, True, cfg["dns"]), cfg["zone"])),
               threading.Thread(target=_sink, args=(_listen(cfg["sink"]),)),
               threading.Thread(target=_echo, args=(_listen(cfg["echo"]),))]
    for t in threads:
        t.daemon = True
        t.start()
    print("ready", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
