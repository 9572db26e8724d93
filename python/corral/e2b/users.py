"""The user an envd call runs as, and where relative paths start.

The SDK names the user in ``Authorization: Basic base64("<user>:")`` (RPCs) or the
``username`` query parameter (/files); neither means envd's default user, ``user``. The
``base`` template has ``user`` (uid 1000, home /home/user) and ``root``.
"""

from __future__ import annotations

import base64
import binascii
import posixpath
import re

from aiohttp import web

from corral.e2b.connect import ConnectError

DEFAULT_USER = "user"
HOMES = {"user": "/home/user", "root": "/root"}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,31}$")


def _checked(name: str) -> str:
    if not _NAME.match(name):
        raise ConnectError("invalid_argument", f"bad user name {name!r}")
    return name


def from_header(request: web.Request) -> str:
    auth = request.headers.get("Authorization", "")
    scheme, _, value = auth.partition(" ")
    if scheme.lower() != "basic" or not value:
        return DEFAULT_USER
    try:
        decoded = base64.b64decode(value.strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise ConnectError("invalid_argument", "bad Basic authorization") from None
    name = decoded.partition(":")[0]
    return _checked(name) if name else DEFAULT_USER


def from_query(request: web.Request) -> str:
    name = request.query.get("username")
    return _checked(name) if name else DEFAULT_USER


def home(user: str) -> str:
    return HOMES.get(user, "/")


def resolve(path: str, user: str) -> str:
    """An absolute path: a relative one (and ``~``) start at the user's home, as in envd."""
    if not path:
        raise ConnectError("invalid_argument", "empty path")
    try:
        path.encode()
    except UnicodeEncodeError:  # JSON can spell a lone surrogate; no file name is one
        raise ConnectError("invalid_argument", "the path is not Unicode text") from None
    if path == "~" or path.startswith("~/"):
        path = home(user) + path[1:]
    if not path.startswith("/"):
        path = posixpath.join(home(user), path)
    return path
