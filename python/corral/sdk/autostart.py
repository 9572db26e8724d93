"""The embedded default: start a local corrald when nothing answers on the local socket, on
the first call and again whenever the daemon has died since (kill -9, a crash, an OOM kill).

Only for the socket the environment names (``CORRAL_SOCKET`` or the default) while
``CORRAL_URL`` is unset: an endpoint a caller chose (a path, a URL) is never started behind
its back, and ``CORRAL_AUTOSTART=0`` turns it off. The new daemon re-adopts the sandboxes the
dead one left running, so existing handles keep working; calls that were in flight when it died
got ``daemon_restarted``.

One starter per socket: the threads of a process queue on a lock here, processes on an flock
beside the socket (``launcher.ensure_daemon``); whoever comes second finds the new daemon
answering. A start that failed is not tried again for a while (0.5 s, doubling up to 30 s), so
a broken install does not fork a daemon per call.
"""

from __future__ import annotations

import os
import threading
import time

from corral import config
from corral.errors import CorralError, DaemonUnavailable
from corral.sdk.endpoint import Endpoint

BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0

_lock = threading.Lock()
# socket path -> (failed starts in a row, monotonic time before which none is tried, why)
_failed: dict[str, tuple[int, float, str]] = {}


def connected(endpoint: Endpoint) -> None:
    """A daemon answered on this endpoint: a later death starts afresh, without backoff."""
    if _failed and endpoint.unix_path is not None:
        _failed.pop(endpoint.unix_path, None)


def enabled(endpoint: Endpoint) -> bool:
    """Autostart applies to the embedded default only: the socket the environment names."""
    path = endpoint.unix_path
    if path is None or os.environ.get("CORRAL_URL", "").strip():
        return False
    if os.environ.get("CORRAL_AUTOSTART", "1").strip().lower() in ("0", "false", "no"):
        return False
    return os.path.abspath(path) == os.path.abspath(config.load().socket_path)


def try_start(endpoint: Endpoint) -> bool:
    """True if the caller should connect again: a daemon answers now (started by this call or
    by another thread or process). False if autostart does not apply to this endpoint. Raises
    DaemonUnavailable if starting one failed (now, or recently: backoff)."""
    path = endpoint.unix_path
    if path is None or not enabled(endpoint):
        return False
    with _lock:  # many threads failing at once: one starts, the others find it answering
        failed = _failed.get(path)
        now = time.monotonic()
        if failed is not None and now < failed[1]:
            raise DaemonUnavailable(
                f"no corrald answered on {path}; starting one failed {failed[0]} time(s) in a "
                f"row, next try in {failed[1] - now:.1f} s: {failed[2]}",
                details={"endpoint": str(endpoint)})
        try:
            from corral.daemon.launcher import ensure_daemon  # lazy: the SDK stays light

            ensure_daemon(socket_path=path)
        except (CorralError, ImportError, OSError) as e:
            why = e.message if isinstance(e, CorralError) else str(e)
            count = failed[0] + 1 if failed is not None else 1
            delay = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (count - 1))
            _failed[path] = (count, time.monotonic() + delay, why)
            raise DaemonUnavailable(f"no corrald answered on {path} and starting one failed: "
                                    f"{why}", details={"endpoint": str(endpoint)}) from e
        _failed.pop(path, None)
        return True
