"""The gvisor substrate: each sandbox is a gVisor sandbox (runsc create/start) whose PID 1
sleeps forever; every command is a `runsc exec` into it.

Per sandbox, under ``<state_dir>/gvisor/sandboxes/<id>/``: the OCI bundle (config.json), the
host-side root (one overlay per image overlay, private upper dirs: bundle.make_root), the
process.json of each exec. runsc's own state is ``<state_dir>/gvisor/runsc`` (its --root).
The limits are runsc's cgroup (``<cgroup name>/<id>``, made and removed by runsc; removed by
us when runsc cannot). The runtime's init is the runsc sandbox process (the sentry): it lives
exactly as long as the sandbox does.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import errno
import itertools
import json
import logging
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Awaitable, Iterator
from typing import TYPE_CHECKING, Any

from corral.daemon import kernel
from corral.daemon.cgroups.common import oom_count_at
from corral.daemon.substrates.base import (
    Capabilities,
    ExecSpec,
    SandboxRuntime,
    Spawned,
    Substrate,
)
from corral.daemon.substrates.gvisor import bundle
from corral.daemon.substrates.gvisor.probe import kill_under
from corral.daemon.substrates.gvisor.runsc import Runsc, RunscError
from corral.daemon.substrates.rootfiles import RootFileOps, RootFiles
from corral.daemon.substrates.types import NotCached, OomCount, oom_verdict
from corral.errors import CorralError, InternalError, SandboxNotRunning
from corral.models import SandboxSpec

if TYPE_CHECKING:  # pragma: no cover
    from corral.daemon.snapshots import CaptureControl, SnapshotStore

log = logging.getLogger("corral.gvisor")

CGROUP_ROOT = "/sys/fs/cgroup"
# The exec wrapper: joins the sandbox's cgroups (every hierarchy runsc made it in, listed in
# $CG), runs the `runsc exec` client, then writes its exit status to fd 9 (a pipe the daemon
# reads) and ends the way the command did. The client lives as long as the command and holds
# ~4 MiB and ~5 host tasks: in the sandbox's cgroups they count against its own memory and
# pids limits, not the daemon's cgroup, so commands kept running cannot take the host's memory
# (a cgroup it cannot join: the sandbox is gone, nothing runs). A wrapper killed before the
# status (the exec's timeout or a kill SIGKILLs its process group) writes nothing: the daemon
# then kills the command inside the sandbox, which the end of the client alone would leave
# running. The client ends 128 + N for a command ended by signal N (and for one that exits
# 128 + N: the two read the same), which the wrapper raises on itself, except the stop
# signals (SIGSTOP, SIGTSTP, SIGTTIN, SIGTTOU): a command's `exit 147` stopped the wrapper
# instead of ending it, and its call waited for its timeout, or for ever.
_WRAP = ('for d in $CG; do echo $$ >"$d/cgroup.procs" || exit 125; done; unset CG; '
         '"$@" 9>&-; s=$?; echo "$s" >&9; '
         'if [ "$s" -gt 128 ] && [ "$s" -lt 160 ]; then case $((s - 128)) in '
         '19|20|21|22) ;; *) kill -s "$((s - 128))" $$;; esac; fi; '
         'exit "$s"')
_SH_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}


async def _ready(value: Spawned) -> Spawned:
    return value


def _cgroup_dirs(rel: str) -> list[str]:
    """``rel`` in every cgroup hierarchy it exists in (v1: one per controller; v2: one)."""
    rel = rel.strip("/")
    out = []
    direct = os.path.join(CGROUP_ROOT, rel)
    if os.path.exists(os.path.join(CGROUP_ROOT, "cgroup.controllers")):
        return [direct] if os.path.isdir(direct) else []
    with contextlib.suppress(OSError):
        for h in os.listdir(CGROUP_ROOT):
            d = os.path.join(CGROUP_ROOT, h, rel)
            if os.path.isdir(d):
                out.append(d)
    return out


def _remove_cgroup(rel: str) -> None:
    """Kill what is left in the cgroup ``rel`` (every hierarchy) and remove it."""
    dirs = _cgroup_dirs(rel)
    for d in dirs:
        with contextlib.suppress(OSError), open(os.path.join(d, "cgroup.procs")) as f:
            for line in f:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(line), signal.SIGKILL)
    for d in dirs:
        deadline = time.monotonic() + 5
        while True:
            try:
                os.rmdir(d)
                break
            except FileNotFoundError:
                break
            except OSError as e:
                if e.errno != errno.EBUSY or time.monotonic() > deadline:
                    log.warning("cannot remove cgroup", extra={"path": d, "error": str(e)})
                    break
                time.sleep(0.01)  # its last tasks are exiting


_EXITING = "Exiting with status: "
KILL_THREADS = 2  # threads sending kills to abandoned commands, for all gvisor sandboxes
KILL_TIMEOUT_S = 10.0       # a `runsc kill` (the sentry's answer)
GROUP_KILL_TIMEOUT_S = 5.0  # the lock-down binary's process-group kill, run in the sandbox
_HELD = "kill-held-"  # <exec dir>/kill-held-<pid>: a kill not yet sent (queued, or held
# for the resume)
# The same line in the text format of a daemon before the log was JSON: glog's prefix, the
# whole line, and only as the log's last line.
_EXITING_TEXT = re.compile(rb"I\d{4} \d\d:\d\d:\d\d\.\d{6} +\d+ [\w.-]+\.go:\d+\] "
                           rb"Exiting with status: (\d+)")


def _exit_status(tail: bytes) -> int | None:
    """The wait status in the sentry's ``Exiting with status: <n>`` entry, from the end of
    its log. The log holds text the sandbox chooses (the path of each failed execve, every
    exec's argv; newlines and quotes included), so a bare search for the phrase finds a
    forged one: a sandbox that wrote one and was then killed from outside (an infra loss)
    was scored as having ended its own init. The log is JSON, one entry a line, the
    sandbox's text escaped inside ``msg``; the sentry's own entry is the one whose whole
    ``msg`` is the phrase and a number (every message carrying the sandbox's text starts
    with the sentry's own words: ``EXEC: [``, ``[ pid: tid] ``)."""
    lines = tail.split(b"\n")
    for line in reversed(lines[1:] if len(lines) > 1 else lines):  # [0] may be cut
        line = line.strip()
        if not line.startswith(b"{"):
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        msg = entry.get("msg") if isinstance(entry, dict) else None
        if (isinstance(msg, str) and msg.startswith(_EXITING)
                and msg[len(_EXITING):].isdigit() and msg[len(_EXITING):].isascii()):
            return int(msg[len(_EXITING):])
    last = tail.rstrip(b"\n").rpartition(b"\n")[2]
    m = _EXITING_TEXT.fullmatch(last.strip())
    return int(m.group(1)) if m else None


def _init_status(gdir: str) -> str | None:
    """How the sandbox's init ended, from the sentry's own last log entry (``Exiting with
    status: <wait status>``, written only when the init ended: a sentry killed from outside
    never writes it; _exit_status). In ``gdir``/log (bundle.make_log_dir), or ``gdir`` for a
    sandbox a daemon before it made."""
    logs = []
    for d in (os.path.join(gdir, "log"), gdir):
        with contextlib.suppress(OSError):
            logs += [os.path.join(d, n) for n in os.listdir(d)
                     if n.startswith("runsc.log.") and n.endswith(".boot.txt")]
    for path in logs:
        with contextlib.suppress(OSError), open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
            ws = _exit_status(f.read())
            if ws is None:
                continue
            if os.WIFSIGNALED(ws):
                sig = os.WTERMSIG(ws)
                try:
                    name_ = signal.Signals(sig).name
                except ValueError:
                    name_ = str(sig)
                return f"killed by {name_}"
            return f"exit code {os.WEXITSTATUS(ws)}"
    return None


def _counter(rel: str, v1: tuple[str, str], v2: str, key: str) -> int:
    """A ``key value`` counter of the cgroup ``rel``: v1 (controller, file) or v2 file."""
    for path in (os.path.join(CGROUP_ROOT, v1[0], rel, v1[1]),
                 os.path.join(CGROUP_ROOT, rel, v2)):
        with contextlib.suppress(OSError, ValueError), open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    return 0


class GvisorSubstrate(RootFileOps, Substrate):
    name = "gvisor"
    capabilities = Capabilities(files=True, snapshot=True, restore=True, pause=True,
                                networks=("none",))

    def __init__(self, state_dir: str, cgroup_name: str, runsc: Runsc,
                 upload_max_bytes: int) -> None:
        self.base = os.path.join(state_dir, "gvisor")
        self.dirs = os.path.join(self.base, "sandboxes")
        self.records = os.path.join(state_dir, "sandboxes")  # the engine's, one per sandbox
        self.cgroup_name = cgroup_name
        self.runsc = runsc
        self.upload_max_bytes = upload_max_bytes
        os.makedirs(self.dirs, mode=0o700, exist_ok=True)
        os.makedirs(runsc.root, mode=0o700, exist_ok=True)
        self.lockdown = os.path.join(self.base, "lockdown")
        bundle.install_lockdown(self.lockdown)
        self._seq = itertools.count()
        self._pending: set[asyncio.Future[Any]] = set()  # kills of abandoned commands
        # They run on threads of their own (a runsc exec and a runsc kill each, ~0.1 s): many
        # commands timing out at once held the default executor, every tenant's creates
        # queued behind them.
        self._killer = concurrent.futures.ThreadPoolExecutor(KILL_THREADS,
                                                             thread_name_prefix="gvisor-kill")
        # Kills of abandoned commands in a paused sandbox (runsc signals nothing in one), by
        # sandbox id: sent when it is resumed (thaw). The lock makes "paused? then defer" one
        # step against thaw's "resume, then take the deferred". Each is on disk too until it
        # has been sent (_HELD): a daemon killed before the resume leaves them to the next
        # (adopt), or the command its caller was told had timed out would run on. The loop
        # is None for kills read at adopt without one: thaw sends those itself.
        self._deferred: dict[str, tuple[asyncio.AbstractEventLoop | None, set[int]]] = {}
        self._deferred_lock = threading.Lock()
        # Sandboxes being destroyed (under the same lock): no kill file is made in one. A
        # wrapper killed with its sandbox ends then (_exec_done), and a file it made while
        # the directory was being removed left the directory behind for good.
        self._ending: set[str] = set()
        # Kills waiting, by sandbox (under the same lock): each sandbox has at most one turn
        # in the kill threads' queue at a time (_kill_turn).
        self._kills: dict[str, collections.deque[int]] = {}
        self.counters = {"gvisor_execs": 0, "gvisor_exec_kills": 0,
                         "gvisor_exec_kills_deferred": 0}

    # ---- lifecycle -----------------------------------------------------------------------
    def _gdir(self, sandbox_id: str) -> str:
        return os.path.join(self.dirs, sandbox_id)

    def _cgroup(self, sandbox_id: str) -> str:
        return f"/{self.cgroup_name}/{sandbox_id}"

    def create(self, sandbox_id: str, spec: SandboxSpec, image: Any) -> SandboxRuntime:
        gdir = self._gdir(sandbox_id)
        os.makedirs(os.path.join(gdir, "exec"), mode=0o700, exist_ok=True)
        sdir = os.path.join(self.records, sandbox_id)
        rt = SandboxRuntime(sandbox_id=sandbox_id, init_pid=0, init_starttime=0,
                            sandbox_dir=sdir, cgroup_paths=[self._cgroup(sandbox_id)],
                            extra={"platform": self.runsc.platform})
        try:
            # The disk is a tmpfs: memory. What the file API writes there is charged to
            # the daemon, not the sandbox, so it is at most the sandbox's memory limit.
            root = bundle.make_root(gdir, image, min(spec.disk_mb, spec.memory_mb))
            bundle.write(os.path.join(gdir, "config.json"),
                         bundle.config(sandbox_id, spec, root, self._cgroup(sandbox_id),
                                       self.lockdown))
            logf = os.path.join(gdir, "runsc.log")
            # create + start in one runsc process (one Go start less than two commands). The
            # sentry logs at info level into a tmpfs charged to it: how its init ended
            # (end_cause).
            logs = bundle.make_log_dir(gdir, spec.memory_mb)
            self.runsc.run("run", "--detach", f"--bundle={gdir}", sandbox_id, log=logf,
                           flags=(f"--debug-log={logs}/", "--debug-command=boot",
                                  "--debug-log-format=json"))
            state = self.runsc.state(sandbox_id)
            pid = int(state["sandbox"]["pid"]) if state else 0
            if pid <= 0:
                raise RunscError("runsc left no sandbox process")
            rt.init_pid = pid
            rt.pidfd = kernel.pidfd_open(pid)
            rt.init_starttime = kernel.proc_starttime(pid) or 0
            if not self.is_alive(rt):
                raise RunscError("the sandbox ended as it started")
        except BaseException as e:
            with contextlib.suppress(Exception):
                self.destroy(rt)
            if isinstance(e, CorralError):
                raise
            if isinstance(e, OSError):
                raise InternalError(f"gvisor sandbox could not start: {e}") from e
            raise
        return rt

    def _held_path(self, sid: str, pid: int) -> str:
        return os.path.join(self._gdir(sid), "exec", f"{_HELD}{pid}")

    def _held(self, sid: str) -> set[int]:
        """The kills a daemon held for the resume and had not sent yet (on disk)."""
        out = set()
        with contextlib.suppress(OSError):
            for name in os.listdir(os.path.join(self._gdir(sid), "exec")):
                if name.startswith(_HELD) and name[len(_HELD):].isdigit():
                    out.add(int(name[len(_HELD):]))
        return out

    def adopt(self, runtime: SandboxRuntime) -> bool:
        pid = runtime.init_pid
        if pid <= 0 or not kernel.proc_alive(pid, runtime.init_starttime):
            return False
        try:
            fd = kernel.pidfd_open(pid)
        except OSError:
            return False
        if kernel.proc_starttime(pid) != runtime.init_starttime or kernel.pidfd_exited(fd):
            os.close(fd)
            return False
        state = self.runsc.state(runtime.sandbox_id)
        if state is None or int(state["sandbox"]["pid"]) != pid:
            os.close(fd)
            return False
        runtime.pidfd = fd
        held = self._held(runtime.sandbox_id)
        if held:  # the last daemon's kills: at the resume, or now if it resumed already
            try:
                loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
            with self._deferred_lock:
                if state.get("status") == "paused":
                    self._deferred[runtime.sandbox_id] = (loop, held)
                    held = set()
            for pid in held:
                if loop is not None:
                    self._schedule_kill(loop, runtime.sandbox_id, pid)
                else:
                    self._kill_inner(None, runtime.sandbox_id, pid)
        return True

    def is_alive(self, runtime: SandboxRuntime) -> bool:
        """The sandbox process exists and is not on its way out. Its pidfd turns readable only
        once its last thread is gone, and a command's `runsc exec` client answers as soon
        as the sentry's sockets close, before that: a sentry killed by an OOM from outside
        (the host's) then read as alive, and the client's failure became the command's
        result. A sentry in do_exit (PF_EXITING, or a zombie) is not alive."""
        if runtime.init_pid <= 0:
            return False
        if runtime.pidfd >= 0 and kernel.pidfd_exited(runtime.pidfd):
            return False
        return kernel.proc_alive(runtime.init_pid, runtime.init_starttime)

    def destroy(self, runtime: SandboxRuntime) -> None:
        self._destroy_id(runtime.sandbox_id, runtime.init_pid if runtime.pidfd >= 0 else 0)
        if runtime.pidfd >= 0:
            os.close(runtime.pidfd)
            runtime.pidfd = -1
        shutil.rmtree(runtime.sandbox_dir, ignore_errors=True)

    def _destroy_id(self, sandbox_id: str, pid: int) -> None:
        """Every trace of one sandbox: its sentry and gofer SIGKILLed and waited for (a
        `runsc delete --force` does the same in over a second), what else is in its cgroup,
        the cgroup, runsc's state files, the root's mounts, the directory."""
        with self._deferred_lock:
            self._deferred.pop(sandbox_id, None)
            self._kills.pop(sandbox_id, None)
            self._ending.add(sandbox_id)
        try:
            self._destroy_traces(sandbox_id, pid)
        finally:
            with self._deferred_lock:
                self._ending.discard(sandbox_id)

    def _destroy_traces(self, sandbox_id: str, pid: int) -> None:
        state = self.runsc.state(sandbox_id)
        pids = {pid}
        if state is not None:
            pids |= {int(state.get("goferPid") or 0),
                     int((state.get("sandbox") or {}).get("pid") or 0)}
        fds = []
        for p in sorted(pids - {0}):
            with contextlib.suppress(OSError):
                fd = kernel.pidfd_open(p)
                # the pid is pinned now: still one of this sandbox's (its state names it)?
                if self._names(p, sandbox_id):
                    kernel.pidfd_signal(fd, signal.SIGKILL)
                    fds.append(fd)
                else:
                    os.close(fd)
        for fd in fds:
            kernel.pidfd_exited(fd, 10.0)
            os.close(fd)
        _remove_cgroup(self._cgroup(sandbox_id))
        self.runsc.forget(sandbox_id)
        gdir = self._gdir(sandbox_id)
        bundle.unmount_all(gdir)
        shutil.rmtree(gdir, ignore_errors=True)

    def _names(self, pid: int, sandbox_id: str) -> bool:
        """Whether process ``pid`` is a runsc process of this daemon's for ``sandbox_id``."""
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            return False
        return (f"--root={self.runsc.root}".encode() in args
                and any(sandbox_id.encode() in a for a in args))

    def cleanup_orphans(self, known_ids: set[str]) -> list[str]:
        ids = set(self.runsc.ids())
        with contextlib.suppress(FileNotFoundError):
            ids |= set(os.listdir(self.dirs))
        removed = []
        for sid in sorted(ids - known_ids):
            self._destroy_id(sid, 0)
            shutil.rmtree(os.path.join(self.records, sid), ignore_errors=True)
            removed.append(sid)
        if removed:  # a sentry whose state file went missing: still named by our --root
            live = {s for s in self.runsc.ids() if s in known_ids}
            if not live:
                kill_under(self.runsc.root)
        return removed

    def close(self, *, retire: bool = False) -> None:
        for fut in list(self._pending):
            fut.cancel()  # one not started stays on disk: the next daemon sends it (adopt)
        self._killer.shutdown(wait=False, cancel_futures=True)
        if not retire:
            return
        # Every sandbox is gone: the cgroup parents runsc made in hierarchies the daemon
        # does not otherwise use (rmdir: only the empty ones go).
        for d in _cgroup_dirs(self.cgroup_name):
            with contextlib.suppress(OSError):
                os.rmdir(d)
        for d in (self.dirs, self.runsc.root):
            with contextlib.suppress(OSError):
                os.rmdir(d)

    # ---- why it ended ----------------------------------------------------------------------
    def end_cause(self, runtime: SandboxRuntime) -> dict[str, Any] | None:
        """Its limits, read in its cgroup before destroy removes it. Under gVisor the sentry
        holds the sandbox's memory and makes a host process or thread for each of its
        processes: an OOM kill, or the pids limit refusing the sentry a thread, ends the whole
        sandbox (``oom``, ``pids``)."""
        rel = self._cgroup(runtime.sandbox_id).strip("/")
        v2 = os.path.exists(os.path.join(CGROUP_ROOT, "cgroup.controllers"))
        memcg = os.path.join(CGROUP_ROOT, rel) if v2 else os.path.join(CGROUP_ROOT, "memory", rel)
        # runsc makes the cgroup per sandbox: every count in it is the sandbox's
        verdict = oom_verdict(OomCount(0, 0), oom_count_at(memcg, 2 if v2 else 1))
        if verdict == "own":
            return {"cause": "oom"}
        if verdict == "host":  # an OOM from outside its own limit (engine.base.LOST_CAUSES)
            return {"cause": "host_oom"}
        if _counter(rel, ("pids", "pids.events"), "pids.events", "max"):
            return {"cause": "pids"}
        status = _init_status(self._gdir(runtime.sandbox_id))
        if status is not None:  # the sentry ended because the sandbox's init did
            return {"cause": "init_exited", "status": status}
        return None

    # ---- exec ----------------------------------------------------------------------------
    def spawn(self, runtime: SandboxRuntime, spec: ExecSpec,
              loop: asyncio.AbstractEventLoop) -> Awaitable[Spawned]:
        if not self.is_alive(runtime):
            raise SandboxNotRunning("the sandbox is not running")
        cwd = self._cwd_from_memory(runtime, spec.cwd)
        if cwd is not None:
            return _ready(self._start(runtime, spec, cwd, loop))
        # The caller closes its ends of the pipes once this returns: the start, after the
        # walk, uses copies.
        fds = [os.dup(fd) if fd >= 0 else -1
               for fd in (spec.stdin_fd, spec.stdout_fd, spec.stderr_fd)]
        own = dataclasses.replace(spec, stdin_fd=fds[0], stdout_fd=fds[1], stderr_fd=fds[2])
        return self._start_after_walk(runtime, own, loop)

    def _cwd_from_memory(self, runtime: SandboxRuntime, cwd: str) -> str | None:
        """The cwd to start in, if the dentry cache tells (a missing one, or not a directory:
        `/`, where runsc would refuse to start the command, as a login starts in `/`); None
        when it takes a walk through the sandbox's symlinks, or a long path (on the event
        loop: its time would be the sandbox's to choose)."""
        try:
            with self._files(runtime) as f:
                kind = f.stat(cwd, cached_only=True).type
        except NotCached:
            return None
        except CorralError:
            return "/"
        if kind == "symlink":
            return None
        return cwd if kind == "dir" else "/"

    async def _start_after_walk(self, runtime: SandboxRuntime, spec: ExecSpec,
                                loop: asyncio.AbstractEventLoop) -> Spawned:
        """Start a command whose cwd takes a walk through symlinks: the walk in a thread,
        following them inside the sandbox's root (a symlink to a file, a dangling one or a
        loop: `/`), then the start, with the copies of the pipes spawn made."""
        try:
            cwd = await loop.run_in_executor(None, self._cwd_walked, runtime, spec.cwd)
            if not self.is_alive(runtime):
                raise SandboxNotRunning("the sandbox is not running")
            return self._start(runtime, spec, cwd, loop)
        finally:
            for fd in (spec.stdin_fd, spec.stdout_fd, spec.stderr_fd):
                if fd >= 0:
                    os.close(fd)

    def _cwd_walked(self, runtime: SandboxRuntime, cwd: str) -> str:
        try:
            with self._files(runtime) as f:
                return cwd if f.is_dir(cwd) else "/"
        except CorralError:
            return "/"

    def _start(self, runtime: SandboxRuntime, spec: ExecSpec, cwd: str,
               loop: asyncio.AbstractEventLoop) -> Spawned:
        sid = runtime.sandbox_id
        cgroups = _cgroup_dirs(self._cgroup(sid))  # the wrapper's (_WRAP)
        if not cgroups:
            raise SandboxNotRunning("the sandbox's cgroup is gone")
        env = {**_SH_ENV, "CG": " ".join(cgroups)}
        n = next(self._seq)
        base = os.path.join(self._gdir(sid), "exec", str(n))
        bundle.write(base + ".json", bundle.process(bundle.exec_argv(spec.argv, spec.env),
                                                    spec.env, cwd, spec.uid, spec.gid,
                                                    spec.groups))
        argv = ["/bin/sh", "-c", _WRAP, "gvisor-exec", *self.runsc.prefix, "exec",
                f"--process={base}.json", f"--internal-pid-file={base}.pid", sid]
        r, w = os.pipe2(os.O_CLOEXEC)
        acts: list[tuple[Any, ...]] = []
        for target, fd in ((0, spec.stdin_fd), (1, spec.stdout_fd), (2, spec.stderr_fd)):
            if fd >= 0:
                acts.append((os.POSIX_SPAWN_DUP2, fd, target))
            else:
                acts.append((os.POSIX_SPAWN_OPEN, target, self.runsc.null, os.O_RDWR, 0))
        acts.append((os.POSIX_SPAWN_DUP2, w, 9))
        try:
            pid = os.posix_spawn("/bin/sh", argv, env, file_actions=acts, setsid=True)
        except BaseException:
            os.close(r)
            with contextlib.suppress(OSError):
                os.unlink(base + ".json")
            raise
        finally:
            os.close(w)
        self.counters["gvisor_execs"] += 1
        loop.add_reader(r, self._exec_done, loop, r, sid, base)
        return Spawned(pidfd=-1, pid=pid, ns_pid=0, own_child=True)

    def _exec_done(self, loop: asyncio.AbstractEventLoop, r: int, sid: str, base: str) -> None:
        """The wrapper ended: with a status (the command ended), or without (killed: the
        command may still run inside the sandbox, so it is killed there)."""
        try:
            got = os.read(r, 16)
        except OSError:
            got = b""
        loop.remove_reader(r)
        os.close(r)
        with contextlib.suppress(OSError):
            os.unlink(base + ".json")
        inner = 0
        with contextlib.suppress(OSError, ValueError), open(base + ".pid") as f:
            inner = int(f.read().strip() or 0)
        with contextlib.suppress(OSError):
            os.unlink(base + ".pid")
        if got or inner <= 0:
            return
        self.counters["gvisor_exec_kills"] += 1
        self._schedule_kill(loop, sid, inner)

    def _schedule_kill(self, loop: asyncio.AbstractEventLoop, sid: str, pid: int) -> None:
        """Kill an abandoned command in the background. It is on disk (_HELD) until sent: a
        daemon that stops (or dies) before leaves it to the next one (adopt), or a command
        its caller was told had timed out would run on. A sandbox being destroyed (or gone)
        needs no kill: its commands end with it."""
        with self._deferred_lock:
            if sid in self._ending:
                return
            try:
                with open(self._held_path(sid, pid), "x"):
                    pass
            except FileExistsError:
                pass
            except FileNotFoundError:  # its directory is gone: so is the sandbox
                return
            except OSError as e:
                log.warning("cannot record a kill to send",
                            extra={"sandbox": sid, "error": str(e)})
            queued = self._kills.get(sid)
            if queued is not None:  # this sandbox's turn is queued or running: it takes it
                queued.append(pid)
                return
            self._kills[sid] = collections.deque([pid])
        self._queue_turn(loop, sid)

    def _queue_turn(self, loop: asyncio.AbstractEventLoop, sid: str) -> None:
        """Put sandbox ``sid``'s next kill at the back of the kill threads' queue."""
        try:
            fut = loop.run_in_executor(self._killer, self._kill_turn, loop, sid)
        except RuntimeError:  # closing: on disk, the next daemon sends it
            with self._deferred_lock:
                self._kills.pop(sid, None)
            return
        self._pending.add(fut)
        fut.add_done_callback(self._pending.discard)

    def _kill_turn(self, loop: asyncio.AbstractEventLoop, sid: str) -> None:
        """One of sandbox ``sid``'s kills; its next one, if any, goes to the back of the
        queue. A sandbox holds one kill thread at a time, and every other sandbox's kills are
        sent between its own: one whose processes stop each kill's process as it starts
        (each then runs to its timeout) held both threads, and other sandboxes' commands,
        answered as timed out, ran on for as long as it went on."""
        with self._deferred_lock:
            queued = self._kills.get(sid)
            pid = queued.popleft() if queued else 0
        try:
            if pid:
                self._kill_inner(loop, sid, pid)
        finally:
            with self._deferred_lock:
                more = bool(self._kills.get(sid))
                if not more:
                    self._kills.pop(sid, None)
            if more:
                try:
                    loop.call_soon_threadsafe(self._queue_turn, loop, sid)
                except RuntimeError:  # the loop is closed: on disk, the next daemon sends them
                    with self._deferred_lock:
                        self._kills.pop(sid, None)

    def _going(self, sid: str) -> bool:
        """The sandbox is being destroyed, or is gone (with its directory). Under
        _deferred_lock."""
        return sid in self._ending or not os.path.isdir(self._gdir(sid))

    def _paused(self, sid: str) -> bool:
        state = self.runsc.state(sid)
        return state is not None and state.get("status") == "paused"

    def _kill_inner(self, loop: asyncio.AbstractEventLoop | None, sid: str, pid: int) -> None:
        """SIGKILL the command (`runsc kill`, which the sandbox cannot hold up), then its
        process group inside the sandbox (runsc kill reaches one process only: the group is
        killed from inside, by the lock-down binary, never by a program of the sandbox's
        image; the sandbox can stop that process, so it has GROUP_KILL_TIMEOUT_S). In a
        paused sandbox runsc refuses both (a timeout that fired while a pause or a
        snapshot's freeze held it would leave the command running once resumed): the kill
        waits for the resume."""
        for _ in range(2):  # paused between the check and the kill: check again
            with self._deferred_lock:
                if self._going(sid):
                    return
                if self._paused(sid):
                    self._deferred.setdefault(sid, (loop, set()))[1].add(pid)
                    self.counters["gvisor_exec_kills_deferred"] += 1
                    try:
                        with open(self._held_path(sid, pid), "x"):
                            pass
                    except FileExistsError:
                        pass
                    except OSError as e:  # held in memory only: lost if the daemon dies
                        log.warning("cannot record a held kill",
                                    extra={"sandbox": sid, "error": str(e)})
                    return
            done = False
            with contextlib.suppress(RunscError):
                self.runsc.run("kill", f"--pid={pid}", sid, "KILL", timeout=KILL_TIMEOUT_S)
                done = True
            path = os.path.join(self._gdir(sid), "exec", f"kill-{pid}.json")
            with contextlib.suppress(OSError, RunscError):
                with self._deferred_lock:  # not into a directory being removed
                    if self._going(sid):
                        return
                    bundle.write(path, bundle.process(bundle.kill_argv(pid), {}, "/", 0, 0,
                                                      []))
                self.runsc.run("exec", f"--process={path}", sid, timeout=GROUP_KILL_TIMEOUT_S)
                done = True
            with contextlib.suppress(OSError):
                os.unlink(path)
            if done:
                break
        with contextlib.suppress(OSError):  # sent (or the sandbox cannot take it): not held
            os.unlink(self._held_path(sid, pid))

    # ---- pause ---------------------------------------------------------------------------
    # runsc's sentry stops and starts the sandbox's tasks itself: nothing in the sandbox can
    # hold a pause or a resume off, so a failure of runsc is the platform's (infra), never
    # an OSError the request's error mapping would give to the caller.
    def freeze(self, runtime: SandboxRuntime) -> None:
        try:
            self.runsc.run("pause", runtime.sandbox_id)
        except RunscError as e:
            raise self._switch_error("pause", runtime, e) from None

    def thaw(self, runtime: SandboxRuntime, wait: bool = True) -> None:
        try:
            self.runsc.run("resume", runtime.sandbox_id)
        except RunscError as e:
            raise self._switch_error("resume", runtime, e) from None
        with self._deferred_lock:
            loop, pids = self._deferred.pop(runtime.sandbox_id, (None, set()))
        for pid in pids:  # from the loop's thread: thaw may run in a worker thread
            if loop is None:  # held by the last daemon, adopted with no loop: sent here
                self._kill_inner(None, runtime.sandbox_id, pid)
                continue
            with contextlib.suppress(RuntimeError):  # the loop is closed: the daemon stops
                loop.call_soon_threadsafe(self._schedule_kill, loop, runtime.sandbox_id, pid)

    def _switch_error(self, what: str, runtime: SandboxRuntime, e: RunscError) -> CorralError:
        """A runsc pause or resume that failed: the sandbox's end when it has stopped (its
        init ended: the engine tells why), else runsc's (infra)."""
        state = self.runsc.state(runtime.sandbox_id)
        if not self.is_alive(runtime) or (state is not None and state.get("status") == "stopped"):
            return SandboxNotRunning("the sandbox is not running")
        return InternalError(f"runsc {what} failed: {e}", details={"cause": "runsc"})

    def is_frozen(self, runtime: SandboxRuntime) -> bool:
        state = self.runsc.state(runtime.sandbox_id)
        return state is not None and state.get("status") == "paused"

    # ---- snapshots: the files, as for a container ------------------------------------------
    def image_on(self, image: Any, layers: list[str], store: SnapshotStore) -> Any:
        """The snapshot layers as lowerdirs over the image's own, in each overlay of the
        host-side root (bundle.make_root mounts them)."""
        overlays = store.stack(image.overlays, layers)
        store.check_fits(overlays, self.dirs)
        return dataclasses.replace(image, overlays=overlays,
                                   meta={**image.meta, "layers": list(layers)})

    def capture(self, runtime: SandboxRuntime, image: Any, store: SnapshotStore,
                paused: bool, control: CaptureControl | None = None) -> tuple[str, str, int]:
        """The root's upper dirs, copied while `runsc pause` holds every task of the sandbox
        (with --file-access=shared a write inside is on the host side when its call
        returns). A sandbox that cannot be paused is not copied live: the snapshot fails."""
        store.check_fits(image.overlays, self.dirs, extra_layers=1)
        base = os.path.join(self._gdir(runtime.sandbox_id), "rw", "upper")
        uppers = [os.path.join(base, str(i)) for i in range(len(os.listdir(base)))]

        def freeze() -> None:
            if not paused:
                self.freeze(runtime)

        def thaw() -> None:
            if not paused:
                self.thaw(runtime)

        return store.capture(uppers, freeze, thaw, control)

    def reset(self, runtime: SandboxRuntime, spec: SandboxSpec, image: Any) -> SandboxRuntime:
        """Restore in place: the sandbox's sentry, gofer, cgroup, root and runsc state go (as
        at destroy; the engine's record dir stays), then a new sandbox starts under the same
        id on ``image`` (the snapshot's layers under a fresh upper dir)."""
        self._destroy_id(runtime.sandbox_id, runtime.init_pid if runtime.pidfd >= 0 else 0)
        if runtime.pidfd >= 0:
            os.close(runtime.pidfd)
            runtime.pidfd = -1
        return self.create(runtime.sandbox_id, spec, image)

    # ---- reporting -----------------------------------------------------------------------
    def metrics(self) -> dict[str, int]:
        return dict(self.counters)

    def status(self) -> dict[str, Any]:
        return {"gvisor_platform": self.runsc.platform}

    # ---- files: on the host side of the sandbox's root -------------------------------------
    @contextlib.contextmanager
    def _files(self, runtime: SandboxRuntime) -> Iterator[RootFiles]:
        """The file operations on an O_PATH fd of the sandbox's host-side root, open for one
        operation (no disk budget: the sandbox's disk is a tmpfs of its size)."""
        if runtime.pidfd < 0 and runtime.init_pid <= 0:
            raise SandboxNotRunning("the sandbox is not running")
        try:
            fd = os.open(os.path.join(self._gdir(runtime.sandbox_id), "root"),
                         os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise SandboxNotRunning(f"the sandbox's root is gone: {e.strerror}") from None
        try:
            yield RootFiles(lambda: contextlib.nullcontext(fd), False, None,
                            self.upload_max_bytes)
        finally:
            os.close(fd)
