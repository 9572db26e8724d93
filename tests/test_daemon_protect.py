"""The daemon survives what its sandboxes do with memory: it runs in its own cgroup
(``<name>/.daemon``, memory reserved on cgroup v2) at oom_score_adj -900, every sandbox
process at +500 with that as its floor. Attacked from inside sandboxes: lowering their own
score, raising every score they can see, and allocating past their memory limit."""

from __future__ import annotations

import os

import corral
from corral.daemon.protect import DAEMON_OOM_SCORE_ADJ, SANDBOX_OOM_SCORE_ADJ

from conftest import CGROUP_NAME

DAEMON_CG = f"/{CGROUP_NAME}/.daemon"


def _can_lower(pid: int) -> bool:
    """Holds CAP_SYS_RESOURCE (some container runtimes drop it even for root)."""
    with open(f"/proc/{pid}/status") as f:
        eff = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    return bool(eff >> 24 & 1)


def _expected_daemon_adj(pid: int) -> int:
    """-900, or without the capability the floor it inherited from us (its starter)."""
    return DAEMON_OOM_SCORE_ADJ if _can_lower(pid) else _adj(os.getpid())


def _adj(pid: int) -> int:
    with open(f"/proc/{pid}/oom_score_adj") as f:
        return int(f.read())


def _memory_cgroup(pid: int) -> tuple[int, str]:
    """(cgroup version, path) of pid's memory cgroup."""
    with open(f"/proc/{pid}/cgroup") as f:
        lines = [line.rstrip("\n").split(":", 2) for line in f]
    for _, ctrls, path in lines:
        if "memory" in ctrls.split(","):
            return 1, path
    return 2, next(path for _, ctrls, path in lines if ctrls == "")


def test_daemon_runs_protected_in_its_own_cgroup(daemon):
    pid = daemon.proc.pid
    assert _adj(pid) == _expected_daemon_adj(pid)
    version, path = _memory_cgroup(pid)
    assert path == DAEMON_CG, path
    if version == 2:
        d = f"/sys/fs/cgroup{DAEMON_CG}"
        assert int(open(f"{d}/memory.min").read()) == 256 << 20
        assert int(open(f"/sys/fs/cgroup/{CGROUP_NAME}/memory.min").read()) >= 256 << 20
    with corral.Sandbox() as sb:
        sb.exec("true")  # v1 makes a sandbox's memory cgroup at its first exec
        init = sb.info().init_pid
        assert _memory_cgroup(init)[1] == f"/{CGROUP_NAME}/{sb.id}"
        assert _adj(init) == SANDBOX_OOM_SCORE_ADJ


SCORE_ATTACK = r"""
own=$(cat /proc/self/oom_score_adj)
for v in -1000 -999 -900 -500 -17 -1 0 1 250 499 500; do
  if echo $v > /proc/self/oom_score_adj 2>/dev/null; then echo "low:$v"; break; fi
done
for v in -1000 -900 -1 0; do
  if echo $v > /proc/1/oom_score_adj 2>/dev/null; then echo "init-low:$v"; break; fi
done
echo -17 > /proc/self/oom_adj 2>/dev/null && echo "legacy:$(cat /proc/self/oom_score_adj)"
for f in /proc/[0-9]*/oom_score_adj; do echo 1000 > $f 2>/dev/null; done
echo "own:$own now:$(cat /proc/self/oom_score_adj)"
"""


def test_sandbox_cannot_lower_its_score_or_touch_the_daemons(daemon):
    pid = daemon.proc.pid
    daemon_adj = _adj(pid)
    # The lowest score sandbox code can reach: its own start value where the daemon could set
    # a floor, else the daemon's own floor; never below the daemon's.
    floor = SANDBOX_OOM_SCORE_ADJ if _can_lower(pid) else daemon_adj
    # A fresh sandbox each: root's attack raises its init's score, which its later commands
    # inherit. The daemon's own exec path (a command too large for the init's channel) too.
    for user, cmd in (("root", SCORE_ATTACK), ("nobody", SCORE_ATTACK),
                      ("root", SCORE_ATTACK + "#" + "x" * 70_000)):
        with corral.Sandbox() as sb:
            r = sb.exec(cmd, user=user)
            assert f"own:{SANDBOX_OOM_SCORE_ADJ} now:1000" in r.stdout, (user, r.stdout, r.stderr)
            for line in r.stdout.splitlines():
                key, _, value = line.partition(":")
                if key in ("low", "init-low", "legacy"):
                    assert int(value) >= floor, (user, line)
    assert _adj(pid) == daemon_adj == _expected_daemon_adj(pid)
    assert _memory_cgroup(pid)[1] == DAEMON_CG


def test_sandbox_past_its_memory_limit_is_killed_daemon_lives(daemon):
    pid = daemon.proc.pid
    hog = "python3 -c 'a=[]\nwhile True: a.append(bytearray(8 << 20))'"
    with corral.Sandbox(memory_mb=64) as sb:
        r = sb.exec(hog, timeout=60)
        assert r.exit_code == 128 + 9, (r.exit_code, r.stderr)  # SIGKILL by the OOM killer
        assert sb.exec("echo alive").stdout == "alive\n"  # the sandbox goes on
    assert daemon.proc.poll() is None and daemon.proc.pid == pid
    assert corral.Sandbox.list() is not None  # and answers
    assert os.path.exists(f"/proc/{pid}")
