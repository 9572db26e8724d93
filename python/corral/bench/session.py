"""One benchmark session: options, the private daemon, the raw baseline, the peers, and the
cleanup check that ends every session (nothing may be left behind: processes, cgroups, mounts,
directories)."""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corral.bench import host, ocifix, raw
from corral.bench.daemon import PrivateDaemon
from corral.bench.peers import Peers, ensure_installed
from corral.bench.ui import UI

SCENARIOS = ("churn", "latency", "exec", "density", "snapshot", "trajlog", "execpath",
             "keyedreads", "run-code", "gvisor", "network")
# snapshot: snapshot/restore cycles per run (and N/3, at least 3, forks); trajlog, execpath:
# execs per daemon and mode; keyedreads: calls per op and variant; gvisor: sandboxes made per
# substrate (and `runsc do` runs); network: the most live networked sandboxes of its scale
# curve (its other counts are capped: corral.bench.network).
DEFAULT_COUNTS = {"churn": 1000, "latency": 300, "exec": 1000, "density": 1000, "snapshot": 30,
                  "trajlog": 1000, "execpath": 1000, "keyedreads": 1000, "run-code": 500,
                  "gvisor": 30, "images": 100, "network": 3000}


@dataclass
class Options:
    scenarios: list[str] = field(default_factory=lambda: list(SCENARIOS))
    peers: bool = False
    runs: int = 3
    count: int | None = None          # every scenario's N (None: DEFAULT_COUNTS)
    concurrency: int = 4              # in flight (churn, async exec) for every system
    peer_count: int | None = None     # peers' N (None: min(churn N, 300))
    batch: int = 100                  # density: create_many batch size
    # churn and density: corral's network modes, each measured against the raw baseline doing
    # the same kernel work: "none" (own netns) vs raw-netns, "disabled" (shared) vs raw
    networks: list[str] = field(default_factory=lambda: ["none"])
    churn_batch: int = 32             # churn's corral-batch row: sandboxes per batch (0: off)
    batches_in_flight: int = 2        # churn's corral-batch row: batches in flight
    plots_dir: str | None = "bench/out"
    profile: bool = False             # py-spy the daemon during corral's churn
    workdir: str = "/var/tmp"         # parent of the private state (its fs type matters)
    snapshot_mb: int = 10             # snapshot: MB changed before each snapshot
    fork: int = 64                    # snapshot: children per fork
    scale_to: int | None = None       # network: the scale curve's most live (None: its N)
    scale_budget_s: float | None = None  # network: seconds of filling, in all (None: no limit)
    image_mb: int = 100               # images: size of the image pulled against skopeo + tar
    trajlog_baseline: str | None = None  # trajlog: PYTHONPATH of another corral tree
    fleet_nodes: int = 200            # fleet: simulated nodes behind the real gateway
    fleet_live: int = 400_000         # fleet: sandboxes the fleet holds at the end
    fleet_node_ms: float | None = None   # fleet: a node's create latency (None: measured)
    fleet_node_rate: float | None = None  # fleet: a node's creates/s (None: measured)
    progress: bool = True

    def n(self, scenario: str) -> int:
        return self.count or DEFAULT_COUNTS[scenario]

    def n_peers(self) -> int:
        return self.peer_count or min(self.n("churn"), 300)


