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
        return [m.name for m in members if m.name not in (".", "./")]
