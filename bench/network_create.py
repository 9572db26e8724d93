"""Create p50 of network none vs internet vs a policy of names only vs one with a CIDR rule,
in one run, round robin (so background
load falls on each alike), against a private daemon whose uplink and DNS upstream are the
tests' own small internet (tests/netlab.py: nothing leaves the machine). Run as root from the
checkout:

    unshare -m --propagation private sh -c \\
        'mount -t tmpfs tmpfs /var/tmp && .venv/bin/python bench/network_create.py 40'

Arguments: creates per mode (40), CORRAL_NET_POOL (16)."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import netlab  # noqa: E402

from corral import Network, Sandbox  # noqa: E402
from corral.errors import CorralError  # noqa: E402
from corral.sdk import admin  # noqa: E402


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    pool = sys.argv[2] if len(sys.argv) > 2 else "16"
    lab = netlab.start(tempfile.mkdtemp(prefix="corral-netb-", dir="/var/tmp"))
    state = tempfile.mkdtemp(prefix="corral-netb-st-", dir="/var/tmp")
    env = dict(os.environ, CORRAL_STATE_DIR=state, CORRAL_SOCKET=f"{state}/sock",
               CORRAL_CGROUP="corral-netb", CORRAL_UPLINK=lab.uplink,
               CORRAL_DNS_UPSTREAM=lab.dns, CORRAL_NET_RANGE="10.216.0.0/20",
               CORRAL_NET_RANGE6="fd5e:b::/112",
               CORRAL_NET_TABLE="corral_b", CORRAL_NET_IFPREFIX="nb", CORRAL_NET_POOL=pool,
               CORRAL_POOL="off", CORRAL_AUTOSTART="0")
    with open(f"{state}/log", "w") as log:
        daemon = subprocess.Popen([sys.executable, "-m", "corral.daemon"], env=env,
                                  stdout=log, stderr=subprocess.STDOUT)
    ep = f"unix://{state}/sock"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                admin.status(ep)
                break
            except CorralError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        modes = [("none", "none"), ("internet", "internet"),
                 ("names", Network(allow=["allowed.test:80", "*.wild.test", "@pypi"])),
                 ("cidrs", Network(allow=["allowed.test:80", "*.wild.test",
                                          "10.0.0.0/8:443"]))]
        for _, net in modes:  # the network starts on first use
            Sandbox(endpoint=ep, network=net).kill()
        time.sleep(3)  # the pools fill
        ts: dict[str, list[float]] = {k: [] for k, _ in modes}
        for _ in range(n):
            for name, net in modes:
                t0 = time.perf_counter()
                sb = Sandbox(endpoint=ep, network=net)
                ts[name].append((time.perf_counter() - t0) * 1e3)
                sb.kill()
                time.sleep(0.05)
        for name, v in ts.items():
            v.sort()
            print(f"{name:9s} create p50 {statistics.median(v):.2f} ms  "
                  f"p90 {v[int(0.9 * len(v))]:.2f} ms  (n={n})")
    finally:
        daemon.terminate()
        daemon.wait()
        netlab.stop(lab)


if __name__ == "__main__":
    main()
