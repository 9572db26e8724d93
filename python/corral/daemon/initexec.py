"""Exec through the sandbox's init: the daemon's half of corral-init's exec channel.

A sandbox's init (rust/init/corral-init.c) holds both ends of a SOCK_SEQPACKET pair on its fds
3 and 4. The daemon takes a copy of fd 4 (``_core.init_channel``, pidfd_getfd) and sends one
message per command; the init forks it (already inside every wall of the sandbox) and answers
with the child's pid in the sandbox and a pidfd. The child is the init's, not the daemon's: the
init reaps it, and the daemon reads its exit status from the pidfd (``PIDFD_GET_INFO``,
Linux 6.15+) once the pidfd reports the reap (EPOLLHUP). That skips what the daemon's own path
(``_core.exec_in``) does per command: joining the cgroups, setns into five namespaces, chroot,
the capability drop and a fresh seccomp filter (docs/isolation.md, "Exec through the init").

Wire format (native endianness, both sides on one host):

- request: ``struct req {u32 magic, id, uid, gid, flags, ngroups, nargv, nenv, ncand}``, then
  ``u32 groups[ngroups]``, then NUL-terminated strings: argv, env, the exec candidates (PATH
  already resolved here, as ``exec_in`` does) and the cwd last, nothing after it; SCM_RIGHTS:
  stdin, stdout, stderr (or only stdout, stderr with ``NULL_STDIN``). A request beyond one
  message (``MAX_MSG``, ``MAX_STRINGS``, ``MAX_GROUPS``) sends the header alone with
  ``MEMFD`` and everything after it in a memfd with every seal set, attached last (at most
  ``MAX_BIG`` bytes); the init maps it read-only for the time of the request;
- answer: ``struct reply {u32 magic, id; i32 value, step}``: ``REPLY`` (value = the pid in the
  sandbox with a pidfd attached, or -errno) or ``FAIL`` (the child failed at ``step`` with
  errno = value before exec; a ``REPLY`` follows).
"""

from __future__ import annotations

import array
import asyncio
import errno
import fcntl
import itertools
import os
import select
import signal
import socket
import struct
import threading
import time
from dataclasses import dataclass

# The exit status of a process the init reaped: PIDFD_GET_INFO (corral.daemon.kernel).
from corral.daemon import kernel
from corral.daemon.kernel import decode, host_pid, wait_status
from corral.daemon.substrates.types import Spawned  # what the init answers: its child

REQ_MAGIC = 0x31585243
REPLY_MAGIC = 0x31525243
FAIL_MAGIC = 0x31465243
NULL_STDIN = 1
SCOPE_UNIX = 2             # network "disabled": the command gets a Landlock domain of its own
MEMFD = 4                  # the body is in a sealed memfd
MAX_MSG = 65536            # the init's receive buffer
MAX_STRINGS = 1024
MAX_GROUPS = 64
MAX_BIG = 4 << 20          # a memfd body (corral-init.c)
MAX_BIG_STRINGS = 1 << 18
MAX_BIG_GROUPS = 65536     # NGROUPS_MAX
# What execve accepts by default (ARG_MAX with an 8 MiB stack: argv and env strings with their
# NULs and pointers) and per string (MAX_ARG_STRLEN); beyond, the command is refused up front.
MAX_ARG_BYTES = 2 << 20
MAX_ARG_STRLEN = 128 << 10
ANSWER_TIMEOUT_S = 5.0     # a healthy init answers in well under a millisecond
# Waiting for room to send, then for the answer, on the daemon's loop, in all: generous, as a
# loaded host may schedule an init late; an init that still has not answered is held by
# something in its own sandbox (a stopped child, a lease on the program its child execs), and
# the command fails with ExecStalled. Below the SDK's grace (30 s past the command's timeout,
# which counts from the request: procs.Process) by more than a SIGKILLed command's settling
# (procs.KILL_SETTLE_S), so a held start is never answered past the client's deadline.
WAIT_TIMEOUT_S = 25.0
# Requests awaiting their answer per sandbox; more wait for one to be answered. It bounds what
# the init may have to queue towards us, so an answer always fits the socket's buffer.
MAX_IN_FLIGHT = 16
_REQ = struct.Struct("=9I")
_REPLY = struct.Struct("=IIii")
FAIL_STEPS = {1: "signals", 2: "setsid", 3: "stdio", 4: "close_fds", 5: "set_ids", 6: "set_caps",
              7: "rlimit_nofile", 8: "landlock"}



