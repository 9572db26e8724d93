"""corral._core's nf_tables set calls keep one netlink socket per thread (closing one makes the
kernel wait out earlier transactions' release): a kernel's error answer leaves that socket
usable, a failed batch leaves nothing behind that the next call would read as its answer, and
every call still sees the table as it is."""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import subprocess
import threading
import uuid

import pytest

from corral import _core
from corral.daemon.network.firewall import element_key, new_element

pytestmark = pytest.mark.skipif(shutil.which("nft") is None, reason="nft not installed")

NETLINK_NETFILTER = 12


def _nft(*args: str, stdin: str | None = None) -> str:
    return subprocess.run(["nft", *args], input=stdin, capture_output=True, text=True,
                          check=True, timeout=30).stdout


def _netfilter_sockets() -> set[str]:
    """This process's NETLINK_NETFILTER sockets, by inode (/proc/net/netlink)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            inodes.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    out = set()
    with open("/proc/net/netlink") as f:
        next(f)
        for line in f:
            cols = line.split()
            if int(cols[1]) == NETLINK_NETFILTER and f"socket:[{cols[-1]}]" in inodes:
                out.add(cols[-1])
    return out


@pytest.fixture
def table():
    name = f"corral_test_{uuid.uuid4().hex[:8]}"
    _nft("-f", "-", stdin=f"""table inet {name} {{
  set names {{ type ifname; flags dynamic; counter; }}
  set src4 {{ type ifname . ipv4_addr; }}
  set allow4 {{ type ifname . ipv4_addr . inet_proto . inet_service; flags interval, timeout; }}
}}""")
    try:
        yield name
    finally:
        _nft("delete", "table", "inet", name)


def _key(name: str) -> bytes:
    return element_key(f'"{name}"', False)[0]


def _add(table: str, set_: str, *elems: str) -> None:
    _core.nft_add_elements(table, [(set_, [new_element(e, False) for e in elems])])


def test_a_missing_element_answers_none_and_keeps_the_socket(table):
    # A get of an element not there: the kernel's ENOENT, None here.
    assert _core.nft_get_counter(table, "names", _key("absent0")) is None
    kept = _netfilter_sockets()
    assert kept, "no socket kept"
    for _ in range(200):
        assert _core.nft_get_counter(table, "names", _key("absent0")) is None
    _add(table, "names", '"here0"')
    assert _core.nft_get_counter(table, "names", _key("here0")) == (0, 0)
    assert _netfilter_sockets() == kept


def test_a_failed_batch_leaves_nothing_for_the_next_call(table):
    _add(table, "src4", '"a0" . 10.0.0.1')
    # One batch: a good set, then one that does not exist. The kernel refuses it whole.
    with pytest.raises(OSError):
        _core.nft_add_elements(table, [
            ("src4", [new_element('"a1" . 10.0.0.2', False)]),
            ("nosuchset", [new_element('"a2"', False)])])
    with pytest.raises(OSError):
        _core.nft_destroy_elements("corral_no_such_table",
                                   [("src4", [element_key('"a0" . 10.0.0.1', False)])])
    _add(table, "src4", '"a3" . 10.0.0.3')
    listed = _nft("list", "set", "inet", table, "src4")
    assert '"a0" . 10.0.0.1' in listed and '"a3" . 10.0.0.3' in listed, listed
    assert '"a1"' not in listed, listed  # the refused batch added nothing
    _core.nft_destroy_elements(table, [("src4", [element_key('"a0" . 10.0.0.1', False)])])
    assert '"a0"' not in _nft("list", "set", "inet", table, "src4")


def test_threads_have_their_own_socket_and_see_the_same_table(table):
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for j in range(50):
                _add(table, "names", f'"t{i}x{j}"')
                assert _core.nft_get_counter(table, "names", _key(f"t{i}x{j}")) == (0, 0)
                _core.nft_destroy_elements(table, [("names", [(_key(f"t{i}x{j}"), None)])])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert '"t' not in _nft("list", "set", "inet", table, "names")


def _elements(table: str, set_: str) -> list:
    doc = json.loads(_nft("-j", "list", "set", "inet", table, set_))
    return next(x["set"] for x in doc["nftables"] if "set" in x).get("elem", [])


def test_element_lists_past_a_message_and_a_send_go_in_whole(table):
    """A set's elements over 64 KiB (the 16 bits of a nested attribute's length) and over the
    socket's send buffer: an add is one transaction whatever its size, every element in; a
    removal takes every one out (an element list sent as one nest wrapped its length, and the
    kernel acted on part of it; one send over the buffer failed with EMSGSIZE)."""
    base = int(ipaddress.IPv4Address("10.0.0.0"))
    plain = [f'"big0" . {ipaddress.IPv4Address(base + i)}' for i in range(12_000)]  # 384 KiB
    ranges = [f'"big0" . {ipaddress.IPv4Address(base + 4 * i)}/30 . tcp . {1000 + i}-{1000 + i}'
              f" timeout 600s" for i in range(4_000)]  # interval elements: 336 KiB
    _core.nft_add_elements(table, [("src4", [new_element(e, False) for e in plain]),
                                   ("allow4", [new_element(e, True) for e in ranges])])
    assert len(_elements(table, "src4")) == len(plain)
    assert len(_elements(table, "allow4")) == len(ranges)
    _core.nft_destroy_elements(table, [("src4", [element_key(e, False) for e in plain]),
                                       ("allow4", [element_key(e, True) for e in ranges])])
    assert _elements(table, "src4") == [] and _elements(table, "allow4") == []
    # The socket is kept and still works for small calls.
    _add(table, "src4", '"a0" . 10.0.0.1')
    assert '"a0" . 10.0.0.1' in _nft("list", "set", "inet", table, "src4")


def test_a_refused_element_among_many_refuses_the_whole_add(table):
    """An add stays one transaction however many messages it takes: an element the kernel
    refuses (an interval overlapping another) in the last message leaves none of the others
    in."""
    base = int(ipaddress.IPv4Address("10.0.0.0"))
    ranges = [f'"big1" . {ipaddress.IPv4Address(base + 4 * i)}/30 . tcp . 80'
              for i in range(3_000)]
    ranges.append('"big1" . 10.0.0.0/24 . tcp . 80')  # overlaps the first ones
    with pytest.raises(OSError):
        _core.nft_add_elements(table, [("allow4", [new_element(e, True) for e in ranges])])
    assert _elements(table, "allow4") == []
    _add(table, "src4", '"a1" . 10.0.0.2')
    assert '"a1" . 10.0.0.2' in _nft("list", "set", "inet", table, "src4")
