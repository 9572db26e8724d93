"""Exec: commands in a sandbox, their processes, stdin, signals, waits."""

from __future__ import annotations

import asyncio
import builtins
import collections
import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from corral.daemon import procs, users
from corral.daemon.outputmem import Kept, OutputMemory, OutputText
from corral.daemon.substrates.base import OomCount, Substrate, oom_verdict
from corral.daemon.tenants import TENANT_LABEL
from corral.errors import (
    CapacityExceeded,
    Conflict,
    CorralError,
    CwdNotFound,
    FileNotFound,
    InfraError,
    InternalError,
    InvalidPath,
    InvalidRequest,
    NotADirectory,
    ProcessNotFound,
    ProcessStillRunning,
)
from corral.models import ExecRequest

from .base import (
    DEFAULT_CWD,
    DEFAULT_PATH,
    INIT_EXIT_GRACE_STEPS,
    MAX_KEPT_OUTPUT,
    MAX_LINGERING,
    MAX_PROCS_KEPT,
    PASSWD_MAX,
    Sandbox,
    _effective_timeout,
    log,
)

if TYPE_CHECKING:  # pragma: no cover
    from .host import EngineHost


class ExecOps:
    async def _identity(self: EngineHost, sb: Sandbox,
                        user: str | int | None) -> users.Identity:
        """``user`` from the sandbox's /etc/passwd and /etc/group, which its code writes: each
        read as any file read is (from memory on the loop, else in a file thread) and at most
        PASSWD_MAX bytes (the parse runs on the loop, for every command run as a user)."""
        if user is None or user == 0 or user in ("root", "0"):
            return users.ROOT

        async def read(path: str) -> str:
            try:
                data, truncated, _ = await self.read_file(sb.id, path, PASSWD_MAX)
            except FileNotFound:
                return ""
            if truncated:
                raise InvalidRequest(
                    f"the sandbox's {path} is larger than {PASSWD_MAX} bytes: a command's "
                    "user is looked up in it only up to that", details={"path": path,
                                                                         "max": PASSWD_MAX})
            return data.decode("utf-8", "replace")

        return users.resolve(user, await read("/etc/passwd"), await read("/etc/group"))

    async def exec(self: EngineHost, sid: str, req: ExecRequest) -> dict[str, Any]:
        if self._capturing(sid):
            await self.ready(sid)
        sb = self.get(sid)
        for k, v in req.env.items():
            if not k or "=" in k or "\0" in k or "\0" in v:
                raise InvalidRequest(f"bad environment variable name or value: {k!r}")
        cwd = req.cwd or sb.spec.cwd
        if not cwd.startswith("/") or "\0" in cwd:
            raise InvalidPath(f"cwd must be an absolute path: {cwd!r}")
        if req.cwd is not None or cwd != DEFAULT_CWD:
            await self._check_cwd(sid, cwd)
        ident = await self._identity(sb, req.user if req.user is not None else sb.spec.user)
        env = {"PATH": DEFAULT_PATH, "HOME": ident.home, "LANG": "C.UTF-8", "TERM": "xterm",
               "HOSTNAME": sb.hostname}
        env.update(sb.spec.env)
        env.update(req.env)
        argv = ["/bin/sh", "-c", req.cmd] if isinstance(req.cmd, str) else req.cmd
        stdin = req.stdin.encode() if req.stdin is not None else None
        substrate = self.substrates[sb.spec.substrate]
        assert self._loop is not None and sb.runtime is not None
        oom_before = substrate.oom_kills(sb.runtime)  # ExecResult.oom_killed: see _oom_after
        try:
            proc = await procs.start(self._loop, substrate, sb.runtime, argv, env, cwd,
                                     ident.uid, ident.gid, ident.groups, cmd=req.cmd,
                                     stdin=stdin, keep_stdin=req.background,
                                     cap=req.max_output_bytes,
                                     timeout=_effective_timeout(req),
                                     store=self.output_memory.share(
                                         sb.spec.labels.get(TENANT_LABEL)))
        except CorralError:
            self._check_alive(sb)  # e.g. sandbox_not_running from a dead init -> lost
            raise
        except OSError as e:
            self._check_alive(sb)
            log.exception("spawn failed", extra={"sandbox": sid})
            raise InternalError(f"could not start the command: {e}") from e
        self.counters["execs"] += 1
        if oom_before is not None:
            runtime = sb.runtime
            proc.on_exit(lambda: self._oom_after(substrate, runtime, proc, oom_before))
        if req.background:
            if not proc.init_child:  # the init told us the pid it sees
                proc.ns_pid = procs.ns_pid(proc.pid)
            self._keep_proc(sb, proc)
            if self.pools is not None:
                self.pools.settled(sid)
            return {"sandbox_id": sid, "pid": proc.ns_pid, "cmd": req.cmd,
                    "started_at": proc.started_at}
        sb.busy += 1
        try:
            await proc.done
        except asyncio.CancelledError:
            proc.killpg(9)  # the daemon is stopping: don't leave the command behind
            raise
        finally:
            sb.busy -= 1
            sb.last_active = self.clock.time()
            if self.pools is not None:  # its first exec is over: refills may start
                self.pools.settled(sid)
        try:
            await self.after_exit(sb, proc)
            return self._result(proc)
        finally:
            self._linger(sb, proc)

    def _linger(self: EngineHost, sb: Sandbox, proc: procs.Process) -> None:
        """A returned command whose output pipes are still open (a process it left holds
        them: ``(server &)``) is drained until they close; past MAX_LINGERING of those in a
        sandbox, the oldest's pipes are closed (a writer then gets EPIPE, as when any reader
        goes away), so a sandbox cannot make the daemon hold two fds per command it ran."""
        if not proc.pipes_open():
            return
        proc.forget_output()  # its result is made: only the draining goes on
        if sb.lingering is None:
            sb.lingering = collections.deque()
        sb.lingering.append(proc)
        if len(sb.lingering) > MAX_LINGERING:
            sb.lingering = collections.deque(p for p in sb.lingering if p.pipes_open())
            while len(sb.lingering) > MAX_LINGERING:
                sb.lingering.popleft().close_pipes()

    async def _check_cwd(self: EngineHost, sid: str, cwd: str) -> None:
        """A cwd named by the client must be a directory inside the sandbox (resolved in its
        root, like a file operation): the command would otherwise start in / unnoticed. The
        default cwd may be missing from an image: then the command starts in /."""
        try:
            entry = await self.stat(sid, cwd)
        except (FileNotFound, NotADirectory):
            raise CwdNotFound(f"cwd {cwd!r} does not exist in the sandbox",
                              details={"cwd": cwd}) from None
        if entry.type not in ("dir", "symlink"):  # a symlink is resolved by chdir itself
            raise NotADirectory(f"cwd {cwd!r} is not a directory", details={"cwd": cwd})

    def _result(self: EngineHost, proc: procs.Process) -> dict[str, Any]:
        _raise_output_lost(proc)
        res = proc.result()
        if self.trajlog.enabled:  # hashes of the full outputs, for the log (popped there)
            res["_sha"] = (proc.stdout.sha256(), proc.stderr.sha256())
        return res

    async def exec_many(self: EngineHost, ids: builtins.list[str], req: ExecRequest,
                        concurrency: int = 64,
                        on_done: Callable[[], None] | None = None,
                        tenant: str | None = None) -> builtins.list[dict[str, Any]]:
        """The same foreground command in each sandbox, ``concurrency`` at a time; one result
        per id, in order: an ExecResult dict, or ``{"error"}`` for a sandbox where it could not
        run (the others are unaffected). ``on_done`` is called once per id settled. Each
        result's output is charged to ``tenant``'s share of the output memory while the
        results are held (_held_for_batch)."""
        gate = asyncio.Semaphore(concurrency)
        logged = req.model_dump(mode="json") if self.trajlog.enabled else {}
        store = self.output_memory.share(tenant)

        async def one(sid: str) -> dict[str, Any]:
            async with gate:
                try:  # each one logged in its sandbox's trajectory log, like a single exec
                    res = await self.trajlog.run(sid, "exec", logged, None,
                                                 lambda: self.exec(sid, req),
                                                 to_log=self.trajlog.exec_result)
                    return _held_for_batch(res, store)
                except CorralError as e:
                    return e.to_payload()
                finally:
                    if on_done is not None:
                        on_done()

        return list(await asyncio.gather(*(one(sid) for sid in ids)))

    async def after_exit(self: EngineHost, sb: Sandbox, proc: procs.Process) -> None:
        """If the sandbox ended while the command ran, report that, not an exit code that
        the ending caused. A SIGKILL we did not send (timeout) may be the init dying: the
        kernel kills the namespace's processes *before* the init turns into a zombie, so the
        command's exit can arrive first; give the init's pidfd watcher a moment to fire."""
        if proc.timed_out:
            self.counters["exec_timeouts"] += 1
        elif proc.exit_code == 128 + 9 and sb.state == "running":
            for _ in range(INIT_EXIT_GRACE_STEPS):
                if sb.state != "running" or not self._alive(sb):
                    break
                await asyncio.sleep(0.005)
        # Paused (or frozen for a snapshot) after the command ended, before its exit was
        # seen here: the command's result stands.
        if sb.state not in ("running", "paused"):
            raise self._gone(sb.id, sb)
        if not self._alive(sb):
            self._lose(sb)
            raise self._gone(sb.id, sb)
        _raise_host_oom(sb.id, proc)

    @staticmethod
    def _oom_after(substrate: Substrate, runtime: Any, proc: procs.Process,
                   before: OomCount) -> None:
        """At the command's exit: did the OOM killer kill in the sandbox while it ran, and
        was the sandbox at its own limit then (oom_verdict)? Read as the exit is
        seen, so a background command's answer does not depend on when it is waited for.
        The counts are the sandbox's: an OOM kill of a concurrent command's process counts
        too. A kill with no sign of the sandbox's own limit hit (a host-wide OOM, an
        enclosing limit) is not the command's doing: ``host_oom``, answered as an
        infra error (_raise_host_oom), never as the command's result."""
        try:
            after = substrate.oom_kills(runtime)
        except (OSError, ValueError):
            return
        verdict = oom_verdict(before, after)
        proc.oom_killed = verdict == "own"
        proc.host_oom = verdict == "host"

    def _keep_proc(self: EngineHost, sb: Sandbox, proc: procs.Process) -> None:
        if sb.procs is None:
            sb.procs = {}
        table = sb.procs
        kept = sum(p.kept_bytes() for p in table.values() if not p.running)
        if len(table) >= MAX_PROCS_KEPT or kept > MAX_KEPT_OUTPUT:
            # Oldest finished first, down to half of each bound (not one per new process).
            for pid in [pid for pid, p in table.items() if not p.running]:
                gone = table.pop(pid)
                kept -= gone.kept_bytes()
                gone.forget_output()
                if len(table) < MAX_PROCS_KEPT // 2 and kept <= MAX_KEPT_OUTPUT // 2:
                    break
        old = table.pop(proc.ns_pid, None)
        if old is not None:
            old.release()
        table[proc.ns_pid] = proc

    def proc(self: EngineHost, sid: str, pid: int) -> tuple[Sandbox, procs.Process]:
        sb = self.get(sid)
        p = sb.procs.get(pid) if sb.procs else None
        if p is None:
            raise ProcessNotFound(f"no background process {pid} in sandbox {sid}",
                                  details={"id": sid, "pid": pid})
        return sb, p

    def proc_status(self: EngineHost, sid: str, pid: int) -> dict[str, Any]:
        """A process's state. An ended one's exit is the command's result only if it was its
        own doing: one killed by an OOM from outside the sandbox's limit answers the infra
        error its wait does (a trainer polling status would otherwise score the 137)."""
        p = self.proc(sid, pid)[1]
        if not p.running:
            _raise_host_oom(sid, p)
        return p.status()

    @contextlib.contextmanager
    def following(self: EngineHost, sb: Sandbox) -> Iterator[None]:
        """A client follows a process's output: activity, as a foreground exec is (the
        sandbox does not idle out meanwhile)."""
        sb.busy += 1
        try:
            yield
        finally:
            sb.busy -= 1

    async def wait(self: EngineHost, sid: str, pid: int, timeout: float | None) -> dict[str, Any]:
        sb, p = self.proc(sid, pid)
        if p.running:
            await self.until_exit(sb, p, timeout)
            await self.after_exit(sb, p)
        _raise_host_oom(sid, p)
        return self._result(p)

    async def until_exit(self: EngineHost, sb: Sandbox, p: procs.Process,
                         timeout: float | None) -> None:
        """Wait for a background process; a client waiting on it keeps the sandbox from
        idling out, like a foreground exec."""
        sb.busy += 1
        try:
            await asyncio.wait_for(asyncio.shield(p.done), timeout)
        except asyncio.TimeoutError:
            raise ProcessStillRunning(f"process {p.ns_pid} still running after {timeout} s",
                          details={"pid": p.ns_pid}) from None
        finally:
            sb.busy -= 1
            sb.last_active = self.clock.time()

    def stdin(self: EngineHost, sid: str, pid: int, data: str, eof: bool) -> None:
        _, p = self.proc(sid, pid)
        if not p.running:
            raise Conflict(f"process {pid} has exited", details={"pid": pid})
        if p.stdin is None:
            raise Conflict(f"process {pid} has no stdin pipe", details={"pid": pid})
        p.stdin.write(data.encode(), eof)

    def signal(self: EngineHost, sid: str, pid: int, sig: int) -> None:
        _, p = self.proc(sid, pid)
        p.killpg(sig)


