"""``corral bench``: corral end to end against a raw-syscall baseline and peers; the
snapshot scenario measures the snapshot / restore / fork targets.

Layout (one job per module):
  session.py    options, the private daemon + raw baseline + peers of one run, the leak check
  daemon.py     a private corrald (own state dir, socket, cgroup name)
  raw.py        builds and drives raw_src/ (the same kernel work as corral, no API)
  peers.py      bwrap, crun, runc (installed from Debian if missing), OCI bundle generation
  sdk_runs.py   corral measured through the SDK: churn, latency, exec, density fill/destroy,
                snapshot / restore / fork cycles
  scenarios.py  churn, latency, exec, density, snapshot: runs, medians, ratios within a run
  network.py    the network scenario: a sandbox's data path vs a plain netns, create/churn
                per network mode, the data path with N live networked sandboxes
  netlab.py     its uplink namespace (netsrv.py: DNS, TCP sink and echo) and plain netns
  host.py       /proc/meminfo, kernel limits, cgroup/mount/process leak checks
  profile.py    py-spy sampling of the daemon (--profile)
  report.py     rich tables with the targets; plots.py: PNGs; runner.py: the session
``python -m corral.bench`` is the same command as ``corral bench``.
"""

from __future__ import annotations


def main() -> None:
    """``python -m corral.bench [SCENARIO] [options]``: same as ``corral bench``."""
    import typer

    from corral.cli.bench import bench

    typer.run(bench)
