"""The corral SDK: ``Sandbox`` (blocking) and ``AsyncSandbox`` (asyncio).

Layout (one job per module):
  endpoint.py          where the daemon is (unix socket or URL); what a handle pickles
  call.py              one API call as data; error bodies -> corral exceptions
  api.py               every operation as a Call: the single implementation of both facades
  sync_transport.py    the blocking facade's transport: a pool, unix_http or http.client, errors
  async_transport.py   the asyncio facade's transport: aiohttp, and unix_http for plain calls
  unix_http.py         HTTP/1.1 on a unix socket with httptools: both facades' plain calls
  tarball.py           directory <-> tar for files.upload / files.download
  autostart.py         the embedded default: start a local corrald on first use
  handle.py            what both facades share: identity, pickling
  results.py           ExecResult (.ok, .check()), CommandFailed, OutputChunk
  sandbox.py           Sandbox, Files, Process
  async_sandbox.py     AsyncSandbox, AsyncFiles, AsyncProcess
  snapshot.py          Snapshot, AsyncSnapshot (list, get, delete)
  admin.py             daemon status, images
  run_code.py          run_code, run_code_many (+ _async): the process substrate's call tier
"""

from corral.sdk.async_sandbox import AsyncFiles, AsyncProcess, AsyncSandbox
from corral.sdk.endpoint import Endpoint
from corral.sdk.results import CommandFailed, ExecResult, OutputChunk
from corral.sdk.run_code import (
    RunCodeResult,
    run_code,
    run_code_async,
    run_code_many,
    run_code_many_async,
)
from corral.sdk.sandbox import Files, Process, Sandbox
from corral.sdk.snapshot import AsyncSnapshot, Snapshot

__all__ = [
    "AsyncFiles", "AsyncProcess", "AsyncSandbox", "CommandFailed", "Endpoint", "ExecResult",
    "Files", "OutputChunk", "Process", "Sandbox", "AsyncSnapshot", "Snapshot",
    "RunCodeResult", "run_code", "run_code_async", "run_code_many", "run_code_many_async",
]
