"""Reading a tar nobody vouches for with the stdlib's tarfile, in bounded time and memory.

tarfile reads each extended header (PAX, GNU long name and link) whole into memory, and the
Python the daemon may run on (3.11 before 3.11.10) parses a PAX one with regular expressions
that take time quadratic in what the header holds, with the GIL held, so every thread of the
daemon (its event loop too) waits:
- ``\\d+ hdrcharset=([^\\n]+)\\n`` searched over the whole header (CVE-2024-6232):
  quadratic in a run of ASCII digits (100,000 digits, a 262-byte gzip, took 21 s), and in
  ``1 hdrcharset=`` repeated with no newline (1 MiB of it, a 2 KB gzip: minutes);
- a record ``(\\d+) ([^=]+)=`` whose keyword runs past the record's length to a later ``=``:
  the next record starts inside it and scans to that ``=`` again, and each keyword is kept.
So :class:`SafeTarInfo` (``tarfile.open(..., tarinfo=SafeTarInfo)``) parses PAX headers
itself, in one pass over the records (``length keyword=value\\n``, each framed by its
length; any other form is refused), and hands tarfile only the result; no regular expression
runs over a header's bytes. It also refuses:
- an extended header over HEADER_MAX bytes (it is never read);
- more than CHAIN_MAX extended headers in a row (tarfile recurses once per header), more
  than RECORDS_MAX records in one, more than GLOBAL_KEYS_MAX in the global ones together
  (tarfile applies them to, and copies them into, every member after);
- a negative size (base-256 allows it), or any member after which the archive does not move
  forward: a seekable read went round it forever;
- sparse members (old GNU ``S`` and the PAX ``GNU.sparse.*`` forms): tarfile gives their
  holes back as zeros, so a few hundred bytes claim a GiB of written blocks, and their maps
  (extension blocks, a 1.0 map in the data) are unbounded lists in memory.
Refusals are the upload API's errors (``too_large`` with ``details.limit ==
"header_bytes"``, else ``invalid_request``); :class:`ImageTarInfo` words them as
``invalid_image`` for layers and image archives.
"""

from __future__ import annotations

import tarfile
from typing import Any

from corral.errors import CorralError, InvalidImage, InvalidRequest, TooLarge

HEADER_MAX = 1 << 20
CHAIN_MAX = 16
RECORDS_MAX = 4096  # records in one PAX header (a file's xattrs are a record each)
GLOBAL_KEYS_MAX = 64  # records of the global headers together, applied to every member
LENGTH_DIGITS_MAX = 20  # a record's length field (as the fixed tarfile reads it)
_EXT_TYPES = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE,
              tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK)
_SPARSE_KEY = b"GNU.sparse."
_DEPTH = "_corral_safetar_depth"  # extended headers being processed on a TarFile


