"""Daemon side of run_code: one zygote process per (language, n), pools of them with a bounded
queue, and the service that owns every pool.

A zygote is a child of the daemon (its launcher, see zygote.py) spoken to over a socketpair in
frames. The daemon never reaps with waitpid(-1) (see procs.py): the launcher is waited for
through its pidfd. A zygote that dies (or stops answering) fails the requests it held with
infra_error and is started again on the next request; a request whose own timeout had passed
is a ``timeout`` whatever its zygote did after. A slot that cannot be made clean for the next
request (its memory limit cannot be set, its tmpfs is not empty after the wipe) is retired:
its zygote takes no new request, and once its last one is done it is started afresh (new
cgroups, new tmpfs).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from corral.daemon import procpolicy
from corral.daemon.discard import DiscardBudget
from corral.daemon.substrates.process import cgroup, view, zygote
from corral.daemon.substrates.process.fairslots import FairSlots
from corral.daemon.substrates.types import NO_CORE, oom_verdict
from corral.errors import CapacityExceeded, CorralError, InfraError, InvalidRequest, QuotaExceeded
from corral.runcode_models import LANGUAGES, MAX_TIMEOUT_S, RunCodeRequest

log = logging.getLogger("corral.runcode")

UID_BASE = 2_100_000_000   # slot uids: owned by nothing on the host
START_TIMEOUT_S = 60.0
ANSWER_GRACE_S = 10.0      # beyond a request's timeout before its zygote counts as hung
# What a fork costs grows with the zygote's anonymous memory and its mappings (page tables
# copied at the fork, torn down at the child's exit): measured per module, these are cheap
# and common; typing, dataclasses (inspect, ast), numpy.random and numpy.linalg (a hundred
# extension mappings) are not, and load on first use instead.
STDLIB = ["json", "re", "math", "random", "collections", "itertools", "functools", "string",
          "heapq", "bisect", "traceback"]
# Pools: (name, language, preloaded modules). A fork costs in proportion to the zygote's
# memory (page tables copied, then torn down at the child's exit): numpy triples a python
# zygote's, so python code that imports numpy goes to a zygote that has it and the rest to a
# lean one. Either can run any python code (numpy is importable in both).
POOLS = {"python": ("python", STDLIB),
         "bash": ("bash", []),
         "python-numpy": ("python", [*STDLIB, "numpy"])}
POOL_NUMBERS = {name: i for i, name in enumerate(POOLS)}
NUMPY_IMPORT = re.compile(r"(?:^|;)\s*(import\s+[\w., ]*?|from\s+)\b(numpy|scipy|pandas|sklearn)\b",
                          re.M)


def pool_for(language: str, code: str) -> str:
    """The pool a request goes to."""
    if language == "python" and NUMPY_IMPORT.search(code):
        return "python-numpy"
    return language
PATH = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"


@dataclass
class Settings:
    zygotes: int = 2                # per language (forks run on as many cores)
    slots: int = 8                  # concurrent requests per zygote
    max_queue: int = 1024           # requests waiting for a slot, per language
    pids: int = 64                  # processes of one request
    tmp_mb: int = 512               # the scratch tmpfs of each request (its slot's)
    nofile: int = 1024
    fsize_mb: int = 256


# Bounds of the settings: slot uids are UID_BASE + (pool * 64 + zygote) * 256 + slot.
BOUNDS = {"zygotes": 64, "slots": 256, "max_queue": 1 << 20, "pids": 1 << 15, "tmp_mb": 1 << 20}


def settings_from_env() -> Settings:
    s = Settings()
    for name, hi in BOUNDS.items():
        var = f"CORRAL_RUNCODE_{name.upper()}"
        raw = os.environ.get(var)
        if not raw:
            continue
        try:
            setattr(s, name, min(hi, max(1, int(raw))))
        except ValueError:
            log.warning("ignored: not an integer", extra={"variable": var, "value": raw[:50]})
    return s


ZYGOTE_ENV = {"PATH": PATH, "LANG": "C.UTF-8", "OPENBLAS_NUM_THREADS": "1",
              "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

# Only in the launcher's exec-time environment: every library symbol is bound at load, in the
# zygote, so a child does not bind its own (each first call through the PLT writes the GOT: a
# copied page per child, and the lookup's CPU).
LAUNCH_ENV = {"LD_BIND_NOW": "1"}


def config(language: str, root_dir: str, entries: list[tuple[str, str, str]],
           join: list[str], slots: list[dict[str, Any]], preload: list[str],
           s: Settings) -> dict[str, Any]:
    """A zygote's config frame (zygote.py reads it first)."""
    from corral import _core

    return {
        "language": language, "core": _core.__file__, "root": root_dir, "entries": entries,
        "zygote_cgroups": join, "slots": slots, "preload": preload, "zygote_env": ZYGOTE_ENV,
        "env": {"PATH": PATH, "LANG": "C.UTF-8"},
        "rlimits": [("nofile", s.nofile, s.nofile), ("core", *NO_CORE),
                    ("fsize", s.fsize_mb << 20, s.fsize_mb << 20)],
    }


