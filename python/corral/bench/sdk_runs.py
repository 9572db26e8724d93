"""corral measured end to end, the way a trainer uses it: through the SDK, over the daemon's
unix socket, container substrate, ``host`` image, network ``none`` (churn and density also
``disabled``, with ``--network``); ``exec(["true"])`` (an argv, so no shell is started: the same
program the raw baseline and the peers run)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from corral.bench.results import OpResult, with_total
from corral.errors import CorralError
from corral.models import NetworkMode
from corral.sdk import AsyncSandbox, Sandbox

TRUE = ["true"]
# Long enough that nothing expires mid-measurement (density fills can take minutes).
TTL_S = 6 * 3600.0
Advance = Callable[[int], None]


def _noop(_: int = 1) -> None:
    pass


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:300]


# ---- churn: create -> exec true -> destroy, `conc` in flight --------------------------------
async def _churn(endpoint: str, n: int, conc: int, advance: Advance,
                 network: NetworkMode = "none") -> OpResult:
    create, execs, destroy = [-1.0] * n, [-1.0] * n, [-1.0] * n
    errors: list[str] = []
    todo = iter(range(n))

    async def worker() -> None:
        for i in todo:  # one iterator shared by the workers: each op is taken once
            t0 = time.perf_counter()
            sb: AsyncSandbox | None = None
            try:
                sb = await AsyncSandbox.create("host", endpoint=endpoint, timeout=TTL_S,
                                               network=network)
                t1 = time.perf_counter()
                r = await sb.exec(TRUE)
                t2 = time.perf_counter()
                await sb.kill()
                sb = None
                t3 = time.perf_counter()
                if r.exit_code != 0:
                    errors.append(f"exit {r.exit_code}: {r.stderr[:200]}")
                else:
                    create[i], execs[i], destroy[i] = ((t1 - t0) * 1e3, (t2 - t1) * 1e3,
                                                       (t3 - t2) * 1e3)
            except CorralError as e:
                errors.append(_err(e))
            finally:
                if sb is not None:
                    await _kill_quietly(sb)
                advance(1)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conc)))
    wall = time.perf_counter() - t0
    phases = with_total({"create": create, "exec": execs, "destroy": destroy},
                        ("create", "exec", "destroy"))
    return OpResult(system_name(network), n, wall, len(errors), _ok(phases),
                    _extra(conc, errors))


def system_name(network: str) -> str:
    """corral's name in the reports: ``corral`` (network none) or ``corral-disabled``."""
    return "corral" if network == "none" else f"corral-{network}"


def churn(endpoint: str, n: int, conc: int, advance: Advance = _noop,
          network: NetworkMode = "none") -> OpResult:
    return asyncio.run(_churn(endpoint, n, conc, advance, network))


# ---- batched churn: create_many(B) -> exec_many(true) -> kill_many, `inflight` batches ----
async def _churn_batch(endpoint: str, n: int, batch: int, inflight: int,
                       advance: Advance) -> OpResult:
    """The same sandbox lifecycle as `churn`, three calls per batch of ``batch`` sandboxes
    instead of three per sandbox: what a trainer running many episodes at once does. Phases
    are per batch (ms for the whole batch); the rate counts sandboxes."""
    sizes = [min(batch, n - i) for i in range(0, n, batch)]
    create: list[float] = [-1.0] * len(sizes)
    execs, destroy = list(create), list(create)
    errors: list[str] = []
    failed = 0
    todo = iter(range(len(sizes)))

    async def worker() -> None:
        nonlocal failed
        for i in todo:
            t0 = time.perf_counter()
            sbs: list[AsyncSandbox] = []
            try:
                sbs = await AsyncSandbox.create_many(sizes[i], "host", endpoint=endpoint,
                                                     timeout=TTL_S)
                t1 = time.perf_counter()
                rs = await AsyncSandbox.exec_many(sbs, TRUE, return_exceptions=True,
                                                  endpoint=endpoint)
                t2 = time.perf_counter()
                await AsyncSandbox.kill_many(sbs, endpoint=endpoint)
                sbs = []
                t3 = time.perf_counter()
                bad = [r for r in rs if isinstance(r, CorralError) or r.exit_code != 0]
                if bad:
                    failed += len(bad)
                    errors.append(str(bad[0])[:300])
                else:
                    create[i], execs[i], destroy[i] = ((t1 - t0) * 1e3, (t2 - t1) * 1e3,
                                                       (t3 - t2) * 1e3)
            except CorralError as e:
                failed += sizes[i]
                errors.append(_err(e))
            finally:
                if sbs:
                    try:
                        await AsyncSandbox.kill_many(sbs, endpoint=endpoint,
                                                     return_exceptions=True)
                    except CorralError:
                        pass
                advance(sizes[i])

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(inflight)))
    wall = time.perf_counter() - t0
    phases = with_total({"create": create, "exec": execs, "destroy": destroy},
                        ("create", "exec", "destroy"))
    res = OpResult("corral-batch", n, wall, failed, _ok(phases), _extra(inflight, errors))
    res.extra.update(batch=batch, batches_in_flight=inflight, phases_per="batch")
    return res


