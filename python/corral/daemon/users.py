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
    if uid is not None and not 0 <= uid < 2**32 - 1:
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
    uid, gid, home, name = int(entry[2]), int(entry[3]), entry[5] or "/", entry[0]
    groups = []
    for f in _parse(group, 4):
        if name in f[3].split(","):
            try:
                g = int(f[2])
            except ValueError:
                continue
            if g != gid:
                groups.append(g)
    return Identity(uid, gid, groups, home)
