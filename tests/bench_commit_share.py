"""Not collected by the suite: commit time and disk bytes of a sandbox that wrote 10 / 100 MB,
committed directly and from a snapshot of it (docs/images.md, Measured). Run by hand:
``pytest -q -s tests/bench_commit_share.py`` (lines starting with BENCH)."""
from __future__ import annotations

import os
import statistics
import subprocess
import time

from test_images_share import env  # noqa: F401

import corral
from corral.sdk import admin


def _du(path: str) -> int:
    if not os.path.exists(path):
        return 0
    return int(subprocess.run(["du", "-s", "-B1", path], capture_output=True, text=True,
                              check=True).stdout.split()[0])


def _disk(state: str) -> int:
    return _du(os.path.join(state, "oci")) + _du(os.path.join(state, "layers"))


def test_bench(env: dict) -> None:  # noqa: F811
    ep, state = env["ep"], env["state"]
    out = []
    write = "dd if=/dev/urandom of=/opt/big bs=1M count={} 2>/dev/null"
    for mb in (10, 100):
        direct, chained, d_disk, c_disk = [], [], [], []
        for i in range(3):
            with corral.Sandbox(image=env["base"], endpoint=ep, disk_mb=1024) as sb:
                sb.exec(write.format(mb), user="root").check()
                before = _disk(state)
                t = time.monotonic()
                sb.commit(f"b-d-{mb}-{i}")
                direct.append((time.monotonic() - t) * 1000)
                d_disk.append(_disk(state) - before)
            with corral.Sandbox(image=env["base"], endpoint=ep, disk_mb=1024) as sb:
                sb.exec(write.format(mb), user="root").check()
                snap = sb.snapshot()
            with corral.Sandbox(snapshot=snap, endpoint=ep) as kid:
                kid.exec("echo x > /opt/x").check()
                before = _disk(state)
                t = time.monotonic()
                kid.commit(f"b-c-{mb}-{i}")
                chained.append((time.monotonic() - t) * 1000)
                c_disk.append(_disk(state) - before)
            snap.delete()
        for n in [f"b-d-{mb}-{i}" for i in range(3)] + [f"b-c-{mb}-{i}" for i in range(3)]:
            admin.remove_image(n, endpoint=ep)
        out.append(f"{mb} MB: commit of the sandbox {statistics.median(direct):.0f} ms "
                   f"({', '.join(f'{x:.0f}' for x in direct)}), disk +{statistics.median(d_disk)}"
                   f"; commit on its snapshot {statistics.median(chained):.0f} ms "
                   f"({', '.join(f'{x:.0f}' for x in chained)}), disk "
                   f"+{statistics.median(c_disk)}")
    print("\nBENCH " + "\nBENCH ".join(out))
