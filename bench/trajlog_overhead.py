"""Trajectory-log overhead: exec throughput with the log on vs off (docs/trajectory.md).

Two private daemons run side by side, one with CORRAL_TRAJLOG=1 and one with CORRAL_TRAJLOG=0;
rounds alternate between them (ABBA order) so that load from anything else on the machine hits
both equally. Each round: N execs of `true` on one live sandbox, sequential (sync client) and
C in flight (async client). Reports the median ops/s per mode and the on/off ratio.

    sudo .venv/bin/python bench/trajlog_overhead.py [-n 500] [-r 8] [-c 4] [--baseline DIR]

``--baseline DIR`` adds a third daemon, log on, running the corral package found in DIR (a
``python/`` directory of another checkout, e.g. ``git archive main python | tar -x``, with
the ``_core`` module copied in), in the same rotation: the cost of a change to the log,
measured against the code before it under the same load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
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
    p.add_argument("--baseline", help="PYTHONPATH of another corral tree to compare with")
    a = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="corral-tlbench-", dir="/var/tmp"))
    envs = {"1": {"CORRAL_TRAJLOG": "1"}, "0": {"CORRAL_TRAJLOG": "0"}}
    if a.baseline:
        envs["base"] = {"CORRAL_TRAJLOG": "1", "PYTHONPATH": os.path.abspath(a.baseline)}
    daemons = {v: PrivateDaemon(root / f"tl{v}", f"corral-tlbench-{os.getpid()}-{v}", 100,
                                env=env) for v, env in envs.items()}
    res: dict[str, dict[str, list[float]]] = {v: {"seq": [], "conc": []} for v in daemons}
    sids = {}
    try:
        for d in daemons.values():
            d.start()
        for v, d in daemons.items():
            sids[v] = Sandbox(endpoint=d.endpoint, timeout=3600).id
            seq(d.endpoint, sids[v], 50)  # warm-up
        names = list(daemons)
        for r in range(a.rounds):
            shift = (r // 2) % len(names)  # every daemon in every position, ABBA-like
            order = names[shift:] + names[:shift]
            for v in (order if r % 2 == 0 else order[::-1]):
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
            if "base" in res:
                base = res["base"][mode]
                pairs = [x / y for x, y in zip(res["1"][mode], base, strict=True)]
                report[mode].update({
                    "baseline_ops_s": round(statistics.median(base)),
                    "baseline/off": round(statistics.median(base) / off, 3),
                    "median_pairwise_baseline/off": round(statistics.median(
                        [x / y for x, y in zip(base, res["0"][mode], strict=True)]), 3),
                    "median_pairwise_on/baseline": round(statistics.median(pairs), 3)})
        print(json.dumps(report, indent=2))
    finally:
        for v, d in daemons.items():
            try:
                if v in sids:
                    Sandbox.from_id(sids[v], endpoint=d.endpoint).kill()
            except Exception:  # noqa: BLE001
                pass
            d.stop()
        shutil.rmtree(root, ignore_errors=True)  # the daemons' state dirs (and trajlog.db)


if __name__ == "__main__":
    main()
