"""The raw-syscall baseline (raw_src/raw.c): built with ``cc`` at run time, driven here.

It does the kernel work of one corral container sandbox with no API around it (see the header
of raw.c), on the same lower layers as corral's ``host`` image, so corral/raw is the price of
corral's own layers: HTTP, the engine, Python.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corral.bench import host
from corral.bench.results import OpResult, with_total

# Sources ship with the package (corral/bench/raw_src), so an installed corral can build them.
SRC_DIR = Path(__file__).resolve().parent / "raw_src"
INIT_FLAGS = ["-static", "-nostdlib", "-ffreestanding", "-fno-stack-protector", "-fno-pie",
              "-no-pie", "-Os", "-s", "-fno-asynchronous-unwind-tables", "-Wl,--build-id=none"]


@dataclass(frozen=True)
class RawBinaries:
    raw: Path
    init: Path


def build(cache_dir: Path) -> RawBinaries:
    """Compile raw.c and init.c into ``cache_dir`` (reused while the sources are unchanged)."""
    if not (SRC_DIR / "raw.c").is_file():
        raise FileNotFoundError(f"raw baseline sources not found in {SRC_DIR}")
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise FileNotFoundError("no C compiler (cc) for the raw baseline: apt-get install gcc")
    h = hashlib.sha256()
    for name in ("raw.c", "init.c"):
        h.update((SRC_DIR / name).read_bytes())
    out = cache_dir / f"raw-{h.hexdigest()[:12]}"
    bins = RawBinaries(out / "raw", out / "raw-init")
    if bins.raw.exists() and bins.init.exists():
        return bins
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run([cc, "-O2", "-Wall", "-o", str(bins.raw), str(SRC_DIR / "raw.c")],
                   check=True, capture_output=True)
    subprocess.run([cc, *INIT_FLAGS, "-o", str(bins.init), str(SRC_DIR / "init.c")],
                   check=True, capture_output=True)
    return bins


def _ms(us: list[float]) -> list[float]:
    """Microseconds -> milliseconds; a failed op stays -1 (dropped by the statistics)."""
    return [x / 1000 if x >= 0 else -1.0 for x in us]


@dataclass(frozen=True)
class Mirror:
    """The per-sandbox kernel work of the daemon of the same run that raw repeats (each
    default: not done), so that corral/raw prices corral's own layers only."""

    tmpfs: bool = False                # sandbox dirs on a tmpfs of their own
    memcg_spares: int = 0              # v1 memory cgroups recycled
    cgroup_spares: int = 0             # v1 pids/cpu/freezer cgroups recycled
    controllers: tuple[str, ...] = ()  # the v1 cgroups a sandbox gets (() = raw's default)
    lazy: tuple[str, ...] = ()         # of those, made at the first exec (init moved by pid)
    subvol_mb: int = 0                 # a btrfs subvolume with this quota as the sandbox's disk
    sys: bool = False                  # /sys skeleton with the sandbox's own cgroups mounted
    proc_binds: tuple[tuple[str, str], ...] = ()  # (host file, /proc name): lxcfs's files
    proc_readonly: tuple[str, ...] = ()    # the /proc policy (procpolicy.py): bound read-only,
    proc_mask_files: tuple[str, ...] = ()  # covered by /dev/null,
    proc_mask_dirs: tuple[str, ...] = ()   # covered by the empty mask dir
    detach: tuple[str, ...] = ()           # mounts detached in each sandbox's namespace


@dataclass(frozen=True)
class Veth:
    """raw.c --veth: what a networked corral sandbox adds to raw +netns: a veth pair named
    ``<ifprefix><slot>`` routed as corral's, its addresses in ``net``/16 (the gateway first),
    and its elements in the nftables table ``table`` (inet, written by the caller with
    corral's ruleset); ``internet``: also in the ``internet`` set (else a policy of names,
    which adds nothing at create); ``net6``: dual-stack, as a daemon with an IPv6 range
    (its addresses in ``net6``/112, its link-local gateway on the host end)."""

    ifprefix: str
    table: str
    net: str           # "10.Y.0.0"
    internet: bool
    net6: str | None = None  # "fd5b:X:Y::"