class SafeTarInfo(tarfile.TarInfo):
    """A TarInfo whose PAX headers are parsed in linear time, and whose extended headers are
    bounded (module docstring). Errors in the upload API's words."""

    def refuse(self, message: str, reason: str, **details: Any) -> CorralError:
        if reason == "header_bytes":
            return TooLarge(message, details={"limit": "header_bytes", **details})
        return InvalidRequest(message, details={"reason": reason, **details})

    def _proc_member(self, tf: Any) -> Any:
        if self.type == tarfile.GNUTYPE_SPARSE:
            raise self._sparse()
        if self.size < 0:  # base-256 sizes can be negative: tarfile would read backwards
            raise self._unframed("a member's size is negative")
        if self.type not in _EXT_TYPES:
            return self._advancing(tf, super()._proc_member(tf))  # type: ignore[misc]
        if self.size > HEADER_MAX:
            raise self.refuse(f"a tar extended header of {self.size} bytes (max {HEADER_MAX})",
                              "header_bytes", max=HEADER_MAX)
        depth = getattr(tf, _DEPTH, 0)
        if depth >= CHAIN_MAX:
            raise self.refuse(f"more than {CHAIN_MAX} tar extended headers in a row",
                              "header_chain", max=CHAIN_MAX)
        setattr(tf, _DEPTH, depth + 1)
        try:
            return self._advancing(tf, super()._proc_member(tf))  # type: ignore[misc]
        finally:
            setattr(tf, _DEPTH, depth)

    def _advancing(self, tf: Any, member: Any) -> Any:
        """``member``, if the archive moves forward past it: a negative size (its own, or a
        PAX ``size``) set tarfile's next offset back onto a header read already, and a
        seekable read went round it forever (a 2 KB tar: 117,000 members in 3 s)."""
        if member.size < 0 or tf.offset <= self.offset:
            raise self._unframed("a member's size is negative")
        return member

    def _proc_pax(self, tf: Any) -> Any:
        """tarfile's step for a PAX header (extended: for the next member; global: for every
        one after), with the header parsed by ``_records``."""
        records = self._records(tf.fileobj.read(self._block(self.size)))  # type: ignore[attr-defined]
        pax = tf.pax_headers if self.type == tarfile.XGLTYPE else dict(tf.pax_headers)
        if self.type == tarfile.XGLTYPE and len(pax) + len(records) > GLOBAL_KEYS_MAX:
            # tarfile applies the global records to every member after (and each member
            # kept holds a copy): 100,000 keys cost 15 ms a member
            raise self._unframed(f"tar global headers hold more than {GLOBAL_KEYS_MAX} records")
        # The first hdrcharset record says how path, linkpath, uname and gname are encoded.
        names_in = next((tf.encoding if v == b"BINARY" else "utf-8"
                         for k, v in records if k == b"hdrcharset"), "utf-8")
        decode = self._decode_pax_field  # type: ignore[attr-defined]
        for key, value in records:
            k = decode(key, "utf-8", "utf-8", tf.errors)
            if k in tarfile.PAX_NAME_FIELDS:
                pax[k] = decode(value, names_in, tf.encoding, tf.errors)
            else:
                pax[k] = decode(value, "utf-8", "utf-8", tf.errors)
        try:
            nxt = self.fromtarfile(tf)
        except tarfile.HeaderError as e:
            raise tarfile.SubsequentHeaderError(str(e)) from None  # type: ignore[attr-defined]
        if self.type in (tarfile.XHDTYPE, tarfile.SOLARIS_XHDTYPE):
            nxt._apply_pax_info(pax, tf.encoding, tf.errors)  # type: ignore[attr-defined]
            nxt.offset = self.offset
            if "size" in pax:  # the member's data starts after its own header
                offset = nxt.offset_data
                if nxt.isreg() or nxt.type not in tarfile.SUPPORTED_TYPES:
                    offset += nxt._block(nxt.size)  # type: ignore[attr-defined]
                tf.offset = offset
        return nxt

    def _records(self, buf: bytes) -> list[tuple[bytes, bytes]]:
        """A PAX header's records, ``(keyword, value)`` in order, in one pass: each is
        ``length keyword=value\\n`` with ``length`` its own size (at most
        LENGTH_DIGITS_MAX digits, at least 5), ending in a newline, with a keyword; the
        header ends at its end or at a NUL. Anything else is refused; so is a sparse key."""
        out: list[tuple[bytes, bytes]] = []
        pos = 0
        while pos < len(buf) and buf[pos] != 0:
            sp = buf.find(b" ", pos, pos + LENGTH_DIGITS_MAX + 1)
            field = buf[pos:sp] if sp > pos else b""
            length = int(field) if field.isdigit() else 0
            end = pos + length - 1  # the record's newline
            if length < 5 or end >= len(buf) or buf[end] != 0x0A:
                raise self._unframed()
            key, eq, value = buf[sp + 1:end].partition(b"=")
            if not key or not eq:
                raise self._unframed()
            if key.startswith(_SPARSE_KEY):
                raise self._sparse()
            out.append((key, value))
            if len(out) > RECORDS_MAX:
                raise self._unframed(f"a tar PAX header holds more than {RECORDS_MAX} records")
            pos = end + 1
        return out

    def _unframed(self, why: str = "a tar PAX header is not a sequence of records framed "
                                   "by their lengths") -> CorralError:
        return self.refuse(why, "header_framing")

    def _sparse(self) -> CorralError:
        return self.refuse(f"tar member {self.name[:200]!r} is sparse (GNU sparse members "
                           "are not taken)", "sparse", member=self.name[:200])


class ImageTarInfo(SafeTarInfo):
    """SafeTarInfo for image layers, image archives and snapshot streams: refusals are
    ``invalid_image`` (their details as SafeTarInfo's)."""

    def refuse(self, message: str, reason: str, **details: Any) -> CorralError:
        key = "limit" if reason == "header_bytes" else "reason"
        return InvalidImage(message, details={key: reason, **details})
