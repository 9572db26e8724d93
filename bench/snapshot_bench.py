"""The snapshot / restore / fork latencies are the ``snapshot`` scenario of
``corral bench`` (docs/benchmarks.md, "Scenarios"), with the other scenarios' machinery: a
private daemon, --runs repeats with medians, progress bars, --json, plots, the cleanup check.

    corral bench snapshot [--count 30] [--snapshot-mb 10] [--fork 64] [--runs 3] [--json]

This file runs exactly that, with the arguments given.
"""

import sys

from corral.bench import main

if __name__ == "__main__":
    sys.argv = [sys.argv[0], "snapshot", *sys.argv[1:]]
    main()
