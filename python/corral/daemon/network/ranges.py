"""A sandbox's DNS pins of port ranges (``name:8000-8100``), placed so they never overlap
another element of its interval allow-set: the kernel refuses an element whose start or end
lies inside another one's (``File exists``), so a pin overlapping one of the policy's CIDR
rules, or an earlier pin of the same address for another name's range, would fail the
lookup. Each new range is cut into the parts nothing covers yet (pinned with the new
timeout) plus the earlier pins it covers whole (added again: the kernel then takes the new
timeout); a part an earlier pin or a CIDR rule covers stays theirs."""

from __future__ import annotations

import ipaddress
import time

Range = tuple[int, int]
# (address, protocol) -> [(port range, expiry (time.time()))] of each pin in the kernel
Pins = dict[tuple[str, str], list[tuple[Range, float]]]


def _ports(text: str) -> Range:
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


def _minus(span: Range, taken: list[Range]) -> list[Range]:
    """``span`` without every range of ``taken``."""
    out, lo = [], span[0]
    for a, b in sorted(taken):
        if b < lo or a > span[1]:
            continue
        if a > lo:
            out.append((lo, a - 1))
        lo = max(lo, b + 1)
    if lo <= span[1]:
        out.append((lo, span[1]))
    return out


class RangePins:
    def __init__(self) -> None:
        self._pins: Pins = {}

    def clear(self) -> None:
        self._pins.clear()

    def note(self, elem: str, until: float) -> None:
        """A pin already in the kernel (``"if" . addr . proto . lo-hi [timeout ...]``)."""
        _, addr, proto, ports = elem.split(" timeout ")[0].split(" . ")
        addr = str(ipaddress.ip_address(addr.split("/")[0]))
        self._pins.setdefault((addr, proto), []).append((_ports(ports), until))

    def place(self, elems: list[str], fixed: list[str], ttl: int, base: Pins | None = None
              ) -> tuple[list[str], Pins]:
        """The elements to add for the new pins ``elems`` (``"if" . addr . proto . lo-hi
        timeout Ns``), none overlapping another, given the policy's own elements of the
        set, ``fixed`` (CIDR rules, no timeout); and the state to ``commit`` once they are
        in the kernel (``base``: such a state not committed yet)."""
        pins = {k: list(v) for k, v in (self._pins if base is None else base).items()}
        now = time.time()
        until = now + ttl
        boxes = []
        for f in fixed:
            if " timeout " in f:
                continue
            _, net, proto, ports = f.split(" . ")
            boxes.append((ipaddress.ip_network(net), proto, _ports(ports)))
        out: list[str] = []
        for e in elems:
            key = e.split(" timeout ")[0]
            ifname, addr, proto, ports = key.split(" . ")
            span = _ports(ports)
            ip = ipaddress.ip_address(addr)
            addr = str(ip)
            live = [(r, t) for r, t in pins.get((addr, proto), []) if t > now]
            taken = [r for r, _ in live] + [
                r for net, p, r in boxes if p == proto and ip.version == net.version
                and ip in net]
            inside = [r for r, _ in live if span[0] <= r[0] and r[1] <= span[1]]
            new = _minus(span, taken)
            kept = [(r, t) for r, t in live if r not in inside]
            pins[(addr, proto)] = kept + [(r, until) for r in (*inside, *new)]
            for lo, hi in (*inside, *new):
                port = str(lo) if lo == hi else f"{lo}-{hi}"
                out.append(f"{ifname} . {addr} . {proto} . {port} timeout {ttl}s")
        return list(dict.fromkeys(out)), pins

    def commit(self, pins: Pins) -> None:
        self._pins = pins

    def prune(self, now: float) -> None:
        """Forget pins expired by ``now``."""
        live = {k: [(r, t) for r, t in v if t > now] for k, v in self._pins.items()}
        self._pins = {k: v for k, v in live.items() if v}
