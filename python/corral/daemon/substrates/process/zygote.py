"""The run_code zygote: a pre-warmed interpreter that forks one locked-down child per request.

Run by the daemon as a script (``python -I zygote.py``, fd 3 a socket to the daemon), so that it
imports none of corral but the Rust core, loaded by path. Its life:

1. The launcher (this process, in the daemon's namespaces) reads its config frame, joins the
   pool's zygote cgroup, unshares mount, network, pid, IPC and UTS namespaces and forks the
   zygote, pid 1 of the new pid namespace. The launcher only waits: when it is killed, the
   zygote gets SIGKILL (PDEATHSIG), and with pid 1 every process of the namespace goes.
2. The zygote opens its slots' cgroup directories, imports the preloaded modules, switches to a
   read-only root that holds only the OS directories and the interpreter, with a private /tmp
   and a /proc that shows each uid only its own processes, its host-wide entries masked as a
   container's are (view.py); SysV IPC and POSIX message queues
   are capped at zero objects (nothing can outlive a request there). It then seals itself
   (no_new_privs and the sandbox seccomp filter, inherited by every child) and says ready.
3. Each request runs in a fresh fork, made ahead of it by the zygote's fork server: a child of
   the zygote made once its interpreter is ready, that forks on the zygote's command and runs
   no Python between forks (rust/src/zygote.rs ``fork_server``), so the pages it shares with
   the waiting children are not copied again at every fork. The child joins its slot's
   cgroups (memory, pids, freezer, cpu), takes the slot's scratch dir, drops to the slot's uid
   with no capability, rlimits and a Landlock domain of its own (abstract unix sockets), all
   in one call (``_core.ZygoteEntry``), then waits for its request on a pipe and runs it
   (python: in the forked interpreter; bash: exec). When its process exits, the zygote kills
   whatever it left running in the slot's cgroup, wipes the scratch dir, says so, and asks
   for the slot's next child.
4. A slot's scratch is a tmpfs of its own, ``/tmp/s<i>``: its root is the zygote's (mode 0710,
   the slot's group), so no other slot's uid reaches a file in it whatever a request makes
   of its modes; the request's working directory is ``/tmp/s<i>/w``, its own, removed and
   made afresh after each request (no mode, time, xattr or ACL of it reaches the next). A
   big tree (more than WIPE_INLINE_INODES inodes or WIPE_INLINE_BYTES) is removed by a
   helper process, off this loop: only its own slot waits for it. A tmpfs that is not back
   to empty after the wipe is looked at again for up to SETTLE_WAIT_S before the request is
   said done and the slot's next child forked: files in flight in a unix socket cycle the
   request left (its fds sent over its own sockets) are freed by the kernel's collector on
   its own pass, after the request's processes are gone. A tmpfs still in use then (a file
   some other process holds) is reported ``dirty``: the daemon retires the slot, and the
   zygote, its tmpfs and its cgroups are made afresh.

A session zygote (``language`` ``session``: one ``Sandbox(substrate="process")``) has one slot
and no preloaded module: its /tmp is the session's own tmpfs (owned by the slot's uid), kept
from one command to the next. Each ``spawn`` frame (with the command's stdio fds) becomes a
fresh child that locks itself down the same way and execs the command; the zygote answers with
the child's pidfd (SCM_RIGHTS), reaps it, and leaves what it started running (the session's
processes end with the session: the zygote is pid 1 of their namespace).

Frames both ways: 4-byte big-endian length + JSON.
"""

from __future__ import annotations

import _signal  # the C functions: signal.signal's enum wrapping costs a child ~60 page faults
import _socket  # likewise socket.py and selectors: their enums and classes grow every fork
import atexit
import builtins
import errno
import json
import os
import resource
import select
import struct
import sys
import time
import traceback
import types

# Every module a child uses is imported here, in the zygote: an import statement in a child
# for a module not yet loaded runs the import machinery there (``import atexit`` alone cost a
# child 54 page faults). Nothing else is: a fork copies the page tables of all the zygote's
# memory and mappings, so each module it holds costs every request.

TYPE_CHECKING = False  # typing is not imported: every module here is in every fork's memory
if TYPE_CHECKING:
    from typing import Any

