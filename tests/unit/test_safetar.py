"""corral.daemon.safetar: extended headers that would hold the GIL for seconds (CVE-2024-6232's
digit runs, records whose keyword runs past their length), that are too big, chained too
deep or sparse are refused before tarfile parses them, in linear time; ordinary archives
(long names, xattrs, PAX and GNU headers) read as the stdlib reads them."""

from __future__ import annotations

import io
import os
import random
import shutil
import subprocess
import tarfile
import time
from pathlib import Path
from typing import Any

import pytest

from corral.daemon import safetar
from corral.errors import InvalidImage, InvalidRequest, TooLarge


def _pax_tar(body: bytes, count: int = 1) -> bytes:
    """``count`` PAX extended headers holding ``body``, then a 3-byte file."""
    hdr = tarfile.TarInfo("././@PaxHeader")
    hdr.type, hdr.size = tarfile.XHDTYPE, len(body)
    ti = tarfile.TarInfo("hello")
    ti.size = 3
    pad = b"\0" * (-len(body) % 512)
    return (hdr.tobuf(tarfile.USTAR_FORMAT) + body + pad) * count + \
        ti.tobuf(tarfile.USTAR_FORMAT) + b"hi\n" + b"\0" * 509 + b"\0" * 1024


def _read(data: bytes | io.RawIOBase, tarinfo: type[tarfile.TarInfo] = safetar.SafeTarInfo
          ) -> list[tuple[Any, ...]]:
    src = io.BytesIO(data) if isinstance(data, bytes) else data
    with tarfile.open(fileobj=src, mode="r|", tarinfo=tarinfo) as tf:
        out = []
        for m in tf:
            f = tf.extractfile(m) if m.isreg() else None
            out.append((m.name, m.linkname, m.type, m.size, m.mode, m.uid, m.mtime,
                        dict(m.pax_headers), f.read() if f else None))
        return out


def _refused(data: bytes, tarinfo: type[tarfile.TarInfo] = safetar.SafeTarInfo) -> Any:
    t0 = time.monotonic()
    with pytest.raises((InvalidRequest, InvalidImage)) as e:
        _read(data, tarinfo)
    took = time.monotonic() - t0
    # the stock tarfile takes ~21 s over 100,000 digits, and minutes over 1 MiB of records
    assert took < 0.5, took
    return e.value


def _record(key: bytes, value: bytes) -> bytes:
    """One PAX record, its length field counting itself."""
    body = b" " + key + b"=" + value + b"\n"
    n = len(body) + 1
    while len(str(n)) + len(body) != n:
        n += 1
    return str(n).encode() + body


def test_a_header_of_digits_is_refused_at_once() -> None:
    e = _refused(_pax_tar(b"1" * 100_000))
    assert type(e) is InvalidRequest
    assert e.details["reason"] == "header_framing"
    e = _refused(_pax_tar(b"1" * 100_000), safetar.ImageTarInfo)
    assert type(e) is InvalidImage and e.details["reason"] == "header_framing"


def test_digits_and_hdrcharsets_in_values_cost_linear_time() -> None:
    """What tarfile's own search is quadratic in (a long digit run; ``1 hdrcharset=``
    repeated without a newline) inside a well-framed value: read at once, the value kept."""
    for value in (b"7" * 200_000, b"1 hdrcharset=" * 60_000):
        t0 = time.monotonic()
        got = _read(_pax_tar(_record(b"comment", value)))
        assert time.monotonic() - t0 < 0.5
        assert got[0][0] == "hello" and got[0][7]["comment"] == value.decode()
    # the same without the record's newline (tarfile drops its last byte, whatever it is)
    rec = _record(b"comment", b"1 hdrcharset=" * 60_000)
    assert _refused(_pax_tar(rec[:-1] + b"x")).details["reason"] == "header_framing"


def test_a_record_whose_keyword_runs_past_its_length_is_refused() -> None:
    # each record's length lands inside it, the keyword reaches the last '=': quadratic in
    # time and in the keywords tarfile keeps (32 KiB of this: 0.3 s; 1 MiB: minutes, GBs)
    e = _refused(_pax_tar(b"4 aa" * 250_000 + b"=\n"))
    assert e.details["reason"] == "header_framing"