def churn_batch(endpoint: str, n: int, batch: int, inflight: int,
                advance: Advance = _noop) -> OpResult:
    return asyncio.run(_churn_batch(endpoint, n, batch, inflight, advance))


async def _kill_quietly(sb: AsyncSandbox) -> None:
    try:
        await sb.kill()
    except CorralError:
        pass


def _ok(phases: dict[str, list[float]]) -> dict[str, list[float]]:
    return {k: [x for x in v if x >= 0] for k, v in phases.items()}


def _extra(conc: int, errors: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"concurrency": conc}
    if errors:
        out["first_error"] = errors[0]
    return out


# ---- latency: one client, nothing else running ----------------------------------------------
class _Latency:
    """One system's create -> first exec -> destroy cycles, one at a time."""

    def __init__(self, endpoint: str, hostname: str | None, substrate: str, image: str) -> None:
        self.endpoint, self.hostname, self.substrate, self.image = (endpoint, hostname,
                                                                    substrate, image)
        self.ph: dict[str, list[float]] = {"create": [], "first_exec": [], "ttfr": [],
                                           "destroy": []}
        self.errors: list[str] = []
        self.wall = 0.0

    def once(self, keep: bool) -> None:
        t0 = time.perf_counter()
        try:
            sb = Sandbox(self.image, endpoint=self.endpoint, timeout=TTL_S,
                         hostname=self.hostname, substrate=self.substrate)
            t1 = time.perf_counter()
            try:
                r = sb.exec(TRUE)
                t2 = time.perf_counter()
            finally:
                sb.kill()
            t3 = time.perf_counter()
        except CorralError as e:
            if keep:
                self.errors.append(_err(e))
            return
        if not keep:
            return
        self.wall += t3 - t0
        if r.exit_code != 0:
            self.errors.append(f"exit {r.exit_code}")
            return
        self.ph["create"].append((t1 - t0) * 1e3)
        self.ph["first_exec"].append((t2 - t1) * 1e3)
        self.ph["ttfr"].append((t2 - t0) * 1e3)
        self.ph["destroy"].append((t3 - t2) * 1e3)

    def result(self, name: str, n: int) -> OpResult:
        # ops_per_s: sequential create+exec+destroy over this system's own cycles
        return OpResult(name, n, self.wall, len(self.errors), self.ph,
                        _extra(1, self.errors))


def latency(endpoint: str, n: int, advance: Advance = _noop, warmup: int = 5,
            hostname: str | None = None, substrate: str = "container",
            image: str = "host") -> OpResult:
    """Per op: create, the first exec, time to the first result (create + exec) and destroy.
    ``hostname`` (a spec the warm pools never serve) makes every create cold."""
    run = _Latency(endpoint, hostname, substrate, image)
    for i in range(-warmup, n):
        run.once(keep=i >= 0)
        if i >= 0:
            advance(1)
    return run.result("corral-cold" if hostname else "corral", n)


