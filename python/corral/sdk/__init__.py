"""The corral SDK: ``Sandbox`` (blocking) and ``AsyncSandbox`` (asyncio).

Layout (one job per module):
  endpoint.py          where the daemon is (unix socket or URL); what a handle pickles
  call.py              one API call as data; error bodies -> corral exceptions
  api.py               every operation as a Call: the single implementation of both facades
  sync_transport.py    httpx HTTPTransport (uds=) for the blocking facade
  async_transport.py   aiohttp for the asyncio facade (see its docstring for why)
  autostart.py         the embedded default: start a local corrald on first use
  sandbox.py           Sandbox, Files, Process
  async_sandbox.py     AsyncSandbox, AsyncFiles, AsyncProcess
  admin.py             daemon status, images
"""

from corral.sdk.async_sandbox import AsyncFiles, AsyncProcess, AsyncSandbox
from corral.sdk.endpoint import Endpoint
from corral.sdk.results import CommandFailed, ExecResult, OutputChunk
from corral.sdk.sandbox import Files, Process, Sandbox

__all__ = [
    "AsyncFiles", "AsyncProcess", "AsyncSandbox", "CommandFailed", "Endpoint", "ExecResult",
    "Files", "OutputChunk", "Process", "Sandbox",
]