class Busy(Exception):
    """Nothing was sent (the channel is closed, or watched by a loop): use the daemon's own
    exec path."""


class Full(Busy):
    """No room now (MAX_IN_FLIGHT answers awaited, or the socket's buffer is full): nothing
    was sent. ``submit_when_ready`` waits for room instead."""


class Invalid(ValueError):
    """A command no exec path can start (too large, NUL bytes): bad input."""


class Stalled(Exception):
    """The init did not take the command, or did not answer, within WAIT_TIMEOUT_S."""


class Gone(Exception):
    """The init is gone (its end of the channel closed)."""


class ChildFailed(OSError):
    """The child failed before exec (``step`` names where)."""

    def __init__(self, err: int, step: str) -> None:
        super().__init__(err, f"exec through the init: {step}: {os.strerror(err)}")
        self.step = step


def candidates(argv0: str, env: dict[str, str], default_path: str) -> list[str]:
    """The paths execve tries, in order (the same rule as ``exec_in``)."""
    if "/" in argv0:
        return [argv0]
    path = env.get("PATH", default_path)
    return [f"{'.' if not d else d.rstrip('/')}/{argv0}" for d in path.split(":")]


def check_size(argv: list[str], env: dict[str, str]) -> None:
    """Invalid unless execve could take this argv and env (the same rule for every path)."""
    if not argv or not argv[0]:
        raise Invalid("argv must not be empty")
    total = 0
    for x in (*argv, *(f"{k}={v}" for k, v in env.items())):
        n = len(x.encode(errors="surrogateescape")) + 1
        if n > MAX_ARG_STRLEN:
            raise Invalid(f"an argument or environment string is longer than {MAX_ARG_STRLEN}"
                          " bytes")
        total += n + 8
    if total > MAX_ARG_BYTES:
        raise Invalid(f"argv and env take more than {MAX_ARG_BYTES} bytes")


def encode(req_id: int, argv: list[str], env: dict[str, str], cwd: str, uid: int, gid: int,
           groups: list[int], cands: list[str], null_stdin: bool,
           scope_unix: bool = False) -> tuple[bytes, bytes | None]:
    """One request: (message, None), or (header, body) for a memfd. Invalid if no init can
    take it."""
    check_size(argv, env)
    strings = [*argv, *(f"{k}={v}" for k, v in env.items()), *cands, cwd or "/"]
    if any("\0" in s for s in strings):
        raise Invalid("NUL byte in argv, env or cwd")
    if len(groups) > MAX_BIG_GROUPS:
        raise Invalid(f"more than {MAX_BIG_GROUPS} supplementary groups")
    if len(strings) - 1 > MAX_BIG_STRINGS:
        raise Invalid("too many arguments, environment variables and PATH entries")
    try:
        body = b"".join(s.encode() + b"\0" for s in strings)
        gids = struct.pack(f"={len(groups)}I", *groups)
    except (UnicodeEncodeError, struct.error) as e:
        raise Invalid(f"cannot encode the command: {e}") from None
    inline = (len(groups) <= MAX_GROUPS and len(strings) - 1 <= MAX_STRINGS
              and _REQ.size + len(gids) + len(body) <= MAX_MSG)
    if not inline and len(gids) + len(body) > MAX_BIG:
        raise Invalid(f"the command with its environment and PATH takes more than {MAX_BIG}"
                      " bytes")
    flags = ((NULL_STDIN if null_stdin else 0) | (SCOPE_UNIX if scope_unix else 0)
             | (0 if inline else MEMFD))
    head = _REQ.pack(REQ_MAGIC, req_id, uid & 0xFFFFFFFF, gid & 0xFFFFFFFF, flags,
                     len(groups), len(argv), len(env), len(cands))
    return (head + gids + body, None) if inline else (head, gids + body)


