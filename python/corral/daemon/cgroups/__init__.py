"""Per-sandbox resource limits over cgroup v1 and v2: ``CgroupManager`` is the interface
(``common``), ``CgroupsV1`` (``v1``) and ``CgroupsV2`` (``v2``) the two versions, and
``MemcgRecycler`` (``recycler``) the v1 memory cgroups kept for reuse.
``for_host(name)`` (or ``CgroupManager(name)``) gives the class this host supports."""

from .common import (
    CFS_PERIOD_US,
    DAEMON_CGROUP,
    CgroupManager,
    check_id,
    for_host,
    oom_count_at,
    parse_cpulist,
)
from .recycler import COOL_S, DRAIN_AT_STOP_S, MEMCG_SPARES, MemcgRecycler
from .v1 import CGROUP_SPARES, CgroupsV1
from .v2 import CgroupsV2

__all__ = ["CFS_PERIOD_US", "CGROUP_SPARES", "COOL_S", "DAEMON_CGROUP", "DRAIN_AT_STOP_S",
           "MEMCG_SPARES", "CgroupManager", "CgroupsV1", "CgroupsV2", "MemcgRecycler",
           "check_id", "for_host", "oom_count_at", "parse_cpulist"]
