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
    ProcessStillRunning,
    SandboxLost,
    SandboxNotFound,
    SandboxNotRunning,
    Timeout,
    Unsupported,
)

__version__ = "0.1.0"

__all__ = [
    "CapacityExceeded", "CorralError", "DaemonRestarted", "DaemonUnavailable", "FileNotFound",
    "ImageNotFound", "InfraError", "InvalidPath", "InvalidRequest", "ProcessStillRunning",
    "SandboxLost",
    "SandboxNotFound", "SandboxNotRunning", "Timeout", "Unsupported", "__version__",
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
