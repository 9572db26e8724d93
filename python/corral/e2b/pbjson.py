"""Proto3 JSON shapes of envd's messages (spec/envd/*.proto in E2B's repository), built from
corral's results and parsed from the SDK's requests. Parsers accept both the lowerCamelCase
and the proto field names, as proto3 JSON requires."""

from __future__ import annotations

import base64
import binascii
import stat as statmod
from datetime import datetime, timezone
from typing import Any

from corral.e2b.connect import ConnectError
from corral.models import FileEntry

FILE_TYPES = {"file": "FILE_TYPE_FILE", "dir": "FILE_TYPE_DIRECTORY",
              "symlink": "FILE_TYPE_SYMLINK"}
_MODE_KIND = {"file": statmod.S_IFREG, "dir": statmod.S_IFDIR, "symlink": statmod.S_IFLNK}
# Go's os.FileMode type bits, which envd reports in EntryInfo.mode.
_GO_MODE_DIR = 1 << 31
_GO_MODE_SYMLINK = 1 << 27
SIGNALS = {"SIGNAL_SIGKILL": 9, "SIGNAL_SIGTERM": 15, 9: 9, 15: 15}


def field(msg: dict[str, Any], camel: str, snake: str | None = None) -> Any:
    if camel in msg:
        return msg[camel]
    return msg.get(snake) if snake else None


def message(msg: dict[str, Any], camel: str, snake: str | None = None) -> dict[str, Any]:
    v = field(msg, camel, snake)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ConnectError("invalid_argument", f"{camel} must be an object")
    return v


def string(msg: dict[str, Any], camel: str, snake: str | None = None,
           default: str = "") -> str:
    v = field(msg, camel, snake)
    if v is None:
        return default
    if not isinstance(v, str):
        raise ConnectError("invalid_argument", f"{camel} must be a string")
    return v


def uint(msg: dict[str, Any], camel: str, snake: str | None = None, default: int = 0) -> int:
    v = field(msg, camel, snake)
    if v is None:
        return default
    if isinstance(v, str) and v.isdigit():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 32:
        raise ConnectError("invalid_argument", f"{camel} must be a uint32")
    return v


def boolean(msg: dict[str, Any], camel: str, default: bool = False) -> bool:
    v = msg.get(camel)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ConnectError("invalid_argument", f"{camel} must be a boolean")
    return v


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(value: Any, name: str) -> bytes:
    if not isinstance(value, str):
        raise ConnectError("invalid_argument", f"{name} must be base64 bytes")
    try:
        return base64.b64decode(value + "=" * (-len(value) % 4),
                                altchars=b"-_" if ("-" in value or "_" in value) else None,
                                validate=True)
    except (binascii.Error, ValueError):
        raise ConnectError("invalid_argument", f"{name} is not base64") from None


def timestamp(unix: float) -> str:
    t = datetime.fromtimestamp(unix, tz=timezone.utc)
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond:06d}Z"


def permissions(kind: str, mode: int) -> str:
    return statmod.filemode(_MODE_KIND.get(kind, 0) | (mode & 0o7777))


def text(s: str) -> str:
    """A file name as a protobuf string: valid UTF-8. A name that is not (its bytes come as
    surrogate escapes) has U+FFFD for each byte that is not: envd's clients parse strings
    strictly, and refused the whole answer (a listing, a watch) for one such name."""
    return s.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def entry_info(e: FileEntry, symlink_target: str | None = None) -> dict[str, Any]:
    """An EntryInfo. ``mode`` carries Go's FileMode type bits, as envd reports it; corral's
    entries carry no owner, so owner and group stay empty."""
    mode = e.mode & 0o777
    if e.type == "dir":
        mode |= _GO_MODE_DIR
    elif e.type == "symlink":
        mode |= _GO_MODE_SYMLINK
    out: dict[str, Any] = {
        "name": text(e.name), "type": FILE_TYPES.get(e.type, "FILE_TYPE_UNSPECIFIED"),
        "path": text(e.path), "size": str(e.size), "mode": mode,
        "permissions": permissions(e.type, e.mode), "owner": "", "group": "",
        "modifiedTime": timestamp(e.mtime),
    }
    if symlink_target is not None:
        out["symlinkTarget"] = text(symlink_target)
    return out


def selector(msg: dict[str, Any]) -> tuple[int | None, str | None]:
    """A ProcessSelector: (pid, None) or (None, tag)."""
    sel = message(msg, "process")
    if "pid" in sel:
        return uint(sel, "pid"), None
    if "tag" in sel:
        return None, string(sel, "tag")
    raise ConnectError("invalid_argument", "the process selector names neither pid nor tag")
