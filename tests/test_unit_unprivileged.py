"""The unit tests (tests/unit: engine, reaper, trajectory log over a fake substrate and a
manual clock) need neither root nor a daemon: run them as user nobody, with no capabilities,
and require that they pass."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOBODY = 65534


def _reachable(targets: list[str], stage: Path) -> list[str]:
    """Shell commands, for a private mount namespace, that let any user reach ``targets``
    (the interpreter may live under a 0700 home): each ancestor directory closed to others is
    covered by a 0755 stand-in holding binds of just the entries on the way, deepest first."""
    need: dict[str, set[str]] = {}
    for target in targets:
        parts = Path(target).parts
        for i in range(1, len(parts)):
            d = os.path.join(*parts[:i])
            if not os.stat(d).st_mode & 0o001:
                need.setdefault(d, set()).add(parts[i])
    cmds = []
    for n, d in enumerate(sorted(need, key=lambda p: -len(Path(p).parts))):
        s = stage / str(n)
        s.mkdir(mode=0o755)
        s.chmod(0o755)
        for child in sorted(need[d]):
            src = os.path.join(d, child)
            (s / child).mkdir() if os.path.isdir(src) else (s / child).touch()
            cmds.append(f"mount --rbind {shlex.quote(src)} {shlex.quote(str(s / child))}")
        cmds.append(f"mount --rbind {shlex.quote(str(s))} {shlex.quote(d)}")
    return cmds


@pytest.mark.skipif(os.geteuid() != 0, reason="switches to user nobody: run as root")
def test_unit_tests_pass_as_nobody(tmp_path):
    stage = tmp_path / "stage"
    stage.mkdir()
    targets = [os.path.realpath(sys.executable), sys.base_prefix, sys.prefix, str(REPO)]
    setup = _reachable([os.path.realpath(t) for t in targets], stage)
    run = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
           "--inh-caps=-all", "--bounding-set=-all",
           "env", "-i", "PATH=/usr/bin:/bin", "HOME=/tmp", "PYTHONDONTWRITEBYTECODE=1",
           sys.executable, "-c", "import os; print('uid', os.getuid(), os.geteuid()); "
           "import sys, pytest; sys.exit(pytest.main(['-q', sys.argv[1]]))",
           str(REPO / "tests" / "unit")]
    script = " && ".join([*setup, "cd /", shlex.join(run)])
    p = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                       capture_output=True, text=True, timeout=240)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert f"uid {NOBODY} {NOBODY}" in out
    summary = [line for line in p.stdout.splitlines() if line.strip()][-1]
    m = re.match(r"(\d+) passed", summary)
    assert m and int(m.group(1)) >= 20 and "failed" not in summary \
        and "error" not in summary, out[-2000:]
