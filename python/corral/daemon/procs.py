"""Exec I/O: the pipes, output capture, stdin and exit status of a process started in a sandbox.

The process is a direct child of the daemon (``Substrate.spawn``). We wait for exactly that
child through a pidfd registered with the event loop and reap it with
``waitid(P_PIDFD, ..., WNOHANG)``. asyncio's subprocess APIs and child watchers are never used
in the daemon: they reap with waitpid(-1)-style calls and would steal other children (sandbox
inits, other execs).

A command started through the sandbox's init (``initexec``) is the init's child, not ours: the
init reaps it, and we learn of that through its pidfd's EPOLLHUP (``ReapWatch``) and read the
exit status from the pidfd.

A command is done when its process exits, not when its pipes close: a background grandchild
(``server &``) may keep stdout open forever. At exit we drain what is already in the pipes, then
keep reading (and discarding) until EOF so that such a grandchild never gets SIGPIPE.
"""

from __future__ import annotations

import asyncio
import codecs
import hashlib
import os
import select
import signal
import time
import weakref
from collections.abc import Callable
from typing import Any

from corral.daemon import kernel
from corral.daemon.discard import DiscardBudget
from corral.daemon.outputmem import FLOOR, Kept, OutputMemory, OutputText
from corral.daemon.substrates.base import ExecSpec, SandboxRuntime, Spawned, Substrate
from corral.errors import Conflict

READ_CHUNK = 256 * 1024
# After exit, read at most this many chunks synchronously: a grandchild flooding the pipe must
# not pin the loop.
DRAIN_CHUNKS = 64
# A client following a process's output: past this many bytes waiting for it, the process's
# pipes are not read (it waits on them) until the client has taken all but FOLLOW_LOW.
FOLLOW_HIGH = 4 * 1024 * 1024
FOLLOW_LOW = 1024 * 1024
STDIN_MAX_PENDING = 64 * 1024 * 1024
# A command SIGKILLed by the daemon whose exit is not seen this long after is answered as
# killed without waiting for it: no code of its runs again, and what is left is the kernel
# tearing its memory down, which a command can make last (page tables: ~10 s a GiB here),
# long enough for the client to give up and read the command's own timeout as infra.
KILL_SETTLE_S = 1.0
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


