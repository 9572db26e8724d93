"""``python -m corral.bench.e2b``: ``Sandbox.create()`` + ``commands.run("echo")`` through the
stock e2b SDK (against corral's E2B front) and the same through corral's own SDK, in one run.

The front is started here, on a free loopback port with a random key, against the daemon the
environment names (``CORRAL_SOCKET`` / ``CORRAL_URL``). Rounds interleave the variants so drift
on a shared machine hits them alike; kills are not timed. Variants:
  e2b          e2b.Sandbox.create() (template ``base``) + commands.run("echo")
  corral       corral.Sandbox() (image ``host``) + exec("echo")
  corral-base  corral.Sandbox(snapshot=<the base template's snapshot>) + exec("echo"): the
               same sandbox the e2b variant gets, so the difference is the front and protocol
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from corral.bench.stats import summary

VARIANTS = ("e2b", "corral", "corral-base")


def start_front(api_key: str) -> tuple[subprocess.Popen[str], str]:
    env = dict(os.environ, CORRAL_E2B_API_KEY=api_key)
    proc = subprocess.Popen([sys.executable, "-m", "corral.e2b", "serve", "--port", "0"],
                            stdout=subprocess.PIPE, env=env, text=True, start_new_session=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    m = re.match(r"listening on (\S+)", line)
    if not m:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"the E2B front did not start: {line!r}")
    return proc, m.group(1)


def _timed(make: Callable[[], Any], run: Callable[[Any], Any],
           kill: Callable[[Any], Any]) -> tuple[float, float]:
    t0 = time.perf_counter()
    sb = make()
    t1 = time.perf_counter()
    try:
        run(sb)
        t2 = time.perf_counter()
    finally:
        kill(sb)
    return t1 - t0, t2 - t1


def measure(rounds: int = 20, warmup: int = 2) -> dict[str, Any]:
    import e2b

    import corral
    from corral.e2b.templates import BASE_SNAPSHOT

    key = "e2b_" + secrets.token_hex(20)
    proc, url = start_front(key)
    saved = {k: os.environ.get(k) for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY")}
    os.environ.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_API_KEY=key)

    def check(out: str) -> None:
        if out != "\n":
            raise RuntimeError(f"echo printed {out!r}")

    steps: dict[str, tuple[Callable[[], Any], Callable[[Any], Any], Callable[[Any], Any]]] = {
        "e2b": (lambda: e2b.Sandbox.create(timeout=60),
                lambda s: check(s.commands.run("echo").stdout), lambda s: s.kill()),
        "corral": (lambda: corral.Sandbox(timeout=60),
                   lambda s: check(s.exec("echo").stdout), lambda s: s.kill()),
        "corral-base": (lambda: corral.Sandbox(snapshot=BASE_SNAPSHOT, timeout=60),
                        lambda s: check(s.exec(["/bin/bash", "-l", "-c", "echo"]).stdout),
                        lambda s: s.kill()),
    }
    samples: dict[str, dict[str, list[float]]] = {
        v: {"create": [], "run": [], "total": []} for v in VARIANTS}
    try:
        for i in range(warmup + rounds):
            for v in VARIANTS:  # e2b first: its first create builds the base snapshot
                c, r = _timed(*steps[v])
                if i >= warmup:
                    samples[v]["create"].append(c * 1000)
                    samples[v]["run"].append(r * 1000)
                    samples[v]["total"].append((c + r) * 1000)
    finally:
        for k, val in saved.items():
            if val is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = val
        proc.terminate()
        proc.wait(30)
    return {"rounds": rounds, "unit": "ms",
            "variants": {v: {part: summary(xs) for part, xs in parts.items()}
                         for v, parts in samples.items()}}


def report(res: dict[str, Any]) -> str:
    lines = [f"{'variant':<12} {'create p50':>11} {'run p50':>9} {'total p50':>10} "
             f"{'total p90':>10}   ({res['rounds']} rounds, ms)"]
    for v, parts in res["variants"].items():
        lines.append(f"{v:<12} {parts['create']['p50']:>11.2f} {parts['run']['p50']:>9.2f} "
                     f"{parts['total']['p50']:>10.2f} {parts['total']['p90']:>10.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m corral.bench.e2b", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="print the samples' summaries as JSON")
    a = ap.parse_args(argv)
    res = measure(a.rounds, a.warmup)
    print(json.dumps(res, indent=1) if a.json else report(res))


if __name__ == "__main__":
    main()
