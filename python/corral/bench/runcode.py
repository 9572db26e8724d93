"""The run-code scenario: ``run_code`` (the process substrate's function-call tier) against the
two ways one would otherwise run a snippet, in the same run:

- container: ``python3 -c`` in a fresh container sandbox (create -> exec -> destroy);
- subprocess server: a small aiohttp server on a unix socket that starts ``python -c CODE``
  per request (the same interpreter as the zygotes), the usual function-call server.

Rows: one client in sequence (p50 latency) and ``--concurrency``x4 calls in flight from an
asyncio client (calls/s); corral also through ``run_code_many`` (batches of 100). Targets:
print(1) p50 <= 2 ms and >= 1,000 calls/s; ``import numpy`` (preloaded) p50 <= 5 ms.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from corral.bench.results import OpResult
from corral.bench.session import Session
from corral.bench.stats import median

PRINT = "print(1)"
NUMPY = "import numpy; print(numpy.__version__)"
TARGETS = {"print_p50_ms": 2.0, "calls_per_s": 1000.0, "numpy_p50_ms": 5.0}
CONTAINER_N = 60      # fresh sandboxes per row (each ~100x the cost of a run_code call)
SERVER_N = 100        # subprocess-per-request: a python start each (~20-40 ms)
BATCH = 100
WARM = {"corral": 40}  # calls before a row is timed; the others need 5

Call = Callable[[str], Awaitable[str]]


# ---- the subprocess-per-request server ---------------------------------------------------
SERVER = r"""
import asyncio, json, sys
from aiohttp import web

async def run(request):
    code = (await request.json())["code"]
    p = await asyncio.create_subprocess_exec(sys.executable, "-c", code,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        stdin=asyncio.subprocess.DEVNULL)
    out, err = await p.communicate()
    return web.json_response({"stdout": out.decode(), "stderr": err.decode(),
                              "exit_code": p.returncode})

app = web.Application()
app.router.add_post("/run", run)
web.run_app(app, path=sys.argv[1], print=None, access_log=None)
"""


class SubprocessServer:
    def __init__(self, sock: str) -> None:
        self.sock = sock
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER, sock], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not os.path.exists(sock):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the subprocess server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ---- the floors ------------------------------------------------------------------------------
# A fork + exit of the zygote's interpreter with its preloads ("fork"), and the same child
# running print(1) as python3 -c would, its output to /dev/null ("print"), with none of the
# isolation (cgroups, uid, Landlock, scratch dir) and no daemon: what any fork-per-request
# CPython design pays per call on this machine. The parent compiles and runs once first, as
# the zygote does, so the children share what a first compile allocates.
FLOOR = r"""
import gc, importlib, os, sys
for m in sys.argv[2].split(","):
    importlib.import_module(m)
mode, n = sys.argv[3], int(sys.argv[1])
null = os.open("/dev/null", os.O_WRONLY)
def child():
    if mode == "print":
        os.dup2(null, 1)
        exec(compile("print(1)", "<string>", "exec"), {"__name__": "__main__"})
        sys.stdout.flush()
    os._exit(0)
exec(compile("x = [1]", "<string>", "exec"), {})
gc.collect(); gc.freeze()
def cpu():
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system
for _ in range(2):  # the first pass: what the parent's first forks allocate
    t0 = cpu()
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            child()
        os.waitpid(pid, 0)