def latency_interleaved(systems: dict[str, tuple[str, str]], n: int,
                        advance: Advance = _noop, warmup: int = 5,
                        hostname: str | None = None) -> dict[str, OpResult]:
    """``latency`` of several systems (name -> (endpoint, image)) taking turns op by op, in
    ABBA order, so the machine's drift over seconds hits each alike."""
    runs = {name: _Latency(ep, hostname, "container", img)
            for name, (ep, img) in systems.items()}
    order = list(runs)
    for i in range(-warmup, n):
        for name in (order if i % 2 == 0 else order[::-1]):
            runs[name].once(keep=i >= 0)
        if i >= 0:
            advance(1)
    return {name: r.result(name, n) for name, r in runs.items()}


# ---- exec throughput on one live sandbox ----------------------------------------------------
def exec_sync(endpoint: str, n: int, advance: Advance = _noop, warmup: int = 5,
              substrate: str = "container") -> OpResult:
    lat: list[float] = []
    errors: list[str] = []
    with Sandbox("host", endpoint=endpoint, timeout=TTL_S, substrate=substrate) as sb:
        for _ in range(warmup):
            sb.exec(TRUE)
        t0 = time.perf_counter()
        for _ in range(n):
            t = time.perf_counter()
            try:
                r = sb.exec(TRUE)
                if r.exit_code == 0:
                    lat.append((time.perf_counter() - t) * 1e3)
                else:
                    errors.append(f"exit {r.exit_code}")
            except CorralError as e:
                errors.append(_err(e))
            advance(1)
        wall = time.perf_counter() - t0
    return OpResult("corral", n, wall, len(errors), {"exec": lat}, _extra(1, errors))


async def _exec_async(endpoint: str, n: int, conc: int, advance: Advance) -> OpResult:
    lat: list[float] = []
    errors: list[str] = []
    async with AsyncSandbox("host", endpoint=endpoint, timeout=TTL_S) as sb:
        await asyncio.gather(*(sb.exec(TRUE) for _ in range(conc)))  # warm connections
        todo = iter(range(n))

        async def worker() -> None:
            for _ in todo:
                t = time.perf_counter()
                try:
                    r = await sb.exec(TRUE)
                    if r.exit_code == 0:
                        lat.append((time.perf_counter() - t) * 1e3)
                    else:
                        errors.append(f"exit {r.exit_code}")
                except CorralError as e:
                    errors.append(_err(e))
                advance(1)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(conc)))
        wall = time.perf_counter() - t0
    return OpResult("corral", n, wall, len(errors), {"exec": lat}, _extra(conc, errors))


def exec_async(endpoint: str, n: int, conc: int, advance: Advance = _noop) -> OpResult:
    return asyncio.run(_exec_async(endpoint, n, conc, advance))


# ---- density: fill, hold, destroy -----------------------------------------------------------
def fill(endpoint: str, count: int, batch: int, advance: Advance = _noop,
         network: NetworkMode = "none", image: str = "host",
         ) -> tuple[list[str], list[tuple[int, float]], float, str | None]:
    """Create ``count`` idle sandboxes in batches (``create_many``). Returns (ids,
    [(live count before the batch, creates/s of the batch)], wall seconds, error or None)."""
    ids: list[str] = []
    rates: list[tuple[int, float]] = []
    error = None
    t0 = time.perf_counter()
    while len(ids) < count:
        b = min(batch, count - len(ids))
        t = time.perf_counter()
        try:
            boxes = Sandbox.create_many(b, image, endpoint=endpoint, timeout=TTL_S,
                                        network=network)
        except CorralError as e:
            error = _err(e)
            break
        rates.append((len(ids), b / (time.perf_counter() - t)))
        ids.extend(sb.id for sb in boxes)
        advance(b)
    return ids, rates, time.perf_counter() - t0, error


