"""Reading a tar nobody vouches for with the stdlib's tarfile, in bounded time and memory.

tarfile reads each extended header (PAX, GNU long name and link) whole into memory, then
parses a PAX one with regular expressions that take time quadratic in what the header
holds, with the GIL held, so every thread of the daemon (its event loop too) waits:
- ``\\d+ hdrcharset=...`` searched over the header (CVE-2024-6232): quadratic in a run of
  ASCII digits, 100,000 digits (a 262-byte gzip) took 21 s;
- a record ``(\\d+) ([^=]+)=`` whose keyword runs past the record's length to a later ``=``:
  the next record starts inside it and scans to that ``=`` again, and each keyword is kept,
  so ``4 aa`` repeated is quadratic in time and in memory.
The Python releases that fix the CVE are not the ones the daemon may run on, so
:class:`SafeTarInfo` (``tarfile.open(..., tarinfo=SafeTarInfo)``) refuses, before tarfile
parses it:
- an extended header over HEADER_MAX bytes (it is never read);
- a PAX header with a digit run over DIGIT_RUN_MAX bytes, or runs whose quadratic cost adds
  up past DIGIT_COST_MAX (a path is at most 4096 bytes: two of those, path and link, fit);
- a PAX header whose records are not framed: a keyword that does not end (``=``) inside its
  record's length;
- more than CHAIN_MAX extended headers in a row (tarfile recurses once per header);
- sparse members (old GNU ``S`` and the PAX ``GNU.sparse.*`` forms): tarfile gives their
  holes back as zeros, so a few hundred bytes claim a GiB of written blocks, and their maps
  (extension blocks, a 1.0 map in the data) are unbounded lists in memory.
Each check is one linear pass over the header's bytes. Refusals are the upload API's errors
(``too_large`` with ``details.limit == "header_bytes"``, else ``invalid_request``);
:class:`ImageTarInfo` words them as ``invalid_image`` for layers and image archives.
"""

from __future__ import annotations

import re
import tarfile
from typing import IO, Any

from corral.errors import CorralError, InvalidImage, InvalidRequest, TooLarge

HEADER_MAX = 1 << 20
DIGIT_RUN_MAX = 4096
# tarfile's search costs about a run's length squared (~0.04 s for 4096 digits)
DIGIT_COST_MAX = 4 * DIGIT_RUN_MAX * DIGIT_RUN_MAX
CHAIN_MAX = 16
_PAX_TYPES = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE)
_EXT_TYPES = _PAX_TYPES + (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK)
_DIGITS = re.compile(rb"\d+")
_RECORD_LENGTH = re.compile(rb"(\d+) ")  # anchored at a record's start: one digit run
_SPARSE_KEY = b"GNU.sparse."
_DEPTH = "_corral_safetar_depth"  # extended headers being processed on a TarFile


class _CheckedFirstRead:
    """``inner``, whose next read (tarfile's read of a PAX header's bytes) goes through
    ``check`` before tarfile sees it; every other attribute is ``inner``'s."""

    def __init__(self, inner: IO[bytes], check: Any) -> None:
        self._inner, self._check = inner, check

    def read(self, n: int = -1) -> bytes:
        data = self._inner.read(n)
        check, self._check = self._check, None
        if check is not None:
            check(data)
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class SafeTarInfo(tarfile.TarInfo):
    """A TarInfo whose extended headers are checked before tarfile parses them (module
    docstring). Errors in the upload API's words."""

    def refuse(self, message: str, reason: str, **details: Any) -> CorralError:
        if reason == "header_bytes":
            return TooLarge(message, details={"limit": "header_bytes", **details})
        return InvalidRequest(message, details={"reason": reason, **details})

    def _proc_member(self, tf: Any) -> Any:
        if self.type == tarfile.GNUTYPE_SPARSE:
            raise self._sparse()
        if self.type not in _EXT_TYPES:
            return super()._proc_member(tf)  # type: ignore[misc]
        if self.size > HEADER_MAX:
            raise self.refuse(f"a tar extended header of {self.size} bytes (max {HEADER_MAX})",
                              "header_bytes", max=HEADER_MAX)
        depth = getattr(tf, _DEPTH, 0)
        if depth >= CHAIN_MAX:
            raise self.refuse(f"more than {CHAIN_MAX} tar extended headers in a row",
                              "header_chain", max=CHAIN_MAX)
        setattr(tf, _DEPTH, depth + 1)
        try:
            return super()._proc_member(tf)  # type: ignore[misc]
        finally:
            setattr(tf, _DEPTH, depth)

    def _proc_pax(self, tf: Any) -> Any:
        inner = tf.fileobj
        tf.fileobj = _CheckedFirstRead(inner, self._check_pax)
        try:
            return super()._proc_pax(tf)  # type: ignore[misc]
        finally:
            tf.fileobj = inner

    def _sparse(self) -> CorralError:
        return self.refuse(f"tar member {self.name[:200]!r} is sparse (GNU sparse members "
                           "are not taken)", "sparse", member=self.name[:200])

    def _check_pax(self, buf: bytes) -> None:
        """Refuse a PAX header that tarfile would take more than linear time to parse."""
        cost = 0
        for run in _DIGITS.finditer(buf):
            n = run.end() - run.start()
            cost += n * n
            if n > DIGIT_RUN_MAX or cost > DIGIT_COST_MAX:
                raise self.refuse(f"a tar PAX header holds a run of {n} digits (at most "
                                  f"{DIGIT_RUN_MAX}, {DIGIT_COST_MAX} squared in all)",
                                  "header_digits", max=DIGIT_RUN_MAX)
        # The records, walked as tarfile does: where tarfile's own pattern would stop (no
        # length, no keyword), it stops too and this walk ends there.
        pos = 0
        while (m := _RECORD_LENGTH.match(buf, pos)) is not None:
            length = int(m.group(1))  # at most DIGIT_RUN_MAX digits
            key = m.end()
            if length == 0 or key >= len(buf) or buf[key:key + 1] == b"=":
                return  # tarfile refuses a zero length itself, and matches no empty keyword
            end = pos + length
            eq = buf.find(b"=", key, end)
            if eq < 0:
                if buf.find(b"=", max(end, key)) < 0:
                    return  # tarfile's pattern does not match here either: it stops
                raise self.refuse("a tar PAX record's keyword runs past its length",
                                  "header_framing")
            if buf.startswith(_SPARSE_KEY, key):
                raise self._sparse()
            pos = end


class ImageTarInfo(SafeTarInfo):
    """SafeTarInfo for image layers, image archives and snapshot streams: refusals are
    ``invalid_image`` (their details as SafeTarInfo's)."""

    def refuse(self, message: str, reason: str, **details: Any) -> CorralError:
        key = "limit" if reason == "header_bytes" else "reason"
        return InvalidImage(message, details={key: reason, **details})