class Session:
    def __init__(self, opts: Options, ui: UI) -> None:
        self.opts = opts
        self.ui = ui
        # Every cgroup of the run (daemon, raw, peers) is named <prefix>...: found by name.
        self.prefix = f"corral-bench-run{os.getpid()}-"
        self.root = Path(tempfile.mkdtemp(prefix="corral-bench-", dir=opts.workdir))
        live = opts.n("density") if "density" in opts.scenarios else 1000
        # The images scenario's registry, on loopback: a daemon reaches a registry there
        # only if named (docs/images.md), so its port is chosen before the daemons start.
        self.registry_port = ocifix.free_port()
        self.registry_env = {"CORRAL_REGISTRIES": f"127.0.0.1:{self.registry_port}"}
        self.daemon = PrivateDaemon(self.root / "daemon", self.prefix + "d",
                                    max_sandboxes=max(20000, live + 1000),
                                    own_memcg=self.prefix + "dproc", env=self.registry_env)
        self.raw: raw.RawBaseline | None = None
        self.raw_scratch: Any = None  # raw's btrfs scratch, when the daemon's is one
        self.peers: Peers | None = None
        self.peer_versions: dict[str, str | None] = {}
        self.peer_errors: dict[str, str] = {}
        self.notes: list[str] = []
        self.mounts_before = host.mount_count()

    # ---- setup ---------------------------------------------------------------------------
    def setup(self) -> None:
        if os.geteuid() != 0:
            raise PermissionError("corral bench needs root (it makes namespaces and cgroups)")
        if "density" in self.opts.scenarios:
            for n in host.raise_limits(self.opts.n("density")):
                self.notes.append(f"raised {n}")
        bins = raw.build(Path("/var/tmp/corral-bench-build"))
        self.daemon.start()
        self._warm_up()
        self.raw = raw.RawBaseline(bins, self.root / "raw", self.prefix + "raw",
                                   self.daemon.host_overlays(), self._mirror())
        if self.opts.peers:
            self.peer_versions = ensure_installed(self.ui.note)
            self.peers = Peers(self.root / "peers", self.daemon.host_rootfs(),
                               self.prefix + "peers")
            for name, version in self.peer_versions.items():
                err = "not installed" if version is None else self.peers.probe(name)
                if err:
                    self.peer_errors[name] = err
                    self.ui.note(f"peer {name} unavailable: {err}")

    def _mirror(self) -> raw.Mirror:
        """What this daemon does per sandbox, for raw to do too: its scratch (a btrfs
        subvolume with a quota per sandbox, else a tmpfs), its cgroups (v1: which, and which
        made at the first exec), recycled cgroups, /sys with the sandbox's own cgroups and
        lxcfs's /proc files, the /proc policy."""
        from corral.daemon import cgroups, procpolicy, scratch
        from corral.daemon.substrates.container.layout import detachable_mounts
        from corral.models import DEFAULT_DISK_MB

        kind = scratch.mount_of(str(self.daemon.state_dir / "sandboxes"))
        where = kind[0] if kind is not None else "the workdir"
        subvol_mb, tmpfs = 0, kind is not None and kind[0] == "tmpfs"
        if kind is not None and kind[0] == "btrfs":
            rdir = self.root / "raw"
            (self.root / "raw-scratch").mkdir(exist_ok=True)
            rdir.mkdir(exist_ok=True)
            self.raw_scratch = scratch.Scratch(str(self.root / "raw-scratch"), str(rdir))
            if self.raw_scratch.quota:
                subvol_mb = DEFAULT_DISK_MB
            else:
                tmpfs = True
        v1 = os.path.isdir("/sys/fs/cgroup/memory")
        spares = cgroups.MEMCG_SPARES if v1 else 0
        set_spares = cgroups.CGROUP_SPARES if v1 else 0
        lazy_on = v1 and os.environ.get("CORRAL_LAZY_MEMCG", "1") != "0"
        ctls = tuple(c for c in ("memory", "pids", "cpu", "cpuacct", "cpuset", "freezer")
                     if os.path.isdir(f"/sys/fs/cgroup/{c}")) if v1 else ()
        lazy = tuple(c for c in ("memory", "cpu", "cpuacct", "cpuset") if c in ctls) \
            if lazy_on else ()
        view = self.daemon.state_dir / "lxcfs" / "view"
        binds = tuple((str(view / n), n) for n in ("meminfo", "cpuinfo", "stat", "uptime",
                                                   "loadavg", "swaps")
                      if os.path.ismount(view / n))
        quota = ", a subvolume with a quota each" if subvol_mb else ""
        policy = procpolicy.compute()  # the daemon's: computed from the same /proc
        masks = len(policy.readonly) + len(policy.mask_files) + len(policy.mask_dirs)
        self.notes.append(
            f"scratch dirs on {where} (raw alike{quota}); "
            f"memory cgroups recycled: {spares or 'no'}, pids/cpu/freezer cgroups recycled: "
            f"{set_spares or 'no'}; cgroups {','.join(ctls) or 'v2'}"
            f"{' (' + ','.join(lazy) + ' at the first exec)' if lazy else ''}; /sys with own "
            f"cgroups; lxcfs files: {len(binds)}; /proc policy: {masks} entries "
            "(corral and raw alike)")
        return raw.Mirror(tmpfs=tmpfs, memcg_spares=spares, cgroup_spares=set_spares,
                          controllers=ctls, lazy=lazy, subvol_mb=subvol_mb, sys=True,
                          proc_binds=binds, proc_readonly=policy.readonly,
                          proc_mask_files=policy.mask_files, proc_mask_dirs=policy.mask_dirs,
                          detach=tuple(detachable_mounts(str(self.root / "raw"))))

    def _warm_up(self) -> None:
        """One sandbox through the SDK: builds the host image and opens the daemon's paths."""
        from corral.sdk import Sandbox

        with Sandbox("host", endpoint=self.daemon.endpoint) as sb:
            sb.exec(["true"])
        if not self.daemon.host_rootfs().is_dir():
            raise RuntimeError(f"no host image skeleton at {self.daemon.host_rootfs()}")

    def peer_names(self) -> list[str]:
        if not self.peers:
            return []
        return [p for p, v in self.peer_versions.items() if v and p not in self.peer_errors]

    # ---- teardown ------------------------------------------------------------------------
    def teardown(self) -> dict[str, Any]:
        """Stop everything and report what (if anything) was left behind, then sweep it."""
        leaks: dict[str, Any] = {}
        try:
            return self._check(leaks)
        finally:  # whatever the check hit: no process, cgroup or directory stays
            self._close_raw_scratch()
            self.daemon.stop()
            if self.peers is not None:
                self.peers.cleanup()
            # Returns once nothing is left: the deadline is for a host tearing down tens of
            # thousands of sandboxes' cgroups after a daemon that had to be killed.
            host.sweep_cgroups(self.prefix, timeout=300.0)
            host.unmount_under(str(self.root))
            shutil.rmtree(self.root, ignore_errors=True)

    def _close_raw_scratch(self) -> None:
        if self.raw_scratch is None:
            return
        with contextlib.suppress(OSError):  # raw's own service dirs
            os.rmdir(self.root / "raw" / "mask")
        shutil.rmtree(self.root / "raw" / "dev", ignore_errors=True)
        self.raw_scratch.close()
        self.raw_scratch = None

    def _check(self, leaks: dict[str, Any]) -> dict[str, Any]:
        self._close_raw_scratch()
        try:
            self.daemon.stop(timeout=900.0)  # a graceful stop destroys every sandbox first
        except Exception as e:  # noqa: BLE001 - the cleanup check must still run
            leaks["daemon_stop"] = str(e)
        if self.peers is not None:
            left = self.peers.cleanup()
            if left:
                leaks["peer_cgroups"] = left
        leaks["sandbox_cgroups"] = host.cgroup_children(self.prefix)
        leaks["processes"] = sorted(host.cgroup_pids(self.prefix))
        leaks["mounts"] = host.host_mounts_under(str(self.root))
        # Host-wide, so other users of the machine move it too: reported, not judged.
        mount_delta = host.mount_count() - self.mounts_before
        sdir = self.daemon.state_dir / "sandboxes"
        leaks["sandbox_dirs"] = sorted(os.listdir(sdir)) if sdir.is_dir() else []
        # Snapshots: every record and layer the run made is deleted (layers once unused).
        state = self.daemon.state_dir
        leaks["snapshot_records"] = _snapshot_records(state / "snapshots.db")
        leaks["spare_layer_dirs"] = (sorted(os.listdir(state / "spares"))
                                     if (state / "spares").is_dir() else [])
        leaks["layers"] = sorted(os.listdir(state / "layers")) if (state / "layers").is_dir() \
            else []
        rdir = self.root / "raw"
        leaks["raw_dirs"] = sorted(os.listdir(rdir)) if rdir.is_dir() else []
        left = host.sweep_cgroups(self.prefix)  # also removes our empty top-level dirs
        if left:
            leaks["unremovable_cgroups"] = left
        clean = not any(v for k, v in leaks.items())
        return {"clean": clean, "leaks": {k: v for k, v in leaks.items() if v},
                "host_mount_count_delta": mount_delta}


def _snapshot_records(db: Path) -> list[str]:
    """Snapshot ids still recorded in a stopped daemon's records file."""
    if not db.exists():
        return []
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return [r[0] for r in conn.execute("SELECT id FROM snapshots")]
    except sqlite3.OperationalError:  # no table: nothing was ever recorded
        return []
    finally:
        conn.close()