def destroy_all(endpoint: str, ids: list[str], batch: int, advance: Advance = _noop) -> float:
    """Kill ``ids`` with the batch endpoint, ``batch`` per request; returns seconds."""
    t0 = time.perf_counter()
    for i in range(0, len(ids), batch):
        chunk = ids[i:i + batch]
        Sandbox.kill_many(chunk, return_exceptions=True, endpoint=endpoint)
        advance(len(chunk))
    return time.perf_counter() - t0


# ---- snapshot / restore / fork ------------------------------------------------------------
def snapshots(endpoint: str, n: int, mb: int, fork_n: int, fork_reps: int,
              advance: Advance = _noop, sandboxes_dir: Path | None = None) -> OpResult:
    """On one sandbox, ``n`` cycles of: write ``mb`` MB (a new file, flushed) -> snapshot
    (timed) -> restore in place to the sandbox's starting snapshot (timed: the ``mb`` MB of
    changes are rolled back) -> delete the snapshot; then ``fork_reps`` forks of ``fork_n``
    children (timed: snapshot + ``fork_n`` creates, one call), each batch killed after. Given
    the daemon's ``sandboxes_dir``, the background work of what came before (the deletes of
    the cycles' uppers and layers in the daemon's trash, each batch's teardown) is waited for
    before each fork, so a fork is not timed against it. The sandbox stays on its one-level
    base, so the chain never grows (a restore to the snapshot just taken would add a level per
    cycle)."""
    fork_key = f"fork{fork_n}"
    ph: dict[str, list[float]] = {"snapshot": [], "restore": [], fork_key: []}
    errors: list[str] = []
    write = (f"dd if=/dev/urandom of=/root/blob bs=1M count={mb} status=none && "
             "sync -f /root/blob")
    t_start = time.perf_counter()
    with Sandbox("host", endpoint=endpoint, timeout=TTL_S, memory_mb=1024) as sb:
        sb.exec(TRUE)
        base = sb.snapshot()
        try:
            sb.restore(base)  # stand on it, so every restore below is the same operation
            for _ in range(n):
                try:
                    sb.exec(write).check()
                    t0 = time.perf_counter()
                    snap = sb.snapshot()
                    t1 = time.perf_counter()
                    sb.restore(base)
                    t2 = time.perf_counter()
                    snap.delete()
                    ph["snapshot"].append((t1 - t0) * 1e3)
                    ph["restore"].append((t2 - t1) * 1e3)
                except CorralError as e:
                    errors.append(_err(e))
                advance(1)
            trash = sandboxes_dir.parent / "trash" if sandboxes_dir is not None else None
            for _ in range(fork_reps):
                try:
                    if trash is not None and sandboxes_dir is not None:
                        # The background deletes before (100s of MB) end first: layers in the
                        # state dir's trash, restored sandboxes' old uppers in sandboxes/.trash.
                        _wait_gone(_children(trash) + _children(sandboxes_dir / ".trash"))
                    t0 = time.perf_counter()
                    kids = sb.fork(fork_n)
                    ph[fork_key].append((time.perf_counter() - t0) * 1e3)
                    Sandbox.kill_many(kids, return_exceptions=True, endpoint=endpoint)
                    if sandboxes_dir is not None:
                        _wait_gone([sandboxes_dir / k.id for k in kids])
                except CorralError as e:
                    errors.append(_err(e))
                advance(1)
        finally:
            base.delete()
    wall = time.perf_counter() - t_start
    res = OpResult("corral", n + fork_reps, wall, len(errors), ph, _extra(1, errors))
    res.extra.update(mb=mb, fork_n=fork_n)
    return res


def _children(d: Path) -> list[Path]:
    try:
        return list(d.iterdir())
    except FileNotFoundError:
        return []


def _wait_gone(paths: list[Path], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while any(p.exists() for p in paths) and time.monotonic() < deadline:
        time.sleep(0.005)


def leftovers(endpoint: str) -> dict[str, int]:
    """Snapshot records still listed by the daemon (the scenario deletes all it makes)."""
    from corral.sdk import Snapshot

    return {"snapshots": len(Snapshot.list(endpoint=endpoint))}
