"""Which of the daemon's mounts a sandbox's namespace drops before its root switch
(layout.detachable_mounts): never one on the way to the sandboxes' dir or below it, only the
top of each other subtree (one recursive detach each), paths with escapes decoded."""

from __future__ import annotations

from pathlib import Path

from corral.daemon.substrates.container.layout import detachable_mounts

MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
23 27 0:22 / /sys rw,relatime - sysfs sysfs rw
24 27 0:6 / /dev rw,relatime - devtmpfs devtmpfs rw
27 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw
28 24 0:23 / /dev/pts rw - devpts devpts rw
29 23 0:24 / /sys/fs/cgroup rw - tmpfs tmpfs rw
30 29 0:25 / /sys/fs/cgroup/pids rw - cgroup cgroup rw,pids
31 27 0:26 / /var rw - tmpfs tmpfs rw
32 31 0:27 / /var/lib/corral/sandboxes rw - btrfs /dev/loop0 rw
33 32 0:28 / /var/lib/corral/sandboxes/gv/rootfs rw - overlay overlay rw
34 31 0:29 / /var/lib/corral/lxcfs/view/meminfo rw - fuse.lxcfs lxcfs rw
35 31 0:30 / /var/lib/corral/my\\040dir rw - tmpfs tmpfs rw
36 27 0:31 / /run rw - tmpfs tmpfs rw
37 36 0:32 / /run/netns rw - tmpfs tmpfs rw
38 27 0:33 / /var2 rw - tmpfs tmpfs rw
"""


def test_detaches_the_top_of_every_subtree_off_the_way(tmp_path: Path) -> None:
    mi = tmp_path / "mountinfo"
    mi.write_text(MOUNTINFO)
    got = detachable_mounts("/var/lib/corral/sandboxes", str(mi))
    assert got == ["/proc", "/sys", "/dev", "/var/lib/corral/lxcfs/view/meminfo",
                   "/var/lib/corral/my dir", "/run", "/var2"]
    # "/" and "/var" lead to the sandboxes' dir, the scratch is it, a mount below it (another
    # substrate's) stays; "/var2" merely shares a prefix and goes.
    for kept in ("/", "/var", "/var/lib/corral/sandboxes", "/var/lib/corral/sandboxes/gv/rootfs"):
        assert kept not in got


def test_a_trailing_slash_or_the_root_itself(tmp_path: Path) -> None:
    mi = tmp_path / "mountinfo"
    mi.write_text("27 1 8:1 / / rw - ext4 /dev/sda1 rw\n22 27 0:21 / /proc rw - proc proc rw\n")
    assert detachable_mounts("/srv/sandboxes/", str(mi)) == ["/proc"]
