"""Query parameters, parsed strictly, and the pagination of list endpoints.

Integers are decimal digits only: no sign, no ``0x``, no ``_``, no leading zero (``010`` is
neither 10 nor 8: it is refused). File modes may also be an explicit octal string, ``0o755`` or
``0755`` (a leading zero means octal there, as in chmod(1)).
"""

from __future__ import annotations

import heapq
import os
import posixpath
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar
from urllib.parse import parse_qs

from aiohttp import web

from corral.errors import Conflict, InvalidPath, InvalidRequest
from corral.models import LABEL_KEY_PATTERN, MAX_PATH, PATH_PATTERN

DECIMAL = r"^(0|[1-9][0-9]{0,17})$"
OCTAL_MODE = r"^0o?[0-7]{1,4}$"
_DECIMAL = re.compile(DECIMAL)
_OCTAL_MODE = re.compile(OCTAL_MODE)
_LABEL_KEY = re.compile(LABEL_KEY_PATTERN)
_PATH = re.compile(PATH_PATTERN)
LABEL_FILTER = r"^[A-Za-z0-9_.\-/]{1,63}(=.{0,256})?$"
MAX_MODE = 0o7777
DEFAULT_PAGE = 1000
MAX_PAGE = 10_000
MAX_TREE_DEPTH = 64  # levels a files/tree call walks
MAX_CURSOR = 512
T = TypeVar("T")


def check_path(path: str, what: str = "path") -> str:
    if not _PATH.match(path) or len(path.encode("utf-8", "surrogateescape")) > MAX_PATH:
        raise InvalidPath(f"{what} must be an absolute path inside the sandbox: {path!r}")
    return path


def not_root(path: str, what: str) -> None:
    """The sandbox's root directory is where everything else hangs: a conflict, not bad
    input, to name it for a remove or a rename."""
    if posixpath.normpath(path) in ("/", "//"):
        raise Conflict(f"the sandbox's root directory cannot be {what}",
                       details={"path": path})


def query_path(request: web.Request) -> str:
    """The ``path`` query parameter. Bytes that are not UTF-8 (a file name in the sandbox that
    is not, as a listing gave it) are kept as surrogate escapes, as os.fsdecode does, so the
    path names that very file (aiohttp's own decoding would replace them)."""
    if "path" not in request.query:
        raise InvalidRequest("missing query parameter 'path'")
    raw = parse_qs(request.rel_url.raw_query_string, keep_blank_values=True,
                   errors="surrogateescape").get("path", [""])
    return check_path(raw[0])


def decimal(raw: str, what: str, lo: int, hi: int) -> int:
    if not _DECIMAL.match(raw):
        raise InvalidRequest(f"{what} must be a decimal integer (digits only, no leading "
                             f"zero): {raw[:40]!r}")
    value = int(raw)
    if not lo <= value <= hi:
        raise InvalidRequest(f"{what} must be in [{lo}, {hi}]")
    return value


def query_int(request: web.Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query.get(name)
    return default if raw is None else decimal(raw, f"query parameter {name!r}", lo, hi)


def query_mode(request: web.Request, name: str = "mode", default: int = 0o644) -> int:
    """Permission bits: decimal (``420``) or explicit octal (``0o644``, ``0644``)."""
    raw = request.query.get(name)
    if raw is None:
        return default
    if _OCTAL_MODE.match(raw):
        return int(raw.replace("o", ""), 8)
    return decimal(raw, f"query parameter {name!r} (decimal, or octal as 0o755)", 0, MAX_MODE)


def label_filters(items: list[str]) -> dict[str, str | None]:
    """``label=key=value`` (equal) or ``label=key`` (present); keys as in a SandboxSpec."""
    labels: dict[str, str | None] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not _LABEL_KEY.match(key) or len(value) > 256:
            raise InvalidRequest(f"bad label filter {item[:80]!r}: use key=value or key, keys "
                                 f"match {LABEL_KEY_PATTERN}, values of at most 256 characters")
        labels[key] = value if eq else None
    return labels


def path_int(request: web.Request, name: str) -> int:
    return decimal(request.match_info[name], f"{name}", 0, (1 << 31) - 1)


# ---- pagination ------------------------------------------------------------------------------
def page_args(request: web.Request, names: bool = False) -> tuple[str | None, int]:
    """``?after=<cursor>`` (the ``next`` of the previous page) and ``?limit=N`` (default 1000,
    at most 10,000). ``names``: the cursor is a file name, kept as its bytes (surrogate
    escapes) when they are not UTF-8, as query_path keeps a path."""
    limit = query_int(request, "limit", DEFAULT_PAGE, 1, MAX_PAGE)
    if names:
        raw = parse_qs(request.rel_url.raw_query_string, keep_blank_values=True,
                       errors="surrogateescape").get("after", [""])
        start = raw[0] or None
    else:
        start = request.query.get("after") or None
    if start is not None and len(start) > MAX_CURSOR:
        raise InvalidRequest("query parameter 'after' is not a cursor this daemon returned")
    return start, limit


def page(request: web.Request, items: Sequence[T], key: Callable[[T], str]
         ) -> tuple[list[T], str | None]:
    """One page of ``items`` in ``key`` order (page_args). ``next`` is None on the last page.
    Items made or gone between pages are seen or not, never twice."""
    start, limit = page_args(request)
    keyed = ((key(x), x) for x in items)
    if start is not None:
        keyed = (kx for kx in keyed if kx[0] > start)
    # The page and one more (is there a next?), without sorting everything.
    page = heapq.nsmallest(limit + 1, keyed, key=lambda kx: kx[0])
    out = [x for _, x in page[:limit]]
    nxt = page[limit - 1][0] if len(page) > limit else None
    return out, nxt


def page_of(items: Iterable[T], after: str | None, limit: int,
            name_of: Callable[[T], str]) -> tuple[list[T], str | None]:
    """A page of directory entries: those whose name's bytes sort after ``after``'s, at most
    ``limit``, and the next page's cursor (the page's last name; None on the last page)."""
    key = os.fsencode
    start = key(after) if after is not None else None
    rest = sorted((x for x in items if start is None or key(name_of(x)) > start),
                  key=lambda x: key(name_of(x)))
    if len(rest) <= limit:
        return rest, None
    return rest[:limit], name_of(rest[limit - 1])


def paged(key: str, items: list[Any], nxt: str | None) -> dict[str, Any]:
    return {key: items, "next": nxt}