def test_an_extended_header_over_the_cap_is_refused_unread() -> None:
    class Counting(io.RawIOBase):
        def __init__(self, data: bytes) -> None:
            self.src, self.read_bytes = io.BytesIO(data), 0

        def readable(self) -> bool:
            return True

        def readinto(self, b: Any) -> int:
            n = self.src.readinto(b)
            self.read_bytes += n
            return n

    for kind in (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.GNUTYPE_LONGNAME,
                 tarfile.GNUTYPE_LONGLINK):
        hdr = tarfile.TarInfo("././@LongLink")
        hdr.type, hdr.size = kind, 2 << 20
        src = Counting(hdr.tobuf(tarfile.GNU_FORMAT) + b"a" * (2 << 20) + b"\0" * 1024)
        with pytest.raises(TooLarge) as e:
            _read(src)  # type: ignore[arg-type]
        assert e.value.details == {"limit": "header_bytes", "max": safetar.HEADER_MAX}
        assert src.read_bytes < 1 << 20, src.read_bytes  # tarfile's buffering, not the header
        with pytest.raises(InvalidImage) as e2:
            _read(Counting(src.src.getvalue()), safetar.ImageTarInfo)  # type: ignore[arg-type]
        assert e2.value.details["limit"] == "header_bytes"


def test_a_chain_of_extended_headers_is_bounded() -> None:
    rec = b"13 comment=x\n"
    assert _read(_pax_tar(rec, safetar.CHAIN_MAX))[0][0] == "hello"
    e = _refused(_pax_tar(rec, safetar.CHAIN_MAX + 1))
    assert e.details["reason"] == "header_chain"
    # tarfile recurses once per header: without the bound, a RecursionError
    assert _refused(_pax_tar(rec, 2000)).details["reason"] == "header_chain"


@pytest.mark.skipif(shutil.which("tar") is None, reason="needs GNU tar")
@pytest.mark.parametrize("form", [["--format=gnu"], ["--format=pax", "--sparse-version=0.0"],
                                  ["--format=pax", "--sparse-version=0.1"],
                                  ["--format=pax", "--sparse-version=1.0"]])
def test_sparse_members_are_refused(tmp_path: Path, form: list[str]) -> None:
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "big", "wb") as f:  # data, a 64 MiB hole, data
        f.write(b"x" * 4096)
        f.seek(64 << 20)
        f.write(b"y" * 4096)
    out = subprocess.run(["tar", "--sparse", *form, "-C", str(src), "-cf", "-", "big"],
                         check=True, capture_output=True).stdout
    assert len(out) < 64 << 10
    assert _read(out, tarfile.TarInfo)[0][3] == (64 << 20) + 4096  # what the stdlib takes
    e = _refused(out)
    assert e.details["reason"] == "sparse"
    assert _refused(out, safetar.ImageTarInfo).details["reason"] == "sparse"


def _ordinary_archives() -> list[bytes]:
    out = []
    for fmt in (tarfile.PAX_FORMAT, tarfile.GNU_FORMAT):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=fmt,
                          pax_headers={"comment": "a global header"}) as tf:
            d = tarfile.TarInfo("d" * 150)
            d.type, d.mode = tarfile.DIRTYPE, 0o755
            tf.addfile(d)
            f = tarfile.TarInfo("d" * 150 + "/" + "f" * 200 + "-1234567890")
            f.size, f.mtime, f.uid = 5, 1_700_000_000, 3_000_000
            f.pax_headers = {"SCHILY.xattr.user.tag": "v 42=x", "mtime": "1700000000.5",
                             "comment": "9" * 4000}
            tf.addfile(f, io.BytesIO(b"data\n"))
            s = tarfile.TarInfo("caf\udce9-link")  # not UTF-8: hdrcharset=BINARY
            s.type, s.linkname = tarfile.SYMTYPE, "t" * 300
            tf.addfile(s)
        out.append(buf.getvalue())
    return out


def test_ordinary_archives_read_as_the_stdlib_reads_them() -> None:
    for data in _ordinary_archives():
        want = _read(data, tarfile.TarInfo)
        assert len(want) == 3 and want[1][8] == b"data\n"
        assert _read(data) == want
        assert _read(data, safetar.ImageTarInfo) == want


@pytest.mark.skipif(shutil.which("tar") is None, reason="needs GNU tar")
def test_a_gnu_tar_archive_with_xattrs_and_long_names_reads(tmp_path: Path) -> None:
    src = tmp_path / "src"
    deep = src / ("n" * 120) / ("m" * 120)
    deep.mkdir(parents=True)
    (deep / "f").write_bytes(b"content")
    (src / "l").symlink_to("x" * 200)
    os.setxattr(deep / "f", "user.note", b"12345")
    for form in (["--format=pax", "--xattrs"], ["--format=gnu"]):
        out = subprocess.run(["tar", *form, "-C", str(src), "-cf", "-", "."], check=True,
                             capture_output=True).stdout
        want = _read(out, tarfile.TarInfo)
        assert _read(out) == want
        assert any(r[8] == b"content" for r in want)