def _raise_output_lost(proc: procs.Process) -> None:
    """Output within the command's cap that the daemon could not keep (its output pool and
    spill disk share full: other commands' output, maybe another tenant's; or the tenant's
    own share of them, outputmem.TENANT_SHARE) would read as the command's own truncation
    and be scored: it is the daemon's failure, an infra error. ``details`` keeps what the
    result would have said."""
    lost = [name for name, c in (("stdout", proc.stdout), ("stderr", proc.stderr))
            if c.kept.full]
    if lost:
        raise InfraError(
            f"the daemon's output store (or the tenant's share of it) was full: it could not "
            f"keep all of the command's "
            f"{' and '.join(lost)} within its max_output_bytes",
            details={"cause": "output_store_full", "streams": lost, "pid": proc.ns_pid,
                     "exit_code": proc.exit_code, "signal": proc.signal,
                     "timed_out": proc.timed_out, "stdout_bytes": proc.stdout.total,
                     "stderr_bytes": proc.stderr.total})


def _raise_host_oom(sid: str, proc: procs.Process) -> None:
    """A command during which the OOM killer killed in the sandbox while the sandbox was not
    at its own memory limit (a host-wide OOM, an enclosing limit such as the
    daemon's or a node's): its outcome is the host's doing, so it is an infra error (mask),
    never an exit code (score). ``details`` keeps what the command's result would have
    said."""
    if proc.host_oom:
        raise InfraError(
            f"a process of sandbox {sid} was killed by an out-of-memory kill from outside its "
            f"own memory limit (the host's or an enclosing limit's) while the command ran",
            details={"cause": "host_oom", "id": sid, "pid": proc.ns_pid,
                     "exit_code": proc.exit_code, "signal": proc.signal})


def _held_for_batch(res: dict[str, Any], store: OutputMemory) -> dict[str, Any]:
    """``res`` with its small outputs kept as the store keeps output, for as long as it is
    held: charged to the pool, else in a spill file. A stream's first FLOOR bytes are free
    because a running command's pipe holds as much; a batch holds every item's result until
    its answer is written: 10,000 items printing 64 KiB to each stream held 1.4 GB of the
    daemon that no pool counted. Output the store cannot keep at all (its pool and its spill
    share full) fails the item as capacity_exceeded (infra: not the command's doing)."""
    for k in ("stdout", "stderr"):
        text = res.get(k)
        if not isinstance(text, str) or not text:
            continue  # an OutputText is charged already (past FLOOR) and spilled past that
        data = text.encode()
        kept = Kept(store)
        if not kept.add_charged(data):
            raise CapacityExceeded(
                "the daemon cannot keep this batch item's output: the batch's results hold "
                "the output memory and spill room this client may use; run fewer or smaller "
                "items at once", details={"resource": "output_memory", "bytes": len(data)})
        res[k] = OutputText(kept)
    return res
