"""The gvisor substrate: sandboxes under gVisor's runsc (docs/substrates.md, "gvisor")."""

from __future__ import annotations

import os

from corral.daemon import kernel
from corral.daemon.substrates.base import Substrate
from corral.daemon.substrates.gvisor.probe import detect, find_runsc
from corral.daemon.substrates.gvisor.runsc import Runsc
from corral.daemon.substrates.registry import Context, Unavailable


def make(ctx: Context) -> Substrate:
    """The substrate, if runsc is installed and one of its platforms runs a sandbox here
    (probe.detect); else Unavailable with why."""
    from corral.daemon.substrates.gvisor.substrate import GvisorSubstrate

    binary = find_runsc()
    if binary is None:
        raise Unavailable("runsc is not installed (Debian package runsc)")
    work = os.path.join(ctx.config.state_dir, "gvisor")
    platform, why = detect(binary, work)
    if platform is None:
        raise Unavailable(f"no gVisor platform runs here: {why}")
    runsc = Runsc(binary, os.path.join(work, "runsc"), platform,
                  kernel.private_null(os.path.join(work, "null")))
    return GvisorSubstrate(ctx.config.state_dir, ctx.config.cgroup_name, runsc,
                           ctx.config.upload_max_bytes)