HDR = struct.Struct("!I")
# The fork server's messages (rust/src/zygote.rs): a command, a fork, an exit.
FORK = struct.Struct("=cI")
FORKED = struct.Struct("=cIi")
EXITED = struct.Struct("=ciidB")
# On a child's status pipe, from its fork server to the daemon: its wait status, when it was
# reaped and whether it had started its request (rust/src/zygote.rs ``write_status``).
STATUS = struct.Struct("=idB")
# The fd a request's child holds until it has its request: one byte written to it then tells
# its fork server the request started (a child that ends before has failed the host's way).
STARTED_FD = 4
MAX_FRAME = 256 << 20
READ_CHUNK = 1 << 16
# How long a session's zygote waits for a command's child to exec (or to say its set-up failed).
SETUP_WAIT_S = 10.0
# A slot's processes are killed and waited for on the loop this long; past it the loop goes
# on and checks again every KILL_POLL_S, for at most KILL_WAIT_S, before the slot is broken.
KILL_INLINE_S = 0.02
KILL_POLL_S = 0.005
KILL_WAIT_S = 300.0
# A scratch using more than this is removed by a helper process, not on the zygote's loop.
WIPE_INLINE_INODES = 1024
WIPE_INLINE_BYTES = 64 << 20
CLEAN_INODES = 2  # a slot's tmpfs between requests: its root and the working directory
# A tmpfs not empty after its wipe is looked at again, SETTLE_FIRST_S after, then at twice
# the wait each time (at most SETTLE_MAX_STEP_S), for SETTLE_WAIT_S before the slot is given
# up: a request whose files are in flight in a unix socket cycle (its own fds sent over its
# own sockets) retired the zygote, where the kernel frees them within milliseconds.
SETTLE_FIRST_S = 0.001
SETTLE_MAX_STEP_S = 0.1
SETTLE_WAIT_S = 1.0
BASH_ARG_MAX = 100_000  # longer bash programs go through a memfd (MAX_ARG_STRLEN is 128 KiB)


# ---- frames (also imported by the daemon side) ----------------------------------------------
def encode(obj: Any) -> bytes:
    data = json.dumps(obj, separators=(",", ":")).encode()
    return HDR.pack(len(data)) + data


class FrameReader:
    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        self.buf += data
        out = []
        while len(self.buf) >= HDR.size:
            (n,) = HDR.unpack_from(self.buf)
            if n > MAX_FRAME:
                raise ValueError(f"frame of {n} bytes")
            if len(self.buf) < HDR.size + n:
                break
            out.append(json.loads(bytes(self.buf[HDR.size:HDR.size + n])))
            del self.buf[:HDR.size + n]
        return out


def recv_with_fds(sk: _socket.socket, flags: int = 0) -> tuple[bytes, list[int]]:
    """One read of ``sk`` and the fds that came with it (SCM_RIGHTS, close-on-exec); b"" at
    the peer's end. BlockingIOError and InterruptedError are the caller's."""
    data, anc, _, _ = sk.recvmsg(READ_CHUNK, _socket.CMSG_SPACE(16 * 4),
                                 _socket.MSG_CMSG_CLOEXEC | flags)
    fds: list[int] = []
    for level, kind, raw in anc:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            n = len(raw) - len(raw) % 4
            fds += list(struct.unpack(f"{n // 4}i", raw[:n]))
    return data, fds


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except InterruptedError:
            continue
        view = view[n:]


def _read_frame(fd: int) -> Any:
    reader = FrameReader()
    while True:
        data = os.read(fd, READ_CHUNK)
        if not data:
            raise EOFError("daemon closed the zygote socket")
        frames = reader.feed(data)
        if frames:
            return frames[0]


# ---- cgroups of a slot (the zygote is root and holds their directory fds) -------------------
def _read_at(dirfd: int, name: str) -> str:
    fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dirfd)
    try:  # small reads: a 1 MiB buffer would be a fresh mapping (and its faults) each time
        chunks = []
        while data := os.read(fd, READ_CHUNK):
            chunks.append(data)
        return b"".join(chunks).decode()
    finally:
        os.close(fd)


def _write_at(dirfd: int, name: str, data: str) -> None:
    fd = os.open(name, os.O_WRONLY | os.O_CLOEXEC, dir_fd=dirfd)
    try:
        os.write(fd, data.encode())
    finally:
        os.close(fd)