print((cpu() - t0) / n)
"""


def floor(mode: str, n: int = 400) -> float:
    """CPU seconds of one call of the floor ``mode`` ("fork" or "print")."""
    from corral.daemon.substrates.process.pool import STDLIB

    out = subprocess.run([sys.executable, "-I", "-c", FLOOR, str(n), ",".join(STDLIB), mode],
                         capture_output=True, text=True, timeout=120, check=True)
    return float(out.stdout.strip())


def fork_floor(n: int = 400) -> float:
    return floor("fork", n)


# ---- measuring ------------------------------------------------------------------------------
async def _measure(system: str, call: Call, code: str, n: int, conc: int) -> OpResult:
    lat = [-1.0] * n
    errors = 0
    todo = iter(range(n))

    async def worker() -> None:
        nonlocal errors
        for i in todo:
            t0 = time.perf_counter()
            try:
                out = await call(code)
            except Exception:  # noqa: BLE001 - counted, the row goes on
                errors += 1
                continue
            if out.strip() == "":
                errors += 1
                continue
            lat[i] = (time.perf_counter() - t0) * 1e3

    # Warm: connections, and for corral every slot's first child forked and used once (the
    # pools fork all their slots' children when they start, beside the first calls).
    for _ in range(min(WARM.get(system.split("-")[0], 5), n)):
        await call(code)
    t = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conc)))
    return OpResult(system, n, time.perf_counter() - t, errors=errors,
                    phases={"call": [x for x in lat if x >= 0]}, extra={"in_flight": conc})


async def _batched(endpoint: str, code: str, n: int) -> OpResult:
    from corral.sdk.run_code import run_code_many_async

    await run_code_many_async([code] * 10, endpoint=endpoint)
    lat: list[float] = []
    errors = 0
    t = time.perf_counter()
    for k in range(0, n, BATCH):
        t0 = time.perf_counter()
        rs = await run_code_many_async([code] * min(BATCH, n - k), endpoint=endpoint,
                                       return_exceptions=True)
        lat.append((time.perf_counter() - t0) * 1e3)
        errors += sum(1 for r in rs if isinstance(r, BaseException) or not r.ok)
    return OpResult("corral-batch", n, time.perf_counter() - t, errors=errors,
                    phases={"batch": lat}, extra={"batch": BATCH})


def _corral(endpoint: str) -> Call:
    from corral.sdk.run_code import run_code_async

    async def call(code: str) -> str:
        r = await run_code_async(code, endpoint=endpoint)
        return r.stdout if r.ok else ""
    return call


def _container(endpoint: str) -> Call:
    from corral.sdk import AsyncSandbox

    async def call(code: str) -> str:
        sb = await AsyncSandbox.create("host", endpoint=endpoint, timeout=600)
        try:
            r = await sb.exec(["python3", "-c", code])
        finally:
            await sb.kill()
        return r.stdout if r.exit_code == 0 else ""
    return call


def _server(sock: str) -> tuple[Call, Callable[[], Awaitable[None]]]:
    import aiohttp

    session: aiohttp.ClientSession | None = None

    async def call(code: str) -> str:
        nonlocal session
        if session is None:
            session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=sock))
        async with session.post("http://server/run", json={"code": code}) as resp:
            body = await resp.json()
        return body["stdout"] if body["exit_code"] == 0 else ""

    async def close() -> None:
        if session is not None:
            await session.close()
    return call, close


async def _one_run(s: Session, n: int, conc: int, sock: str) -> dict[str, OpResult]:
    ep = s.daemon.endpoint
    corral, container = _corral(ep), _container(ep)
    server, close = _server(sock)
    res: dict[str, OpResult] = {}
    nc, ns = min(n, CONTAINER_N), min(n, SERVER_N)
    plan: list[tuple[str, Call, str, int, int]] = [
        ("corral", corral, PRINT, n, 1), ("corral-numpy", corral, NUMPY, n, 1),
        ("corral-conc", corral, PRINT, n, conc),
        ("server", server, PRINT, ns, 1), ("server-numpy", server, NUMPY, ns, 1),
        ("server-conc", server, PRINT, ns, conc),
        ("container", container, PRINT, nc, 1), ("container-conc", container, PRINT, nc, conc),
    ]
    try:
        for name, call, code, count, c in plan:
            with s.ui.task(f"run-code {name}", None):
                res[name] = await _measure(name, call, code, count, c)
        with s.ui.task("run-code corral-batch", None):
            res["corral-batch"] = await _batched(ep, PRINT, n)
    finally:
        await close()
    return res


def run_code(s: Session) -> tuple[dict[str, Any], dict[str, Any]]:
    from corral.bench.scenarios import _summarize

    n, R = s.opts.n("run-code"), s.opts.runs
    conc = s.opts.concurrency * 4
    sock = str(s.root / "subprocess-server.sock")
    srv = SubprocessServer(sock)
    runs: list[dict[str, OpResult]] = []
    try:
        for _ in range(R):
            runs.append(asyncio.run(_one_run(s, n, conc, sock)))
    finally:
        srv.stop()
    sec = _summarize(runs, [("corral-conc", "server-conc"), ("corral-conc", "container-conc"),
                            ("corral-batch", "corral-conc")])

    def p50(name: str) -> float | None:
        return median([median(r[name].phases.get("call", [])) for r in runs if name in r])

    for a, b in (("server", "corral"), ("container", "corral"),
                 ("server-numpy", "corral-numpy")):
        pa, pb = p50(a), p50(b)
        if pa and pb:
            sec["ratios"][f"{a}/{b} p50"] = round(pa / pb, 1)
    # run_code_many is as much the API as run_code: the better of the two is the rate.
    best = [max(r["corral-conc"].ops_per_s or 0.0, r["corral-batch"].ops_per_s or 0.0)
            for r in runs]
    rate = median(best)
    cpus = os.cpu_count() or 1
    for mode in ("fork", "print"):
        floor_s = floor(mode)
        sec[f"{mode}_floor"] = {"cpu_ms": round(floor_s * 1e3, 3), "calls_per_s_cap":
                                round(cpus / floor_s) if floor_s > 0 else None}
    got = {"print_p50_ms": p50("corral"), "calls_per_s": rate, "numpy_p50_ms": p50("corral-numpy")}
    sec["targets"] = {k: {"target": TARGETS[k], "got": v,
                          "met": v is not None and (v >= TARGETS[k] if k == "calls_per_s"
                                                    else v <= TARGETS[k])}
                      for k, v in got.items()}
    sec["targets"]["calls_per_s"]["runs"] = [round(x, 1) for x in best]
    sec.update(n=n, concurrency=conc, cpus=os.cpu_count())
    last = runs[-1]
    samples = {k: v.phases.get("call", []) for k, v in last.items() if "call" in v.phases}
    return sec, samples
