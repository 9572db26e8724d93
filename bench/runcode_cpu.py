"""What a run_code call costs the whole machine: the CPU time every process and the kernel
spent (``/proc/stat``, steal excluded) per call, batched (``run_code_many`` of 100) and one at
a time (with the p50 and p90 latency), against the running daemon (``CORRAL_SOCKET``).

Machine-wide CPU counts everything a call costs (client, daemon, zygote, fork server, child,
kernel), wherever it runs, so two builds compare by starting each one's daemon in turn:

    sudo corral up; sudo python bench/runcode_cpu.py [N]; sudo corral down
"""

from __future__ import annotations

import asyncio
import sys
import time

from corral.sdk.run_code import run_code_async, run_code_many_async

NUMPY = "import numpy; print(numpy.__version__)"


def busy_s() -> float:
    """CPU seconds the machine has spent busy (user, nice, system, irq, softirq)."""
    f = open("/proc/stat").readline().split()[1:]
    return sum(int(f[i]) for i in (0, 1, 2, 5, 6)) / 100


async def batched(n: int) -> str:
    for _ in range(5):  # every slot's child forked and used
        await run_code_many_async(["print(1)"] * 100)
    b0, t0 = busy_s(), time.monotonic()
    for _ in range(n // 100):
        await run_code_many_async(["print(1)"] * 100)
    b1, wall = busy_s(), time.monotonic() - t0
    return f"batched print(1): {n / wall:.0f} calls/s, {(b1 - b0) / n * 1e3:.2f} ms CPU a call"


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