def _random_archive(rng: random.Random) -> bytes:
    """A PAX archive of random members: names long or short, some not UTF-8, link names,
    times with fractions, big ids, PAX records whose values hold '=', newlines, digits, and
    global headers now and then."""
    alphabet = "ab=9 \n\u00e9\u4e2d/" + "\udce9"

    def text(n: int) -> str:
        return "".join(rng.choice(alphabet) for _ in range(n))

    buf = io.BytesIO()
    glob = {"comment": text(rng.randint(0, 50))} if rng.random() < 0.3 else None
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT,
                      pax_headers=glob) as tf:
        for i in range(rng.randint(1, 12)):
            name = f"m{i}-" + text(rng.choice([3, 40, 120, 300])).replace("/", "_")
            ti = tarfile.TarInfo(name.replace("\n", "_"))
            kind = rng.random()
            if kind < 0.2:
                ti.type, ti.linkname = tarfile.SYMTYPE, text(rng.choice([5, 200, 400]))
            elif kind < 0.3:
                ti.type = tarfile.DIRTYPE
            ti.mtime = rng.choice([0, 1_700_000_000, 1_700_000_000.25, 2 ** 34])
            ti.uid = rng.choice([0, 1000, 3_000_000, 2 ** 22])
            ti.uname = text(rng.randint(0, 10))
            ti.pax_headers = {f"SCHILY.xattr.user.k{j}": text(rng.randint(0, 80))
                              for j in range(rng.randint(0, 3))}
            if rng.random() < 0.3:
                ti.pax_headers["comment"] = "7" * rng.randint(0, 5000)
            data = text(rng.randint(0, 100)).encode("utf-8", "surrogateescape")
            if ti.isreg():
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
            else:
                tf.addfile(ti)
    return buf.getvalue()


def test_random_archives_read_as_the_stdlib_reads_them() -> None:
    """A seeded differential test: safetar's own PAX parse gives tarfile what tarfile's own
    parse does, member for member (names, links, sizes, modes, ids, times, PAX records,
    contents), for both refusal wordings."""
    rng = random.Random(20261205)
    for _ in range(150):
        data = _random_archive(rng)
        want = _read(data, tarfile.TarInfo)
        assert _read(data) == want
        assert _read(data, safetar.ImageTarInfo) == want


def _with_size(header: bytes, size: int) -> bytes:
    """A copy of a 512-byte ustar header with its size field set to ``size`` (base-256,
    which can say a negative number) and its checksum made again."""
    h = bytearray(header)
    h[124:136] = size.to_bytes(12, "big", signed=True)
    h[124] |= 0x80 if size >= 0 else 0xFF
    h[148:156] = b" " * 8
    h[148:156] = b"%06o\0 " % sum(h)
    return bytes(h)


def test_a_negative_size_is_refused_not_read_round_forever(tmp_path: Path) -> None:
    """A member whose size is -512 set tarfile's next offset back onto its own header: a
    seekable read ("r:", image archives and tarballs) went round it forever (a 2 KB tar:
    117,000 members in 3 s, memory growing 16 MiB/s); a PAX ``size`` record the same."""
    a, b = tarfile.TarInfo("a"), tarfile.TarInfo("b")
    a.size = b.size = 0
    good = a.tobuf(tarfile.USTAR_FORMAT) + b.tobuf(tarfile.USTAR_FORMAT)
    bad = good[:512] + _with_size(good[512:], -512) + b"\0" * 1024
    pax = _pax_tar(_record(b"size", b"-1536"))
    for data in (bad, pax):
        path = tmp_path / "t.tar"
        path.write_bytes(data)
        for mode in ("r:", "r:*", "r|"):
            t0 = time.monotonic()
            with pytest.raises((InvalidRequest, tarfile.TarError)):
                with tarfile.open(path, mode, tarinfo=safetar.SafeTarInfo) as tf:
                    for _ in tf:
                        pass
            assert time.monotonic() - t0 < 0.5


def test_global_headers_and_records_are_bounded() -> None:
    """tarfile applies the global headers' records to every member after, and each member it
    keeps holds a copy: 100,000 keys cost 15 ms a member (a 228 KB upload of members: hours)."""
    many = b"".join(_record(b"k%d" % i, b"v") for i in range(safetar.GLOBAL_KEYS_MAX + 1))
    hdr = tarfile.TarInfo("././@PaxHeader")
    hdr.type, hdr.size = tarfile.XGLTYPE, len(many)
    ti = tarfile.TarInfo("x")
    data = hdr.tobuf(tarfile.USTAR_FORMAT) + many + b"\0" * (-len(many) % 512) + \
        ti.tobuf(tarfile.USTAR_FORMAT) + b"\0" * 1024
    assert _refused(data).details["reason"] == "header_framing"
    records = b"".join(_record(b"k%d" % i, b"v") for i in range(safetar.RECORDS_MAX + 1))
    assert _refused(_pax_tar(records)).details["reason"] == "header_framing"
    fine = b"".join(_record(b"SCHILY.xattr.user.k%d" % i, b"v") for i in range(100))
    assert len(_read(_pax_tar(fine))[0][7]) == 100