def launch() -> tuple[subprocess.Popen[bytes], socket.socket]:
    """Start a zygote's launcher; returns it and the daemon's end of its socket (its config
    frame not sent yet)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # Its own small environment from the exec on: /proc/self/environ of every child
        # shows the exec-time one, and the daemon's (a token, say) is none of theirs.
        proc = subprocess.Popen(
            [sys.executable, "-I", "-X", "utf8", zygote.__file__, str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, start_new_session=True, cwd="/",
            env={**ZYGOTE_ENV, **LAUNCH_ENV})
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return proc, ours


class ZygoteDied(InfraError):
    pass


class Warm:
    """A slot's child waiting for its request: its pid and the daemon's ends of its pipes
    (request, stdout, stderr, and its status: the fork server writes there how it ended)."""

    def __init__(self, pid: int, ctl: int, out: int, err: int, st: int) -> None:
        self.pid, self.ctl, self.out, self.err, self.st = pid, ctl, out, err, st

    def close(self) -> None:
        for fd in (self.ctl, self.out, self.err, self.st):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.ctl = self.out = self.err = self.st = -1


class SlotState:
    def __init__(self, index: int, dirs: dict[str, str]) -> None:
        self.index = index
        self.memory = cgroup.SlotMemory(dirs, keep_open=True)
        self.ooms = self.memory.oom_kills()  # the counts after the slot's last request
        self.warm: Warm | None = None
        self.ready = asyncio.Event()                      # warm is set
        self.done: dict[int, asyncio.Future[dict[str, Any]]] = {}  # by pid
        # pids whose processes the zygote is still killing (they take long to exit): their
        # answer may come up to zygote.KILL_WAIT_S later, the zygote's other slots going on
        self.draining: set[int] = set()


class Output:
    """One stream of a running request, read on the loop up to its cap; the rest is read
    (and dropped) within the loop's DiscardBudget, the request waiting on its full pipe past
    it."""

    def __init__(self, fd: int, cap: int) -> None:
        self.fd, self.cap = fd, cap
        self.buf = bytearray()
        self.truncated = False
        self.eof = False
        self.watched = False  # a reader on the loop (removed at EOF, by unwatch or hold)
        self.held = False     # by the DiscardBudget, until its refill
        self.loop: asyncio.AbstractEventLoop | None = None
        os.set_blocking(fd, False)

    def watch(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        loop.add_reader(self.fd, self.read)
        self.watched = True

    def unwatch(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = None  # for good: a refill after this does not watch it again
        if self.watched:
            self.watched = False
            with contextlib.suppress(ValueError, OSError, RuntimeError):
                loop.remove_reader(self.fd)

    def hold(self, who: object) -> None:
        if self.watched and self.loop is not None:
            self.held = True
            self.watched = False
            self.loop.remove_reader(self.fd)

    def release(self, who: object) -> None:
        if self.held and self.loop is not None and not self.eof:
            self.held = False
            self.watch(self.loop)

    def read(self, budgeted: bool = True) -> None:
        """Up to 64 reads (a flood must not pin the loop); ``budgeted=False`` for the last
        read after the process ended, which only takes what its pipe holds."""
        budget = DiscardBudget.of(asyncio.get_running_loop())
        for _ in range(64):
            if budgeted and len(self.buf) >= self.cap and not budget.admit(self):
                return
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self.eof = True
                if self.watched:
                    self.unwatch(asyncio.get_running_loop())
                return
            room = self.cap - len(self.buf)
            if len(data) > room:
                self.truncated = True
                budget.spend(len(data) - max(room, 0))
                data = data[:max(room, 0)]
            self.buf += data

    def text(self) -> str:
        return self.buf.decode("utf-8", "replace")


class Zygote:
    """One zygote process, its slots' waiting children, and the requests running on them."""

    def __init__(self, pool: Pool, index: int) -> None:
        self.pool = pool
        self.index = index
        self.name = f"{pool.name}-{index}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.sock: socket.socket | None = None
        self.pidfd = -1
        self.slots: list[SlotState] = []
        self.preloaded: list[str] = []
        self.alive = False
        self._ready: asyncio.Future[dict[str, Any]] | None = None
        self._reader = zygote.FrameReader()
        self._fds: list[int] = []  # received with the frames, 4 per "warm"
        self.in_use: set[int] = set()  # slots handed to requests and not given back
        self.retiring = False  # a slot of it cannot be cleaned: made afresh when idle
        self.parked: set[int] = set()  # slots kept from requests while it retires

    async def start(self) -> None:
        svc = self.pool.service
        s = svc.settings
        loop = asyncio.get_running_loop()
        try:
            join, slot_dirs = await asyncio.to_thread(
                svc.layout.make_pool, self.name, s.slots, s.pids)
            self.slots = [SlotState(i, d) for i, d in enumerate(slot_dirs)]
        except OSError as e:
            # The host's cgroups (a slot whose last processes have not died yet: EBUSY), never
            # the request that came to start it: not an errno mapped as its fault.
            raise InfraError(f"the run_code {self.pool.language} zygote's cgroups could not "
                             f"be made: {e}", details={"errno": e.errno}) from None
        self.retiring = False
        uid0 = UID_BASE + (self.pool.number * 64 + self.index) * 256
        uids = [uid0 + i for i in range(len(slot_dirs))]
        cfg = config(self.pool.language, svc.root_dir,
                     view.entries(s.tmp_mb, svc.proc_masks, uids), join,
                     [{"uid": uid, "cgroups": d} for uid, d in zip(uids, slot_dirs, strict=True)],
                     POOLS[self.pool.name][1], s)
        self.proc, ours = launch()
        self.sock = ours
        ours.setblocking(False)
        self.pidfd = os.pidfd_open(self.proc.pid)
        self._ready = loop.create_future()
        self.alive = True
        loop.add_reader(self.pidfd, self._dead, "it exited")
        loop.add_reader(ours.fileno(), self._readable)
        await loop.sock_sendall(ours, zygote.encode(cfg))
        try:
            hello = await asyncio.wait_for(self._ready, START_TIMEOUT_S)
        except (asyncio.TimeoutError, ZygoteDied) as e:
            self.kill()
            raise InfraError(f"the run_code {self.pool.language} zygote did not start: "
                             f"{e or 'no answer'}") from None
        if not hello.get("ready"):
            self.kill()
            raise InfraError(f"the run_code {self.pool.language} zygote did not start: "
                             f"{hello.get('error')}")
        self.preloaded = hello.get("preloaded", [])
        self.pool.started += 1
        log.info("run_code zygote started", extra={"zygote": self.name, "pid": self.proc.pid,
                                                    "preloaded": len(self.preloaded)})

    # -- from the zygote --
    def _readable(self) -> None:
        assert self.sock is not None
        try:
            data, fds = zygote.recv_with_fds(self.sock)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data, fds = b"", []
        self._fds += fds
        if not data:
            self._dead("its socket closed")
            return
        try:
            frames = self._reader.feed(data)
        except ValueError as e:
            self._dead(f"bad frame: {e}")
            return
        for f in frames:
            if "warm" in f:
                fds, self._fds = self._fds[:4], self._fds[4:]
                if len(fds) != 4:
                    self._dead("a waiting child came without its pipes")
                    return
                slot = self.slots[f["warm"]]
                if slot.warm is not None:
                    slot.warm.close()
                slot.warm = Warm(f["pid"], *fds)
                slot.ready.set()
            elif "draining" in f:
                self.slots[f["draining"]].draining.add(f["pid"])
            elif "done" in f:
                slot = self.slots[f["done"]]
                slot.draining.discard(f["pid"])
                if slot.warm is not None and slot.warm.pid == f["pid"]:
                    slot.warm.close()  # died waiting
                    slot.warm = None
                    slot.ready.clear()
                if f.get("dirty"):
                    self.retire(f"slot {f['done']}'s scratch tmpfs is not empty after its wipe")
                fut = slot.done.pop(f["pid"], None)
                if fut is not None and not fut.done():
                    fut.set_result(f)
            elif "ready" in f and self._ready is not None and not self._ready.done():
                self._ready.set_result(f)

    def _dead(self, why: str) -> None:
        if not self.alive:
            return
        self.alive = False
        err = ZygoteDied(f"the run_code {self.pool.language} zygote died ({why}); the "
                         f"request did not complete")
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(err)
        for slot in self.slots:
            for fut in slot.done.values():
                if not fut.done():
                    fut.set_exception(err)
            slot.done.clear()
        self.kill()
        log.warning("run_code zygote ended", extra={"zygote": self.name, "why": why})

    def retire(self, why: str) -> None:
        """Take no new request; the pool starts this zygote afresh once its requests are
        done (Pool.give_back)."""
        if not self.retiring:
            self.retiring = True
            log.warning("run_code zygote retired", extra={"zygote": self.name, "why": why})

    def kill(self) -> None:
        """SIGKILL the launcher (the zygote and its namespace follow) and reap it."""
        self.alive = False
        loop = asyncio.get_running_loop()
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
            self.proc = None
        if self.pidfd >= 0:
            loop.remove_reader(self.pidfd)
            os.close(self.pidfd)
            self.pidfd = -1
        if self.sock is not None:
            loop.remove_reader(self.sock.fileno())
            self.sock.close()
            self.sock = None
        for slot in self.slots:
            if slot.warm is not None:
                slot.warm.close()
                slot.warm = None
            slot.memory.close()  # a late reader falls back to the file's path
            slot.ready.set()  # wake waiters: they see the zygote is gone
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []

    # -- one request --
    async def request(self, si: int, req: RunCodeRequest, release: Any) -> dict[str, Any]:
        """Run ``req`` on slot ``si``; ``release()`` is called once the slot is clean again
        (its processes dead, its scratch wiped), which may be after this returns: the fork
        server that reaps the child writes its wait status to the status pipe, and the answer
        does not wait for the zygote to clean the slot."""
        slot = self.slots[si]
        try:
            if not slot.ready.is_set():  # mostly it is: the child was forked while idle
                await asyncio.wait_for(slot.ready.wait(), START_TIMEOUT_S)
        except asyncio.TimeoutError:
            self._dead("no child forked in time")
        except BaseException:
            release()
            raise
        if not self.alive or slot.warm is None:
            release()
            raise ZygoteDied(f"the run_code {self.pool.language} zygote is not running")
        w, slot.warm = slot.warm, None
        slot.ready.clear()
        loop = asyncio.get_running_loop()
        done: asyncio.Future[dict[str, Any]] = loop.create_future()
        # The fork server's word: {"status": wait status, "t_exit": when it was reaped,
        # "started": whether the child had its request before it ended}.
        told: asyncio.Future[dict[str, Any]] = loop.create_future()
        slot.done[w.pid] = done
        out, err = Output(w.out, req.max_output_bytes), Output(w.err, req.max_output_bytes)
        timed_out = False

        def expire() -> None:
            nonlocal timed_out
            timed_out = True
            if self.sock is not None:  # the zygote kills the slot's whole tree
                with contextlib.suppress(OSError):
                    self.sock.send(zygote.encode({"kill": si, "pid": w.pid}))

        status_watched = False

        def status() -> None:
            nonlocal status_watched
            try:
                data = os.read(w.st, zygote.STATUS.size + 1)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            status_watched = False
            loop.remove_reader(w.st)
            if told.done() or len(data) != zygote.STATUS.size:
                return  # nothing (the fork server died): the zygote's word decides
            st, t_exit, began = zygote.STATUS.unpack(data)
            if os.WIFEXITED(st) or os.WIFSIGNALED(st):  # a wait status of an ended process
                told.set_result({"status": st, "t_exit": t_exit, "started": bool(began)})

        timer: asyncio.TimerHandle | None = None  # armed as the request goes to its process
        finished = False

        def finish() -> None:
            """The slot is clean (or the zygote is gone): give it back."""
            nonlocal finished
            if finished:
                return
            finished = True
            if timer is not None:
                timer.cancel()
            slot.done.pop(w.pid, None)
            out.unwatch(loop)
            err.unwatch(loop)
            if status_watched:
                with contextlib.suppress(ValueError, OSError):
                    loop.remove_reader(w.st)
            w.close()
            with contextlib.suppress(OSError):
                slot.ooms = slot.memory.oom_kills()
            release()

        try:
            await self._set_limit(slot, req.memory_mb << 20)
            payload = json.dumps({"code": req.code, "stdin": req.stdin, "files": req.files,
                                  "timeout": req.timeout}, separators=(",", ":")).encode()
            out.watch(loop)
            err.watch(loop)
            os.set_blocking(w.st, False)
            loop.add_reader(w.st, status)
            status_watched = True
            # The request's own clock starts here: its deadline is t0 + timeout, the instant
            # its timer kills it (call_later counts from loop.time(), time.monotonic(), read
            # after t0: never earlier).
            t0 = time.monotonic()
            deadline = t0 + req.timeout
            timer = loop.call_later(req.timeout, expire)
            await _write_pipe(w.ctl, payload)
            os.close(w.ctl)
            w.ctl = -1
            waits: set[asyncio.Future[Any]] = {done, told}
            first, _ = await asyncio.wait(waits, timeout=req.timeout + ANSWER_GRACE_S,
                                          return_when=asyncio.FIRST_COMPLETED)
            if not first and not timed_out:  # its timer never ran: the loop, not the code
                self._dead("no answer in time")
                raise InfraError(f"the run_code {self.pool.language} zygote did not answer; "
                                 f"it was restarted")
        except BaseException:
            # Cancelled (the client went away) or failed: its tree is killed now, and the slot
            # comes back when the zygote has reaped it.
            expire()
            self._later(done, finish, slot, w.pid)
            raise
        d: dict[str, Any] | None = None
        # Past the deadline (the timer ran, or is due: the fork server's word came too late),
        # whether the process ended in time is its fork server's to say, not the timer's:
        # its answer may simply arrive after the timer ran.
        late = timed_out or time.monotonic() > deadline
        if told.done():  # how it ended, from its fork server's waitpid: no word of its own
            d = told.result()
        elif done.done() or late:
            if not done.done():
                await asyncio.wait({done}, timeout=ANSWER_GRACE_S)
            if done.done() and done.exception() is None:
                d = done.result()
            elif not late:  # the zygote failed it before its own deadline: infra
                finish()
                raise done.exception()  # type: ignore[misc]
            # Else its own deadline passed: a timeout, whatever its zygote did after (a
            # zygote that never answers is restarted by _later, this request's tree with it).
        if d is not None:
            st, t_exit = d["status"], d["t_exit"]
            sig = os.WTERMSIG(st) if os.WIFSIGNALED(st) else None
            code = 128 + sig if sig is not None else os.WEXITSTATUS(st)
            if d.get("broken"):  # a process of the slot would not die: start afresh
                self.retire(f"slot {si}'s processes would not die")
            # In time or not by when the process ended: its fork server's clock when it
            # reaped it (CLOCK_MONOTONIC, the daemon's too), never a time the process could
            # give. A process killed at its deadline is reaped after it.
            timed_out = t_exit > deadline
        else:  # killed at its timeout; neither its fork server nor the zygote has said so yet
            sig = int(signal.SIGKILL)
            code, t_exit, timed_out = 128 + sig, deadline, True
        # What is in the pipes now is all there is: the process has ended (a holder of a
        # copy elsewhere is not waited for; it dies with the slot).
        out.read(budgeted=False)
        err.read(budgeted=False)
        truncated = out.truncated or err.truncated
        oom = oom_verdict(slot.ooms, slot.memory.oom_kills())
        if done.done():
            finish()
        else:
            self._later(done, finish, slot, w.pid, ANSWER_GRACE_S if timed_out else None)
        if oom == "host":
            # Killed by an OOM outside the slot's own limit (the host's, an ancestor
            # cgroup's): not the program's doing, whatever its status would have been.
            raise InfraError("a process of the run_code request was killed by an "
                             "out-of-memory kill from outside its own memory limit (the "
                             "host's or an enclosing cgroup's)",
                             details={"cause": "host_oom", "exit_code": code, "signal": sig})
        if d is not None and not d.get("started", True) and oom != "own" and not timed_out:
            # Its process ended before it had its request (killed from outside while it
            # waited, or its own set-up failed): none of the request ran, so the status is
            # the host's, never the request's. A request whose payload alone passes its
            # memory limit is its own (memory_exceeded); one past its deadline, a timeout.
            why = err.text().strip()[-500:]
            raise InfraError("the run_code request's process ended before it ran the request"
                             + (f": {why}" if why else ""),
                             details={"cause": "not_started", "exit_code": code,
                                      "signal": sig})
        if timed_out:
            result = "timeout"
        elif oom == "own":
            result = "memory_exceeded"
        elif truncated:
            result = "output_truncated"
        else:
            result = "ok" if code == 0 else "error"
        return {"status": result, "stdout": out.text(), "stderr": err.text(),
                "exit_code": code, "signal": sig,
                "duration_s": round(max(0.0, t_exit - t0), 6), "truncated": truncated,
                "language": self.pool.language}

    async def _set_limit(self, slot: SlotState, limit: int) -> None:
        """Set the slot's memory limit for a request. A write the kernel refuses (v1: EBUSY,
        the slot's usage above the new limit and nothing reclaimable: memory a process
        outside the slot holds) is the host's state, not the request's: infra, and the slot
        is retired."""
        try:
            if limit < slot.memory.limit:
                # A lower limit reclaims what the slot's last request left charged (its page
                # cache: 0.15 s a GB) before the write returns: not on the loop. Cancelled,
                # the slot is not let go before the write is done (the next request's limit
                # would be overwritten).
                setting = asyncio.ensure_future(asyncio.to_thread(slot.memory.set, limit))
                try:
                    await asyncio.shield(setting)
                except asyncio.CancelledError:
                    await setting
                    raise
            else:
                slot.memory.set(limit)
        except OSError as e:
            slot.memory.limit = -1  # unknown: written again next time
            self.retire(f"slot {slot.index}'s memory limit: {e.strerror or e}")
            raise InfraError(f"the run_code {self.pool.language} slot's memory limit could "
                             f"not be set ({e.strerror or e}); the slot is rebuilt",
                             details={"errno": e.errno}) from None

    def _later(self, done: asyncio.Future[dict[str, Any]], finish: Any, slot: SlotState,
               pid: int, wait: float | None = None) -> None:
        """After an answer on the fork server's word (or at its timeout): free the slot when
        the zygote has cleaned it (its timer still runs: what the child left running is
        killed); a zygote that has not within ``wait`` is restarted, unless it said the
        slot's processes are still dying: then it has until zygote.KILL_WAIT_S, and one
        that breaks the slot is retired (its other requests run to their end). A callback
        and a timer, not a task: this is every python request's path."""
        loop = asyncio.get_running_loop()
        timers: list[asyncio.TimerHandle] = []

        def settled(_: object = None) -> None:
            timers[-1].cancel()
            if not done.done() and len(timers) == 1 and self.alive and pid in slot.draining:
                timers.append(loop.call_later(zygote.KILL_WAIT_S + ANSWER_GRACE_S, settled))
                return
            try:
                if not done.done():
                    self._dead("no answer in time")
                elif done.exception() is None and done.result().get("broken"):
                    self.retire(f"slot {slot.index}'s processes would not die")
            finally:
                slot.draining.discard(pid)
                finish()

        timers.append(loop.call_later(MAX_TIMEOUT_S + ANSWER_GRACE_S if wait is None else wait,
                                      settled))
        done.add_done_callback(settled)


