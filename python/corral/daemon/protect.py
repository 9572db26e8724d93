"""Keep the daemon alive whatever its sandboxes do with memory.

- Its own cgroup, ``<name>/.daemon``, with memory reserved where the kernel can reserve it
  (cgroup v2 memory.min/memory.low; see CgroupManager.enter_daemon_cgroup).
- ``oom_score_adj`` -900: the OOM killer picks sandbox processes (+500, set by the Rust core
  as each init and command starts, before any sandbox code runs) long before the daemon.
  Lowering a score needs CAP_SYS_RESOURCE; a write by a holder also becomes the process's
  floor (``oom_score_adj_min``), inherited by its children, which sandbox code (never holding
  that capability) cannot go below. A daemon run without the capability (some containers)
  keeps the score it was given, and sandboxes can lower theirs back to that floor, never below.
"""

from __future__ import annotations

import logging
import os

from corral.daemon.cgroups import CgroupManager

log = logging.getLogger("corral.daemon")

DAEMON_OOM_SCORE_ADJ = -900
SANDBOX_OOM_SCORE_ADJ = 500  # what rust/src/harden.rs writes for every sandbox process


def set_oom_score_adj(value: int, pid: int | str = "self") -> None:
    with open(f"/proc/{pid}/oom_score_adj", "w") as f:
        f.write(str(value))


def _current_adj() -> int | None:
    try:
        with open("/proc/self/oom_score_adj") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def protect_daemon(cgroups: CgroupManager, reserve_mb: int) -> dict[str, object]:
    """Apply both protections to this process; what was done, for the start-up log line.
    A failure is logged, not fatal: a daemon that runs unprotected beats none."""
    done: dict[str, object] = {}
    try:
        set_oom_score_adj(DAEMON_OOM_SCORE_ADJ)
        done["oom_score_adj"] = DAEMON_OOM_SCORE_ADJ
    except OSError as e:
        done["oom_score_adj"] = _current_adj()
        log.warning("cannot lower the daemon's oom_score_adj (no CAP_SYS_RESOURCE?); it stays "
                    "at its floor, which sandboxes cannot go below",
                    extra={"error": str(e), "oom_score_adj": done["oom_score_adj"]})
    try:
        done["cgroup"] = cgroups.enter_daemon_cgroup(os.getpid(), reserve_mb * 1024 * 1024)
        done["memory_reserved_mb"] = reserve_mb if cgroups.version == 2 else 0
    except OSError as e:
        log.warning("cannot move the daemon into its own cgroup", extra={"error": str(e)})
    return done
