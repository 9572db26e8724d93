"""The ``process`` substrate's sessions: ``Sandbox(substrate="process")``, a short-lived sandbox
made of one session zygote (zygote.py, ``language`` ``session``).

A session is a zygote process of its own: its own mount, network (none), pid, IPC and UTS
namespaces, the read-only view of the host's OS directories (view.session_entries), a /tmp
tmpfs of the session's ``disk_mb`` owned by the session's uid (its home; /root leads there),
and the sandbox seccomp filter. Each command is a fresh fork of that zygote that joins the
session's memory and pids cgroups, drops to the session's uid with no capability, rlimits and
a Landlock domain, and execs the command. The zygote answers each spawn with the command's
pidfd; it reaps the command, so the exec layer reads its exit status from that pidfd (an
"init child", as in a container sandbox).

The sandbox's init (``SandboxRuntime.init_pid``) is the zygote's launcher in the daemon's
namespaces: killing it ends the zygote (PDEATHSIG) and, pid 1 gone, every process of the
session. Sessions do not outlive the daemon that made them (the zygote ends when its socket
closes): after a restart they are cleaned up, never adopted.

Files: done from the host side on the session's own root (``/proc/<zygote>/root``, opened as
an O_PATH fd): every path resolves inside it (openat2 RESOLVE_IN_ROOT, no magic links), the
kernel's pseudo-filesystems and device nodes are refused (the Rust core's fs module), and all
but /tmp is read-only, so a symlink the session made cannot lead the daemon out of it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Awaitable, Iterator
from typing import Any

from corral.daemon import kernel, procpolicy
from corral.daemon.substrates.base import (
    Capabilities,
    ExecSpec,
    SandboxRuntime,
    Spawned,
    Substrate,
)
from corral.daemon.substrates.process import cgroup, giveaway, pool, view, zygote
from corral.daemon.substrates.rootfiles import RootFileOps, RootFiles
from corral.daemon.substrates.types import OomCount
from corral.errors import CorralError, InfraError, SandboxNotRunning
from corral.models import SandboxSpec

log = logging.getLogger("corral.process")

# Session uids: above the run_code pools' (UID_BASE + pool * 64 * 256 + ...), owned by nothing.
UID_FIRST = pool.UID_BASE + (1 << 20)
UID_COUNT = 1 << 20
START_TIMEOUT_S = 30.0
HOME = "/tmp"  # the session's own directory
ROOT_HOME = "/root"  # root's home, the default working directory: the session's is HOME


class Session:
    """The daemon's side of one live session: its launcher, the socket to its zygote, and the
    spawns waiting for their answer (answered in order)."""

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket, uid: int) -> None:
        self.proc = proc
        self.sock = sock
        self.uid = uid
        self.zygote_pid = 0       # host pid of the zygote (for its root)
        self.memory: cgroup.SlotMemory | None = None
        self.reader = zygote.FrameReader()
        self.fds: list[int] = []
        self.pending: collections.deque[asyncio.Future[Spawned]] = collections.deque()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.lock = threading.Lock()  # spawns from worker threads never interleave frames

    def fail(self, why: str) -> None:
        while self.pending:
            fut = self.pending.popleft()
            if not fut.done():
                fut.set_exception(SandboxNotRunning(f"the process session ended ({why})"))

    def close(self) -> None:
        if self.loop is not None:
            with contextlib.suppress(ValueError, OSError, RuntimeError):
                self.loop.remove_reader(self.sock.fileno())
            self.loop = None
        self.fail("it was destroyed")
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []
        self.sock.close()


class ProcessSubstrate(RootFileOps, Substrate):
    name = "process"
    capabilities = Capabilities(files=True, oom_kills=True, networks=("none",))

    def __init__(self, state_dir: str, cgroup_name: str, upload_max_bytes: int) -> None:
        self.records = os.path.join(state_dir, "sandboxes")  # the engine's, one per sandbox
        self.root_dir = os.path.join(state_dir, "process", "root")
        # cpu: a session's commands weigh less than the daemon, and get its ``cpu`` as a quota
        self.layout = cgroup.Layout(cgroup_name, suffix=".process", cpu=True)
        self.settings = pool.Settings()
        self.upload_max_bytes = upload_max_bytes
        self.sessions: dict[str, Session] = {}
        self.uids: set[int] = set()
        self._next_uid = 0
        self._lock = threading.Lock()
        os.makedirs(self.root_dir, mode=0o700, exist_ok=True)
        self.proc_masks = view.proc_masks(procpolicy.compute(), procpolicy.make_mask_dir(
            os.path.join(state_dir, "mask")))
        self.counters = {"process_sessions": 0, "process_execs": 0}

    # ---- lifecycle -----------------------------------------------------------------------
    def _take_uid(self) -> int:
        with self._lock:
            for _ in range(UID_COUNT):
                uid = UID_FIRST + self._next_uid
                self._next_uid = (self._next_uid + 1) % UID_COUNT
                if uid not in self.uids:
                    self.uids.add(uid)
                    return uid
        raise InfraError("no free uid for a process session")

    def create(self, sandbox_id: str, spec: SandboxSpec, image: Any) -> SandboxRuntime:
        uid = self._take_uid()
        rt = SandboxRuntime(sandbox_id=sandbox_id, init_pid=0, init_starttime=0,
                            sandbox_dir=os.path.join(self.records, sandbox_id),
                            cgroup_paths=[], extra={"uid": uid})
        try:
            join, slots = self.layout.make_pool(sandbox_id, 1, spec.pids)
            rt.cgroup_paths = sorted(slots[0].values())
            memory = cgroup.SlotMemory(slots[0])
            memory.set(spec.memory_mb << 20)
            cgroup.set_cpu_quota(slots[0], spec.cpu)
            # /tmp is a tmpfs: memory. What the file API writes there is charged to the
            # daemon, not the session, so it is at most the session's memory limit.
            tmp_mb = min(spec.disk_mb, spec.memory_mb)
            entries = view.session_entries(tmp_mb, uid, self.proc_masks)
            cfg = pool.config("session", self.root_dir, entries, join,
                              [{"uid": uid, "cgroups": slots[0]}], [], self.settings)
            cfg["hostname"] = spec.hostname or sandbox_id[:63]
            proc, sock = pool.launch()
            s = Session(proc, sock, uid)
            s.memory = memory
            self.sessions[sandbox_id] = s
            rt.init_pid = proc.pid
            rt.init_starttime = kernel.proc_starttime(proc.pid) or 0
            rt.pidfd = kernel.pidfd_open(proc.pid)
            sock.settimeout(START_TIMEOUT_S)
            sock.sendall(zygote.encode(cfg))
            hello = self._hello(s)
            if not hello.get("ready"):
                raise InfraError(f"the process session did not start: {hello.get('error')}")
            s.zygote_pid = int(hello.get("pid") or 0) or self._zygote_pid(proc.pid)
            self.counters["process_sessions"] += 1
        except BaseException as e:
            with contextlib.suppress(Exception):
                self.destroy(rt)
            if isinstance(e, (CorralError, KeyboardInterrupt)):
                raise
            if isinstance(e, (OSError, ValueError, RuntimeError)):
                raise InfraError(f"the process session did not start: {e}") from e
            raise
        return rt

    @staticmethod
    def _hello(s: Session) -> dict[str, Any]:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            data = s.sock.recv(1 << 16)
            if not data:
                raise InfraError("the process session ended as it started")
            frames = s.reader.feed(data)
            if frames:
                return dict(frames[0])
        raise InfraError("the process session did not answer in time")

    @staticmethod
    def _zygote_pid(launcher: int) -> int:
        """The launcher's one child: the zygote (pid 1 of the session's pid namespace)."""
        try:
            with open(f"/proc/{launcher}/task/{launcher}/children") as f:
                kids = f.read().split()
        except OSError:
            return 0
        return int(kids[0]) if kids else 0

    def adopt(self, runtime: SandboxRuntime) -> bool:
        return False  # its zygote ended with the daemon's end of its socket

    def is_alive(self, runtime: SandboxRuntime) -> bool:
        if runtime.sandbox_id not in self.sessions:
            return False
        if runtime.pidfd >= 0:
            return not kernel.pidfd_exited(runtime.pidfd)
        return runtime.init_pid > 0 and kernel.proc_alive(runtime.init_pid,
                                                            runtime.init_starttime)

    def destroy(self, runtime: SandboxRuntime) -> None:
        sid = runtime.sandbox_id
        s = self.sessions.pop(sid, None)
        if s is not None:
            loop = s.loop
            try:
                here = asyncio.get_running_loop()
            except RuntimeError:
                here = None
            if loop is not None and loop is not here and loop.is_running():
                done = threading.Event()  # its reader and futures are the loop's to touch

                def close() -> None:
                    s.close()
                    done.set()
                loop.call_soon_threadsafe(close)
                done.wait(5.0)
            else:
                s.close()
            with contextlib.suppress(ProcessLookupError):
                s.proc.kill()  # the zygote and, as its pid 1, the whole namespace go
            with contextlib.suppress(subprocess.TimeoutExpired):
                s.proc.wait(timeout=10)
        elif runtime.pidfd >= 0:
            kernel.pidfd_signal(runtime.pidfd, signal.SIGKILL)
        if runtime.pidfd >= 0:
            os.close(runtime.pidfd)
            runtime.pidfd = -1
        self.layout.remove_pool(sid)  # what is left in its cgroups is killed first
        uid = runtime.extra.get("uid")
        with self._lock:
            self.uids.discard(uid if isinstance(uid, int) else -1)
        shutil.rmtree(runtime.sandbox_dir, ignore_errors=True)

    def cleanup_orphans(self, known_ids: set[str]) -> list[str]:
        removed = []
        for sid in self.layout.pools():
            if sid in known_ids or sid in self.sessions:
                continue
            self.layout.remove_pool(sid)
            shutil.rmtree(os.path.join(self.records, sid), ignore_errors=True)
            removed.append(sid)
        return removed

    def close(self, *, retire: bool = False) -> None:
        for s in list(self.sessions.values()):
            s.fail("the daemon is stopping")
        if retire:
            for t in self.layout.tops():
                with contextlib.suppress(OSError):
                    os.rmdir(t)

    def oom_kills(self, runtime: SandboxRuntime) -> OomCount | None:
        s = self.sessions.get(runtime.sandbox_id)
        if s is None or s.memory is None:
            return None
        with contextlib.suppress(OSError, ValueError):
            return s.memory.oom_kills()
        return None

    # ---- exec ----------------------------------------------------------------------------
    def spawn(self, runtime: SandboxRuntime, spec: ExecSpec,
              loop: asyncio.AbstractEventLoop) -> Awaitable[Spawned]:
        s = self.sessions.get(runtime.sandbox_id)
        if s is None or not self.is_alive(runtime):
            raise SandboxNotRunning("the sandbox is not running")
        if s.loop is None:
            s.loop = loop
            loop.add_reader(s.sock.fileno(), self._readable, s)
        stdio = [spec.stdin_fd, spec.stdout_fd, spec.stderr_fd]
        # Whoever the command asks to be, it runs as the session's uid, whose home is /tmp.
        env = dict(spec.env)
        if env.get("HOME") == ROOT_HOME:
            env["HOME"] = HOME
        cwd = HOME if spec.cwd == ROOT_HOME else spec.cwd
        frame = zygote.encode({"spawn": {"argv": spec.argv, "env": env, "cwd": cwd,
                                         "stdio": [fd >= 0 for fd in stdio]}})
        fut: asyncio.Future[Spawned] = loop.create_future()
        with s.lock:
            try:
                fds = struct.pack(f"{sum(fd >= 0 for fd in stdio)}i",
                                  *[fd for fd in stdio if fd >= 0])
                n = s.sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
                if n < len(frame):
                    s.sock.sendall(frame[n:])
            except OSError as e:
                raise SandboxNotRunning(f"the process session is gone: {e}") from None
            s.pending.append(fut)
        self.counters["process_execs"] += 1
        return fut

    def _readable(self, s: Session) -> None:
        try:
            data, fds = zygote.recv_with_fds(s.sock, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data, fds = b"", []
        s.fds += fds
        if not data:
            if s.loop is not None:
                s.loop.remove_reader(s.sock.fileno())
                s.loop = None
            s.fail("its zygote ended")
            return
        try:
            frames = s.reader.feed(data)
        except ValueError:
            frames = []
        for f in frames:
            if "spawned" not in f or not s.pending:
                continue
            fut = s.pending.popleft()
            if f.get("error") or not s.fds:
                if not fut.done():
                    fut.set_exception(InfraError(f"could not start the command: "
                                                 f"{f.get('error') or 'no pidfd'}"))
                continue
            pidfd = s.fds.pop(0)
            if fut.done():  # the caller went away: the command runs on in the session
                os.close(pidfd)
                continue
            fut.set_result(Spawned(pidfd=pidfd, pid=kernel.host_pid(pidfd),
                                   ns_pid=int(f["spawned"])))

    # ---- reporting -----------------------------------------------------------------------
    def metrics(self) -> dict[str, int]:
        return dict(self.counters)

    # ---- files: the session's root, from the host side -------------------------------------
    @contextlib.contextmanager
    def _files(self, runtime: SandboxRuntime) -> Iterator[RootFiles]:
        """The file operations on an O_PATH fd of the session's root, open for one operation
        (no disk budget here: the session's /tmp is a tmpfs of its size)."""
        s = self.sessions.get(runtime.sandbox_id)
        if s is None or not s.zygote_pid:
            raise SandboxNotRunning("the sandbox is not running")
        try:
            fd = os.open(f"/proc/{s.zygote_pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise SandboxNotRunning(f"the session's files are gone: {e.strerror}") from None
        # The pid names another process only if the zygote died: is it still the session's
        # (its launcher alive, and still its parent)?
        if not self.is_alive(runtime) or self._zygote_pid(s.proc.pid) != s.zygote_pid:
            os.close(fd)
            raise SandboxNotRunning("the sandbox is not running")
        try:
            yield RootFiles(lambda: contextlib.nullcontext(fd), False, None,
                            self.upload_max_bytes)
        finally:
            os.close(fd)

    def _made(self, runtime: SandboxRuntime, f: RootFiles, path: str, tree: bool = False) -> None:
        """What the daemon made in the session's /tmp (``path``, the parents it may have
        made, with ``tree`` all below it) belongs to the session's uid, so that its commands
        may change it (giveaway: walked by fd, never through a symlink the session swapped
        in). Everything there is the session's: giving it again changes nothing else.
        Elsewhere the root is read-only."""
        uid = runtime.extra.get("uid")
        parts = [x for x in os.path.normpath(path).split("/") if x]
        if not isinstance(uid, int) or len(parts) < 2 or parts[0] != HOME.strip("/"):
            return
        with f.rooted() as root:
            try:
                giveaway.give(root, HOME, parts[1:], uid, tree)
            except OSError as e:
                log.warning("chown in a process session", extra={"path": path, "error": str(e)})
