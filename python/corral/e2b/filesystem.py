"""envd's filesystem service (``/filesystem.Filesystem/*``) over corral's file API.

Paths resolve inside the sandbox (corral's openat2 RESOLVE_IN_ROOT); a relative path starts at
the user's home. Directories are made by the user itself (``mkdir -p`` as that user, so they
are its own and its permissions apply); reads, stats, moves and removes go through the
daemon. Watching is by polling the tree (corral has no in-sandbox watcher): events are
create, write (size or mtime changed) and remove, at the poll interval's resolution. Each
watcher (a WatchDir stream or a CreateWatcher one) polls corrald up to five times a second
with one ``files.tree`` call (not logged: an observation), and waits WATCH_DUTY times as long
as its last poll took before the next, so the sandbox's code, which decides how big the tree
is, decides how rarely it is polled, not how much of corrald it takes. They are few:
WATCHERS_PER_SANDBOX per sandbox, MAX_WATCHERS in all; one ends when its sandbox does.
"""

from __future__ import annotations

import asyncio
import posixpath
import secrets
import time
from typing import Any

from aiohttp import web

from corral import errors as ce
from corral.e2b import users
from corral.e2b.connect import (
    ConnectError,
    ServerStream,
    read_stream_request,
    read_unary,
    unary_response,
)
from corral.e2b.errors import to_connect
from corral.e2b.pbjson import boolean, entry_info, string, text, uint
from corral.models import FileEntry
from corral.sdk.async_sandbox import AsyncSandbox
from corral.sdk.results import ExecResult

MAX_ENTRIES = 100_000
MAX_DEPTH = 64
EXISTS_EXIT = 17
POLL_S = 0.2
WATCH_DUTY = 10  # a watcher waits this many times its last poll's time before the next
MAX_WATCHED = 10_000  # entries a watcher follows (one files.tree answer)
MAX_WATCHERS = 64
WATCHERS_PER_SANDBOX = 8
MAX_EVENTS = 10_000


