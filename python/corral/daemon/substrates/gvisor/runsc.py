"""The runsc command line, for one daemon: its own ``--root`` (state dir) under the daemon's
state dir, the platform the probe chose, no network, shared file access (the daemon's file
operations write the sandbox's root from the host side)."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

CMD_TIMEOUT_S = 30.0


class RunscError(OSError):
    pass


class Runsc:
    def __init__(self, binary: str, root: str, platform: str, null: str) -> None:
        self.binary = binary
        # runsc gives its stdio to the sandbox's user: a null node of the daemon's own
        # (kernel.private_null), never the host's /dev/null
        self.null = null
        self.root = root
        self.platform = platform
        self.prefix = [binary, f"--root={root}", f"--platform={platform}", "--network=none",
                       "--file-access=shared"]

    def run(self, *args: str, timeout: float = CMD_TIMEOUT_S, log: str | None = None,
            flags: tuple[str, ...] = ()) -> None:
        """Run one runsc command to its end; RunscError with its last stderr line if it
        fails. stdout is the null node: a sandbox runsc starts inherits it (a pipe would never see
        its end); stderr goes to ``log`` (a file) for the same reason. ``flags``: global
        flags for this command only."""
        err_path = log or self.null
        with open(self.null, "r+b") as null, open(err_path, "ab") as err:
            try:
                r = subprocess.run([*self.prefix, *flags, *args], stdin=null,
                                   stdout=null, stderr=err, timeout=timeout)
            except subprocess.TimeoutExpired:
                raise RunscError(f"runsc {args[0]}: no answer within {timeout:g}s") from None
        if r.returncode != 0:
            raise RunscError(f"runsc {args[0]} failed: {_last_line(log) or r.returncode}")

    def state(self, sandbox_id: str) -> dict[str, Any] | None:
        """The container's state file (status, sandbox pid, gofer pid), read directly: a
        `runsc state` is a process start for what a file read tells."""
        path = os.path.join(self.root, f"{sandbox_id}_sandbox:{sandbox_id}.state")
        try:
            with open(path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def ids(self) -> set[str]:
        """The containers this root holds state for."""
        out = set()
        try:
            for name in os.listdir(self.root):
                if name.endswith(".state") and "_sandbox:" in name:
                    out.add(name.split("_sandbox:", 1)[0])
        except FileNotFoundError:
            pass
        return out

    def forget(self, sandbox_id: str) -> None:
        """Remove what runsc keeps for a container it could not delete itself."""
        prefix = f"{sandbox_id}_sandbox:"
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return
        for name in names:
            if name.startswith(prefix):
                try:
                    os.unlink(os.path.join(self.root, name))
                except OSError:
                    pass


def _last_line(path: str | None) -> str:
    if not path:
        return ""
    try:
        with open(path, errors="replace") as f:
            lines = [ln.strip() for ln in f if ln.strip()]
    except OSError:
        return ""
    return lines[-1][-300:] if lines else ""