class RawBaseline:
    def __init__(self, bins: RawBinaries, state_dir: Path, cgroup_name: str,
                 overlays: list[tuple[str, list[str]]], mirror: Mirror | None = None) -> None:
        self.bins = bins
        self.state_dir = state_dir
        self.cgroup_name = cgroup_name
        self.overlays = overlays
        self.mirror = mirror or Mirror()
        self.tmpfs = self.mirror.tmpfs
        self.memcg_spares = self.mirror.memcg_spares
        self.cgroup_spares = self.mirror.cgroup_spares

    def argv(self, mode: str, n: int, conc: int = 1, netns: bool = False,
             controllers: list[str] | None = None, disabled: bool = False,
             veth: Veth | None = None) -> list[str]:
        """``disabled``: corral's network "disabled" (one shared netns, Landlock scope);
        ``veth``: a networked sandbox's link and nftables elements (raw.c ``--veth``)."""
        a = [str(self.bins.raw), mode, str(n), "--conc", str(conc), "--state",
             str(self.state_dir), "--cgroup", self.cgroup_name, "--init", str(self.bins.init)]
        if netns:
            a.append("--netns")
        if veth is not None:
            a += ["--veth", veth.ifprefix, "--veth-table", veth.table, "--veth-net", veth.net]
            a += ["--veth-internet"] if veth.internet else []
            a += ["--veth-net6", veth.net6] if veth.net6 else []
        if self.tmpfs:
            a.append("--tmpfs")
        if self.memcg_spares:
            a += ["--memcg-spares", str(self.memcg_spares)]
        if disabled:
            a.append("--disabled")
        if self.cgroup_spares:
            a += ["--cgroup-spares", str(self.cgroup_spares)]
        m = self.mirror
        if controllers is None and m.controllers:
            controllers = list(m.controllers)
        if controllers is not None:
            a += ["--cg", ",".join(controllers) or "none"]
        lazy = [c for c in m.lazy if controllers is None or c in controllers]
        if lazy:
            a += ["--lazy", ",".join(lazy)]
        if m.subvol_mb:
            a += ["--subvol", str(m.subvol_mb)]
        if m.sys:
            a += ["--sys", str(self.state_dir) + "-sys"]
        for src, name in m.proc_binds:
            a += ["--proc-bind", f"{src}={name}"]
        for flag, names in (("--proc-ro", m.proc_readonly), ("--proc-mask-file", m.proc_mask_files),
                            ("--proc-mask-dir", m.proc_mask_dirs)):
            for name in names:
                a += [flag, name]
        for path in m.detach:
            a += ["--detach", path]
        for target, lowers in self.overlays:
            a += ["--ov", f"{target}={':'.join(lowers)}"]
        return a

    def _run(self, argv: list[str], timeout: float) -> dict[str, Any]:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0 or not r.stdout.strip():
            raise RuntimeError(f"raw baseline failed ({r.returncode}): {r.stderr[-2000:]}")
        return json.loads(r.stdout.splitlines()[-1])

    def churn(self, n: int, conc: int, netns: bool, system: str,
              disabled: bool = False, veth: Veth | None = None) -> OpResult:
        d = self._run(self.argv("churn", n, conc, netns, disabled=disabled, veth=veth),
                      timeout=60 + n * 0.2)
        phases = {p: _ms(d[f"{p}_us"]) for p in ("create", "exec", "destroy")}
        return OpResult(system=system, n=n, wall_s=d["wall_s"], errors=d["errors"],
                        phases=with_total(phases, ("create", "exec", "destroy")),
                        extra={"concurrency": conc, "netns": netns, "disabled": disabled,
                               "veth": veth is not None})

    def exec(self, n: int, conc: int, system: str) -> OpResult:
        d = self._run(self.argv("exec", n, conc), timeout=60 + n * 0.1)
        return OpResult(system=system, n=n, wall_s=d["wall_s"], errors=d["errors"],
                        phases={"exec": _ms(d["exec_us"])},
                        extra={"concurrency": conc})

    @contextmanager
    def idle(self, n: int, netns: bool, own_memcg: str | None = None,
             controllers: list[str] | None = None,
             disabled: bool = False) -> Iterator[dict[str, Any]]:
        """Create ``n`` idle sandboxes and keep them while the body runs; they are destroyed
        on exit (stdin closed -> raw destroys all; killed if it does not). With ``own_memcg``
        raw runs in that memory cgroup (what it allocates at clone time is counted there),
        and the sandboxes' parent cgroup is made first so it outlives raw for the reading.
        ``controllers``: the v1 cgroups each sandbox gets (None: all four)."""
        host.make_memcg(self.cgroup_name)
        procs = host.make_memcg(own_memcg) if own_memcg else None
        p = subprocess.Popen(self.argv("idle", n, 1, netns, controllers, disabled),
                             stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=(lambda: host.join_cgroup(procs)) if procs else None)
        info: dict[str, Any] = {}
        try:
            assert p.stdout is not None and p.stdin is not None
            line = p.stdout.readline()
            if not line:
                why = p.stderr.read()[-2000:] if p.stderr else ""
                raise RuntimeError(f"raw idle failed: {why}")
            info = json.loads(line)
            yield info
        finally:
            try:
                out, _ = p.communicate(timeout=300 + n * 0.05)  # closes stdin: destroy all
                if out.strip():
                    info.update(json.loads(out.strip().splitlines()[-1]))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
