"""Two or more private daemons measured side by side: blocks of execs that take turns across
the daemons in ABBA order (used by the ``trajlog`` and ``execpath`` scenarios).

This machine's speed swings by +-20 % over seconds: interleaving at the block's scale (tens
of milliseconds) makes every swing hit each daemon alike (rounds of a second each leave
per-run ratios scattered over 0.83-1.01). A daemon's figure for a run is its execs over the
wall time of its own blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from corral.bench import host, sdk_runs
from corral.bench.daemon import PrivateDaemon
from corral.bench.results import OpResult
from corral.errors import CorralError
from corral.sdk import AsyncSandbox, Sandbox

# Execs per block (times the concurrency in the concurrent mode): the daemons take turns every
# block, so the machine's drift hits each alike.
BLOCK = 20
WARMUP = 5


class Tally:
    """One daemon's share of one run in one mode: its blocks' execs, wall time, latencies,
    errors and CPU time (all its threads, plus the commands it reaped)."""

    def __init__(self) -> None:
        self.n = 0
        self.wall = 0.0
        self.cpu = 0.0
        self.cpu_ok = True
        self.lat: list[float] = []
        self.errors: list[str] = []

    def note(self, r: Any, t0: float) -> None:
        """One exec's outcome (started at ``t0``)."""
        if r.exit_code == 0:
            self.lat.append((time.perf_counter() - t0) * 1e3)
        else:
            self.errors.append(f"exit {r.exit_code}")

    @contextlib.contextmanager
    def block(self, d: PrivateDaemon, m: int) -> Iterator[None]:
        """Account one block of ``m`` execs on daemon ``d``: its wall time and CPU."""
        c0 = daemon_cpu(d)
        t0 = time.perf_counter()
        yield
        self.wall += time.perf_counter() - t0
        c1 = daemon_cpu(d)
        if c0 is None or c1 is None:
            self.cpu_ok = False
        else:
            self.cpu += c1 - c0
        self.n += m

    def to_json(self, mode: str) -> dict[str, Any]:
        out = OpResult(mode, self.n, self.wall, len(self.errors), {"exec": self.lat}).to_json()
        if self.n and self.cpu_ok:
            out["daemon_cpu_us_per_exec"] = round(self.cpu * 1e6 / self.n, 1)
        if self.errors:
            out["first_errors"] = self.errors[:3]
        return out


def daemon_cpu(d: PrivateDaemon) -> float | None:
    if not d.pid:
        return None
    try:
        u, st = host.proc_cpu_s(d.pid)
    except OSError:
        return None
    return u + st