class Capture:
    """One output stream read from the loop: kept up to ``cap`` bytes (outputmem: in memory,
    past its pool in a spill file), counted to the end. What it does not keep (sent to a
    follower or thrown away) is read within the loop's DiscardBudget; ``hold`` stops reading
    (the writer then waits on its full pipe) until every holder has let go."""

    __slots__ = ("fd", "kept", "cap", "total", "listeners", "loop", "keep", "sha",
                 "holds")

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int, cap: int,
                 store: OutputMemory | None = None) -> None:
        self.loop = loop
        self.fd = fd
        self.kept = Kept(store)
        self.cap = cap
        self.total = 0
        self.keep = True           # False once the command is done: read only to avoid SIGPIPE
        self.sha: Any = None       # sha256 of the whole stream, started once it passes the cap
        # Who follows the stream, each with its own incremental UTF-8 decoder: one that came
        # after a gap must not get a character begun by bytes before it.
        self.listeners: list[tuple[Callable[[str], None], Any]] | None = None
        self.holds: list[object] = []  # who has reading stopped (DiscardBudget, Follower)
        loop.add_reader(fd, self._on_readable)

    @property
    def truncated(self) -> bool:
        return self.total > len(self.kept)

    def hold(self, who: object) -> None:
        """Stop reading until ``who`` (and every other holder) releases it."""
        if who in self.holds:
            return
        if not self.holds and self.fd >= 0:
            self.loop.remove_reader(self.fd)
        self.holds.append(who)

    def release(self, who: object) -> None:
        if who not in self.holds:
            return
        self.holds.remove(who)
        if not self.holds and self.fd >= 0:
            self.loop.add_reader(self.fd, self._on_readable)

    def _past_cap(self) -> bool:
        """The next read is not kept: the stream is past its cap, or its command is done.
        (A follower may still get it: what one is sent past the cap is in the budget too.)"""
        return not self.keep or len(self.kept) >= self.cap

    def _read(self, budgeted: bool = True) -> bool:
        """One read; False when nothing more is readable right now (or at EOF), or when what
        it would not keep is over the loop's budget (then it is held until the refill)."""
        budget = DiscardBudget.of(self.loop) if self._past_cap() else None
        if budget is not None and budgeted and not budget.admit(self):
            return False
        try:
            data = os.read(self.fd, READ_CHUNK)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        if not data:
            self.close()
            return False
        if not self.keep:
            DiscardBudget.of(self.loop).spend(len(data))
        else:
            self.total += len(data)
            kept = self.kept
            room = self.cap - len(kept)
            n = kept.add(data if room >= len(data) else data[:room]) if room > 0 else 0
            if n < len(data):  # past the cap: keep hashing what is dropped (trajectory log)
                if n < room:  # nothing more can be kept (outputmem): as if at its cap
                    self.cap = len(kept)
                if self.sha is None:
                    self.sha = hashlib.sha256()
                    for chunk in kept.chunks():
                        self.sha.update(chunk)
                self.sha.update(data[n:] if n else data)
                DiscardBudget.of(self.loop).spend(len(data) - n)
            if self.listeners:
                for cb, dec in list(self.listeners):
                    text = dec.decode(data)
                    if text:
                        cb(text)
        return True

    def _on_readable(self) -> None:
        self._read()

    def drain(self) -> None:
        """What the pipe holds at the command's exit, whatever the budget (then charged to
        it): at most DRAIN_CHUNKS reads."""
        for _ in range(DRAIN_CHUNKS):
            if self.fd < 0 or not self._read(budgeted=False):
                break

    def subscribe(self, cb: Callable[[str], None]) -> tuple[str | OutputText, int]:
        """Start delivering decoded text to ``cb``; return what was buffered so far, and how
        many bytes the command wrote after that which were dropped (past its cap before
        anyone streamed): the text ``cb`` gets follows that gap, not the buffered text."""
        skipped = self.total - len(self.kept)
        dec = codecs.getincrementaldecoder("utf-8")("replace")
        # Bytes read before it came were not fed to its decoder: its state is their
        # unfinished last character (at most 3 bytes), which their last 4 set. Not past a
        # gap: the bytes after it do not continue that character.
        if not skipped:
            dec.decode(self.kept.tail(4))
        if self.listeners is None:
            self.listeners = []
        self.listeners.append((cb, dec))
        if skipped:  # the kept text whole, as the command's result has it
            return self._text(len(self.kept)), skipped
        pending = len(dec.getstate()[0])
        return self._text(len(self.kept) - pending), 0

    def unsubscribe(self, cb: Callable[[str], None]) -> None:
        if self.listeners:
            self.listeners = [(c, d) for c, d in self.listeners if c != cb]  # bound methods: ==

    def text(self) -> str | OutputText:
        """What it kept, as text: a str when small, else read from the kept bytes as it is
        written (OutputText), never held whole."""
        return self._text(len(self.kept))

    def _text(self, size: int) -> str | OutputText:
        kept = self.kept
        if kept.fd < 0 and size <= FLOOR:
            return kept.head[:size].decode("utf-8", "replace")
        return OutputText(kept, size)

    def sha256(self) -> str:
        """Hex sha256 of everything the stream produced (not only the kept part)."""
        if self.sha is not None:
            return str(self.sha.hexdigest())
        if not len(self.kept):
            return EMPTY_SHA256  # most streams of most commands: no hashing per exec
        h = hashlib.sha256()
        for chunk in self.kept.chunks():
            h.update(chunk)
        return h.hexdigest()

    def forget(self) -> None:
        """Let go of what it kept (given back once no answer still reads it)."""
        self.kept = Kept(None)

    def flush(self) -> None:
        """The command's output is all read: give each listener what its decoder still
        holds, an unfinished last character (one U+FFFD, as the answer's decode gives it), or
        a stream would end short of the command's own result."""
        for cb, dec in list(self.listeners or ()):
            text = dec.decode(b"", True)
            if text:
                cb(text)

    def finish(self) -> None:
        """The command is done: stop buffering, keep draining to EOF."""
        self.keep = False
        self.listeners = None

    def close(self) -> None:
        if self.fd >= 0:
            if not self.holds:
                self.loop.remove_reader(self.fd)
            os.close(self.fd)
            self.fd = -1


