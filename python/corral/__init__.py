"""corral: elastic sandboxes for agentic RL."""

from corral.errors import (
    CapacityExceeded,
    CorralError,
    DaemonRestarted,
    DaemonUnavailable,
    FileNotFound,
    ImageNotFound,
    InfraError,
    InvalidPath,
    InvalidRequest,
    SandboxLost,
    SandboxNotFound,
    SandboxNotRunning,
    Timeout,
    Unsupported,
)

__version__ = "0.1.0"

__all__ = [
    "CapacityExceeded", "CorralError", "DaemonRestarted", "DaemonUnavailable", "FileNotFound",
    "ImageNotFound", "InfraError", "InvalidPath", "InvalidRequest", "SandboxLost",
    "SandboxNotFound", "SandboxNotRunning", "Timeout", "Unsupported", "__version__",
]

# The SDK is added by corral.sdk (Sandbox, AsyncSandbox, ExecResult, ...).
try:  # pragma: no cover - the SDK module may be absent during early bootstrap
    from corral.sdk import AsyncSandbox, ExecResult, Sandbox  # noqa: F401

    __all__ += ["AsyncSandbox", "ExecResult", "Sandbox"]
except ImportError:  # noqa: S110
    pass
