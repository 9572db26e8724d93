"""Test doubles of the boundaries the engine and the trajectory log sit on: a substrate that
keeps its sandboxes in memory (the protocol of corral.daemon.substrates.base, the boundary
under test) and an image store. Commands run as plain host processes of the test's own user
(in the test's cwd: the ExecSpec's uid, gid and cwd are not applied), so the engine's exec
path (pipes, pidfds, exit status, timeouts) is the real one."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import signal
import threading
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from corral.daemon.substrates.base import (
    Capabilities,
    ExecSpec,
    SandboxRuntime,
    Spawned,
    Substrate,
)
from corral.daemon.substrates.types import NotCached
from corral.errors import FileNotFound
from corral.models import FileEntry, SandboxSpec


@dataclass
class Box:
    """One fake sandbox: its files (path -> bytes; dirs), whether its init lives and is
    frozen, and the cause a crash reports (Substrate.end_cause)."""

    spec: SandboxSpec
    files: dict[str, bytes] = field(default_factory=dict)
    dirs: set[str] = field(default_factory=lambda: {"/", "/root", "/tmp"})
    alive: bool = True
    frozen: bool = False
    cause: dict[str, Any] | None = None
    pids: list[int] = field(default_factory=list)  # commands started in it (process groups)
    cold: set[str] = field(default_factory=set)  # paths not in memory: cached calls refuse
    read_threads: list[str] = field(default_factory=list)  # the thread each read ran in
    stat_threads: list[str] = field(default_factory=list)  # the thread each stat ran in


class FakeSubstrate(Substrate):
    capabilities = Capabilities(files=True, pause=True, exit_watch=True,
                                networks=("none", "disabled"))

    def __init__(self) -> None:
        self.name = "fake"
        self.boxes: dict[str, Box] = {}
        self.destroyed: list[str] = []
        self.created: list[str] = []
        self.fail_create: BaseException | None = None  # raised by the next create
        self.closed = 0
        self._on_lost: Any = None

    # ---- lifecycle -----------------------------------------------------------------------
    def create(self, sandbox_id: str, spec: SandboxSpec, image: Any) -> SandboxRuntime:
        if self.fail_create is not None:
            e, self.fail_create = self.fail_create, None
            raise e
        self.boxes[sandbox_id] = Box(spec)
        self.created.append(sandbox_id)
        return SandboxRuntime(sandbox_id=sandbox_id, init_pid=0, init_starttime=0,
                              sandbox_dir=os.path.join(image.state_dir, "sandboxes",
                                                       sandbox_id),
                              cgroup_paths=[], extra={"fake": True})

    def adopt(self, runtime: SandboxRuntime) -> bool:
        box = self.boxes.get(runtime.sandbox_id)
        return box is not None and box.alive

    def destroy(self, runtime: SandboxRuntime) -> None:
        box = self.boxes.pop(runtime.sandbox_id, None)
        if box is not None:
            self.destroyed.append(runtime.sandbox_id)
            for pid in box.pids:  # every process of the sandbox goes with it
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        shutil.rmtree(runtime.sandbox_dir, ignore_errors=True)

    def cleanup_orphans(self, known_ids: set[str]) -> list[str]:
        gone = [sid for sid in self.boxes if sid not in known_ids]
        for sid in gone:
            del self.boxes[sid]
        return gone

    def is_alive(self, runtime: SandboxRuntime) -> bool:
        box = self.boxes.get(runtime.sandbox_id)
        return box is not None and box.alive

    def close(self, *, retire: bool = False) -> None:
        self.closed += 1

    def watch_exits(self, loop: asyncio.AbstractEventLoop, on_lost: Any) -> bool:
        self._on_lost = on_lost
        return True

    def end_cause(self, runtime: SandboxRuntime) -> dict[str, Any] | None:
        box = self.boxes.get(runtime.sandbox_id)
        return box.cause if box is not None else None

    def kill_init(self, sid: str, cause: dict[str, Any] | None = None) -> None:
        """The sandbox's init dies (something outside killed it, or ``cause``: it crashed);
        the engine hears of it as it would from a real substrate's exit watch."""
        box = self.boxes[sid]
        box.alive, box.cause = False, cause
        if self._on_lost is not None:
            self._on_lost([sid])

    # ---- exec: a host process of the test's user, in its own session ------------------------
    def spawn(self, runtime: SandboxRuntime, spec: ExecSpec,
              loop: asyncio.AbstractEventLoop) -> asyncio.Future[Spawned]:
        box = self.boxes.get(runtime.sandbox_id)
        if box is None or not box.alive:
            raise OSError(errno.ESRCH, "the sandbox's init is gone")
        actions = []
        for target, fd in ((0, spec.stdin_fd), (1, spec.stdout_fd), (2, spec.stderr_fd)):
            if fd >= 0:
                actions.append((os.POSIX_SPAWN_DUP2, fd, target))
            else:
                actions.append((os.POSIX_SPAWN_OPEN, target, os.devnull, os.O_RDWR, 0))
        pid = os.posix_spawn(spec.argv[0], spec.argv, spec.env, file_actions=actions,
                             setsid=True)
        box.pids.append(pid)
        fut: asyncio.Future[Spawned] = loop.create_future()
        fut.set_result(Spawned(pidfd=-1, pid=pid, ns_pid=pid, own_child=True))
        return fut

    # ---- freeze ------------------------------------------------------------------------------
    def freeze(self, runtime: SandboxRuntime) -> None:
        self.boxes[runtime.sandbox_id].frozen = True

    def thaw(self, runtime: SandboxRuntime, wait: bool = True) -> None:
        self.boxes[runtime.sandbox_id].frozen = False

    def is_frozen(self, runtime: SandboxRuntime) -> bool:
        box = self.boxes.get(runtime.sandbox_id)
        return box is not None and box.frozen

    # ---- files, in memory ----------------------------------------------------------------
    def _box(self, runtime: SandboxRuntime) -> Box:
        return self.boxes[runtime.sandbox_id]

    def read_file(self, runtime: SandboxRuntime, path: str, max_bytes: int,
                  cached_only: bool = False) -> bytes:
        box = self._box(runtime)
        if cached_only and path in box.cold:
            raise NotCached(path)
        box.read_threads.append(threading.current_thread().name)
        data = box.files.get(path)
        if data is None:
            raise FileNotFound(f"no such file: {path}", details={"path": path})
        return data[:max_bytes]

    def write_file(self, runtime: SandboxRuntime, path: str, data: bytes | BinaryIO,
                   mode: int = 0o644, make_parents: bool = True) -> None:
        box = self._box(runtime)
        box.files[path] = data if isinstance(data, bytes) else data.read()
        parent = os.path.dirname(path)
        while make_parents and parent not in box.dirs:
            box.dirs.add(parent)
            parent = os.path.dirname(parent)

    def stat(self, runtime: SandboxRuntime, path: str, cached_only: bool = False) -> FileEntry:
        box = self._box(runtime)
        if cached_only and path in box.cold:
            raise NotCached(path)
        box.stat_threads.append(threading.current_thread().name)
        if path in box.dirs:
            return FileEntry(name=os.path.basename(path), path=path, type="dir", size=0,
                             mode=0o755, mtime=0.0)
        if path in box.files:
            return FileEntry(name=os.path.basename(path), path=path, type="file",
                             size=len(box.files[path]), mode=0o644, mtime=0.0)
        raise FileNotFound(f"no such file: {path}", details={"path": path})

    def list_dir(self, runtime: SandboxRuntime, path: str) -> list[FileEntry]:
        box = self._box(runtime)
        names = [p for p in (*box.dirs, *box.files) if p != path and os.path.dirname(p) == path]
        return [self.stat(runtime, p) for p in sorted(names)]

    def mkdir(self, runtime: SandboxRuntime, path: str, parents: bool = True) -> None:
        self._box(runtime).dirs.add(path)


@dataclass
class FakeImage:
    name: str
    state_dir: str
    meta: dict[str, Any] = field(default_factory=dict)
    kind: str = "builtin"


class FakeEgress:
    """The pulls' address policy (corral.daemon.oci.egress): the engine hands it the blocked
    addresses' source; nothing here pulls."""

    def __init__(self) -> None:
        self.blocked_source: Any = None


class FakeImages:
    """The image store the engine asks for images by name: ``host`` only."""

    def __init__(self, state_dir: str) -> None:
        self.state_dir = state_dir
        self.egress = FakeEgress()

    def ensure_host(self) -> FakeImage:
        return FakeImage("host", self.state_dir)

    def get(self, name: str) -> FakeImage | None:
        return FakeImage(name, self.state_dir) if name == "host" else None

    def shared_snapshot_parts(self) -> list[str]:
        return []  # no committed images here

    def compose(self, image: FakeImage, layers: list[Any] | None) -> FakeImage:
        """No layers in these tests: the image as it is."""
        assert not layers
        return image
