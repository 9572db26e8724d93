"""Idempotency: keys, request fingerprints, the step_interrupted error, and the logged
form of results that a replay answers with."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import math
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from corral.daemon import jsonbody
from corral.errors import ReplayDivergence, StepInterrupted

KEY_HEADER = "Idempotency-Key"
MAX_KEY_LEN = 256


# Ops that change a sandbox: they get a started row (create does not: its id is not known
# before it ends, and a half-made sandbox is removed at restart anyway).
STARTED_OPS = frozenset({"exec", "write", "upload", "mkdir", "remove", "rename", "snapshot",
                         "fork", "restore", "pause", "resume", "kill"})


# Keyed ops whose started row is journaled before they run: a retry of one that never
# finished answers step_interrupted instead of running again. Not kill: running a kill twice
# is harmless, and a retried kill must end the sandbox.
KEYED_START_OPS = STARTED_OPS - {"kill"}


# entries.status: NULL for a finished call (every row of older logs), else one of these.
STARTED, INTERRUPTED = "started", "interrupted"


def interrupted_error(sid: str, op: str, key: str | None, started_at: float,
                      seq: int) -> dict[str, Any]:
    """The error an interrupted row carries (and a retry of its key raises)."""
    return StepInterrupted(
        "the daemon died while this call was in flight: it may have run, in whole or in part "
        "(its key is not run again)",
        details={"interrupted": True, "sandbox_id": sid, "op": op, "key": key,
                 "started_at": started_at, "seq": seq}).to_payload()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fingerprint(op: str, request: dict[str, Any]) -> str:
    """The request's identity under an idempotency key: the hash of
    ``json.dumps([op, request], sort_keys=True)``'s compact text."""
    return keyed_text(op, request)[1]


def keyed_text(op: str, request: dict[str, Any]) -> tuple[str, str]:
    """(the request as logged, its fingerprint) from one encoding: the sorted text, made by a
    C encoder built once (json.dumps builds one per call), is both the logged request and,
    wrapped in ``[op, ...]`` (an op is a bare word), what the fingerprint hashes."""
    if _FP_ENCODE is None:
        text = json.dumps(request, sort_keys=True, separators=(",", ":"))
    else:
        text = "".join(_FP_ENCODE(request, 0))
    fp = sha256(f'["{op}",{text}]'.encode())
    if "NaN" in text or "Infinity" in text:  # maybe a non-JSON float: logged by _dumps
        text = _dumps(request)
    return text, fp


def body_request(size: int, digest: str, data: bytes | None, **fields: Any) -> dict[str, Any]:
    """A request with a raw body (file write, tar upload): its size and hash always, the bytes
    themselves (base64) when the whole body was kept (it fit the log's cap), so that replay
    can send them again."""
    req = dict(fields, size=size, sha256=digest)
    if data is not None:
        req["data_b64"] = base64.b64encode(data).decode()
    return req


def data_result(data: bytes, keep: int = -1, **fields: Any) -> dict[str, Any]:
    """What a read logs: size and hash of what the client got; the bytes themselves (base64)
    only if they fit ``keep`` (a keyed read: its replay returns them)."""
    res = dict(fields, size=len(data), sha256=sha256(data))
    if len(data) <= keep:
        res["data_b64"] = base64.b64encode(data).decode()
    return res


# A keyed listing logs its entries up to this many (its replay returns them).
LIST_KEEP = 4096


def listing_result(entries: list[dict[str, Any]], keep: bool, next_cursor: str | None = None,
                   after: str | None = None) -> dict[str, Any]:
    """What a listing (one page of it) logs: the count and a hash of its sorted ``name type
    size`` lines (a name that is not UTF-8 hashed as its bytes), its cursor (``after``) and
    the next page's; for a keyed one also the entries (up to LIST_KEEP, and only if every
    name and cursor is UTF-8: the log stores text), which its replay returns."""
    lines = sorted(f"{e['name']}\t{e['type']}\t{e['size'] if e['type'] == 'file' else 0}"
                   for e in entries)
    text = "\n".join(lines)
    res = data_result(text.encode("utf-8", "surrogateescape"), count=len(entries))
    storable = all(c is None or is_text(c) for c in (next_cursor, after))
    res["next"] = next_cursor if storable else None
    if after is not None and storable:
        res["after"] = after
    if keep and len(entries) <= LIST_KEEP and is_text(text) and storable:
        res["entries"] = entries
    return res