class SlotCgroups:
    """The slot's cgroups: {"memory": dir, "pids": dir, "freezer": dir} (v1) or
    {"unified": dir} (v2)."""

    def __init__(self, dirs: dict[str, str]) -> None:
        self.v2 = "unified" in dirs
        self.fds = {k: os.open(p, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
                    for k, p in dirs.items()}
        member = "cgroup.procs" if self.v2 else "tasks"
        # Open once here: a child joins by writing "0" to each, with no open of its own.
        self.join = [os.open(member, os.O_WRONLY | os.O_CLOEXEC, dir_fd=fd)
                     for fd in self.fds.values()]
        self.procs = self.fds["unified" if self.v2 else "pids"]

    def pids(self) -> list[int]:
        return [int(x) for x in _read_at(self.procs, "cgroup.procs").split()]

    def kill_all(self, reaped: Any, wait: float = KILL_INLINE_S) -> bool:
        """SIGKILL every process of the slot; True once none is left, False if some are
        still there after ``wait`` seconds: they are dying (a process's exit can take
        seconds, tearing down page tables a request built up on purpose), and the caller
        calls again later, off its loop's critical path."""
        if not self.pids():
            return True
        if self.v2:
            try:
                _write_at(self.procs, "cgroup.kill", "1")
            except OSError:
                pass
        freezer = self.fds.get("freezer")
        deadline = time.monotonic() + wait
        while True:
            # Frozen, nothing forks while we read the list; SIGKILL acts at the thaw.
            if freezer is not None:
                _write_at(freezer, "freezer.state", "FROZEN")
            for pid in self.pids():
                try:
                    os.kill(pid, _signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if freezer is not None:
                _write_at(freezer, "freezer.state", "THAWED")
            for pid, status in _reap_any():
                reaped(pid, status)
            if not self.pids():
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0005)


def _remove_tree(path: str) -> None:
    """rm -rf of a small tree (at most WIPE_INLINE_INODES): shutil's recursion gives up on a
    tree a thousand directories deep (RecursionError), rm(1) does not."""
    import shutil

    try:
        shutil.rmtree(path)
        return
    except (RecursionError, OSError):
        pass
    pid = _spawn_rm(path)
    while True:
        try:
            os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    if os.path.lexists(path):
        raise OSError(f"could not remove {path}")


def _spawn_rm(path: str) -> int:
    return os.posix_spawn("/bin/rm", ["rm", "-rf", "--one-file-system", "--", path], {})


def _scratch_use(root: str) -> tuple[int, int]:
    """(inodes, bytes) in use on a slot's tmpfs: one statvfs."""
    st = os.statvfs(root)
    return st.f_files - st.f_ffree, (st.f_blocks - st.f_bfree) * st.f_frsize


def _dirty(slot: Slot) -> bool:
    """The slot's tmpfs holds more than its root and a fresh working directory."""
    inodes, used = _scratch_use(slot.root)
    return inodes > CLEAN_INODES or used > 0


def _collect_unix_cycles() -> None:
    """Have the kernel's collector of unix socket cycles run: it runs (in a kernel worker,
    soon after) when a unix socket is released while fds are in flight. A request's own
    cycle releases none when it ends: its sockets are still referenced from inside it."""
    a, b = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_DGRAM)
    a.close()
    b.close()


def _empty_and_remove(path: str) -> None:
    """Remove a (small) working directory and what is in it."""
    try:
        os.rmdir(path)  # mostly it is empty: one call
        return
    except OSError as e:
        if e.errno != errno.ENOTEMPTY:
            raise
    for name in os.listdir(path):
        p = os.path.join(path, name)
        if os.path.isdir(p) and not os.path.islink(p):
            _remove_tree(p)
        else:
            os.unlink(p)
    os.rmdir(path)


def _reap_any() -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return out
        if pid == 0:
            return out
        out.append((pid, status))


# ---- the zygote -----------------------------------------------------------------------------
class Slot:
    def __init__(self, index: int, uid: int, cgroups: dict[str, str]) -> None:
        self.index = index
        self.uid = uid
        self.cg = SlotCgroups(cgroups)
        self.root = f"/tmp/s{index}"        # its tmpfs, the zygote's (0710, the slot's group)
        self.scratch = f"/tmp/s{index}/w"   # a request's working directory, made per request
        self.pid = 0           # its child, waiting for a request or running one
        self.broken = False
        self.retired = False   # its tmpfs is not empty after a wipe: the daemon rebuilds us
        self.settling = 0.0    # its tmpfs was not empty after the wipe: when it is given up
        self.settle_at = 0.0   # and when it is looked at next
        self.settle_step = 0.0
        self.done_frame: dict[str, Any] = {}  # the request's answer, sent once it settles
        self.killing = 0.0     # while its processes are being killed: when it gives up
        self.kill_at = 0.0     # and when it looks at them next
        self.exited: tuple[int, int, float] | None = None  # (pid, status, t_exit), not wiped
        self.started = True     # whether that child had started its request (its fork server's)
        self.entry: Any = None  # _core.ZygoteEntry: what its request children do first


