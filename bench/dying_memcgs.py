"""Do destroyed sandboxes leave dying memory cgroups in the kernel? (docs/benchmarks.md,
"This host's kernel"; cgroup v1.)

    sudo .venv/bin/python bench/dying_memcgs.py [-n 40] [--pythonpath DIR]

Writes N files of 1 MiB under /usr (seen by the `host` image) and drops them from the page
cache; then, on a private daemon, N sandboxes each read one file (and are charged for its
page cache) and are destroyed. Prints the daemon's memory cgroup recycling counters and how
many memory cgroups the kernel holds beyond the live directories (dying ones), after the
sandboxes are gone and after the daemon stops. ``--pythonpath`` runs the daemon from another
corral tree (the code before a change, for an A/B).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from corral import Sandbox
from corral.bench.daemon import PrivateDaemon

MEMCG_ROOT = "/sys/fs/cgroup/memory"


def dying() -> int:
    with open("/proc/cgroups") as f:
        total = next(int(line.split()[2]) for line in f if line.split()[:1] == ["memory"])
    return total - sum(1 for _ in os.walk(MEMCG_ROOT))


def uncached_files(d: str, n: int) -> None:
    os.makedirs(d, exist_ok=True)
    for i in range(n):
        with open(f"{d}/f{i}", "wb") as f:
            f.write(os.urandom(1 << 20))
            f.flush()
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("-n", type=int, default=40, help="sandboxes (one new file each)")
    p.add_argument("--pythonpath", help="run the daemon from this corral tree (python/)")
    a = p.parse_args()
    if not os.path.exists(f"{MEMCG_ROOT}/cgroup.procs"):
        print("no cgroup v1 memory hierarchy: nothing to measure", file=sys.stderr)
        return 2
    files = f"/usr/local/share/corral-dying-memcgs-{os.getpid()}"
    root = Path(tempfile.mkdtemp(prefix="corral-bench-dying-", dir="/var/tmp"))
    env = {"PYTHONPATH": a.pythonpath} if a.pythonpath else None
    d = PrivateDaemon(root / "d", f"corral-bench-dying-{os.getpid()}", 100, env=env)
    try:
        uncached_files(files, a.n)
        d.start()
        Sandbox.create("host", endpoint=d.endpoint).kill()  # image prepared, pools warm
        time.sleep(1)
        before = dying()
        for i in range(a.n):
            sb = Sandbox.create("host", endpoint=d.endpoint)
            sb.exec(["sh", "-c", f"cat {files}/f{i} > /dev/null"])
            sb.kill()
        time.sleep(2)
        counters = {k.removeprefix("corral_memcg_spares_").removesuffix("_total"): int(v)
                    for k, v in d.metrics().items() if k.startswith("corral_memcg_spares_")}
        print(f"sandboxes: {a.n}, memory cgroup spares: {counters}")
        print(f"dying memory cgroups, sandboxes gone: {dying() - before:+d}")
        d.stop()
        time.sleep(3)
        print(f"dying memory cgroups, daemon stopped: {dying() - before:+d}")
    finally:
        d.stop()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(files, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
