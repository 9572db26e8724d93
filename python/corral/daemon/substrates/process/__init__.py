"""The ``process`` substrate: its function-call tier (``run_code``) and its short-lived sessions
(``Sandbox(substrate="process")``).

Layout (one job per module):
  zygote.py   the zygote program (runs in its own namespaces) and the frame protocol
  view.py     what a zygote's read-only root holds
  cgroup.py   the pools' cgroups on the daemon's side
  pool.py     zygote processes, pools with a bounded queue, the service
  api.py      the HTTP routes
  session.py  the substrate (sessions), registered in substrates/registry.py
"""

from __future__ import annotations

from corral.daemon.substrates.base import Substrate
from corral.daemon.substrates.registry import Context, Unavailable


def make(ctx: Context) -> Substrate:
    """The sessions' substrate, if this host has the cgroup controllers it needs."""
    from corral.daemon.substrates.process.session import ProcessSubstrate

    try:
        return ProcessSubstrate(ctx.config.state_dir, ctx.config.cgroup_name,
                                ctx.config.upload_max_bytes)
    except RuntimeError as e:
        raise Unavailable(str(e)) from None
