"""The check every substrate makes of a path a client names inside a sandbox, before any
syscall: absolute, no NUL, at most PATH_MAX. Resolving it safely is the substrate's job (the
Rust core's openat2 RESOLVE_IN_ROOT for the host-side roots)."""

from __future__ import annotations

from corral.errors import InvalidPath

PATH_MAX = 4096


def check_path(path: str) -> str:
    """``path`` if it may name a file in a sandbox, else InvalidPath."""
    if not isinstance(path, str) or not path.startswith("/"):
        raise InvalidPath(f"paths must be absolute inside the sandbox: {path!r}",
                          details={"path": path})
    if "\0" in path:
        raise InvalidPath("NUL byte in path", details={"path": path})
    if len(path) > PATH_MAX:
        raise InvalidPath(f"path longer than {PATH_MAX} bytes",
                          details={"path": path[:100] + "..."})
    return path