async def replayed_read(logged: dict[str, Any],
                        now: Callable[[], Awaitable[tuple[bytes, bool]]]) -> tuple[bytes, bool]:
    """What a fast-forwarded keyed read returns: the logged bytes; if they were over the log's
    cap, the file as it is now, provided it is still what was read then."""
    truncated = bool(logged.get("truncated"))
    if "data_b64" in logged:
        return base64.b64decode(logged["data_b64"]), truncated
    data, truncated = await now()
    if sha256(data) != logged.get("sha256"):
        raise ReplayDivergence("the file read under this key was over the log's cap and has "
                               "changed since: its logged content cannot be returned",
                               details={"sha256": logged.get("sha256")})
    return data, truncated


async def replayed_listing(
        logged: dict[str, Any], now: Callable[[], Awaitable[tuple[list[Any], str | None]]]
) -> tuple[list[Any], str | None]:
    """What a fast-forwarded keyed listing returns, (entries, next cursor): the logged ones,
    or (a listing over LIST_KEEP) the directory's page (or whole listing, as a daemon that
    logged whole listings logged it) now, provided it is still what was listed then."""
    if "entries" in logged:
        return list(logged["entries"]), logged.get("next")
    entries, nxt = await now()
    if listing_result(entries, False)["sha256"] != logged.get("sha256"):
        raise ReplayDivergence("the directory listed under this key was too long to log and "
                               "has changed since", details={"sha256": logged.get("sha256")})
    return entries, nxt


# json.dumps(obj, separators=...) builds a JSONEncoder and a C encoder per call: build the C
# encoder once (compact, ASCII, no circular-reference check: requests and results are trees).
# No NaN or Infinity: they are not JSON, and SQLite's JSON functions would refuse the batch
# (such a float is written as its repr string instead: ``_finite``).
_ENCODE = (json.encoder.c_make_encoder(  # type: ignore[attr-defined]
    None, json.JSONEncoder().default, json.encoder.encode_basestring_ascii, None, ":", ",",
    False, False, False) if json.encoder.c_make_encoder is not None else None)  # type: ignore[attr-defined]


# The same text as json.dumps([op, request], sort_keys=True, separators=(",", ":")).
_FP_ENCODE = (json.encoder.c_make_encoder(  # type: ignore[attr-defined]
    None, json.JSONEncoder().default, json.encoder.encode_basestring_ascii, None, ":", ",",
    True, False, True) if json.encoder.c_make_encoder is not None else None)  # type: ignore[attr-defined]


def _dumps(obj: Any) -> str:
    try:
        if _ENCODE is None:  # no C accelerator
            return json.dumps(obj, separators=(",", ":"), allow_nan=False)
        return "".join(_ENCODE(obj, 0))
    except ValueError:
        return json.dumps(_finite(obj), separators=(",", ":"), allow_nan=False)


# Past BIG_ENTRY characters of JSON an entry is encoded a piece at a time
# (corral.daemon.jsonbody.pieces), the event loop let go after about LOOP_PIECE characters
# (see encoded).
LOOP_PIECE = 1 << 18
BIG_ENTRY = 1 << 18


async def _joined(parts: Iterator[str]) -> str:
    out: list[str] = []
    size = 0
    for part in parts:
        out.append(part)
        size += len(part)
        if size >= LOOP_PIECE:
            size = 0
            await asyncio.sleep(0)
    return "".join(out)


async def encoded(obj: Any) -> tuple[str, str]:
    """(``_dumps(obj)``, ``_dumps`` of that text): an entry's JSON and the same as a string
    in its journal line, made a piece at a time with the event loop let go between pieces.
    Each at once, an exec's entry with a megabyte of binary output in each stream (12 MB of
    JSON, as each byte is a \\ufffd) held the loop for tens of milliseconds, and a few dozen
    such commands ending together held it for a second."""
    text = await _joined(jsonbody.pieces(obj, _dumps))
    return text, await _joined(jsonbody.pieces(text, _dumps))


def _plain(request: Any) -> Any:
    """A request as logged: a dict, or a pydantic model dumped to one (the exec handler
    passes its model, so that the dump happens while the command runs, not before)."""
    dump = getattr(request, "model_dump", None)
    return request if dump is None else dump(mode="json")


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else repr(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def is_text(text: str) -> bool:
    """No lone surrogates: JSON's \\u escapes and a header can carry them, but they are no
    text (a request's strings, what SQLite's JSON stores)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True