class Stdin:
    """The write end of a process's stdin, non-blocking, with a bounded pending queue."""

    __slots__ = ("fd", "pending", "eof", "loop", "waiting")

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int) -> None:
        self.loop = loop
        self.fd = fd
        self.pending = bytearray()
        self.eof = False
        self.waiting = False

    def write(self, data: bytes, eof: bool = False) -> None:
        if self.fd < 0:
            raise Conflict("stdin of this process is closed")
        if len(self.pending) + len(data) > STDIN_MAX_PENDING:
            raise Conflict("too much stdin pending: the process is not reading it")
        self.pending += data
        self.eof = self.eof or eof
        self._flush()

    def _flush(self) -> None:
        while self.pending:
            try:
                n = os.write(self.fd, self.pending)
            except BlockingIOError:
                if not self.waiting:
                    self.loop.add_writer(self.fd, self._flush)
                    self.waiting = True
                return
            except OSError:  # EPIPE: the reader is gone
                self.close()
                return
            del self.pending[:n]
        if self.waiting:
            self.loop.remove_writer(self.fd)
            self.waiting = False
        if self.eof:
            self.close()

    def close(self) -> None:
        if self.fd >= 0:
            if self.waiting:
                self.loop.remove_writer(self.fd)
                self.waiting = False
            os.close(self.fd)
            self.fd = -1
            self.pending = bytearray()


class ReapWatch:
    """Wakes a callback when a pidfd's process has been reaped by someone else (EPOLLHUP).

    One epoll set per event loop, itself registered with the loop. Its pidfds are registered
    for no event at all: epoll always reports EPOLLHUP, and EPOLLIN (the process exited, a
    zombie whose status cannot be read yet) would wake us before the init's reap, and again
    and again while a paused sandbox's init sits frozen with it unreaped.
    """

    _by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, ReapWatch] = \
        weakref.WeakKeyDictionary()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.ep = select.epoll()
        self.callbacks: dict[int, Callable[[], None]] = {}
        loop.add_reader(self.ep.fileno(), self._ready)

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> ReapWatch:
        watch = cls._by_loop.get(loop)
        if watch is None:
            watch = cls._by_loop[loop] = cls(loop)
        return watch

    def add(self, pidfd: int, cb: Callable[[], None]) -> None:
        self.ep.register(pidfd, 0)
        self.callbacks[pidfd] = cb

    def remove(self, pidfd: int) -> None:
        if self.callbacks.pop(pidfd, None) is not None:
            self.ep.unregister(pidfd)

    def _ready(self) -> None:
        for fd, _events in self.ep.poll(0):
            cb = self.callbacks.get(fd)
            if cb is None:
                continue
            cb()