async def _write_pipe(fd: int, data: bytes) -> None:
    """Write all of ``data`` to a pipe without blocking the loop (the child reads it all)."""
    os.set_blocking(fd, False)
    view = memoryview(data)
    loop = asyncio.get_running_loop()
    while view:
        try:
            n = os.write(fd, view)
            view = view[n:]
            continue
        except BlockingIOError:
            pass
        except BrokenPipeError:
            return  # it died waiting: its status tells
        ready = loop.create_future()
        loop.add_writer(fd, ready.set_result, None)
        try:
            await ready
        finally:
            loop.remove_writer(fd)


@dataclass(eq=False)
class Pool:
    service: RunCodeService
    name: str
    language: str
    number: int
    zygotes: list[Zygote] = field(default_factory=list)
    free: FairSlots[tuple[int, int]] = field(default_factory=FairSlots)
    waiting: int = 0  # admitted, not yet given a slot
    # A tenant's requests admitted and not yet answered (admin requests, None, are not
    # counted): an equal share of the pool's slots and queue (tenant_cap).
    held: collections.Counter[str] = field(default_factory=collections.Counter)
    busy: int = 0
    started: int = 0
    served: int = 0

    def __post_init__(self) -> None:
        s = self.service.settings
        self.zygotes = [Zygote(self, i) for i in range(s.zygotes)]
        self._locks = [asyncio.Lock() for _ in self.zygotes]
        for si in range(s.slots):
            for zi in range(s.zygotes):
                self.free.put_nowait((zi, si))

    def _park(self, zi: int, si: int) -> None:
        """Keep a slot of a retiring zygote; with every slot back, the zygote goes (its
        cgroups and tmpfs are made afresh by its next start) and its slots serve again."""
        z = self.zygotes[zi]
        z.parked.add(si)
        if z.in_use:
            return
        z.retiring = False
        if z.alive:
            z._dead("it was retired")
        for s in sorted(z.parked):
            self.free.put_nowait((zi, s))
        z.parked.clear()

    @property
    def slots(self) -> int:
        return len(self.zygotes) * self.service.settings.slots

    def tenant_cap(self, tenant: str | None = None) -> int:
        """The most of the pool's slots and queue ``tenant``'s requests may hold: an equal
        share among the tenants holding some and one more (a half when it is alone), so that
        a tenant holding none always finds room, however many hold their share."""
        others = sum(1 for t in self.held if t != tenant)
        return max(1, int((self.slots + self.service.settings.max_queue) / (others + 2)))

    def admit(self, n: int = 1, tenant: str | None = None) -> None:
        """Take ``n`` places in the queue for ``tenant``'s requests (all or none, before any
        await: two batches cannot both pass one check); each request's ``run`` gives its
        place up (``admitted=True``), else ``unadmit``."""
        cap = self.tenant_cap(tenant)
        if tenant is not None and self.held[tenant] + n > cap:
            raise QuotaExceeded(
                f"run_code {self.name}: this tenant has {self.held[tenant]} requests running "
                f"or waiting, at most {cap} at once while {len(self.held)} tenants use the "
                "pool; try again later",
                details={"resource": "run_code", "held": self.held[tenant], "limit": cap})
        room = self.service.settings.max_queue + self.free.qsize() - self.waiting
        if n > room:
            raise CapacityExceeded(
                f"run_code {self.name}: {self.busy} requests running and {self.waiting} "
                f"waiting (at most {self.service.settings.max_queue} wait); try again later",
                details={"running": self.busy, "waiting": self.waiting,
                         "max_queue": self.service.settings.max_queue})
        self.waiting += n
        if tenant is not None:
            self.held[tenant] += n

    def unadmit(self, n: int, tenant: str | None) -> None:
        """Give up ``n`` places taken by ``admit`` whose requests never ran."""
        self.waiting -= n
        self._unhold(tenant, n)

    def _unhold(self, tenant: str | None, n: int = 1) -> None:
        if tenant is not None:
            self.held[tenant] -= n
            if self.held[tenant] <= 0:
                del self.held[tenant]

    async def _ensure(self, zi: int) -> Zygote:
        z = self.zygotes[zi]
        if z.alive:
            return z
        async with self._locks[zi]:
            if not z.alive:
                await self.service.starting(z.start())
        return z

    async def run(self, req: RunCodeRequest, tenant: str | None = None,
                  admitted: bool = False) -> dict[str, Any]:
        if not admitted:
            self.admit(1, tenant)
        try:
            return await self._run(req, tenant)
        finally:
            self._unhold(tenant)

    async def _run(self, req: RunCodeRequest, tenant: str | None) -> dict[str, Any]:
        try:
            while True:
                zi, si = await self.free.get(tenant)
                if not self.zygotes[zi].retiring:
                    break
                self._park(zi, si)  # a retiring zygote takes no new request
        finally:
            self.waiting -= 1
        self.busy += 1
        self.zygotes[zi].in_use.add(si)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.busy -= 1
                self.zygotes[zi].in_use.discard(si)
                if self.zygotes[zi].retiring:
                    self._park(zi, si)
                else:
                    self.free.put_nowait((zi, si))

        try:
            z = await self._ensure(zi)
        except BaseException:
            release()
            raise
        out = await z.request(si, req, release)
        self.served += 1
        return out

    def status(self) -> dict[str, Any]:
        pre = next((z.preloaded for z in self.zygotes if z.alive), [])
        return {"name": self.name, "language": self.language,
                "zygotes": sum(z.alive for z in self.zygotes),
                "slots": self.slots, "busy": self.busy, "queued": self.waiting,
                "max_queue": self.service.settings.max_queue, "started": self.started,
                "preloaded": pre, "served": self.served}