class Zygote:
    """The loop of pid 1. It forks each slot's child ahead of its request and hands the
    daemon the child's ends (request pipe, stdout, stderr) over the socket (SCM_RIGHTS): the
    request's code, input and output never pass through the zygote, so no trace of them is
    in the memory the next children are forked from. It reaps each child, kills what it left
    in the slot's cgroups, wipes the scratch dir, says so, and forks the next one when idle."""

    def __init__(self, cfg: dict[str, Any], core: Any, sock: int) -> None:
        self.cfg = cfg
        self.core = core
        self.sock = sock
        self.sk = _socket.socket(fileno=sock)
        self.language = cfg["language"]
        self.session = self.language == "session"
        self.entered = False  # a request's child: past ZygoteEntry.enter (stdio moved)
        self.slots = [Slot(i, s["uid"], s["cgroups"]) for i, s in enumerate(cfg["slots"])]
        self.by_pid: dict[int, Slot] = {}
        # rm helpers of big scratch trees: pid -> (slot, its child's pid, status, t_exit)
        self.wipers: dict[int, tuple[Slot, int, int, float]] = {}
        self.forks: Any = None                   # the fork server's socket (not a session)
        self.forks_fd = -1
        self.reader = FrameReader()
        self.poll = select.poll()
        self.preloaded: list[str] = []
        self.fds: list[int] = []                 # received with spawn frames, in order
        self.env = cfg["env"]
        self.rlimits = [tuple(x) for x in cfg["rlimits"]]

    # -- setup --
    def setup(self) -> None:
        import gc
        import importlib

        for name in [*self.cfg["preload"], "resource"]:
            try:
                importlib.import_module(name)
                self.preloaded.append(name)
            except Exception as e:  # noqa: BLE001 - an optional module: say which, go on
                print(f"run_code zygote: preload {name}: {e}", file=sys.stderr)
        # From here on the zygote's environment is a request's (its preloads read theirs):
        # a child then only adds its own HOME, TMPDIR and PWD.
        os.environ.clear()
        os.environ.update(self.env)
        self.core.zygote_build_root(self.cfg["root"], [tuple(e) for e in self.cfg["entries"]])
        if self.cfg.get("hostname"):
            _socket.sethostname(self.cfg["hostname"])
        # SysV IPC objects and POSIX queues outlive their process: allow none at all.
        for path, value in (("/proc/sys/kernel/shmmni", "0"), ("/proc/sys/kernel/msgmni", "0"),
                            ("/proc/sys/kernel/sem", "0 0 0 0"),
                            ("/proc/sys/fs/mqueue/queues_max", "0")):
            with open(path, "w") as f:
                f.write(value)
        if self.session:
            for s in self.slots:
                s.root = s.scratch = "/tmp"  # the session's tmpfs, its uid's, mode 0700
        else:
            for s in self.slots:
                self._new_scratch(s)
                s.entry = self.core.ZygoteEntry(join=s.cg.join, dir=s.scratch, umask=0o077,
                                                uid=s.uid, gid=s.uid, rlimits=self.rlimits)
        self.devnull = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
        wake_r, wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self.wake_r = wake_r
        _signal.set_wakeup_fd(wake_w)
        _signal.signal(_signal.SIGCHLD, lambda *_: None)
        self.poll.register(self.sock, select.POLLIN)
        self.poll.register(wake_r, select.POLLIN)
        # The seccomp filter, for the zygote and every child it forks; a session's commands
        # share one Landlock domain (they see and signal each other), requests have their own.
        self.core.zygote_seal(landlock=self.session)
        if self.language == "python":
            _warm_python()
        gc.collect()
        gc.freeze()  # keeps the children from dirtying (copying) the preloaded objects' pages
        if not self.session:
            self._start_fork_server()

    def _new_scratch(self, s: Slot) -> None:
        """Make the slot's working directory afresh (a new inode: nothing a request set on
        the old one, times, xattrs, ACLs, reaches the next). Mode 0700: the zygote's umask
        is the daemon's 022."""
        os.mkdir(s.scratch, 0o700)
        os.chown(s.scratch, s.uid, s.uid)

    # -- the loop --
    def serve(self) -> None:
        _write_all(self.sock, encode({"ready": True, "preloaded": self.preloaded}))
        if not self.session:
            for slot in self.slots:
                self._fork(slot)
        while True:
            # While a slot's processes die, the loop looks at them again every KILL_POLL_S;
            # a slot whose tmpfs is settling, at its next look.
            wait = None
            timers = [s.kill_at for s in self.slots if s.killing]
            timers += [s.settle_at for s in self.slots if s.settling]
            if timers:
                wait = max(0, int((min(timers) - time.monotonic()) * 1000) + 1)
            for fd, _ in self.poll.poll(wait):
                if fd == self.sock:
                    if not self._from_daemon():
                        return
                elif fd == self.forks_fd:
                    if not self._from_fork_server():
                        print("run_code zygote: the fork server ended", file=sys.stderr)
                        return
                else:
                    try:
                        os.read(self.wake_r, 4096)
                    except BlockingIOError:
                        pass
            for pid, status in _reap_any():
                self._reaped(pid, status)
            if timers:
                now = time.monotonic()
                for slot in self.slots:
                    if slot.killing and now >= slot.kill_at:
                        self._kill(slot)
                    elif slot.settling and now >= slot.settle_at:
                        self._settle(slot)

    def _kill(self, slot: Slot) -> None:
        """Kill every process of the slot, then (its child reaped) wipe it. Processes that
        take long to exit are waited for off the loop's path: each other slot goes on (a
        loop held by one slot's dying processes held every other request of the zygote, and
        gave it up as dead). Ones still there after KILL_WAIT_S break the slot."""
        first = not slot.killing
        if first:
            slot.killing = time.monotonic() + KILL_WAIT_S
        if slot.cg.kill_all(self._reaped, KILL_INLINE_S if first else 0.0):
            slot.killing = 0.0
        elif time.monotonic() > slot.killing:
            slot.killing = 0.0
            slot.broken = True
        else:
            slot.kill_at = time.monotonic() + KILL_POLL_S
            if first:  # the daemon waits for this slot's answer until KILL_WAIT_S
                pid = slot.pid if slot.exited is None else slot.exited[0]
                _write_all(self.sock, encode({"draining": slot.index, "pid": pid}))
            return
        if slot.exited is not None:
            exited, slot.exited = slot.exited, None
            self._clean(slot, *exited)

    def _from_daemon(self) -> bool:
        try:
            data, fds = recv_with_fds(self.sk)
        except InterruptedError:
            return True
        if not data:
            return False
        self.fds += fds
        for msg in self.reader.feed(data):
            if "spawn" in msg:
                self._spawn(msg["spawn"])
                continue
            slot = self.slots[msg["kill"]]
            if slot.pid > 0 and slot.pid == msg.get("pid"):  # its timeout: the whole tree
                if not slot.killing:
                    self._kill(slot)
        return True

    def _reaped(self, pid: int, status: int, t_exit: float | None = None,
                started: bool = True) -> None:
        """A slot's child ended (its request done, killed, or it died waiting), or the
        helper that removed a slot's big tree did."""
        if t_exit is None:
            t_exit = time.monotonic()
        wiper = self.wipers.pop(pid, None)
        if wiper is not None:
            self._wiped(*wiper)
            return
        slot = self.by_pid.pop(pid, None)
        if slot is None or self.session:
            return  # an orphan of some request, reparented to us; or a session's command
        slot.pid = 0
        slot.exited = (pid, status, t_exit)
        slot.started = started
        if not slot.killing:  # what it left behind dies with it, then the slot is wiped
            self._kill(slot)

    def _clean(self, slot: Slot, pid: int, status: int, t_exit: float) -> None:
        """The slot's child has exited and nothing of its request is left: wipe it."""
        if slot.broken:
            self._wiped(slot, pid, status, t_exit)
            return
        try:
            inodes, used = _scratch_use(slot.root)
            if inodes > WIPE_INLINE_INODES or used > WIPE_INLINE_BYTES:
                # Off this loop: the other slots' requests go on; this one waits for it.
                self.wipers[_spawn_rm(slot.scratch)] = (slot, pid, status, t_exit)
                return
            _empty_and_remove(slot.scratch)
        except Exception as e:  # noqa: BLE001 - that slot is not used again; the rest go on
            print(f"run_code zygote: slot {slot.index} scratch: {e}", file=sys.stderr)
            slot.broken = True
        self._wiped(slot, pid, status, t_exit)

    def _wiped(self, slot: Slot, pid: int, status: int, t_exit: float) -> None:
        """The slot's old working directory is gone: make a new one and, once the slot's
        tmpfs is empty again, say the request is done and have the next child forked."""
        dirty = False
        if not slot.broken:
            try:
                self._new_scratch(slot)
                dirty = _dirty(slot)
            except Exception as e:  # noqa: BLE001 - that slot is not used again
                print(f"run_code zygote: slot {slot.index} scratch: {e}", file=sys.stderr)
                slot.broken = True
        done = {"done": slot.index, "pid": pid, "status": status, "t_exit": t_exit,
                "started": slot.started, "broken": slot.broken, "dirty": False}
        if dirty:  # the answer waits too: the daemon gives the slot out again once told
            _collect_unix_cycles()
            now = time.monotonic()
            slot.settling = now + SETTLE_WAIT_S
            slot.settle_step = SETTLE_FIRST_S
            slot.settle_at = now + SETTLE_FIRST_S
            slot.done_frame = done
            return
        _write_all(self.sock, encode(done))
        if not slot.broken:
            self._fork(slot)

    def _settle(self, slot: Slot) -> None:
        """Look again at a slot's tmpfs that was not empty after its wipe: empty, the slot
        goes on; still in use at SETTLE_WAIT_S (files another process holds, charged to the
        slot's tmpfs and memory: only a new zygote frees the slot of them), the request is
        done with the slot ``dirty`` and the daemon retires it."""
        try:
            dirty = _dirty(slot)
        except OSError as e:
            print(f"run_code zygote: slot {slot.index} scratch: {e}", file=sys.stderr)
            dirty = True
        now = time.monotonic()
        if dirty and now < slot.settling:
            _collect_unix_cycles()
            slot.settle_step = min(2 * slot.settle_step, SETTLE_MAX_STEP_S)
            slot.settle_at = min(now + slot.settle_step, slot.settling)
            return
        slot.settling = 0.0
        done, slot.done_frame = slot.done_frame, {}
        slot.retired = done["dirty"] = dirty
        _write_all(self.sock, encode(done))
        if not dirty:
            self._fork(slot)

    # -- the fork server --
    def _start_fork_server(self) -> None:
        """Fork the process that forks the requests' children (rust/src/zygote.rs
        ``fork_server``): it runs no Python between forks, so what it shares with its waiting
        children stays shared, where this loop's own writes (reaping, wiping, frames) would
        copy each page it touches again after every fork. It is this zygote's child, made
        once its interpreter is ready: the children are copies of that state."""
        ours, theirs = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:
            ours.close()
            _signal.set_wakeup_fd(-1)
            _signal.signal(_signal.SIGCHLD, _signal.SIG_DFL)
            try:
                si, ctl, fout, ferr, go = self.core.zygote_fork_server(theirs.fileno())
            except BaseException as e:  # noqa: BLE001 - say why, never return into the loop
                os.write(2, f"run_code fork server: {type(e).__name__}: {e}\n".encode())
                os._exit(1)
            # A request's child (the server itself never returns).
            try:
                self._child(self.slots[si], ctl, fout, ferr, go)
            except BaseException as e:  # noqa: BLE001 - report, never return into the loop
                # stderr is fd 2 once the child has entered its slot (ferr is closed then)
                err = 2 if self.entered else ferr
                try:
                    os.write(err, f"run_code: could not start: {type(e).__name__}: {e}\n"
                             .encode())
                finally:
                    os._exit(126)
            os._exit(126)
        theirs.close()
        self.forks = ours
        self.forks_fd = ours.fileno()
        self.poll.register(self.forks_fd, select.POLLIN)

    def _fork(self, slot: Slot) -> None:
        """Have the slot's next child forked ahead of its request: it joins the slot's
        cgroups, takes the scratch dir, locks itself down, then waits for its request on a
        pipe whose other end (with its stdout and stderr) goes to the daemon."""
        if slot.pid or slot.broken:
            return
        slot.pid = -1  # asked for
        self.forks.send(FORK.pack(b"f", slot.index))

    def _from_fork_server(self) -> bool:
        try:
            data, anc, _, _ = self.forks.recvmsg(32, _socket.CMSG_SPACE(4 * 4),
                                                 _socket.MSG_CMSG_CLOEXEC)
        except InterruptedError:
            return True
        fds: list[int] = []
        for level, kind, raw in anc:
            if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
                n = len(raw) - len(raw) % 4
                fds += list(struct.unpack(f"{n // 4}i", raw[:n]))
        if not data:
            return False
        if data[:1] == b"X":
            _, pid, status, t_exit, started = EXITED.unpack(data)
            self._reaped(pid, status, t_exit, bool(started))
            return True
        _, si, pid = FORKED.unpack(data)
        slot = self.slots[si]
        slot.pid = pid
        self.by_pid[pid] = slot
        try:
            self.sk.sendmsg([encode({"warm": si, "pid": pid})],
                            [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, struct.pack("4i", *fds))])
        finally:
            for fd in fds:
                os.close(fd)
        return True

    # -- a session's commands --
    def _spawn(self, req: dict[str, Any]) -> None:
        """Start one command of the session: its stdio fds came with the frame (``stdio``
        says which of 0, 1, 2 did; the others are /dev/null). Answer with its pidfd."""
        stdio: list[int] = []
        for have in req["stdio"]:
            stdio.append(self.fds.pop(0) if have and self.fds else -1)
        slot = self.slots[0]
        pidfd = setup_r = setup_w = -1
        try:
            setup_r, setup_w = os.pipe2(os.O_CLOEXEC)
            pid = os.fork()
            if pid == 0:
                os.close(setup_r)
                try:
                    self._exec_child(slot, req, stdio, setup_w)
                except BaseException as e:  # noqa: BLE001 - report, never return into the loop
                    try:
                        os.write(setup_w, f"{type(e).__name__}: {e}".encode()[:1024])
                    finally:
                        os._exit(126)
                os._exit(126)
            os.close(setup_w)
            setup_w = -1
            # Our child, not reaped before the loop runs again: its pid is still its own.
            pidfd = os.pidfd_open(pid)
            failed = _setup_failure(setup_r)
            if failed:  # none of the command ran: the host's failure, never its exit code
                _write_all(self.sock, encode({"spawned": 0, "error": failed}))
                return
            self.by_pid[pid] = slot
            self.sk.sendmsg([encode({"spawned": pid})],
                            [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, struct.pack("i", pidfd))])
        except OSError as e:
            _write_all(self.sock, encode({"spawned": 0, "error": f"{e.strerror or e}"}))
        finally:
            for fd in [*stdio, pidfd, setup_r, setup_w]:
                if fd >= 0:
                    os.close(fd)

    def _exec_child(self, slot: Slot, req: dict[str, Any], stdio: list[int],
                    setup: int) -> None:
        """In a session command's child: its set-up, then its exec. A set-up step that fails
        raises (the caller writes why to ``setup``, close-on-exec: the zygote reads nothing
        there once the exec is done); a failed exec is the command's own (127 or 126, as a
        shell says it)."""
        _signal.set_wakeup_fd(-1)
        for sig in (_signal.SIGCHLD, _signal.SIGPIPE, _signal.SIGXFSZ):  # python ignores some
            _signal.signal(sig, _signal.SIG_DFL)
        for fd in slot.cg.join:
            os.write(fd, b"0")
        os.setsid()
        for target, fd in enumerate(stdio):
            os.dup2(fd if fd >= 0 else self.devnull, target)
        os.closerange(3, setup)  # the zygote's 0-2 are open: the pipe is above them
        os.closerange(setup + 1, 1 << 20)
        try:
            os.chdir(req["cwd"])
        except (OSError, ValueError):
            os.chdir(slot.scratch)  # a missing working directory: its home
        os.umask(0o022)
        self.core.zygote_lockdown(slot.uid, slot.uid, self.rlimits, landlock=False)
        argv, env = req["argv"], req["env"]
        try:
            os.execvpe(argv[0], argv, env)
        except OSError as e:
            _say(f"{argv[0]}: {e.strerror}")
            os._exit(127 if e.errno == errno.ENOENT else 126)
        except (ValueError, UnicodeError) as e:  # what the command names, not the host's
            _say(f"{argv[0]!r}: {e}")
            os._exit(126)

    def _child(self, slot: Slot, ctl: int, fout: int, ferr: int, go: int) -> None:
        # The fork server reset the wakeup fd and SIGCHLD before its loop: inherited.
        # Its cgroups, a session, stdio, fd 3 the request, fd 4 its "started" pipe, no other
        # fd, the scratch dir, its uid and limits: in one call. How it ends is told to the
        # daemon by the fork server that reaps it (its wait status), never by the child.
        slot.entry.enter([(self.devnull, 0, False), (fout, 1, False), (ferr, 2, False),
                          (ctl, 3, False), (go, STARTED_FD, True)])
        self.entered = True
        own = {"HOME": slot.scratch, "TMPDIR": slot.scratch, "PWD": slot.scratch}
        main = None
        if self.language == "python":
            _reseed()
            main = _prepare_python(own)  # while idle: off the request's path
        chunks = []
        while True:
            data = os.read(3, READ_CHUNK)
            if not data:
                break
            chunks.append(data)
        os.close(3)
        if not chunks:
            os._exit(0)  # the daemon let it go unused
        req = json.loads(b"".join(chunks))
        # Its request in hand: what ends it from here on is the request's. Written and closed
        # before any of the request runs, so nothing of the request can say it started or not.
        os.write(STARTED_FD, b"g")
        os.close(STARTED_FD)
        used = resource.getrusage(resource.RUSAGE_SELF)
        cpu = int(used.ru_utime + used.ru_stime + float(req["timeout"])) + 2
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        stdin = req.get("stdin")
        if stdin:
            fin = os.memfd_create("stdin", 0)
            _write_all(fin, stdin.encode())
            os.lseek(fin, 0, os.SEEK_SET)
            os.dup2(fin, 0)
            os.close(fin)
        for name, text in (req.get("files") or {}).items():
            parent = os.path.dirname(name)
            if parent:
                os.makedirs(parent, exist_ok=True)
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            try:
                _write_all(fd, text.encode())
            finally:
                os.close(fd)
        code = req["code"]
        if self.language == "bash":
            env = dict(self.env, **own)
            for sig in (_signal.SIGPIPE, _signal.SIGXFSZ):  # python ignores them; bash not
                _signal.signal(sig, _signal.SIG_DFL)
            if len(code) < BASH_ARG_MAX:
                os.execve("/bin/bash", ["bash", "-c", code], env)
            fd = os.memfd_create("code", 0)  # MAX_ARG_STRLEN is 128 KiB
            _write_all(fd, code.encode())
            os.lseek(fd, 0, os.SEEK_SET)
            os.execve("/bin/bash", ["bash", f"/proc/self/fd/{fd}"], env)
        assert main is not None
        _run_python(code, main)


