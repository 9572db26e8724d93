"""The container substrate: Linux namespaces + overlayfs + cgroups, driven by ``corral._core``.

One job per module: ``substrate`` (the class: create, reset, destroy, recover, freeze and
snapshots), ``netns`` (the pool of ready network namespaces, the shared one), ``layout`` (the
/sys and /proc mask skeletons), ``rootcache`` (O_PATH fds of sandbox roots), ``initpath`` and
``daemonpath`` (the two exec paths), ``threads`` (the daemon path's thread per command),
``files`` and ``tar``.
"""

from corral import _core
from corral.daemon.kernel import proc_starttime
from corral.daemon.procpolicy import make_mask_dir

from .layout import make_sys_dir
from .netns import NetnsPool, SharedNetns
from .substrate import ContainerSubstrate

__all__ = ["ContainerSubstrate", "NetnsPool", "SharedNetns", "_core", "make_mask_dir",
           "make_sys_dir", "proc_starttime"]