class Process:
    """One command running (or run) in a sandbox."""

    __slots__ = ("pid", "ns_pid", "pidfd", "cmd", "started_at", "t0", "stdout", "stderr",
                 "stdin", "exit_code", "timed_out", "duration", "done", "_timer", "loop",
                 "_waiters", "init_child", "signal", "oom_killed", "host_oom", "_settle")

    def __init__(self, loop: asyncio.AbstractEventLoop, child: Spawned,
                 cmd: str | list[str], stdout_fd: int, stderr_fd: int, stdin_fd: int, cap: int,
                 timeout: float | None, store: OutputMemory | None = None,
                 began: float | None = None) -> None:
        self.loop = loop
        # Our own child, or someone else's (the init's), whose pidfd we are handed.
        self.init_child = not child.own_child
        pid = child.pid
        self.pid = pid
        self.ns_pid = child.ns_pid or pid
        self.cmd = cmd
        self.started_at = time.time()
        # ``began``: when its start was asked for (monotonic). Its timeout counts from there,
        # so the time the sandbox held its start (a process in it stopping the init's child
        # before its exec, a lease on the program the exec opens) is the command's own: the
        # answer never comes later than the timeout plus the kill's settling, past which the
        # client's deadline (timeout + 30 s) would turn the command's own timeout into infra.
        self.t0 = time.monotonic() if began is None else began
        self.stdout = Capture(loop, stdout_fd, cap, store)
        self.stderr = Capture(loop, stderr_fd, cap, store)
        self.stdin = Stdin(loop, stdin_fd) if stdin_fd >= 0 else None
        self.exit_code: int | None = None
        self.signal: int | None = None  # the signal that ended it, if one did
        self.oom_killed = False  # set by the engine from the memory cgroup's OOM counts
        self.host_oom = False  # the same, an OOM kill from outside the sandbox's own limit
        self.timed_out = False
        self.duration = 0.0
        self._waiters: list[Callable[[], None]] | None = None
        self.done: asyncio.Future[None] = loop.create_future()
        if self.init_child:
            self.pidfd = child.pidfd
            ReapWatch.of(loop).add(self.pidfd, self._on_exit)
        else:
            # The child is ours and unreaped, so the pid cannot have been reused yet.
            self.pidfd = kernel.pidfd_open(pid)
            loop.add_reader(self.pidfd, self._on_exit)
        self._timer = None
        if timeout:
            left = max(0.0, timeout - (time.monotonic() - self.t0))
            self._timer = loop.call_later(left, self._on_timeout)
        self._settle: asyncio.TimerHandle | None = None

    @property
    def running(self) -> bool:
        return self.exit_code is None

    def _on_timeout(self) -> None:
        self._timer = None
        if self.exit_code is None:
            self.timed_out = True
            self.killpg(signal.SIGKILL)

    def killpg(self, sig: int) -> None:
        """Signal the whole process group (the child called setsid, so pgid == pid). Safe
        while the child is unreaped: its pid (and so its group id) cannot be reused. An init
        child is reaped by the init, so the exit is only seen a moment later: its group id is
        still safe while any member of the group lives (the kernel keeps a pid number that
        is some process's group id allocated); once none does, the number comes back only
        after the host's pid space (pid_max, raised by the daemon) wraps around."""
        if self.exit_code is not None or self.pid <= 0:
            return
        if not kernel.killpg(self.pid, sig):
            # No group yet: the child has not reached its setsid (stopped before it, say).
            # It can have no children of its own then: signalling it is the whole group.
            kernel.pidfd_signal(self.pidfd, sig)
        if sig == signal.SIGKILL and self._settle is None:
            self._settle = self.loop.call_later(KILL_SETTLE_S, self._settle_killed)

    def _settle_killed(self) -> None:
        """KILL_SETTLE_S after our SIGKILL and still not seen to exit: answer as its reap
        would (killed by SIGKILL); the reap, when it comes, only closes the pidfd."""
        self._settle = None
        if self.exit_code is None:
            self._finish(128 + signal.SIGKILL, signal.SIGKILL)

    def _on_exit(self) -> None:
        sig = None
        if self.init_child:
            status = kernel.wait_status(self.pidfd)
            if status is None:  # EPOLLHUP without a status: not seen; never spin on it
                code = 255
            else:
                code, sig = kernel.decode(status)
            ReapWatch.of(self.loop).remove(self.pidfd)
        else:
            try:
                got = kernel.reap(self.pidfd)
            except ChildProcessError:
                code = 255  # reaped elsewhere: should never happen, don't spin on the fd
            else:
                if got is None:
                    return  # spurious wake-up
                code, sig = got
            self.loop.remove_reader(self.pidfd)
        os.close(self.pidfd)
        self.pidfd = -1
        if self.exit_code is None:  # else answered already (_settle_killed)
            self._finish(code, sig)

    def _finish(self, code: int, sig: int | None) -> None:
        """The command's end as the API reports it: its final output drained, its result
        set, its waiters told."""
        for timer in (self._timer, self._settle):
            if timer is not None:
                timer.cancel()
        self._timer = self._settle = None
        self.duration = time.monotonic() - self.t0
        self.stdout.drain()
        self.stderr.drain()
        self.stdout.flush()  # before the waiters: a follower's end comes after its last text
        self.stderr.flush()
        self.exit_code, self.signal = code, sig
        if self.stdin is not None:
            self.stdin.close()
        if self._waiters:
            for cb in self._waiters:
                cb()
            self._waiters = None
        self.stdout.finish()
        self.stderr.finish()
        if not self.done.done():
            self.done.set_result(None)

    def on_exit(self, cb: Callable[[], None]) -> None:
        """Call ``cb`` after the final output is drained, before buffers stop filling."""
        if self._waiters is None:
            self._waiters = []
        self._waiters.append(cb)

    def result(self) -> dict[str, Any]:
        o, e = self.stdout, self.stderr
        return {
            "stdout": o.text(),
            "stderr": e.text(),
            "exit_code": self.exit_code,
            "duration_s": round(self.duration, 6),
            "truncated": o.truncated or e.truncated,
            "timed_out": self.timed_out,
            "stdout_bytes": o.total,
            "stderr_bytes": e.total,
            "signal": self.signal,
            "oom_killed": self.oom_killed,
        }

    def status(self) -> dict[str, Any]:
        return {"pid": self.ns_pid, "running": self.exit_code is None,
                "exit_code": self.exit_code, "timed_out": self.timed_out,
                "signal": self.signal, "oom_killed": self.oom_killed}

    def kept_bytes(self) -> int:
        """The output it keeps for a later wait or stream."""
        return len(self.stdout.kept) + len(self.stderr.kept)

    def pipes_open(self) -> bool:
        return self.stdout.fd >= 0 or self.stderr.fd >= 0

    def forget_output(self) -> None:
        """Drop what was kept of its output (the result has it, or nobody wants it)."""
        self.stdout.forget()
        self.stderr.forget()

    def close_pipes(self) -> None:
        """Stop draining its output (a writer left behind gets EPIPE)."""
        self.stdout.close()
        self.stderr.close()

    def release(self) -> None:
        """Forget the buffers (the sandbox is gone); pipes close when their writers die."""
        if self.stdin is not None:
            self.stdin.close()
        self.forget_output()