def _say(text: str) -> None:
    """A line to stderr that may be gone (the exit code still says what happened)."""
    try:
        os.write(2, (text + "\n").encode("utf-8", "replace"))
    except OSError:
        pass


def _setup_failure(fd: int) -> str:
    """What a session command's child wrote to its set-up pipe before its exec ("" once the
    exec closed the pipe, or the child exited, without a word). Waited for up to
    SETUP_WAIT_S: a child frozen with its session before its exec is not waited out (its
    command is then as good as started)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + SETUP_WAIT_S
    got = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            return got.decode("utf-8", "replace")
        chunk = os.read(fd, 1024)
        if not chunk:
            return got.decode("utf-8", "replace")
        got += chunk


def _reseed() -> None:
    """The zygote's state is every child's: reseed what was seeded at import (``random``
    reseeds itself in a forked child)."""
    npr = sys.modules.get("numpy.random")  # seeded at its import: per child unless preloaded
    if npr is not None:
        npr.seed()


def _warm_python() -> None:
    """Run, in the zygote, the first compile, exec and JSON parse of a request: the first of
    each in a process allocates and touches what later ones reuse (the parser's arenas, the
    interned names), and done once here it is shared by every child instead of copied and
    paid by each (measured: 2-3 ms of CPU per request)."""
    for _ in range(3):
        code = compile("import os\nfor i in range(2):\n    x = (i, 'x', [i], {i: str(i)})\n",
                       "<string>", "exec")
        exec(code, {"__builtins__": builtins, "__name__": "__warm__"})
        json.loads(b'{"code":"print(1)","stdin":null,"files":null,"timeout":10}')
    resource.getrusage(resource.RUSAGE_SELF)


def _prepare_python(own: dict[str, str]) -> Any:
    """Everything of ``python3 -c`` that does not depend on the request, done by the waiting
    child: its environment, argv, sys.path and a fresh ``__main__``; and a first compile
    and JSON parse, so that the memory they touch is copied (copy-on-write faults) before the
    request comes rather than while it waits for its answer. Nothing of this is the
    program's to see but what ``python3 -c`` would show it. The zygote's environment is a
    request's (``Zygote.setup``): only the child's ``own`` variables are added."""
    for k, v in own.items():
        os.environ[k] = v
    sys.argv = ["-c"]
    sys.path[0] = ""
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins  # type: ignore[attr-defined]
    sys.modules["__main__"] = main
    compile("import os\nfor i in range(2):\n    print(i, 'x', [i])\n", "<string>", "exec")
    json.loads(b'{"code":"print(1)","stdin":null,"files":null,"timeout":10}')
    resource.getrusage(resource.RUSAGE_SELF)
    return main


def _run_python(code: str, main: Any) -> None:
    """Run ``code`` as ``python3 -c`` would, in this forked interpreter; never returns."""
    rc = 0
    try:
        exec(compile(code, "<string>", "exec"), main.__dict__)
    except SystemExit as e:
        rc = _exit_code(e)
    except BaseException as e:  # noqa: BLE001 - the program's own failure, told like python
        # Without this frame (the zygote's): the traceback starts at the program's own code.
        traceback.print_exception(type(e), e, e.__traceback__.tb_next if e.__traceback__
                                  else None)
        rc = 1
    try:
        threading = sys.modules.get("threading")  # its threads, if the program made any
        if threading is not None:
            threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001 - a closed or broken stream: nothing to say
            rc = rc or 120
    os._exit(rc)


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF
    try:
        print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001
        pass
    return 1


def _load_core(path: str) -> Any:
    """The Rust core by file path, without importing the corral package."""
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.ExtensionFileLoader("corral._core", path)
    spec = importlib.util.spec_from_file_location("corral._core", path, loader=loader)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def main() -> None:
    sock = int(sys.argv[1])
    os.set_inheritable(sock, False)  # not into the helpers the zygote runs (rm)
    cfg = _read_frame(sock)
    core = _load_core(cfg["core"])
    for path in cfg["zygote_cgroups"]:
        with open(path, "w") as f:
            f.write("0")
    core.zygote_unshare()
    pid = os.fork()
    if pid:
        os.close(sock)
        _signal.signal(_signal.SIGTERM, lambda *_: os.kill(pid, _signal.SIGKILL))
        while True:
            try:
                _, status = os.waitpid(pid, 0)
                break
            except InterruptedError:
                continue
        os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
    # Our parent is outside our pid namespace: getppid() says 0. Should the launcher die
    # before this, the daemon sees it (pidfd) and closes the socket, which ends us as well.
    core.zygote_die_with_parent(0)
    os.environ.clear()
    os.environ.update(cfg["zygote_env"])
    z = Zygote(cfg, core, sock)
    try:
        z.setup()
    except BaseException as e:  # noqa: BLE001 - say why, then die
        try:
            _write_all(sock, encode({"ready": False, "error": f"{type(e).__name__}: {e}"}))
        finally:
            os._exit(1)
    try:
        z.serve()
    except OSError as e:
        if e.errno != errno.EPIPE:
            raise
    os._exit(0)


if __name__ == "__main__":
    main()