class FilesystemService:
    def __init__(self, front: Any) -> None:
        self.f = front
        self._watchers: dict[str, _Watcher] = {}

    def _sb(self, request: web.Request) -> AsyncSandbox:
        return AsyncSandbox.from_id(request["sandbox_id"], endpoint=self.f.endpoint)

    async def _path(self, request: web.Request, msg: dict[str, Any],
                    name: str = "path") -> tuple[str, str]:
        user = users.from_header(request)
        return users.resolve(string(msg, name), user), user

    async def stat(self, request: web.Request) -> web.Response:
        msg = await read_unary(request)
        path, _ = await self._path(request, msg)
        e = await self._sb(request).files.stat(path)
        return unary_response({"entry": entry_info(e)})

    async def make_dir(self, request: web.Request) -> web.Response:
        msg = await read_unary(request)
        path, user = await self._path(request, msg)
        sb = self._sb(request)
        r = await sb.exec(["/bin/sh", "-c", f'[ -e "$1" ] && exit {EXISTS_EXIT}; '
                           'exec mkdir -p -- "$1"', "mkdir", path], user=user, cwd="/",
                          timeout=30)
        if r.exit_code == EXISTS_EXIT:
            raise ConnectError("already_exists", f"{path} already exists")
        if not r.ok:
            raise _mkdir_failed(r)
        return unary_response({"entry": entry_info(await sb.files.stat(path))})

    async def move(self, request: web.Request) -> web.Response:
        msg = await read_unary(request)
        src, _ = await self._path(request, msg, "source")
        dst, user = await self._path(request, msg, "destination")
        sb = self._sb(request)
        await sb.files.stat(src)  # a missing source is named as such, before anything is made
        parent = posixpath.dirname(dst)
        try:
            await sb.files.stat(parent)
        except ce.FileNotFound:  # envd makes the destination's directories, as the user
            r = await sb.exec(["mkdir", "-p", "--", parent], user=user, cwd="/", timeout=30)
            if not r.ok:
                raise _mkdir_failed(r) from None
        await sb.files.rename(src, dst)
        return unary_response({"entry": entry_info(await sb.files.stat(dst))})

    async def remove(self, request: web.Request) -> web.Response:
        msg = await read_unary(request)
        path, _ = await self._path(request, msg)
        await self._sb(request).files.remove(path, recursive=True)
        return unary_response({})

    async def _walk(self, sb: AsyncSandbox, path: str, depth: int) -> list[FileEntry]:
        out: list[FileEntry] = []
        level = [path]
        for _ in range(depth):
            nxt: list[str] = []
            for d in level:
                try:
                    entries = await sb.files.list(d)
                except (ce.FileNotFound, ce.PermissionDenied):
                    if d == path:
                        raise
                    continue  # removed or unreadable while walking: skip it
                for e in entries:
                    out.append(e)
                    if len(out) > MAX_ENTRIES:
                        raise ConnectError("resource_exhausted",
                                           f"more than {MAX_ENTRIES} entries")
                    if e.type == "dir":
                        nxt.append(e.path)
            level = nxt
            if not level:
                break
        return out

    async def list_dir(self, request: web.Request) -> web.Response:
        msg = await read_unary(request)
        path, _ = await self._path(request, msg)
        depth = uint(msg, "depth") or 1
        if depth > MAX_DEPTH:
            raise ConnectError("invalid_argument", f"depth is at most {MAX_DEPTH}")
        sb = self._sb(request)
        st = await sb.files.stat(path)
        if st.type != "dir":
            raise ConnectError("invalid_argument", f"{path} is not a directory")
        entries = await self._walk(sb, path, depth)
        return unary_response({"entries": [entry_info(e) for e in entries]})

    # ---- watching -------------------------------------------------------------------------
    async def _new_watcher(self, request: web.Request, msg: dict[str, Any]) -> _Watcher:
        path, _ = await self._path(request, msg)
        sb = self._sb(request)
        st = await sb.files.stat(path)
        if st.type != "dir":
            raise ConnectError("invalid_argument", f"{path} is not a directory")
        w = _Watcher(self, sb, request["sandbox_id"], path, boolean(msg, "recursive"),
                     boolean(msg, "includeEntry") or boolean(msg, "include_entry"))
        await w.prime()
        return w

    async def watch_dir(self, request: web.Request) -> web.StreamResponse:
        msg = await read_stream_request(request)
        sid = request["sandbox_id"]
        with self.f.streams.slot(sid), self.f.watchers.slot(sid):
            return await self._watch(request, msg)

    async def _watch(self, request: web.Request, msg: dict[str, Any]) -> web.StreamResponse:
        stream = ServerStream(request)
        try:
            w = await self._new_watcher(request, msg)
        except ConnectError as e:
            return await stream.end(e)
        except ce.CorralError as e:
            return await stream.end(to_connect(e, request["sandbox_id"]))
        await stream.send({"start": {}})
        last_sent = time.monotonic()
        while stream.open:
            await asyncio.sleep(w.interval())
            try:
                events = await w.poll()
            except ConnectError as e:
                return await stream.end(e)
            except ce.CorralError as e:
                return await stream.end(to_connect(e, request["sandbox_id"]))
            for ev in events:
                await stream.send({"filesystem": ev})
                last_sent = time.monotonic()
            if time.monotonic() - last_sent > 30:
                await stream.send({"keepalive": {}})
                last_sent = time.monotonic()
        return stream.response

    async def create_watcher(self, request: web.Request) -> web.Response:
        msg = await read_unary(request)
        for wid in [k for k, w in self._watchers.items() if w.task is not None and w.task.done()]:
            del self._watchers[wid]  # their sandbox ended: nobody reads them any more
        sid = request["sandbox_id"]
        self.f.watchers.take(sid)
        try:
            w = await self._new_watcher(request, msg)
        except BaseException:
            self.f.watchers.give(sid)
            raise
        w.holds_slot = True
        wid = secrets.token_hex(8)
        self._watchers[wid] = w
        w.task = asyncio.ensure_future(w.run())
        return unary_response({"watcherId": wid})

    def _watcher(self, request: web.Request, msg: dict[str, Any]) -> tuple[str, _Watcher]:
        wid = string(msg, "watcherId", "watcher_id")
        w = self._watchers.get(wid)
        if w is None or w.sandbox_id != request["sandbox_id"]:
            raise ConnectError("not_found", f"no watcher {wid!r}")
        return wid, w

    async def get_watcher_events(self, request: web.Request) -> web.Response:
        _, w = self._watcher(request, await read_unary(request))
        if w.error is not None:
            raise w.error
        events, w.pending = w.pending, []
        return unary_response({"events": events})

    async def remove_watcher(self, request: web.Request) -> web.Response:
        wid, w = self._watcher(request, await read_unary(request))
        del self._watchers[wid]
        w.stop()
        return unary_response({})

    async def close(self) -> None:
        for w in self._watchers.values():
            w.stop()
        self._watchers.clear()