class Follower:
    """A client following a process's output: what was buffered (``first``), then each chunk
    as it is read, then None once the process has exited and its pipes were drained. While
    more than FOLLOW_HIGH bytes wait for the client, the process's pipes are not read (it
    waits on them, as on a slow terminal) until the client has taken all but FOLLOW_LOW: a
    client slower than the process never makes the daemon buffer without bound."""

    def __init__(self, proc: Process) -> None:
        self.proc = proc
        self.queue: asyncio.Queue[tuple[str, str] | None] = asyncio.Queue()
        self.waiting = 0  # characters queued for the client
        # (stream, what was kept of it, bytes dropped after that before this follower came)
        self.first: list[tuple[str, str | OutputText, int]]
        if proc.running:
            self.first = [("stdout", *proc.stdout.subscribe(self._on_out)),
                          ("stderr", *proc.stderr.subscribe(self._on_err))]
            proc.on_exit(lambda: self.queue.put_nowait(None))
        else:
            self.first = [("stdout", proc.stdout.text(), 0), ("stderr", proc.stderr.text(), 0)]
            self.queue.put_nowait(None)

    def _on_out(self, text: str) -> None:
        self._push("stdout", text)

    def _on_err(self, text: str) -> None:
        self._push("stderr", text)

    def _push(self, stream: str, text: str) -> None:
        self.queue.put_nowait((stream, text))
        self.waiting += len(text)
        if self.waiting > FOLLOW_HIGH:
            self.proc.stdout.hold(self)
            self.proc.stderr.hold(self)

    async def next(self) -> tuple[str, str] | None:
        item = await self.queue.get()
        if item is not None:
            self.waiting -= len(item[1])
            if self.waiting <= FOLLOW_LOW:
                self.proc.stdout.release(self)
                self.proc.stderr.release(self)
        return item

    def close(self) -> None:
        for cap, cb in ((self.proc.stdout, self._on_out), (self.proc.stderr, self._on_err)):
            cap.unsubscribe(cb)
            cap.release(self)


