"""Trajectory-log overhead: exec throughput with the log on vs off (docs/trajectory.md).

Two private daemons run side by side, one with CORRAL_TRAJLOG=1 and one with CORRAL_TRAJLOG=0;
rounds alternate between them (ABBA order) so that load from anything else on the machine hits
both equally. Each round: N execs of `true` on one live sandbox, sequential (sync client) and
C in flight (async client). Reports the median ops/s per mode and the on/off ratio.

    sudo .venv/bin/python bench/trajlog_overhead.py [-n 500] [-r 8] [-c 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from corral import AsyncSandbox, Sandbox
from corral.bench.daemon import PrivateDaemon


def seq(ep: str, sid: str, n: int) -> float:
    sb = Sandbox.from_id(sid, endpoint=ep)
    t0 = time.perf_counter()
    for _ in range(n):
        sb.exec("true")
    return n / (time.perf_counter() - t0)


def conc(ep: str, sid: str, n: int, c: int) -> float:
    async def main() -> float:
        sb = AsyncSandbox.from_id(sid, endpoint=ep)
        left = n

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                await sb.exec("true")

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(c)))
        return n / (time.perf_counter() - t0)

    return asyncio.run(main())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-n", type=int, default=500)
    p.add_argument("-r", "--rounds", type=int, default=8)
    p.add_argument("-c", "--concurrency", type=int, default=4)
    a = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="corral-tlbench-", dir="/var/tmp"))
    daemons = {v: PrivateDaemon(root / f"tl{v}", f"corral-tlbench-{os.getpid()}-{v}", 100,
                                env={"CORRAL_TRAJLOG": v}) for v in ("1", "0")}
    res: dict[str, dict[str, list[float]]] = {v: {"seq": [], "conc": []} for v in daemons}
    sids = {}
    try:
        for d in daemons.values():
            d.start()
        for v, d in daemons.items():
            sids[v] = Sandbox(endpoint=d.endpoint, timeout=3600).id
            seq(d.endpoint, sids[v], 50)  # warm-up
        for r in range(a.rounds):
            order = ("1", "0") if r % 2 == 0 else ("0", "1")
            for v in order:
                ep = daemons[v].endpoint
                res[v]["seq"].append(seq(ep, sids[v], a.n))
                res[v]["conc"].append(conc(ep, sids[v], a.n, a.concurrency))
        report = {"n": a.n, "rounds": a.rounds, "concurrency": a.concurrency}
        for mode in ("seq", "conc"):
            on = statistics.median(res["1"][mode])
            off = statistics.median(res["0"][mode])
            ratios = [x / y for x, y in zip(res["1"][mode], res["0"][mode], strict=True)]
            report[mode] = {"on_ops_s": round(on), "off_ops_s": round(off),
                            "on/off": round(on / off, 3),
                            "median_pairwise_on/off": round(statistics.median(ratios), 3)}
        print(json.dumps(report, indent=2))
    finally:
        for v, d in daemons.items():
            try:
                if v in sids:
                    Sandbox.from_id(sids[v], endpoint=d.endpoint).kill()
            except Exception:  # noqa: BLE001
                pass
            d.stop()


if __name__ == "__main__":
    main()