def order(names: list[str], b: int) -> list[str]:
    """The daemons' order in block ``b``: rotated each block, reversed every other one (ABBA:
    each daemon is as often first as last, so a drift within a pair of blocks cancels)."""
    k = (b // 2) % len(names)
    order = names[k:] + names[:k]
    return order[::-1] if b % 2 else order


def one_exec(sb: Sandbox, tally: Tally) -> None:
    t = time.perf_counter()
    try:
        r = sb.exec(sdk_runs.TRUE)
    except CorralError as e:
        tally.errors.append(sdk_runs._err(e))
        return
    tally.note(r, t)


def run_seq(daemons: dict[str, PrivateDaemon], n: int, adv: Any) -> dict[str, Tally]:
    """``n`` sequential execs per daemon, in blocks of BLOCK interleaved across the daemons
    (one sync client, one sandbox per daemon)."""
    names = list(daemons)
    tallies = {k: Tally() for k in names}
    boxes = {k: Sandbox("host", endpoint=d.endpoint, timeout=sdk_runs.TTL_S)
             for k, d in daemons.items()}
    try:
        for sb in boxes.values():
            for _ in range(WARMUP):
                sb.exec(sdk_runs.TRUE)
        for b in range(-(-n // BLOCK)):
            m = min(BLOCK, n - b * BLOCK)
            for k in order(names, b):
                tally, sb = tallies[k], boxes[k]
                with tally.block(daemons[k], m):
                    for _ in range(m):
                        one_exec(sb, tally)
                adv(m)
    finally:
        for sb in boxes.values():
            sb.kill()
    return tallies


async def run_conc(daemons: dict[str, PrivateDaemon], n: int, conc: int,
                   adv: Any) -> dict[str, Tally]:
    names = list(daemons)
    tallies = {k: Tally() for k in names}
    boxes = {k: AsyncSandbox("host", endpoint=d.endpoint, timeout=sdk_runs.TTL_S)
             for k, d in daemons.items()}
    try:
        for sb in boxes.values():
            await sb.__aenter__()
            await asyncio.gather(*(sb.exec(sdk_runs.TRUE) for _ in range(conc)))

        async def worker(sb: AsyncSandbox, tally: Tally, todo: Any) -> None:
            for _ in todo:
                t = time.perf_counter()
                try:
                    r = await sb.exec(sdk_runs.TRUE)
                except CorralError as e:
                    tally.errors.append(sdk_runs._err(e))
                    continue
                tally.note(r, t)

        per = BLOCK * conc
        for b in range(-(-n // per)):
            m = min(per, n - b * per)
            for k in order(names, b):
                tally, sb = tallies[k], boxes[k]
                todo = iter(range(m))  # shared: each exec taken once
                with tally.block(daemons[k], m):
                    await asyncio.gather(*(worker(sb, tally, todo) for _ in range(conc)))
                adv(m)
    finally:
        for sb in boxes.values():
            await sb.__aexit__(None, None, None)
    return tallies


READ_PATH = "/root/bench-read"


def run_reads(variants: dict[str, tuple[PrivateDaemon, bool]], n: int,
              adv: Any) -> dict[str, Tally]:
    """``n`` sequential ``files.read`` of a 100-byte file per variant, in blocks of BLOCK
    interleaved across the variants (one sync client). A variant is (daemon, keyed): a keyed
    one reads through a trajectory handle, so each read carries a key and its log entry the
    bytes (docs/trajectory.md); two variants may share a daemon."""
    names = list(variants)
    tallies = {k: Tally() for k in names}
    boxes: dict[str, Sandbox] = {}
    try:
        for k, (d, keyed) in variants.items():
            tid = f"bench-reads-{os.getpid()}-{time.monotonic_ns()}-{k}" if keyed else None
            sb = boxes[k] = Sandbox("host", endpoint=d.endpoint, timeout=sdk_runs.TTL_S,
                                    trajectory_id=tid)
            Sandbox.from_id(sb.id, endpoint=d.endpoint).files.write(READ_PATH, "x" * 100)
            for _ in range(WARMUP):
                sb.files.read(READ_PATH)
        for b in range(-(-n // BLOCK)):
            m = min(BLOCK, n - b * BLOCK)
            for k in order(names, b):
                tally, sb = tallies[k], boxes[k]
                with tally.block(variants[k][0], m):
                    for _ in range(m):
                        t = time.perf_counter()
                        try:
                            sb.files.read(READ_PATH)
                        except CorralError as e:
                            tally.errors.append(sdk_runs._err(e))
                            continue
                        tally.lat.append((time.perf_counter() - t) * 1e3)
                adv(m)
    finally:
        for k, sb in boxes.items():
            Sandbox.from_id(sb.id, endpoint=variants[k][0].endpoint).kill()
    return tallies


def run_first_results(daemons: dict[str, PrivateDaemon], n: int, adv: Any,
                      block: int = 5) -> dict[str, Tally]:
    """``n`` x (create -> exec ``true`` -> kill) per daemon, in blocks of ``block`` that take
    turns; each latency is the create plus the exec (time to the first result)."""
    names = list(daemons)
    tallies = {k: Tally() for k in names}
    for b in range(-(-n // block)):
        m = min(block, n - b * block)
        for k in order(names, b):
            tally = tallies[k]
            with tally.block(daemons[k], m):
                for _ in range(m):
                    t = time.perf_counter()
                    try:
                        sb = Sandbox("host", endpoint=daemons[k].endpoint,
                                     timeout=sdk_runs.TTL_S)
                        try:
                            r = sb.exec(sdk_runs.TRUE)
                            tally.note(r, t)
                        finally:
                            sb.kill()
                    except CorralError as e:
                        tally.errors.append(sdk_runs._err(e))
            adv(m)
    return tallies


def stop_and_check(daemons: dict[str, PrivateDaemon]) -> dict[str, Any]:
    """Stop the daemons, then check each left nothing: no sandbox dir, cgroup or process."""
    leaks: dict[str, Any] = {}
    for k, d in daemons.items():
        try:
            d.stop()
        except Exception as e:  # noqa: BLE001 - the check must still run
            leaks[f"{k}: stop"] = str(e)
        sdir = Path(d.state_dir) / "sandboxes"
        left = {"sandbox_dirs": sorted(os.listdir(sdir)) if sdir.is_dir() else [],
                "cgroups": host.cgroup_children(d.cgroup_name, exact=True),
                "processes": sorted(host.cgroup_pids(d.cgroup_name, exact=True))}
        leaks.update({f"{k}: {what}": v for what, v in left.items() if v})
    return {"clean": not leaks, "leaks": leaks}