class RunCodeService:
    """Every run_code pool of the daemon; pools start on their first request."""

    def __init__(self, state_dir: str, cgroup_name: str,
                 settings: Settings | None = None) -> None:
        self.settings = settings or settings_from_env()
        self.root_dir = os.path.join(state_dir, "runcode", "root")
        self.mask_dir = os.path.join(state_dir, "mask")
        self.proc_masks: list[tuple[str, str, str]] = []  # view.proc_masks, at the first pool
        self.cgroup_name = cgroup_name
        self._layout: cgroup.Layout | None = None
        self.pools: dict[str, Pool] = {}
        self._closed = False
        self._starts = 0
        self._no_starts = asyncio.Event()
        self._no_starts.set()

    @property
    def layout(self) -> cgroup.Layout:
        if self._layout is None:
            self._layout = cgroup.Layout(self.cgroup_name, cpu=True)
            self._layout.remove_all()  # a previous daemon's, if it died
            os.makedirs(self.root_dir, mode=0o700, exist_ok=True)
            self.proc_masks = view.proc_masks(procpolicy.compute(),
                                              procpolicy.make_mask_dir(self.mask_dir))
        return self._layout

    def pool(self, language: str, code: str = "") -> Pool:
        if self._closed:
            raise InfraError("the daemon is stopping")
        if language not in LANGUAGES:
            raise InvalidRequest(f"unknown language {language!r} (known: {', '.join(LANGUAGES)})")
        name = pool_for(language, code)
        p = self.pools.get(name)
        if p is None:
            p = self.pools[name] = Pool(self, name, language, POOL_NUMBERS[name])
        return p

    async def run(self, req: RunCodeRequest, tenant: str | None = None) -> dict[str, Any]:
        return await self.pool(req.language, req.code).run(req, tenant)

    async def run_many(self, reqs: list[RunCodeRequest],
                       tenant: str | None = None) -> list[dict[str, Any]]:
        counts: dict[Pool, int] = {}
        for r in reqs:
            p = self.pool(r.language, r.code)
            counts[p] = counts.get(p, 0) + 1
        taken: list[tuple[Pool, int]] = []
        try:  # all or nothing at admission
            for p, n in counts.items():
                p.admit(n, tenant)
                taken.append((p, n))
        except CorralError:
            for p, n in taken:
                p.unadmit(n, tenant)
            raise
        started: collections.Counter[Pool] = collections.Counter()

        async def one(r: RunCodeRequest) -> dict[str, Any]:
            p = self.pool(r.language, r.code)
            started[p] += 1
            try:
                return await p.run(r, tenant, admitted=True)
            except CorralError as e:
                return {"error": e.to_payload()["error"]}

        try:
            return list(await asyncio.gather(*(one(r) for r in reqs)))
        finally:  # cancelled (its client left): the places of requests that never started
            for p, n in counts.items():
                if n > started[p]:
                    p.unadmit(n - started[p], tenant)

    async def starting(self, start: Coroutine[Any, Any, None]) -> None:
        """Start a zygote, unless the daemon is stopping; ``close`` waits for starts under
        way (a start it did not wait for made its cgroups after close removed them all)."""
        if self._closed:
            start.close()
            raise InfraError("the daemon is stopping")
        self._starts += 1
        self._no_starts.clear()
        task = asyncio.ensure_future(start)

        def ended(t: asyncio.Future[None]) -> None:
            if not t.cancelled():
                t.exception()  # seen (its caller may have left): raised to those awaiting
            self._starts -= 1
            if not self._starts:
                self._no_starts.set()

        task.add_done_callback(ended)
        # A request that leaves (its client gone) does not cut the start short: its threads
        # would make the zygote's cgroups after a stop had removed them all.
        await asyncio.shield(task)

    def status(self) -> dict[str, Any]:
        return {"pools": [p.status() for p in self.pools.values()]}

    async def close(self) -> None:
        self._closed = True
        await self._no_starts.wait()  # then no zygote starts again: stop every one
        for p in self.pools.values():
            for z in p.zygotes:
                z._dead("the daemon is stopping")
        # Also when no pool ran: a previous daemon that died may have left its cgroups.
        try:
            layout = self._layout or cgroup.Layout(self.cgroup_name, cpu=True)
        except (OSError, RuntimeError) as e:
            log.warning("run_code cgroups not checked", extra={"error": str(e)})
            return
        await asyncio.to_thread(layout.remove_all)
