"""Output kept past the daemon's memory pool goes to a spill file and comes back byte-exact:
the text an answer or the trajectory log reads from it is the one ``bytes.decode`` makes of
the whole output, and its JSON is ``json.dumps``'s (corral.daemon.outputmem, jsonbody)."""

from __future__ import annotations

import codecs
import json
import os
import random
import tempfile

from corral.daemon import jsonbody
from corral.daemon.outputmem import FLOOR, READ_SLICE, Kept, OutputMemory, OutputText


def _samples() -> list[bytes]:
    rnd = random.Random(7)
    mixed = "aé€😀\x00\x1f\"\\".encode()
    return [
        bytes(rnd.getrandbits(8) for _ in range(3 * READ_SLICE + 17)),  # mostly invalid
        (mixed * 40000)[: 5 * READ_SLICE + 3],  # multibyte characters cut at every offset
        b"\xf0\x9f\x98" * 70000,  # unfinished sequences throughout
        b"x" * (FLOOR + 1),
    ]


def _keep(data: bytes, store: OutputMemory, step: int) -> Kept:
    kept = Kept(store)
    for i in range(0, len(data), step):
        assert kept.add(data[i:i + step]) == len(data[i:i + step])
    return kept


def test_spilled_output_reads_back_as_the_whole_output_decoded() -> None:
    with tempfile.TemporaryDirectory() as d:
        store = OutputMemory(limit=100_000, spill_dir=d, disk_limit=1 << 30)
        for data in _samples():
            for step in (1000, 65_537, 300_001):
                kept = _keep(data, store, step)
                assert len(kept) == len(data)
                assert kept.fd >= 0 or len(data) <= FLOOR + 100_000
                want = data.decode("utf-8", "replace")
                text = OutputText(kept)
                assert text.text() == want
                assert "".join(jsonbody.pieces({"stdout": text})) == \
                    json.dumps({"stdout": want}, separators=(",", ":"))
                assert text.prefix(1000) == (want[:1000], len(want) > 1000)
                assert OutputText(kept, 5000).text() == data[:5000].decode("utf-8", "replace")
                assert kept.tail(4) == data[-4:]
                del kept, text
                assert store.held == 0 and store.spilled == 0  # all given back
        assert os.listdir(d) == []  # the spill files have no names


def test_the_pool_takes_what_fits_then_the_file_then_nothing() -> None:
    with tempfile.TemporaryDirectory() as d:
        store = OutputMemory(limit=FLOOR, spill_dir=d, disk_limit=3 * FLOOR)
        a = Kept(store)
        assert a.add(b"a" * (2 * FLOOR)) == 2 * FLOOR  # the floor, then the pool
        assert a.fd < 0 and a.charged == FLOOR and store.held == FLOOR
        b = Kept(store)
        assert b.add(b"b" * (FLOOR + 10)) == FLOOR + 10  # the pool is full: spilled
        assert b.fd >= 0 and b.spilled == 10 and store.counters["spills"] == 1
        assert b.add(b"c" * (4 * FLOOR)) == 3 * FLOOR - 10  # the disk share runs out
        assert b.full and b.add(b"d") == 0
        assert OutputText(b).text() == "b" * (FLOOR + 10) + "c" * (3 * FLOOR - 10)
        del a, b
        assert store.held == 0 and store.spilled == 0


def test_a_late_follower_decodes_on_from_the_last_four_bytes() -> None:
    """Capture.subscribe sets its decoder from the kept bytes' last 4: the same state as
    decoding all of them."""
    for data in _samples():
        for cut in range(len(data) - 40, len(data)):
            whole = codecs.getincrementaldecoder("utf-8")("replace")
            whole.decode(data[:cut])
            tail = codecs.getincrementaldecoder("utf-8")("replace")
            tail.decode(data[max(0, cut - 4):cut])
            assert whole.getstate() == tail.getstate(), (cut, data[cut - 4:cut])


def test_a_tenants_output_holds_at_most_its_share_and_gives_it_all_back() -> None:
    """Each tenant's streams together hold at most TENANT_SHARE of the pool and of the spill
    share, whichever of its views (one per command) they were made with; the admin's only
    the whole store; everything freed comes back to the store and to the tenant."""
    from corral.daemon.outputmem import TENANT_SHARE

    with tempfile.TemporaryDirectory() as d:
        store = OutputMemory(limit=4 << 20, spill_dir=d, disk_limit=4 << 20)
        data = b"x" * (8 << 20)

        def add(k: Kept, data: bytes = data) -> int:  # as a pipe gives it: 64 KiB at a time
            return sum(k.add(data[i:i + (64 << 10)]) for i in range(0, len(data), 64 << 10))

        alice = [Kept(store.share("alice")) for _ in range(3)]
        kept = [add(k) for k in alice]
        held = store.tenant_held("alice")
        assert held == (int((4 << 20) * TENANT_SHARE), int((4 << 20) * TENANT_SHARE)), held
        assert sum(kept) == 3 * FLOOR + sum(held)
        assert [k.full for k in alice] == [True, True, True]
        bob = Kept(store.share("bob"))
        assert add(bob, b"y" * (3 << 20)) == 3 << 20 and not bob.full  # his share is free
        room = (store.limit - store.held) + (store.disk_limit - store.spilled)
        admin = Kept(store.share(None))  # the rest of the store, past any share
        assert add(admin) == FLOOR + room and admin.full
        for k in (*alice, bob, admin):
            k.free()
        assert (store.held, store.spilled) == (0, 0)
        assert store.tenant_held("alice") == (0, 0) and store._tenant_use == {}
