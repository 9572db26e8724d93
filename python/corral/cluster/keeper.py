"""Runs one node's corrald for as long as its supervisor lives.

``python -m corral.cluster.keeper <corrald args>``: starts corrald and reads its own stdin, a
pipe whose other end only the supervisor actor holds. When the supervisor stops, is killed or
its raylet dies, the pipe reaches EOF and the keeper stops corrald with SIGTERM (corrald then
destroys every sandbox of the node). If the keeper itself is killed, corrald gets SIGTERM from
the kernel (PR_SET_PDEATHSIG), so the node's sandboxes never run on unseen. (The pipe, not a
death signal, ties the keeper to the supervisor: a death signal follows the thread that forked,
and Ray decides which thread runs an actor's methods.) If corrald dies (a crash, an OOM kill,
a kill -9), the keeper starts it again on its state dir (0.5 s, doubling to 30 s while it keeps
dying young), and it adopts the node's sandboxes as a single machine's restart does; a
supervisor gone while corrald is down gets it started once more, to end them.

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
import socket
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1
STOP_GRACE_S = 120.0  # corrald destroys every sandbox on SIGTERM; then SIGKILL
# corrald started again after it died: 1 s, doubling to 30 s while it keeps dying young.
RESTART_MIN_S, RESTART_MAX_S = 0.5, 30.0


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


def _start(argv: list[str]) -> subprocess.Popen[bytes]:
    # The keeper is single-threaded, so the child's PDEATHSIG follows the keeper's life.
    return subprocess.Popen([sys.executable, "-m", "corral.daemon", *argv],
                            stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--detach"]:
        _detach()
        argv = argv[1:]
    _normal_priority()
    daemon = [_start(argv)]
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: _stop(daemon[0]))
    stdin = sys.stdin.fileno()
    backoff, born = RESTART_MIN_S, time.monotonic()
    while True:
        ready, _, _ = select.select([stdin], [], [], 1.0)
        if ready and not os.read(stdin, 4096):  # EOF: the supervisor is gone
            break
        if daemon[0].poll() is None:
            continue
        # corrald died (a crash, an OOM kill, a kill -9): its sandboxes run on unseen, its
        # node out of placement. Started again on its state dir, it adopts them (or ends
        # those that died), as a single machine's restart does.
        lived = time.monotonic() - born
        backoff = RESTART_MIN_S if lived > RESTART_MAX_S else min(RESTART_MAX_S, backoff * 2)
        print(f"corral keeper: corrald exited ({daemon[0].returncode}) after {lived:.0f} s; "
              f"starting it again in {backoff:g} s", file=sys.stderr, flush=True)
        ready, _, _ = select.select([stdin], [], [], backoff)
        if ready and not os.read(stdin, 4096):
            break
        daemon[0], born = _start(argv), time.monotonic()
    if daemon[0].poll() is not None:
        # The supervisor is gone with corrald down: start it once more to end the node's
        # sandboxes (a stop of corrald destroys them), so nothing runs on unseen.
        daemon[0] = _start(argv)
        _wait_up(daemon[0], argv)
    return _stop(daemon[0])


def _wait_up(daemon: subprocess.Popen[bytes], argv: list[str]) -> None:
    """Until corrald answers on its socket (its state recovered) or dies, at most a minute."""
    sock = argv[argv.index("--socket") + 1] if "--socket" in argv[:-1] else None
    deadline = time.monotonic() + 60
    while daemon.poll() is None and time.monotonic() < deadline:
        if sock is None:
            return
        with socket.socket(socket.AF_UNIX) as s:
            try:
                s.connect(sock)
                return
            except OSError:
                pass
        time.sleep(0.2)  # polling a socket another process makes, with a deadline


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