def _pipe() -> tuple[int, int]:
    return os.pipe2(os.O_CLOEXEC)


async def start(loop: asyncio.AbstractEventLoop, substrate: Substrate, runtime: SandboxRuntime,
                argv: list[str], env: dict[str, str], cwd: str, uid: int, gid: int,
                groups: list[int], *, cmd: str | list[str], stdin: bytes | None,
                keep_stdin: bool, cap: int, timeout: float | None,
                store: OutputMemory | None = None) -> Process:
    """Spawn ``argv`` in the sandbox with fresh pipes. ``stdin`` is written then closed unless
    ``keep_stdin`` (background commands keep it open for the stdin route)."""
    began = time.monotonic()  # the command's timeout counts from here (Process)
    child_fds: list[int] = []
    parent_fds: list[int] = []
    try:
        out_r, out_w = _pipe()
        parent_fds.append(out_r)
        child_fds.append(out_w)
        err_r, err_w = _pipe()
        parent_fds.append(err_r)
        child_fds.append(err_w)
        in_r = in_w = -1
        if stdin is not None or keep_stdin:
            in_r, in_w = _pipe()
            child_fds.append(in_r)
            parent_fds.append(in_w)
        for fd in parent_fds:
            os.set_blocking(fd, False)
        spec = ExecSpec(argv=argv, env=env, cwd=cwd, uid=uid, gid=gid, groups=groups,
                        stdin_fd=in_r, stdout_fd=out_w, stderr_fd=err_w)
        started = substrate.spawn(runtime, spec, loop)
    except BaseException:
        for fd in parent_fds:
            os.close(fd)
        raise
    finally:
        for fd in child_fds:  # sent with the request (the substrate keeps its own copies)
            os.close(fd)
    try:  # the substrate's answer; the loop is free meanwhile
        child = await started
    except BaseException:
        for fd in parent_fds:
            os.close(fd)
        raise
    try:
        proc = Process(loop, child, cmd, out_r, err_r, in_w, cap, timeout, store, began)
    except BaseException:  # e.g. EMFILE on pidfd_open: don't leave an unreaped child behind
        if not child.own_child:  # the init reaps it
            kernel.pidfd_signal(child.pidfd, signal.SIGKILL)
            os.close(child.pidfd)
        else:
            kernel.killpg(child.pid, signal.SIGKILL)
            os.waitpid(child.pid, 0)
        for fd in parent_fds:
            try:
                loop.remove_reader(fd)
                os.close(fd)
            except OSError:
                pass
        raise
    if proc.stdin is not None and (stdin or not keep_stdin):
        proc.stdin.write(stdin or b"", eof=not keep_stdin)
    return proc


ns_pid = kernel.ns_pid  # the pid a process has in its own pid namespace
