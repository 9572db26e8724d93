"""Directory <-> tar bytes for ``files.upload`` / ``files.download`` (local side only)."""

from __future__ import annotations

import io
import os
import tarfile

from corral.errors import InvalidRequest


def pack(local_dir: str | os.PathLike[str]) -> bytes:
    """A tar of the *contents* of ``local_dir`` (names relative to it)."""
    root = os.fspath(local_dir)
    if not os.path.isdir(root):
        raise InvalidRequest(f"not a local directory: {root!r}")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in sorted(os.listdir(root)):
            tar.add(os.path.join(root, name), arcname=name, recursive=True)
    return buf.getvalue()


def unpack(data: bytes, local_dir: str | os.PathLike[str]) -> list[str]:
    """Extract into ``local_dir`` (created if missing) and return the member names. Members
    that would land outside it (absolute paths, ``..``, links out) are refused: the tar comes
    from a sandbox, which runs untrusted code."""
    root = os.path.realpath(os.fspath(local_dir))
    os.makedirs(root, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
        members = tar.getmembers()
        names = [m.name for m in members if m.name not in (".", "./")]
        _refuse_members_beneath_links(members)
        # Links are made after everything else, so no member is ever written through one: the
        # filter's own check resolves paths with realpath, which gives up past PATH_MAX, and a
        # chain of long-named links can then point outside unseen (CVE-2025-4517).
        members = sorted(members, key=lambda m: m.issym() or m.islnk())
        if hasattr(tarfile, "data_filter"):  # 3.10.12+/3.11.4+: the stdlib's safe filter
            try:
                # Every member is checked before the first is written: a bad one late in the
                # tar must not leave the earlier ones extracted. Extraction checks again (on
                # disk, with the links made so far).
                for m in members:
                    tarfile.data_filter(m, root)
                tar.extractall(root, members=members, filter="data")
            except tarfile.FilterError as e:
                raise InvalidRequest(f"refusing unsafe tar member: {e}") from None
        else:  # pragma: no cover - older Pythons
            for m in members:
                target = os.path.realpath(os.path.join(root, m.name))
                if os.path.commonpath([root, target]) != root or m.issym() or m.islnk() \
                        or m.isdev():
                    raise InvalidRequest(f"refusing unsafe tar member {m.name!r}")
            tar.extractall(root, members=members)
        return names


def _refuse_members_beneath_links(members: list[tarfile.TarInfo]) -> None:
    """A tree's tar never has a member inside a link (a walk does not follow links): one that
    does would be written wherever the link points. Every link must also stay inside the tree
    when resolved through the tar's own links, as the kernel would once they are on disk
    (without PATH_MAX: the stdlib's check is done by realpath, which stops there)."""
    symlinks = {os.path.normpath(m.name): m.linkname for m in members if m.issym()}
    links = set(symlinks) | {os.path.normpath(m.name) for m in members if m.islnk()}
    if not links:
        return
    for m in members:
        if _beneath(os.path.dirname(os.path.normpath(m.name)), links):
            raise InvalidRequest(f"refusing tar member {m.name!r}: it is beneath a link")
        if m.issym():
            _resolve_inside(os.path.join(os.path.dirname(m.name), m.linkname), symlinks, m.name)
        elif m.islnk():
            # A hard link is made to its target with links followed.
            _resolve_inside(m.linkname, symlinks, m.name)


def _beneath(path: str, links: set[str]) -> bool:
    """``path`` is one of ``links`` or inside one."""
    while path not in ("", "/", "."):
        if path in links:
            return True
        path = os.path.dirname(path)
    return False


MAX_LINK_HOPS = 40  # the kernel's own bound (ELOOP)


def _resolve_inside(path: str, symlinks: dict[str, str], member: str) -> None:
    """Resolve ``path`` (relative to the tree's root) through the tar's symlinks; refuse
    ``member`` if that leaves the tree."""
    if os.path.isabs(path):
        raise InvalidRequest(f"refusing link {member!r}: its target is absolute")
    todo = [c for c in path.split("/") if c not in ("", ".")]
    todo.reverse()
    done: list[str] = []
    hops = 0
    while todo:
        part = todo.pop()
        if part == "..":
            if not done:
                raise InvalidRequest(f"refusing link {member!r}: it points outside the tree")
            done.pop()
            continue
        done.append(part)
        target = symlinks.get("/".join(done))
        if target is None:
            continue
        hops += 1
        if hops > MAX_LINK_HOPS:
            raise InvalidRequest(f"refusing link {member!r}: its links loop")
        if os.path.isabs(target):
            raise InvalidRequest(f"refusing link {member!r}: it points outside the tree")
        done.pop()
        todo.extend(reversed([c for c in target.split("/") if c not in ("", ".")]))
