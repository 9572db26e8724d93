"""What a run_code call costs the whole machine: the CPU time every process and the kernel
spent (``/proc/stat``, steal excluded) per call, batched (``run_code_many`` of 100) and one at
a time (with the p50 and p90 latency), against the running daemon (``CORRAL_SOCKET``).

Machine-wide CPU counts everything a call costs (client, daemon, zygote, fork server, child,
kernel), wherever it runs, so two builds compare by starting each one's daemon in turn. The
batched row is also split by process: the daemon, each zygote, each fork server and the
children it reaped (``/proc/<pid>/stat``: own and reaped CPU of every process under the
daemon), so what a call costs where is read off one run:

    sudo corral up; sudo python bench/runcode_cpu.py [N]; sudo corral down
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

from corral.sdk.run_code import run_code_async, run_code_many_async

NUMPY = "import numpy; print(numpy.__version__)"


def busy_s() -> float:
    """CPU seconds the machine has spent busy (user, nice, system, irq, softirq)."""
    f = open("/proc/stat").readline().split()[1:]
    return sum(int(f[i]) for i in (0, 1, 2, 5, 6)) / 100


TICK = os.sysconf("SC_CLK_TCK")


def daemon_pid() -> int:
    from corral.sdk.endpoint import Endpoint
    from corral.sdk.sync_transport import UnixConnection

    path = Endpoint.from_env().unix_path
    if path is None:
        raise SystemExit("the split by process needs the local daemon's socket (CORRAL_SOCKET)")
    conn = UnixConnection(path)
    try:
        conn.request("GET", "/v1/status")
        return int(json.loads(conn.getresponse().read())["pid"])
    finally:
        conn.close()


def processes(pid: int) -> list[int]:
    """``pid`` and every process under it (not threads)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(c) for c in f.read().split()]
    except OSError:
        kids = []
    return [pid, *(p for k in kids for p in processes(k))]


def cpu(pid: int) -> tuple[float, float]:
    """(own, reaped children's) CPU seconds of ``pid``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            v = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0.0
    return (int(v[11]) + int(v[12])) / TICK, (int(v[13]) + int(v[14])) / TICK


def role(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return "?"
    if b"corral.daemon" in argv:
        return "daemon"
    return "zygote" if any(a.endswith(b"zygote.py") for a in argv) else argv[0].decode()


async def batched(n: int) -> str:
    for _ in range(5):  # every slot's child forked and used
        await run_code_many_async(["print(1)"] * 100)
    pids = processes(daemon_pid())
    before = {p: cpu(p) for p in pids}
    b0, t0 = busy_s(), time.monotonic()
    for _ in range(n // 100):
        await run_code_many_async(["print(1)"] * 100)
    b1, wall = busy_s(), time.monotonic() - t0
    lines = [f"batched print(1): {n / wall:.0f} calls/s, {(b1 - b0) / n * 1e3:.2f} ms CPU a call"]
    for p in pids:  # a zygote launcher's, a zygote's, a fork server's (its children reaped)
        (own0, kids0), (own1, kids1) = before[p], cpu(p)
        if own1 - own0 or kids1 - kids0:
            lines.append(f"  {role(p)} {p}: own {(own1 - own0) / n * 1e3:.3f} ms a call, "
                         f"reaped children {(kids1 - kids0) / n * 1e3:.3f}")
    return "\n".join(lines)


async def sequential(n: int, code: str) -> str:
    for _ in range(40):
        await run_code_async(code)
    lat = []
    b0 = busy_s()
    for _ in range(n):
        t = time.perf_counter()
        await run_code_async(code)
        lat.append(time.perf_counter() - t)
    b1 = busy_s()
    lat.sort()
    return (f"one at a time {code.split(';')[0]}: p50 {lat[n // 2] * 1e3:.2f} ms, "
            f"p90 {lat[n * 9 // 10] * 1e3:.2f} ms, {(b1 - b0) / n * 1e3:.2f} ms CPU a call")


async def main(n: int) -> None:
    print(await batched(n))
    print(await sequential(n // 4, "print(1)"))
    print(await sequential(n // 4, NUMPY))


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 2000))
