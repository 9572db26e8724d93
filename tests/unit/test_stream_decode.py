"""What a follower of a command's output gets (procs.Capture.subscribe, then the text of each
read, then the decoder's flush at the end) against the bytes the command wrote, for seeded
adversarial output read in random pieces (characters split between reads, invalid UTF-8,
encoded surrogates) and followers that come at any read, before or after the cap:

- come before the cap was passed: the kept text then the live text are the decode of every
  byte, ``bytes.decode("utf-8", "replace")``, an unfinished last character included;
- come after bytes were dropped past the cap: the kept text is the command's result's
  (decoded whole), ``skipped`` is the number of bytes dropped, and the live text is the
  decode of every byte after them, never joined to the kept text's unfinished character.

tests/test_output_fidelity.py checks the same through a daemon's streams."""

from __future__ import annotations

import asyncio
import os
import random

from corral.daemon.outputmem import as_text
from corral.daemon.procs import Capture

_PIECES = [b"\xed\xa0\x80", b"\x00", b"\r\n", "\u20ac".encode(), "\U0001F600".encode(),
           b"\xff", b"\x80", b"\xc0\xaf", b"\xf0\x9f\x98", b"abc", b"\xe2\x82"]


def _follow(seed: int) -> None:
    r = random.Random(seed)
    data = bytearray()
    while len(data) < r.choice([10, 300, 5000, 20000]):
        data += r.choice(_PIECES)
    data = bytes(data)
    cuts = sorted({r.randrange(len(data) + 1) for _ in range(r.randint(0, 12))} | {0, len(data)})
    reads = [data[a:b] for a, b in zip(cuts, cuts[1:], strict=False) if b > a]
    cap = r.choice([1, 7, 100, 4096, len(data), len(data) + 1])
    join_at = sorted(r.sample(range(len(reads) + 1), min(2, len(reads) + 1)))

    async def run() -> None:
        loop = asyncio.get_running_loop()
        rfd, wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        cap_ = Capture(loop, rfd, cap)
        followers: list[tuple[int, str, int, list[str]]] = []
        pos = 0
        try:
            for i in range(len(reads) + 1):
                if i in join_at:
                    got: list[str] = []
                    first, skipped = cap_.subscribe(got.append)
                    followers.append((pos, as_text(first), skipped, got))
                if i < len(reads):
                    os.write(wfd, reads[i])
                    assert cap_._read(budgeted=False)
                    pos += len(reads[i])
        finally:
            os.close(wfd)
        cap_.drain()  # the end of file
        cap_.flush()
        kept = data[:cap].decode("utf-8", "replace")
        assert as_text(cap_.text()) == kept
        for at, first, skipped, got in followers:
            live = "".join(got)
            if at <= cap:  # nothing dropped before it came
                assert skipped == 0, (seed, at)
                assert first + live == data.decode("utf-8", "replace"), (seed, at, cap)
            else:
                assert (first, skipped) == (kept, at - cap), (seed, at, cap)
                assert live == data[at:].decode("utf-8", "replace"), (seed, at, cap)

    asyncio.run(run())


def test_a_follower_that_leaves_gets_nothing_more() -> None:
    class Follower:
        def __init__(self) -> None:
            self.got: list[str] = []

        def on(self, text: str) -> None:
            self.got.append(text)

    async def run() -> None:
        rfd, wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        cap = Capture(asyncio.get_running_loop(), rfd, 100)
        a, b = Follower(), Follower()
        cap.subscribe(a.on)  # a bound method, as procs.Follower's (a new object each time)
        cap.subscribe(b.on)
        os.write(wfd, b"x\xe2")
        cap._read(budgeted=False)
        cap.unsubscribe(a.on)
        os.write(wfd, b"\x82\xacy")
        cap._read(budgeted=False)
        os.close(wfd)
        cap.drain()
        cap.flush()
        assert a.got == ["x"] and "".join(b.got) == "x\u20acy"

    asyncio.run(run())


def test_followers_get_the_decode_of_every_byte_or_a_marked_gap() -> None:
    for seed in range(400):
        _follow(seed)
