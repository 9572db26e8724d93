"""envd's process service (``/process.Process/*``) over corral's background commands.

Start runs the command as a corral background process and streams its start event (the pid
inside the sandbox), its output and its end event; the call's deadline
(``Connect-Timeout-Ms``) is the command's timeout, as in envd. A client that disconnects
leaves the process running (Connect reattaches, replaying what corral kept of its output).
An end by a signal is reported as envd does: exit code -1, ``exited`` false.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from aiohttp import web

from corral import errors as ce
from corral.e2b import users
from corral.e2b.connect import (
    ConnectError,
    ServerStream,
    read_client_stream,
    read_stream_request,
    read_unary,
    timeout_s,
    unary_response,
)
from corral.e2b.errors import to_connect
from corral.e2b.pbjson import SIGNALS, b64, message, selector, string, unb64
from corral.e2b.state import ProcEntry
from corral.models import ProcessHandle
from corral.sdk.async_sandbox import AsyncProcess, AsyncSandbox
from corral.sdk.results import OutputChunk

SIGNAL_NAMES = {9: "killed", 15: "terminated", 2: "interrupt", 1: "hangup", 3: "quit",
                6: "aborted", 13: "broken pipe", 14: "alarm clock"}
# The SDK asks for 50 s (its streams time out after 60 s of silence). Longer is not granted:
# a client that vanished is noticed at the next write, and until then its stream holds a slot
# and a connection to corrald.
MAX_KEEPALIVE = 50.0
MAX_ARGS = 4096


def _keepalive(request: web.Request) -> float:
    raw = request.headers.get("Keepalive-Ping-Interval", "")
    if raw.isascii() and raw.isdigit() and len(raw) <= 6 and int(raw) > 0:
        return min(float(raw), MAX_KEEPALIVE)
    return MAX_KEEPALIVE


def _config(msg: dict[str, Any]) -> tuple[str, list[str], dict[str, str], str | None]:
    cfg = message(msg, "process")
    cmd = string(cfg, "cmd")
    if not cmd:
        raise ConnectError("invalid_argument", "process.cmd is required")
    args = cfg.get("args") or []
    envs = cfg.get("envs") or {}
    if not isinstance(args, list) or len(args) > MAX_ARGS or \
            not all(isinstance(a, str) for a in args):
        raise ConnectError("invalid_argument", "process.args must be a list of strings")
    if not isinstance(envs, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                             for k, v in envs.items()):
        raise ConnectError("invalid_argument", "process.envs must map strings to strings")
    cwd = cfg.get("cwd")
    if cwd is not None and not isinstance(cwd, str):
        raise ConnectError("invalid_argument", "process.cwd must be a string")
    return cmd, args, envs, cwd or None


class ProcessService:
    def __init__(self, front: Any) -> None:
        self.f = front

    def _proc(self, sid: str, pid: int) -> AsyncProcess:
        handle = ProcessHandle(sandbox_id=sid, pid=pid, cmd="", started_at=time.time())
        return AsyncProcess(self.f.endpoint, handle)

    def _pid(self, sid: str, msg: dict[str, Any]) -> int:
        pid, tag = selector(msg)
        if pid is not None:
            return pid
        entry = self.f.state.procs(sid).by_tag(tag or "")
        if entry is None:
            raise ConnectError("not_found", f"no process with tag {tag!r}")
        return entry.pid

    # ---- streams --------------------------------------------------------------------------
    async def _pump(self, stream: ServerStream, sid: str, p: AsyncProcess,
                    keepalive: float, close_stdin: asyncio.Task[None] | None) -> None:
        """Output, then the end event; keepalives while the process is quiet."""
        q: asyncio.Queue[tuple[str, Any]] = asyncio.Queue(maxsize=256)

        async def read() -> None:
            try:
                async for chunk in p.stream():
                    await q.put(("data", chunk))
                await q.put(("end", None))
            except ce.CorralError as e:
                await q.put(("error", e))

        reader = asyncio.ensure_future(read())
        try:
            while stream.open:
                try:
                    kind, value = await asyncio.wait_for(q.get(), keepalive)
                except asyncio.TimeoutError:
                    await stream.send({"event": {"keepalive": {}}})
                    continue
                if kind == "data":
                    ch: OutputChunk = value
                    await stream.send({"event": {"data": {
                        ch.stream: b64(ch.data.encode("utf-8", "surrogateescape"))}}})
                elif kind == "error":
                    await stream.end(to_connect(value, sid))
                    return
                else:
                    await self._end(stream, sid, p)
                    return
        finally:
            reader.cancel()
            if close_stdin is not None:
                with contextlib.suppress(ce.CorralError, asyncio.CancelledError):
                    await close_stdin
            entry = self.f.state.procs(sid).by_pid.get(p.pid)
            if entry is not None and p.exit_code is not None:
                entry.finished = True

    async def _end(self, stream: ServerStream, sid: str, p: AsyncProcess) -> None:
        if p.timed_out:
            await stream.end(ConnectError("deadline_exceeded",
                                          "the command ran past its timeout and was killed"))
            return
        code = p.exit_code if p.exit_code is not None else -1
        end: dict[str, Any] = {"exitCode": code, "exited": True, "status": f"exit status {code}"}
        if p.signal:  # the stream's last line says (a shell's exit code 137 is no signal)
            name = SIGNAL_NAMES.get(p.signal, f"signal {p.signal}")
            end = {"exitCode": -1, "exited": False, "status": f"signal: {name}"}
        await stream.send({"event": {"end": end}})
        await stream.end()

    async def start(self, request: web.Request) -> web.StreamResponse:
        sid = request["sandbox_id"]
        msg = await read_stream_request(request)
        if msg.get("pty") is not None:
            raise ConnectError("unimplemented", "PTY sessions are not supported by corral")
        cmd, args, envs, cwd = _config(msg)
        user = users.from_header(request)
        tag = msg.get("tag")
        if tag is not None and not isinstance(tag, str):
            raise ConnectError("invalid_argument", "tag must be a string")
        stdin = msg.get("stdin", True)
        timeout = timeout_s(request)
        with self.f.streams.slot(sid):  # taken before the command runs: refused, it never does
            stream = ServerStream(request)
            sb = AsyncSandbox.from_id(sid, endpoint=self.f.endpoint)
            try:
                p = await sb.exec([cmd, *args], background=True, env=envs, user=user,
                                  cwd=users.resolve(cwd, user) if cwd else users.home(user),
                                  timeout=timeout)
            except ce.CorralError as e:
                return await stream.end(to_connect(e, sid))
            self.f.state.procs(sid).add(ProcEntry(pid=p.pid, cmd=cmd, args=args, envs=envs,
                                                  cwd=cwd, tag=tag))
            closing = None if stdin is not False else asyncio.ensure_future(p.close_stdin())
            await stream.send({"event": {"start": {"pid": p.pid}}})
            await self._pump(stream, sid, p, _keepalive(request), closing)
            return stream.response

    async def connect(self, request: web.Request) -> web.StreamResponse:
        sid = request["sandbox_id"]
        pid = self._pid(sid, await read_stream_request(request))
        with self.f.streams.slot(sid):
            stream = ServerStream(request)
            p = self._proc(sid, pid)
            try:
                st = await p.status()
            except ce.CorralError as e:
                return await stream.end(to_connect(e, sid))
            if not st.running:
                return await stream.end(ConnectError("not_found", f"process {pid} has ended"))
            await stream.send({"event": {"start": {"pid": pid}}})
            await self._pump(stream, sid, p, _keepalive(request), None)
            return stream.response

    # ---- unary ----------------------------------------------------------------------------
    async def list(self, request: web.Request) -> web.Response:
        sid = request["sandbox_id"]
        await read_unary(request)
        procs = self.f.state.procs(sid)
        entries = [e for e in procs.by_pid.values() if not e.finished]

        async def alive(e: ProcEntry) -> bool:
            try:
                running = (await self._proc(sid, e.pid).status()).running
            except ce.ProcessNotFound:
                running = False
            e.finished = not running
            return running

        states = await asyncio.gather(*(alive(e) for e in entries))
        out = []
        for e, running in zip(entries, states, strict=True):
            if not running:
                continue
            cfg: dict[str, Any] = {"cmd": e.cmd, "args": e.args, "envs": e.envs}
            if e.cwd is not None:
                cfg["cwd"] = e.cwd
            info: dict[str, Any] = {"config": cfg, "pid": e.pid}
            if e.tag is not None:
                info["tag"] = e.tag
            out.append(info)
        return unary_response({"processes": out})

    async def send_input(self, request: web.Request) -> web.Response:
        sid = request["sandbox_id"]
        msg = await read_unary(request)
        await self._send(sid, self._pid(sid, msg), message(msg, "input"))
        return unary_response({})

    async def _send(self, sid: str, pid: int, inp: dict[str, Any]) -> None:
        if "pty" in inp:
            raise ConnectError("unimplemented", "PTY sessions are not supported by corral")
        data = unb64(inp.get("stdin", ""), "input.stdin")
        try:
            data.decode()
        except UnicodeDecodeError:
            raise ConnectError("invalid_argument", "input.stdin must be UTF-8 text: a corral "
                               "command's stdin is text") from None
        await self._proc(sid, pid).send_stdin(data)

    async def stream_input(self, request: web.Request) -> web.StreamResponse:
        sid = request["sandbox_id"]
        msgs = await read_client_stream(request)
        stream = ServerStream(request)
        pid: int | None = None
        try:
            for m in msgs:
                if "start" in m:
                    pid = self._pid(sid, message(m, "start"))
                elif "data" in m:
                    if pid is None:
                        raise ConnectError("invalid_argument", "data before the start event")
                    await self._send(sid, pid, message(message(m, "data"), "input"))
        except ConnectError as e:
            return await stream.end(e)
        except ce.CorralError as e:
            return await stream.end(to_connect(e, sid))
        await stream.send({})
        return await stream.end()

    async def send_signal(self, request: web.Request) -> web.Response:
        sid = request["sandbox_id"]
        msg = await read_unary(request)
        name = msg.get("signal")
        sig = SIGNALS.get(name) if isinstance(name, (str, int)) else None
        if sig is None:
            raise ConnectError("invalid_argument", f"unknown signal {msg.get('signal')!r}")
        p = self._proc(sid, self._pid(sid, msg))
        st = await p.status()
        if not st.running:
            raise ConnectError("not_found", f"process {p.pid} has ended")
        await p.kill(sig)
        return unary_response({})

    async def close_stdin(self, request: web.Request) -> web.Response:
        sid = request["sandbox_id"]
        msg = await read_unary(request)
        await self._proc(sid, self._pid(sid, msg)).close_stdin()
        return unary_response({})

    async def update(self, request: web.Request) -> web.Response:
        raise ConnectError("unimplemented", "PTY sessions are not supported by corral")


def routes(svc: ProcessService) -> list[web.RouteDef]:
    base = "/process.Process/"
    return [web.post(base + "Start", svc.start), web.post(base + "Connect", svc.connect),
            web.post(base + "List", svc.list), web.post(base + "SendInput", svc.send_input),
            web.post(base + "StreamInput", svc.stream_input),
            web.post(base + "SendSignal", svc.send_signal),
            web.post(base + "CloseStdin", svc.close_stdin),
            web.post(base + "Update", svc.update)]
