"""Networked sandboxes (docs/network.md), attacked from inside. Every test runs against the
tests' own small internet (tests/netlab.py): a namespace behind a veth pair that is the
daemon's uplink, with its own DNS server; no packet leaves this machine."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import tempfile
import textwrap
from collections.abc import Iterator

import netlab
import pytest

from corral import Sandbox

from conftest import CGROUP_NAME, private_daemon

TOKEN = "net-test-token"


@pytest.fixture(scope="module")
def lab() -> Iterator[netlab.Lab]:
    tmp = tempfile.mkdtemp(prefix="corral-netlab-", dir="/var/tmp")
    lab = netlab.start(tmp)
    try:
        yield lab
    finally:
        netlab.stop(lab)
        subprocess.run(["rm", "-rf", tmp], check=False)


class Env:
    def __init__(self, lab: netlab.Lab, daemon, table: str, prefix: str, port: int) -> None:
        self.lab, self.d, self.table, self.prefix, self.port = lab, daemon, table, prefix, port
        self.ep = f"unix://{daemon.socket_path}"

    def sandbox(self, **kw) -> Sandbox:
        return Sandbox(endpoint=self.ep, timeout=120, **kw)

    def links(self) -> list[str]:
        out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        names = [ln.split(":")[1].strip().split("@")[0] for ln in out.splitlines()]
        return [n for n in names if n.startswith(self.prefix) and n[len(self.prefix):].isdigit()]

    def table_json(self) -> dict | None:
        r = subprocess.run(["nft", "-j", "list", "table", "inet", self.table],
                           capture_output=True, text=True)
        return json.loads(r.stdout) if r.returncode == 0 else None


@pytest.fixture(scope="module")
def net(lab: netlab.Lab) -> Iterator[Env]:
    tag = os.urandom(2).hex()
    table, prefix = f"corral_t{tag}", f"n{tag}"
    conf = os.path.join(os.path.dirname(lab.log), "network.json")
    with open(conf, "w") as f:
        json.dump({"allowlists": {"wild": ["*.wild.test:80"],
                                  "labweb": ["allowed.test:80", "other.test"]}}, f)
    port = _free_port()
    x = random.randint(0, 255)
    with private_daemon("corral-test-net-", f"{CGROUP_NAME}-net",
                        CORRAL_UPLINK=lab.uplink, CORRAL_DNS_UPSTREAM=lab.dns,
                        CORRAL_NET_RANGE=f"10.214.{x}.0/24", CORRAL_NET_TABLE=table,
                        CORRAL_NET_IFPREFIX=prefix, CORRAL_NETWORK_CONFIG=conf,
                        CORRAL_NET_POOL="2", CORRAL_TCP=f"0.0.0.0:{port}",
                        CORRAL_TOKEN=TOKEN) as d:
        env = Env(lab, d, table, prefix, port)
        yield env
        d.stop()
        # A graceful stop leaves no table, no link, no namespace of ours.
        assert env.table_json() is None
        assert env.links() == []


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# A script run inside a sandbox: each probe prints one JSON line {probe: result}.
PROBE = textwrap.dedent('''
    import json, socket, sys
    def connect(host, port, timeout=3):
        try:
            s = socket.create_connection((host, port), timeout=timeout)
            data = s.recv(200).decode()
            s.close()
            return "ok:" + data.strip()
        except socket.gaierror as e:
            return "dns:" + str(e.errno)
        except OSError as e:
            return "err:" + (e.__class__.__name__ if e.errno is None else str(e.errno))
    def resolve(name):
        try:
            return sorted({a[4][0] for a in socket.getaddrinfo(name, 80, socket.AF_INET)})
        except socket.gaierror as e:
            return "dns:" + str(e.errno)
    out = {}
    for arg in sys.argv[1:]:
        kind, _, what = arg.partition("=")
        if kind == "connect":
            host, _, port = what.rpartition(":")
            out[arg] = connect(host, int(port))
        elif kind == "resolve":
            out[arg] = resolve(what)
    print(json.dumps(out))
''')


def probe(sb: Sandbox, *args: str) -> dict:
    r = sb.exec(["python3", "-c", PROBE, *args], timeout=60)
    assert r.exit_code == 0, r
    return json.loads(r.stdout)


def ok(res: str) -> bool:
    return isinstance(res, str) and res.startswith("ok:")


# ---- mode internet ---------------------------------------------------------------------------
def test_internet_reaches_the_lab_through_nat_and_its_resolver(net: Env):
    lab = net.lab
    with net.sandbox(network="internet") as sb:
        r = probe(sb, f"connect={lab.addr(10)}:80", "resolve=allowed.test",
                  "connect=allowed.test:8080")
        assert r[f"connect={lab.addr(10)}:80"] == f"ok:hello {lab.addr(10)}:80 from " \
                                                  f"{lab.host_addr}", r  # masqueraded
        assert r["resolve=allowed.test"] == [lab.addr(10)]
        assert ok(r["connect=allowed.test:8080"])
        info = sb.info()
        assert info.network == "internet" and info.net is not None
        assert info.net.tx_packets > 0 and info.net.address.startswith("10.214.")