def sealed_memfd(data: bytes) -> int:
    """A memfd holding ``data`` that nobody can change any more (every seal set)."""
    fd = os.memfd_create("corral-exec", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK
                    | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return fd


class Channel:
    """The daemon's end of one sandbox init's exec channel.

    ``submit`` is the daemon's way: it sends the request and returns a future that the event
    loop resolves when the answer arrives, so the loop never waits for the init (which, on a
    busy core, may only get to answer once the command it started has run). ``spawn`` is the
    blocking form, for callers without a loop (tests, tools). The socket is non-blocking."""

    __slots__ = ("sock", "lock", "ids", "loop", "waiting", "failed", "room")

    def __init__(self, fd: int) -> None:
        self.sock = socket.socket(fileno=fd)
        self.sock.setblocking(False)
        self.lock = threading.Lock()       # one sender at a time
        self.ids = itertools.count(1)
        # The loop watching the socket: from the first submit until close (one epoll entry per
        # cached channel is cheaper than adding and removing it around every command).
        self.loop: asyncio.AbstractEventLoop | None = None
        self.waiting: dict[int, asyncio.Future[Spawned]] = {}
        self.failed: dict[int, ChildFailed] = {}
        # submit_when_ready's waiters: woken whenever an answer arrives (room was made).
        self.room: list[asyncio.Future[None]] = []

    def close(self) -> None:
        """Close the channel; every answer still awaited fails with Gone. From another thread
        the loop's thread does it (the loop watches the socket and owns the futures)."""
        loop = self.loop
        if loop is not None and not _in_loop(loop):
            try:
                loop.call_soon_threadsafe(self.close)
                return
            except RuntimeError:  # the loop is closed: nobody awaits anything any more
                self.loop = None
        self._unwatch()
        self._fail_waiting("the sandbox is being destroyed")
        self.sock.close()
        self._wake()

    def _fail_waiting(self, why: str) -> None:
        """Every answer still awaited fails with Gone(why)."""
        self.failed.clear()
        waiting, self.waiting = self.waiting, {}
        for fut in waiting.values():
            if not fut.done():
                fut.set_exception(Gone(why))

    # ---- sending ------------------------------------------------------------------------
    def _send(self, argv: list[str], env: dict[str, str], cwd: str, uid: int, gid: int,
              groups: list[int], cands: list[str], stdio: tuple[int, int, int],
              scope_unix: bool = False) -> int:
        """Send one request (under ``lock``); its id. Busy (nothing sent) or Gone."""
        if self.sock.fileno() < 0:  # closed under us (evicted from the cache, destroyed)
            raise Busy("the channel is closed")
        req_id = next(self.ids) & 0xFFFFFFFF
        stdin, stdout, stderr = stdio
        msg, body = encode(req_id, argv, env, cwd, uid, gid, groups, cands, stdin < 0,
                           scope_unix)
        fds = [stdout, stderr] if stdin < 0 else [stdin, stdout, stderr]
        memfd = sealed_memfd(body) if body is not None else -1
        if memfd >= 0:
            fds.append(memfd)
        try:
            self.sock.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                       array.array("i", fds))])
        except BlockingIOError:
            raise Full("the init's queue is full") from None
        except (BrokenPipeError, ConnectionError):
            raise Gone("the sandbox's init is gone") from None
        finally:
            if memfd >= 0:
                os.close(memfd)
        return req_id

    def submit(self, loop: asyncio.AbstractEventLoop, argv: list[str], env: dict[str, str],
               cwd: str, uid: int, gid: int, groups: list[int], cands: list[str],
               stdio: tuple[int, int, int], scope_unix: bool = False) -> asyncio.Future[Spawned]:
        """Send the request now (the stdio fds travel with it: the caller may close its
        copies); the future gets the Spawned, or Gone / ChildFailed / OSError. Raises Busy if
        nothing was sent. Loop thread only."""
        if len(self.waiting) >= MAX_IN_FLIGHT:
            raise Full("enough requests in flight in this sandbox")
        with self.lock:
            if not self.waiting:
                self._drain()
            req_id = self._send(argv, env, cwd, uid, gid, groups, cands, stdio, scope_unix)
        fut: asyncio.Future[Spawned] = loop.create_future()
        self.waiting[req_id] = fut
        if self.loop is None:
            loop.add_reader(self.sock.fileno(), self._on_readable)
            self.loop = loop
        return fut

    async def submit_when_ready(self, loop: asyncio.AbstractEventLoop, deadline: float,
                                *args: object) -> asyncio.Future[Spawned]:
        """``submit`` once there is room (an answer arrived), until ``deadline`` (loop time):
        then Stalled. The stdio fds in ``args`` must stay open until this returns."""
        while True:
            try:
                return self.submit(loop, *args)  # type: ignore[arg-type]
            except Full:
                pass
            if self.sock.fileno() < 0:
                raise Gone("the sandbox is being destroyed")
            left = deadline - loop.time()
            if left <= 0:
                raise Stalled("the sandbox's init has taken no command for "
                              f"{WAIT_TIMEOUT_S:.0f}s")
            if self.loop is None:  # nothing in flight is ours: the socket is full of a
                loop.add_reader(self.sock.fileno(), self._on_readable)  # predecessor's
                self.loop = loop
            room: asyncio.Future[None] = loop.create_future()
            self.room.append(room)
            try:
                await asyncio.wait_for(room, left)
            except TimeoutError:
                pass
            finally:
                if room in self.room:
                    self.room.remove(room)

    def _wake(self) -> None:
        room, self.room = self.room, []
        for f in room:
            if not f.done():
                f.set_result(None)

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str, uid: int, gid: int,
              groups: list[int], cands: list[str], stdio: tuple[int, int, int],
              scope_unix: bool = False) -> Spawned:
        """The blocking form of ``submit``: Busy, Gone, ChildFailed or OSError."""
        with self.lock:
            if self.loop is not None:  # the loop reads this socket's answers
                raise Busy("the channel is watched by an event loop")
            self._drain()
            req_id = self._send(argv, env, cwd, uid, gid, groups, cands, stdio, scope_unix)
            deadline = time.monotonic() + ANSWER_TIMEOUT_S
            poll = select.poll()  # not select(): the daemon's fds may pass FD_SETSIZE
            poll.register(self.sock, select.POLLIN)
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not poll.poll(left * 1000):
                    raise OSError(errno.ETIMEDOUT, "the sandbox's init did not answer")
                try:
                    data, fds = self._recv()
                except BlockingIOError:
                    continue
                if data is None:
                    raise Gone("the sandbox's init is gone")
                done = self._answer(req_id, data, fds)
                if done is not None:
                    return done.result()

    # ---- answers --------------------------------------------------------------------------
    def _on_readable(self) -> None:
        try:
            self._read_answers()
        finally:
            self._wake()

    def _read_answers(self) -> None:
        while True:
            try:
                data, fds = self._recv()
            except BlockingIOError:
                break
            if data is None:  # the init is gone: stop watching (EOF stays readable)
                self._unwatch()
                self._fail_waiting("the sandbox's init is gone")
                break
            req_id = _REPLY.unpack(data)[1] if len(data) == _REPLY.size else 0
            fut = self.waiting.get(req_id)
            if fut is None:  # left over from a request a restarted daemon never read
                _close_all(fds)
                continue
            done = self._answer(req_id, data, fds)
            if done is None:
                continue
            del self.waiting[req_id]
            if fut.cancelled():  # the caller gave up: the command must not run unobserved
                try:
                    _kill(done.result())
                except (OSError, Gone):
                    pass
            elif not fut.done():
                try:
                    fut.set_result(done.result())
                except (OSError, Gone) as e:
                    fut.set_exception(e)

    def _answer(self, req_id: int, data: bytes, fds: list[int]) -> _Answer | None:
        """Read one message for ``req_id``: its final answer, or None (a failure report,
        which a REPLY follows, or a message that is not ours)."""
        if len(data) != _REPLY.size:
            _close_all(fds)
            return None
        magic, rid, value, step = _REPLY.unpack(data)
        if rid != req_id or magic not in (FAIL_MAGIC, REPLY_MAGIC):
            _close_all(fds)
            return None
        if magic == FAIL_MAGIC:
            _close_all(fds)
            self.failed[rid] = ChildFailed(value if value > 0 else errno.EIO,
                                           FAIL_STEPS.get(step, "unknown"))
            return None
        failed = self.failed.pop(rid, None)
        if value < 0 or not fds:
            _close_all(fds)
            err = -value if value < 0 else errno.EPROTO
            return _Answer(error=OSError(err, f"exec through the init: {os.strerror(err)}"))
        pidfd, rest = fds[0], fds[1:]
        _close_all(rest)
        if failed is not None:  # the child exited 127 before exec; the init reaps it
            os.close(pidfd)
            return _Answer(error=failed)
        return _Answer(spawned=Spawned(pidfd=pidfd, pid=host_pid(pidfd), ns_pid=value))

    def _unwatch(self) -> None:
        if self.loop is not None:
            if self.sock.fileno() >= 0:
                self.loop.remove_reader(self.sock.fileno())
            self.loop = None

    def _recv(self) -> tuple[bytes | None, list[int]]:
        """One message and the fds it carried; (None, []) at EOF; BlockingIOError if none."""
        fds = array.array("i")
        try:
            data, anc, _flags, _addr = self.sock.recvmsg(
                _REPLY.size + 1, socket.CMSG_SPACE(4 * fds.itemsize), socket.MSG_CMSG_CLOEXEC)
        except BlockingIOError:
            raise
        except OSError:  # ECONNRESET and the like: as good as EOF
            return None, []
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
        if not data and not anc:
            return None, []
        return data, list(fds)

    def _drain(self) -> None:
        """Drop answers nobody waits for (a restarted daemon's predecessor's)."""
        while True:
            try:
                data, fds = self._recv()
            except BlockingIOError:
                return
            _close_all(fds)
            if data is None:
                return


@dataclass(slots=True)
class _Answer:
    spawned: Spawned | None = None
    error: BaseException | None = None

    def result(self) -> Spawned:
        if self.error is not None:
            raise self.error
        assert self.spawned is not None
        return self.spawned


def _in_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _kill(sp: Spawned) -> None:
    """SIGKILL a command nobody waits for (its process group), and let go of its pidfd."""
    if sp.pid > 0:
        kernel.killpg(sp.pid, signal.SIGKILL)
    os.close(sp.pidfd)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def exit_code(pidfd: int) -> int | None:
    """The reaped process's exit code (128 + signal if killed); None if not reaped yet."""
    status = wait_status(pidfd)
    return None if status is None else decode(status)[0]


def supported() -> bool:
    """Does this kernel give a non-parent a reaped process's exit status (6.15+)?"""
    try:
        pid = os.posix_spawn("/bin/true", ["true"], {})
        fd = kernel.pidfd_open(pid)
    except OSError:
        return False
    try:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:  # reaped by someone else: the pidfd still tells
            poll = select.poll()
            poll.register(fd, select.POLLHUP)
            poll.poll(1000)
        return exit_code(fd) == 0
    finally:
        os.close(fd)
