"""JSON response bodies that can carry commands' output: encoded and written in pieces.

A command's output is kept up to its cap (4 MiB a stream by default), and JSON can take six
bytes for one byte of it (a control character is ``\\u0001``; an undecodable byte, replaced by
U+FFFD, is ``\\ufffd``). ``json.dumps`` of one such result makes a string six times the output
and then a copy of it as bytes: about 100 MiB for one default-capped command, held by the
daemon until the client has read it all, and one encode holding the event loop for a large
part of a second. A few dozen sandboxes printing binary at once would take the daemon down.

Here a body whose strings add up to more than ``BIG`` characters is an async iterable:
strings are cut into slices of ``SLICE`` characters, each encoded on its own (the same text
``json.dumps`` makes), gathered into pieces of about ``PIECE`` bytes and written as the client
reads them (aiohttp awaits the transport's drain), with the event loop let go between pieces.
A response then costs the daemon the result it answers plus a few hundred KiB. An output too
big to be a str (``outputmem.OutputText``: kept past its first 64 KiB, in memory or a spill
file) is read and decoded slice by slice as it is written, so it is never whole in memory
as text either.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from aiohttp import web
from aiohttp.payload import AsyncIterablePayload

from corral.daemon.outputmem import OutputText

SLICE = 1 << 16   # characters of a string encoded at once (at most 6x that in bytes)
PIECE = 1 << 18   # bytes gathered before one write
BIG = 1 << 18     # characters of strings in a body past which it is written in pieces

_encode_str = json.encoder.encode_basestring_ascii


def text_size(obj: Any, limit: int = BIG) -> int:
    """The characters in ``obj``'s strings (keys too), counted until past ``limit``; an
    OutputText counts as past it (it is always written in pieces)."""
    if isinstance(obj, str):
        return len(obj)
    if isinstance(obj, OutputText):
        return limit + 1
    total = 0
    if isinstance(obj, dict):
        for k, v in obj.items():
            total += len(k) if isinstance(k, str) else 0
            total += text_size(v, limit - total) \
                if isinstance(v, (str, dict, list, tuple, OutputText)) else 0
            if total > limit:
                break
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            if isinstance(v, (str, dict, list, tuple, OutputText)):
                total += text_size(v, limit - total)
                if total > limit:
                    break
    return total


def pieces(obj: Any, leaf: Callable[[Any], str] = json.dumps) -> Iterator[str]:
    """``json.dumps(obj, separators=(",", ":"))`` as consecutive parts, none longer than
    6 * SLICE + a little; ``leaf`` encodes what is neither a string nor a container (the
    trajectory log's own encoder, which writes no NaN)."""
    if isinstance(obj, str):
        if len(obj) <= SLICE:
            yield _encode_str(obj)
            return
        yield '"'
        for i in range(0, len(obj), SLICE):
            yield _encode_str(obj[i:i + SLICE])[1:-1]
        yield '"'
    elif isinstance(obj, OutputText):
        yield '"'
        for text in obj.slices():
            for i in range(0, len(text), SLICE):
                yield _encode_str(text[i:i + SLICE])[1:-1]
        yield '"'
    elif isinstance(obj, dict):
        yield "{"
        for i, (k, v) in enumerate(obj.items()):
            # json.dumps writes a key that is not a string as its JSON text, quoted
            yield ("," if i else "") + _encode_str(k if isinstance(k, str) else json.dumps(k))
            yield ":"
            yield from pieces(v, leaf)
        yield "}"
    elif isinstance(obj, (list, tuple)):
        yield "["
        for i, v in enumerate(obj):
            if i:
                yield ","
            yield from pieces(v, leaf)
        yield "]"
    else:
        yield leaf(obj)


async def chunks(obj: Any, tail: bytes = b"") -> AsyncIterator[bytes]:
    """``obj``'s JSON (then ``tail``) as pieces of about PIECE bytes, the loop let go between
    them."""
    parts: list[str] = []
    size = 0
    for part in pieces(obj):
        parts.append(part)
        size += len(part)
        if size >= PIECE:
            yield "".join(parts).encode()
            parts, size = [], 0
            await asyncio.sleep(0)
    yield "".join(parts).encode() + tail


def response(obj: Any, status: int = 200) -> web.Response:
    """``obj`` as an application/json response, in pieces when it is big."""
    if text_size(obj) <= BIG:
        return web.Response(body=json.dumps(obj, separators=(",", ":")).encode(), status=status,
                            content_type="application/json")
    return web.Response(body=AsyncIterablePayload(chunks(obj)), status=status,
                        content_type="application/json")


async def write_line(resp: web.StreamResponse, obj: Any) -> None:
    """One NDJSON line of ``obj`` on a prepared stream, in pieces when it is big."""
    if text_size(obj) <= BIG:
        await resp.write(json.dumps(obj, separators=(",", ":")).encode() + b"\n")
        return
    async for chunk in chunks(obj, b"\n"):
        await resp.write(chunk)
