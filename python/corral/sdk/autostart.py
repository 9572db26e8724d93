"""The embedded default: start a local corrald when nothing answers on the local socket.

Only for unix-socket endpoints, only when ``CORRAL_URL`` is unset, and only once per socket per
process (``CORRAL_AUTOSTART=0`` turns it off). A daemon that dies later is reported as
unavailable instead of being silently replaced: its sandboxes' fate is something the caller
should hear about.
"""

from __future__ import annotations

import os
import threading

from corral.errors import CorralError, DaemonUnavailable
from corral.sdk.endpoint import Endpoint

_lock = threading.Lock()
_outcome: dict[str, bool] = {}
_seen: set[str] = set()  # sockets this process has talked to: no autostart for those


def connected(endpoint: Endpoint) -> None:
    """Note that a daemon answered on this endpoint (cheap: called on new connections)."""
    if endpoint.unix_path is not None:
        _seen.add(endpoint.unix_path)


def enabled(endpoint: Endpoint) -> bool:
    if endpoint.unix_path is None or os.environ.get("CORRAL_URL"):
        return False
    return os.environ.get("CORRAL_AUTOSTART", "1").strip().lower() not in ("0", "false", "no")


def try_start(endpoint: Endpoint) -> bool:
    """True if the caller should try to connect again (a daemon was started for this socket,
    now or earlier in this process). Raises DaemonUnavailable if starting one failed."""
    path = endpoint.unix_path
    if path is None or not enabled(endpoint):
        return False
    with _lock:  # many threads / tasks failing at once start one daemon
        if path in _outcome:  # decided by an earlier caller: retry if it started one
            return _outcome[path]
        if path in _seen:  # a daemon answered before and is gone now: don't replace it
            return False
        _outcome[path] = False
        try:
            from corral.daemon.launcher import ensure_daemon  # lazy: the SDK stays light

            ensure_daemon(socket_path=path)
        except CorralError as e:
            raise DaemonUnavailable(f"no corrald answered on {path} and starting one failed: "
                                    f"{e.message}") from e
        except (ImportError, OSError) as e:
            raise DaemonUnavailable(f"no corrald answered on {path} and starting one failed: "
                                    f"{e}") from e
        _outcome[path] = True
        _seen.add(path)
        return True
