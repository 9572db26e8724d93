"""corral: elastic sandboxes for agentic RL."""

from corral.errors import (
    CapacityExceeded,
    Conflict,
    CorralError,
    DaemonRestarted,
    DaemonUnavailable,
    DirectoryNotEmpty,
    FileExists,
    FileNotFound,
    ImageNotFound,
    InfraError,
    InternalError,
    InvalidPath,
    InvalidRequest,
    IsADirectory,
    NotADirectory,
    NotFound,
    ProcessNotFound,
    ProcessStillRunning,
    SandboxLost,
    SandboxNotFound,
    SandboxNotRunning,
    Timeout,
    Unauthorized,
    Unsupported,
)

__version__ = "0.1.0"

__all__ = [
    "CapacityExceeded",
    "Conflict",
    "CorralError",
    "DaemonRestarted",
    "DaemonUnavailable",
    "DirectoryNotEmpty",
    "FileExists",
    "FileNotFound",
    "ImageNotFound",
    "InfraError",
    "InternalError",
    "InvalidPath",
    "InvalidRequest",
    "IsADirectory",
    "NotADirectory",
    "NotFound",
    "ProcessNotFound",
    "ProcessStillRunning",
    "SandboxLost",
    "SandboxNotFound",
    "SandboxNotRunning",
    "Timeout",
    "Unauthorized",
    "Unsupported",
    "__version__",
]

from corral.sdk import (  # noqa: E402 - after __version__: the SDK modules import it
    AsyncProcess,
    AsyncSandbox,
    CommandFailed,
    ExecResult,
    OutputChunk,
    Process,
    Sandbox,
)

__all__ += ["AsyncProcess", "AsyncSandbox", "CommandFailed", "ExecResult", "OutputChunk",
            "Process", "Sandbox"]
