"""Attacks on the daemon through request bodies: many big uploads at once, a client that hangs
up mid-body, bodies past their caps. A body costs the daemon a bounded amount of memory
whatever its size and however many arrive together; what it spools to disk is gone when the
request ends, however it ends; a body past its cap is 413 too_large."""

from __future__ import annotations

import concurrent.futures
import os
import socket
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path

import apiclient
from conftest import SOCKET, STATE_DIR, wait_until

MiB = 1 << 20
TMP = Path(STATE_DIR, "tmp")



def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field}")


def zeros(n: int) -> Iterator[bytes]:
    chunk = bytes(MiB)
    while n > 0:
        yield chunk[:min(n, MiB)]
        n -= MiB


def tar_stream(name: str, n: int) -> Iterator[bytes]:
    """A tar of one ``n``-byte file, generated as it is sent (the test holds 1 MiB of it)."""
    info = tarfile.TarInfo(name)
    info.size = n
    yield info.tobuf(format=tarfile.PAX_FORMAT)
    yield from zeros(n)
    yield bytes(-n % 512 + 1024)


def spooled_fds(pid: int) -> list[str]:
    """The daemon's open files under its spool directory."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(TMP) + "/"):
            out.append(target)
    return out


class Sampler:
    """The daemon's peak RSS while a block runs, sampled every 10 ms (and its VmHWM)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self.stop = pid, 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, status_kib(self.pid, "VmRSS"))
            self.stop.wait(0.01)

    def __enter__(self) -> Sampler:
        self.before = status_kib(self.pid, "VmRSS")
        self.hwm_before = status_kib(self.pid, "VmHWM")
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        hwm = status_kib(self.pid, "VmHWM")
        if hwm > self.hwm_before:  # the peak was reached during the block
            self.peak = max(self.peak, hwm)


def test_concurrent_big_uploads_keep_daemon_memory_flat(daemon):
    """6 bodies of 300 MiB at once (3 file writes, 3 tar uploads): the daemon grows by well
    under one body, and the sandboxes got every byte."""
    size, n = 300 * MiB, 6
    pid = daemon.proc.pid
    with apiclient.client(timeout=600) as c:
        sids = [apiclient.create(c, disk_mb=1024)["id"] for _ in range(n)]
    try:
        def upload(i: int) -> int:
            with apiclient.client(timeout=600) as c:
                if i % 2:
                    r = c.put(f"/v1/sandboxes/{sids[i]}/files/tar", params={"path": "/work"},
                              content=tar_stream("big", size))
                else:
                    r = c.put(f"/v1/sandboxes/{sids[i]}/files",
                              params={"path": "/work/big"}, content=zeros(size))
                return r.status_code

        with Sampler(pid) as s, concurrent.futures.ThreadPoolExecutor(n) as pool:
            codes = list(pool.map(upload, range(n)))
        assert codes == [200] * n
        with apiclient.client() as c:
            for sid in sids:
                r = c.get(f"/v1/sandboxes/{sid}/files/stat", params={"path": "/work/big"})
                assert r.status_code == 200 and r.json()["size"] == size, r.text
        growth = s.peak - s.before
        print(f"corrald RSS KiB: before {s.before}, peak {s.peak} during {n} concurrent "
              f"{size >> 20} MiB uploads (growth {growth})")
        assert growth < 150 * 1024, f"daemon grew by {growth} KiB"
        assert wait_until(lambda: not spooled_fds(pid), 30.0)
        assert not list(TMP.iterdir())
    finally:
        with apiclient.client() as c:
            for sid in sids:
                apiclient.kill(c, sid)


def _raw_put(path: str, length: int) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(SOCKET)
    s.sendall(f"PUT {path} HTTP/1.1\r\nHost: corral\r\nContent-Length: {length}\r\n"
              "Content-Type: application/octet-stream\r\n\r\n".encode())
    return s


def test_client_hanging_up_mid_upload_leaves_no_temp_file(daemon):
    pid = daemon.proc.pid
    with apiclient.client() as c:
        sid = apiclient.create(c)["id"]
    try:
        for route in ("files", "files/tar"):
            s = _raw_put(f"/v1/sandboxes/{sid}/{route}?path=/work/x", 200 * MiB)
            try:
                chunk = bytes(MiB)
                for _ in range(20):
                    s.sendall(chunk)
                # The body is being spooled: an unnamed file, never a name in the directory.
                assert wait_until(lambda: spooled_fds(pid), 30.0), "no spool file seen"
                assert not list(TMP.iterdir())
            finally:
                s.close()
            assert wait_until(lambda: not spooled_fds(pid), 30.0), spooled_fds(pid)
            assert not list(TMP.iterdir())
        with apiclient.client() as c:  # the daemon and the sandbox carry on
            assert apiclient.run(c, sid, "test ! -e /work/x && echo ok")["stdout"] == "ok\n"
    finally:
        with apiclient.client() as c:
            apiclient.kill(c, sid)


def test_body_past_its_cap_is_413_too_large(daemon):
    with apiclient.client() as c:
        sid = apiclient.create(c)["id"]
        try:
            # A JSON body is read whole, so its cap is small (16 MiB).
            r = c.post(f"/v1/sandboxes/{sid}/exec",
                       json={"cmd": "wc -c", "stdin": "x" * (17 * MiB)})
            err = r.json()["error"]
            assert r.status_code == 413 and err["code"] == "too_large", r.text
            assert err["details"] == {"limit": "body_bytes", "max": 16 * MiB}
            # An exec with a big but allowed stdin still runs.
            out = apiclient.run(c, sid, "wc -c", stdin="x" * (8 * MiB))
            assert out["stdout"].strip() == str(8 * MiB)
            # A write that declares more than 1 GiB is refused before its body is read.
            for route in ("files", "files/tar"):
                s = _raw_put(f"/v1/sandboxes/{sid}/{route}?path=/work/y", (1 << 30) + 1)
                try:
                    s.settimeout(30)
                    head = s.recv(65536).decode(errors="replace")
                finally:
                    s.close()
                assert head.startswith("HTTP/1.1 413"), head
                assert '"too_large"' in head
            # A body that lies about nothing but is too big is cut off at the cap while read.
            r = c.put(f"/v1/sandboxes/{sid}/files", params={"path": "/work/z"},
                      content=zeros((1 << 30) + MiB))
            assert r.status_code == 413 and r.json()["error"]["code"] == "too_large"
            assert apiclient.run(c, sid, "test ! -e /work/z && echo ok")["stdout"] == "ok\n"
        finally:
            apiclient.kill(c, sid)