def _mkdir_failed(r: ExecResult) -> ConnectError:
    """The error of a mkdir run as the user: its permission errors as permission_denied."""
    err = r.stderr.strip() or f"mkdir exited {r.exit_code}"
    return ConnectError("permission_denied" if "ermission denied" in err else "invalid_argument",
                        err)


class _Watcher:
    """Polls a directory's listing and turns differences into envd's FilesystemEvents."""

    def __init__(self, svc: FilesystemService, sb: AsyncSandbox, sandbox_id: str, path: str,
                 recursive: bool, include_entry: bool) -> None:
        self.svc, self.sb, self.sandbox_id, self.path = svc, sb, sandbox_id, path
        self.recursive, self.include_entry = recursive, include_entry
        self.seen: dict[str, FileEntry] = {}
        self.pending: list[dict[str, Any]] = []
        self.error: ConnectError | None = None
        self.task: asyncio.Future[None] | None = None
        self.holds_slot = False  # of the front's watchers (a WatchDir stream's is the stream's)
        self.took = 0.0  # the last poll's time

    def release(self) -> None:
        if self.holds_slot:
            self.holds_slot = False
            self.svc.f.watchers.give(self.sandbox_id)

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
        self.release()

    async def _snapshot(self) -> dict[str, FileEntry]:
        t0 = time.monotonic()
        tree = await self.sb.files.tree(self.path, MAX_DEPTH if self.recursive else 1,
                                        MAX_WATCHED)
        self.took = time.monotonic() - t0
        if tree.truncated:
            raise ConnectError("resource_exhausted",
                               f"more than {MAX_WATCHED} entries to watch under {self.path}")
        return {e.path: e for e in tree.entries}

    def interval(self) -> float:
        """The wait before the next poll: WATCH_DUTY times what the last one took."""
        return max(POLL_S, WATCH_DUTY * self.took)

    async def prime(self) -> None:
        self.seen = await self._snapshot()

    def _event(self, path: str, kind: str, e: FileEntry | None) -> dict[str, Any]:
        ev: dict[str, Any] = {"name": text(posixpath.relpath(path, self.path)), "type": kind}
        if e is not None and self.include_entry:
            ev["entry"] = entry_info(e)
        return ev

    async def poll(self) -> list[dict[str, Any]]:
        now = await self._snapshot()
        events = []
        for p, e in now.items():
            old = self.seen.get(p)
            if old is None:
                events.append(self._event(p, "EVENT_TYPE_CREATE", e))
            elif (old.size, old.mtime) != (e.size, e.mtime):
                events.append(self._event(p, "EVENT_TYPE_WRITE", e))
            elif old.mode != e.mode:
                events.append(self._event(p, "EVENT_TYPE_CHMOD", e))
        for p in self.seen.keys() - now.keys():
            events.append(self._event(p, "EVENT_TYPE_REMOVE", None))
        self.seen = now
        return events

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval())
            try:
                events = await self.poll()
            except ConnectError as e:  # the tree grew past MAX_WATCHED
                self.error = e
                self.release()
                return
            except ce.CorralError as e:  # the sandbox ended: its slot is free, its error kept
                self.error = to_connect(e, self.sandbox_id)
                self.release()
                return
            self.pending.extend(events)
            del self.pending[:-MAX_EVENTS]


def routes(svc: FilesystemService) -> list[web.RouteDef]:
    base = "/filesystem.Filesystem/"
    return [web.post(base + "Stat", svc.stat), web.post(base + "MakeDir", svc.make_dir),
            web.post(base + "Move", svc.move), web.post(base + "ListDir", svc.list_dir),
            web.post(base + "Remove", svc.remove), web.post(base + "WatchDir", svc.watch_dir),
            web.post(base + "CreateWatcher", svc.create_watcher),
            web.post(base + "GetWatcherEvents", svc.get_watcher_events),
            web.post(base + "RemoveWatcher", svc.remove_watcher)]
