"""How long a snapshot takes to move between two nodes: two private corrald (own state dir,
socket, cgroup) on this machine; a sandbox on the first writes ``--mb`` MB of random data,
is snapshotted, and the snapshot is exported from the first and imported into the second,
the export's body streamed straight into the import (as the cluster gateway does). Timed:
the export alone (read to the end) and export + import together, median of ``--runs``.

    sudo .venv/bin/python bench/snapshot_move.py --mb 10 100 --runs 3
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx

from corral import Sandbox


@contextlib.contextmanager
def daemon(tag: str) -> Iterator[str]:
    state = tempfile.mkdtemp(prefix=f"corral-bench-move-{tag}-", dir="/var/tmp")
    sock = os.path.join(state, "run", "corrald.sock")
    env = dict(os.environ, CORRAL_STATE_DIR=state, CORRAL_SOCKET=sock,
               CORRAL_CGROUP=f"corral-bench-move-{os.getpid()}-{tag}")
    log = open(os.path.join(state, "corrald.log"), "ab")  # noqa: SIM115 - the child's
    proc = subprocess.Popen([sys.executable, "-m", "corral.daemon"], stdout=log,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError, OSError), _client(sock) as c:
                if c.get("/v1/health").status_code == 200:
                    break
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("corrald did not start")
            time.sleep(0.05)
        yield sock
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        log.close()
        shutil.rmtree(state, ignore_errors=True)


def _client(sock: str) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://corral",
                        timeout=600)


def move(a: str, b: str, snap: str) -> tuple[float, float, int]:
    """(export seconds, export+import seconds, bytes)."""
    with _client(a) as ca, _client(b) as cb:
        t0 = time.perf_counter()
        n = 0
        with ca.stream("GET", f"/v1/snapshots/{snap}/export") as r:
            for chunk in r.iter_raw(1 << 20):
                n += len(chunk)
        t1 = time.perf_counter()
        with ca.stream("GET", f"/v1/snapshots/{snap}/export") as r:
            got = cb.post("/v1/snapshots", content=r.iter_raw(1 << 20))
        t2 = time.perf_counter()
        assert got.status_code == 201, got.text
        assert cb.delete(f"/v1/snapshots/{snap}").status_code == 200
    return t1 - t0, t2 - t1, n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, nargs="+", default=[10, 100])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    with daemon("a") as a, daemon("b") as b:
        for mb in args.mb:
            with Sandbox(endpoint=f"unix://{a}", timeout=600, disk_mb=max(256, 2 * mb)) as sb:
                sb.exec("mkdir -p /work && dd if=/dev/urandom of=/work/data bs=1M "
                        f"count={mb}").check()
                snap = sb.snapshot()
            try:
                runs = [move(a, b, snap.id) for _ in range(args.runs)]
            finally:
                snap.delete()
            ex = statistics.median(r[0] for r in runs)
            both = statistics.median(r[1] for r in runs)
            print(f"{mb:4d} MB changed: stream {runs[0][2] / 1e6:.1f} MB, export alone "
                  f"{ex * 1000:.0f} ms ({runs[0][2] / 1e6 / ex:.0f} MB/s), export+import "
                  f"{both * 1000:.0f} ms ({runs[0][2] / 1e6 / both:.0f} MB/s), "
                  f"median of {args.runs}")


if __name__ == "__main__":
    main()
