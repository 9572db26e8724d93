"""``--profile``: sample the daemon with py-spy while corral's churn runs, then rank functions
by self and inclusive share of the samples (where corrald's CPU goes per sandbox).

py-spy is not a dependency: found on PATH, next to the interpreter, or at $CORRAL_PYSPY
(``pip install py-spy``).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

_LINE = re.compile(r"^(?P<stack>.*) (?P<count>\d+)$")
_FRAME_LINE = re.compile(r":\d+\)$")


def find_pyspy() -> str | None:
    cands = [os.environ.get("CORRAL_PYSPY"), shutil.which("py-spy"),
             str(Path(sys.executable).parent / "py-spy")]
    return next((c for c in cands if c and os.access(c, os.X_OK)), None)


class Sampler:
    def __init__(self, pid: int, out: Path, rate: int = 250, native: bool = False) -> None:
        exe = find_pyspy()
        if exe is None:
            raise FileNotFoundError("py-spy not found (pip install py-spy, or set CORRAL_PYSPY)")
        self.out = out
        argv = [exe, "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw",
                "--output", str(out), "--nonblocking", "--full-filenames"]
        if native:
            argv.append("--native")
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        time.sleep(0.5)  # attached before the measured work starts

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _short(frame: str, keep_line: bool = False) -> str:
    """``fn (/long/path/corral/daemon/engine.py:123)`` -> ``fn (corral/daemon/engine.py)``
    (``:123`` kept with keep_line)."""
    if not keep_line:
        frame = _FRAME_LINE.sub(")", frame)
    m = re.search(r"\((.*)\)$", frame)
    if m:
        path = m.group(1)
        for marker in ("/corral/", "/site-packages/", "/lib/python3"):
            if marker in path:
                path = path[path.index(marker) + 1:]
                break
        frame = frame[:m.start()] + f"({path})"
    return frame


def summarize(raw: Path, top: int = 15) -> dict[str, Any]:
    """Top frames by self share (leaf frame, with its line) and corral functions by inclusive
    share, as % of the non-idle samples (py-spy leaves idle threads out)."""
    self_c: Counter[str] = Counter()
    incl_c: Counter[str] = Counter()
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        m = _LINE.match(line.strip())
        if not m:
            continue
        n = int(m.group("count"))
        raw_frames = [f for f in m.group("stack").split(";") if f]
        if not raw_frames:
            continue
        total += n
        self_c[_short(raw_frames[-1], keep_line=True)] += n
        # Inclusive: corral's own functions only (the event loop and aiohttp frames above
        # them are in every stack and say nothing).
        for f in {_short(f) for f in raw_frames}:
            if "(corral/" in f and "__main__" not in f:
                incl_c[f] += n

    def pct(c: Counter[str]) -> list[dict[str, Any]]:
        return [{"function": f, "pct": round(100 * k / total, 1)} for f, k in c.most_common(top)]

    return {"samples": total, "top_self": pct(self_c) if total else [],
            "top_inclusive": pct(incl_c) if total else []}
