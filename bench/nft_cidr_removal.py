"""Cost of a sandbox's policy CIDR elements in the daemon's nftables table as the table grows:
N sandboxes attached (each with allow CIDRs on a few ports and a deny CIDR, the elements a
policy like ``Network(allow=["203.0.113.0/24:80,443", "198.51.100.7"], deny=[...])`` writes),
then some attached and removed again, timing each (wall and the process's kernel CPU: the
nf_tables commit runs in the caller's context). The real Firewall class, in a network
namespace of its own (no interface, no packet). Run as root from the checkout:

    unshare -n .venv/bin/python bench/nft_cidr_removal.py 1000 20

Arguments: sandboxes in the table (1000), sandboxes attached and removed while timed (20)."""

from __future__ import annotations

import ipaddress
import resource
import statistics
import sys
import time

from corral.daemon.network.firewall import Firewall
from corral.daemon.network.policy import compile_policy
from corral.daemon.network.settings import NetSettings

POLICY = compile_policy(["203.0.113.0/24:80,443", "198.51.100.7", "192.0.2.0/25:8000-8100"],
                        ["203.0.113.128/28"], {})


def elements(fw: Firewall, n: int) -> tuple[str, ipaddress.IPv4Address,
                                             ipaddress.IPv6Address, dict[str, list[str]]]:
    ifname = f"bx{n}"
    addr, gw6 = fw.s.gateway + n, fw.s.gateway6
    assert gw6 is not None
    return ifname, addr, gw6 + n, Firewall.policy_elems(ifname, POLICY)


def attach(fw: Firewall, n: int) -> dict[str, list[str]]:
    ifname, addr, addr6, elems = elements(fw, n)
    fw.attach(ifname, addr, addr6, False, elems)
    return elems


def timed(fn) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    t0, c0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_stime
    fn()
    return ((time.perf_counter() - t0) * 1e3,
            (resource.getrusage(resource.RUSAGE_SELF).ru_stime - c0) * 1e3)


def main() -> None:
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    k = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    s = NetSettings(uplink="lo", range4=ipaddress.IPv4Network("10.200.0.0/16"),
                    table="corral_bench", ifprefix="bx")
    fw = Firewall(s)
    fw.install()
    try:
        t0 = time.perf_counter()
        for n in range(2, size + 2):
            attach(fw, n)
        fill = time.perf_counter() - t0
        add, rm = [], []
        for j in range(k):
            n = size + 2 + j
            ifname, addr, addr6, elems = elements(fw, n)
            add.append(timed(lambda n=n: attach(fw, n)))
            rm.append(timed(lambda i=ifname, a=addr, a6=addr6, e=elems: fw.detach(i, a, a6, e)))
        per = sum(len(v) for v in elements(fw, 2)[3].values())
        print(f"{size} sandboxes ({per} CIDR elements each) in {fill:.1f} s; "
              f"median of {k}:")
        for what, xs in (("attach", add), ("remove", rm)):
            print(f"  {what}: {statistics.median(w for w, _ in xs):.2f} ms wall, "
                  f"{statistics.median(c for _, c in xs):.1f} ms kernel CPU")
    finally:
        fw.remove()


if __name__ == "__main__":
    main()
