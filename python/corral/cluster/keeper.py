"""Runs one node's corrald for as long as its supervisor lives.

``python -m corral.cluster.keeper <corrald args>``: starts corrald and reads its own stdin, a
pipe whose other end only the supervisor actor holds. When the supervisor stops, is killed or
its raylet dies, the pipe reaches EOF and the keeper stops corrald with SIGTERM (corrald then
destroys every sandbox of the node). If the keeper itself is killed, corrald gets SIGTERM from
the kernel (PR_SET_PDEATHSIG), so the node's sandboxes never run on unseen. (The pipe, not a
death signal, ties the keeper to the supervisor: a death signal follows the thread that forked,
and Ray decides which thread runs an actor's methods.)

``--detach`` first: the keeper leaves the actor's process tree (it forks, writes its pid on
stdout and the parent exits; the keeper starts a session of its own). Ray SIGKILLs what stays
under a worker that exits, which would cut corrald's cleanup short; the pipe still ties the
keeper to the supervisor.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1
STOP_GRACE_S = 120.0  # corrald destroys every sandbox on SIGTERM; then SIGKILL


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _detach() -> None:
    pid = os.fork()
    if pid:
        os.write(sys.stdout.fileno(), f"{pid}\n".encode())
        os._exit(0)
    os.setsid()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _normal_priority() -> None:
    """Ray starts its workers niced (``worker_niceness``, 15), and the keeper and corrald
    would inherit that: the node's daemon would yield to every other process on the machine
    (and its own niced threads would outrank it). corrald runs at the default priority."""
    try:
        if os.getpriority(os.PRIO_PROCESS, 0) > 0:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
    except OSError:
        pass  # not permitted: corrald runs as the raylet made it


def main(argv: list[str]) -> int:
    if argv[:1] == ["--detach"]:
        _detach()
        argv = argv[1:]
    _normal_priority()
    # The keeper is single-threaded, so the child's PDEATHSIG follows the keeper's life.
    daemon = subprocess.Popen([sys.executable, "-m", "corral.daemon", *argv],
                              stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: _stop(daemon))
    stdin = sys.stdin.fileno()
    while daemon.poll() is None:
        ready, _, _ = select.select([stdin], [], [], 1.0)
        if ready and not os.read(stdin, 4096):  # EOF: the supervisor is gone
            break
    return _stop(daemon)


def _stop(daemon: subprocess.Popen[bytes]) -> int:
    if daemon.poll() is None:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
    os._exit(daemon.returncode if daemon.returncode >= 0 else 1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
