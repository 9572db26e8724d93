"""Results the SDK hands back: ``ExecResult`` with ``ok``/``check()``, and ``CommandFailed``."""

from __future__ import annotations

from typing import Any, NamedTuple

from corral import models
from corral.errors import CorralError


class ExecResult(models.ExecResult):
    """What a command did: ``stdout``, ``stderr``, ``exit_code``, ``duration_s``,
    ``truncated`` (output beyond ``max_output_bytes`` was dropped), ``timed_out``, ``signal``
    (the signal that ended the command's process, None if it exited), ``oom_killed`` (the OOM
    killer killed in the sandbox while it ran: its memory limit, category ``limit``)."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def check(self) -> ExecResult:
        """Return self if the command succeeded, else raise CommandFailed."""
        if not self.ok:
            raise CommandFailed(self)
        return self


class CommandFailed(CorralError):
    """A command ran and failed (non-zero exit or its own timeout). Not an infra error: the
    sandbox and the platform did their job; the command's outcome is a real signal."""

    code, status = "command_failed", 200

    def __init__(self, result: ExecResult, message: str = "") -> None:
        if not message:
            what = "timed out" if result.timed_out else f"exited with code {result.exit_code}"
            tail = result.stderr.strip()[-500:]
            message = f"command {what}" + (f": {tail}" if tail else "")
        super().__init__(message, details={"exit_code": result.exit_code,
                                           "timed_out": result.timed_out})
        self.result = result

    def __reduce__(self) -> tuple[Any, ...]:
        # CorralError rebuilds by code, which only knows the daemon's codes.
        return (CommandFailed, (self.result, self.message))


class OutputChunk(NamedTuple):
    """One piece of a background process's output: ``for stream, data in proc.stream()``."""

    stream: str  # "stdout" or "stderr"
    data: str
