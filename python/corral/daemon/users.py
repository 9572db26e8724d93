"""Resolve an exec ``user`` against the sandbox's own /etc/passwd and /etc/group."""

from __future__ import annotations

from typing import NamedTuple

from corral.errors import InvalidRequest, UserNotFound


class Identity(NamedTuple):
    uid: int
    gid: int
    groups: list[int]
    home: str


ROOT = Identity(0, 0, [], "/root")
# The ids a process can take: (uid_t)-1 means "leave unchanged" to setresuid/setresgid, so a
# user whose id is 4294967295 (or -1, or wraps to it) would keep the daemon's root.
MAX_ID = 2**32 - 2


def _id(text: str, what: str, name: str) -> int:
    """An id from the sandbox's /etc/passwd or /etc/group (code in the sandbox writes those:
    an id no process can take is the task's error, never run as something else)."""
    try:
        value = int(text)
    except ValueError:
        raise InvalidRequest(f"the sandbox's {what} gives {name!r} an id that is not a "
                             f"number: {text[:40]!r}", details={"user": name}) from None
    if not 0 <= value <= MAX_ID:
        raise InvalidRequest(f"the sandbox's {what} gives {name!r} the id {value}, which no "
                             f"process can have (0 to {MAX_ID})",
                             details={"user": name, "id": value})
    return value


def _parse(text: str, nfields: int) -> list[list[str]]:
    rows = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        f = line.split(":")
        if len(f) >= nfields:
            rows.append(f)
    return rows


def resolve(user: str | int, passwd: str, group: str) -> Identity:
    """``user`` is a name, a numeric string or an int uid. An unknown uid still runs (with
    gid = uid, as docker does); an unknown name is an error."""
    uid: int | None = None
    name: str | None = None
    if isinstance(user, int):
        uid = user
    elif user.isdigit():
        uid = int(user)
    else:
        name = user
    if uid is not None and not 0 <= uid <= MAX_ID:
        raise InvalidRequest(f"user id out of range: {uid}")
    entry = None
    for f in _parse(passwd, 7):
        try:
            if (name is not None and f[0] == name) or (uid is not None and int(f[2]) == uid):
                entry = f
                break
        except ValueError:
            continue
    if entry is None:
        if name is not None:
            raise UserNotFound(f"unknown user {name!r} in the sandbox's /etc/passwd",
                               details={"user": name})
        assert uid is not None
        return Identity(uid, uid, [], "/")
    name = entry[0]
    uid, gid, home = _id(entry[2], "/etc/passwd", name), _id(entry[3], "/etc/passwd", name), \
        entry[5] or "/"
    groups = []
    for f in _parse(group, 4):
        if name in f[3].split(","):
            try:
                g = int(f[2])
            except ValueError:
                continue
            g = _id(str(g), "/etc/group", name)
            if g != gid:
                groups.append(g)
    return Identity(uid, gid, groups, home)
