"""The trajectory log's overhead is a `corral bench` scenario (docs/trajectory.md,
"Overhead"; python/corral/bench/trajlog.py). This wrapper keeps this command line:

    sudo .venv/bin/python bench/trajlog_overhead.py [-n 500] [-r 3] [-c 4] [--baseline DIR]

runs ``corral bench trajlog --count N --runs R --concurrency C [--trajlog-baseline DIR]``.
"""

from __future__ import annotations

import argparse
import os
import sys


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-n", type=int, default=500)
    p.add_argument("-r", "--rounds", type=int, default=3, help="runs (each one ABBA)")
    p.add_argument("-c", "--concurrency", type=int, default=4)
    p.add_argument("--baseline", help="PYTHONPATH of another corral tree to compare with")
    a, rest = p.parse_known_args()
    argv = [sys.executable, "-m", "corral.bench", "trajlog", "--count", str(a.n),
            "--runs", str(a.rounds), "--concurrency", str(a.concurrency), *rest]
    if a.baseline:
        argv += ["--trajlog-baseline", a.baseline]
    os.execv(sys.executable, argv)


if __name__ == "__main__":
    main()
