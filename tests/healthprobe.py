"""A tenant's GET /v1/health in a loop, in a process of its own, while a test attacks the
daemon: its round trips are the daemon's, not the test process's (whose own clients, taking
megabytes each, would hold its GIL)."""

from __future__ import annotations

import subprocess
import sys

_PROBER = r"""
import sys, threading, time, httpx
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
with httpx.Client(base_url=sys.argv[1], timeout=600,
                  headers={"Authorization": "Bearer " + sys.argv[2]}) as v:
    while not stop.is_set():
        t0 = time.monotonic()
        assert v.get("/v1/health").status_code == 200
        print(time.monotonic() - t0, flush=True)
        stop.wait(0.02)
"""


class HealthProbe:
    """``with HealthProbe(base, token) as p:``: ``p.took`` the seconds of each health check
    (all of them once the block ends), ``p.worst`` the slowest; ``p.quiet(n)`` waits for
    the first ``n`` (the baseline, and the prober is connected)."""

    def __init__(self, base: str, token: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _PROBER, base, token],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.took: list[float] = []
        self.quiet(1)  # connected

    def quiet(self, n: int) -> list[float]:
        assert self.proc.stdout is not None
        while len(self.took) < n:
            line = self.proc.stdout.readline()
            assert line, f"the prober ended: {self.proc.wait()}"
            self.took.append(float(line))
        return list(self.took)

    def __enter__(self) -> HealthProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        out, _ = self.proc.communicate(timeout=600)  # closes its stdin: it stops
        self.took += [float(x) for x in out.split()]
        assert self.proc.returncode == 0, self.proc.returncode

    @property
    def worst(self) -> float:
        return max(self.took, default=0.0)
