"""Snapshots, fork and restore (the layers: corral.daemon.snapshots)."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import os
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from corral.daemon import diskguard, persist, snapshots, snapxfer
from corral.daemon.tenants import TENANT_LABEL
from corral.errors import (
    InvalidRequest,
    QuotaExceeded,
    SnapshotExists,
    SnapshotNotFound,
    TooLarge,
    Unsupported,
)

from .base import Sandbox

if TYPE_CHECKING:  # pragma: no cover
    from .host import EngineHost


class SnapshotOps:
    # The state dir's disk (corral.daemon.diskguard), set at start; None: not guarded.
    disk: diskguard.DiskGuard | None = None
    # What a tenant's snapshots may hold here: tenant -> (snapshots, bytes), set at start
    # from its tokens file entry or CORRAL_TENANT_MAX_SNAPSHOTS / CORRAL_TENANT_SNAPSHOT_MB;
    # None: no bound. The admin's snapshots (no tenant) are bound only by the disk.
    snapshot_quota: Callable[[str], tuple[int, int]] | None = None

    def _snaps(self: EngineHost) -> snapshots.SnapshotStore:
        if self.snaps is None:
            raise Unsupported("snapshots are not available")
        return self.snaps

    async def snapshot(self: EngineHost, sid: str, name: str | None,
                       control: snapshots.CaptureControl | None = None) -> dict[str, Any]:
        """The sandbox's files (what it changed over its image) as a new layer on its own
        chain (Substrate.capture). ``control`` reports the bytes copied; a cancel (the client
        left) stops the copy, waits for it to end (thawed, its partial layer removed) and
        leaves no snapshot."""
        store = self._snaps()
        sb = self.lookup(sid)
        substrate = self.substrates[sb.spec.substrate]
        if not substrate.capabilities.snapshot:
            raise self._lacks(substrate, "snapshot")
        if name is not None and name in store.by_name:  # checked again in commit
            raise SnapshotExists(f"a snapshot named {name!r} exists", details={"name": name})
        tenant = sb.spec.labels.get(TENANT_LABEL)
        quota = None
        if isinstance(tenant, str) and self.snapshot_quota is not None:
            quota = self.snapshot_quota(tenant)
        if quota is None:
            sb, base, (tmp, digest, size) = await self._capture(sid, control)
        else:
            assert isinstance(tenant, str)
            _within_quota(store, tenant, quota)
            store.pending[tenant] += 1  # captures in flight count: none overtakes another
            try:
                sb, base, (tmp, digest, size) = await self._capture(sid, control)
                try:
                    _within_quota(store, tenant, quota, (digest, size))
                except BaseException:
                    store.drop(tmp)  # refused whole: no layer, no record
                    raise
            finally:
                store.pending[tenant] -= 1
                if store.pending[tenant] <= 0:
                    del store.pending[tenant]
        rec = store.commit(tmp, digest, size, name=name, parent=sb.spec.snapshot,
                           image=sb.spec.image, base=base, sandbox_id=sid, tenant=tenant)
        if store.wants_spares():  # the next capture's dir, made while this one answers
            task = asyncio.ensure_future(asyncio.to_thread(store.refill_spares))
            self._batch_tasks.add(task)
            task.add_done_callback(self._batch_tasks.discard)
        self.counters["snapshots"] = self.counters.get("snapshots", 0) + 1
        return rec

    async def _capture(self: EngineHost, sid: str,
                       control: snapshots.CaptureControl | None = None,
                       ) -> tuple[Sandbox, builtins.list[str], tuple[str, str, int]]:
        """Copy what the sandbox changed while it is frozen: (the sandbox, the chain it stands
        on, (temporary layer dir, digest, bytes)); ``control`` as for snapshot. Shared by
        snapshots and image commits."""
        while True:  # one capture at a time (a freeze is shared), after file ops in flight
            await self.wait_capture(sid)
            sb = self.lookup(sid)
            if not sb.threads:
                break
            await sb.no_threads()
        base = sb.layers
        image = self._image(sb.spec.image)
        paused = sb.state == "paused"
        # The copy lands on the state dir's disk: what it is expected to write (the
        # sandbox's disk use, where the scratch can tell) is claimed from the room above
        # the daemon's reserve before it starts, so a full disk refuses it whole; the claim
        # is raised ahead of the copy as it goes, and the copy waits at it (_within_claim).
        if self.disk is None:
            return await self._capture_claimed(sb, base, image, paused, control)
        with self.disk.claim("a snapshot", self._capture_estimate(sb)) as held, \
                self.disk.claim_inodes("a snapshot") as inodes:
            return await self._capture_claimed(sb, base, image, paused, control, held,
                                               inodes)

    def _capture_estimate(self: EngineHost, sb: Sandbox) -> int:
        """Bytes a capture of ``sb`` is expected to write (Substrate.capture_estimate), at
        most the snapshot bound."""
        if sb.runtime is None:
            return 0
        used = self.substrates[sb.spec.substrate].capture_estimate(sb.runtime)
        return min(used, self._snaps().max_bytes)

    async def _capture_claimed(self: EngineHost, sb: Sandbox, base: builtins.list[str],
                               image: Any, paused: bool,
                               control: snapshots.CaptureControl | None,
                               held: diskguard.Claim | None = None,
                               inodes: diskguard.InodeClaim | None = None,
                               ) -> tuple[Sandbox, builtins.list[str], tuple[str, str, int]]:
        store = self._snaps()
        substrate = self.substrates[sb.spec.substrate]
        runtime = sb.runtime
        assert runtime is not None
        layers = list(base)
        store.acquire(layers)  # the sandbox may die meanwhile: keep its chain
        sb.enter_thread()
        sb.capturing = asyncio.get_running_loop().create_future()
        control = control if control is not None else snapshots.CaptureControl()
        try:
            _allow_first(control, held)
            copy = asyncio.ensure_future(asyncio.to_thread(
                substrate.capture, runtime, substrate.image_on(image, base, store), store,
                paused, control))
            watch = _within_claim(copy, control, held, sb.spec.disk_mb, inodes)
            tmp, digest, size = await _to_the_end(copy, control, store, watch)
        finally:
            sb.leave_thread()
            store.release(layers)
            done, sb.capturing = sb.capturing, None
            done.set_result(None)
        return sb, base, (tmp, digest, size)

    async def fork(self: EngineHost, sid: str, count: int, name: str | None, keep: bool,
                   key: str | None = None, control: snapshots.CaptureControl | None = None,
                   on_made: Callable[[], None] | None = None,
                   ) -> tuple[dict[str, Any], builtins.list[Sandbox]]:
        """Snapshot + ``count`` sandboxes on it with the parent's spec (one call, all or
        nothing: a failure or a cancel destroys the children made and drops the snapshot,
        ``keep`` or not). A parent made for trajectory ``T`` forked under key ``T:S`` (or
        explicit key ``S``) gives child ``i`` the trajectory ``T/forkS/i``, the SDK's name for
        it. ``control`` and ``on_made``: progress of the capture and of the children."""
        sb = self.lookup(sid)
        substrate = self.substrates[sb.spec.substrate]
        if not substrate.capabilities.snapshot:
            raise self._lacks(substrate, "fork")
        self._admit(count, sb.spec.labels)
        kids_of: list[str] | None = None
        if sb.trajectory is not None and key is not None:
            head, sep, step = key.rpartition(":")
            if not sep:
                _check_fork_key(key)
            if not sep or head == sb.trajectory:
                kids_of = [f"{sb.trajectory}/fork{step}/{i}" for i in range(count)]
        rec = await self.snapshot(sid, name, control)
        spec = sb.spec.model_copy(update={"snapshot": rec["id"]})
        try:
            kids = await self.create_many(count, spec, kids_of, on_made)
        except BaseException:  # all or nothing: the children made are destroyed by now
            self._drop_snapshot(rec["id"])
            raise
        if not keep:
            self._drop_snapshot(rec["id"])  # the children hold its layers
        return rec, kids

    def _drop_snapshot(self: EngineHost, snap_id: str) -> None:
        with contextlib.suppress(SnapshotNotFound):  # deleted through the API meanwhile
            self._snaps().delete(snap_id)

    async def restore(self: EngineHost, sid: str, key: str) -> Sandbox:
        """Roll a sandbox back to a snapshot in place: same id, spec and limits; its
        processes are killed and a new init starts on the snapshot (Substrate.reset)."""
        store = self._snaps()
        sb = self.lookup(sid)
        substrate = self.substrates[sb.spec.substrate]
        if not substrate.capabilities.restore:
            raise self._lacks(substrate, "restore")
        rec = store.get(key)
        image = substrate.image_on(self._image(rec["image"]), rec["layers"], store)
        old_layers = sb.layers
        store.acquire(rec["layers"])
        spec = sb.spec.model_copy(update={"snapshot": rec["id"], "image": rec["image"]})
        self._unwatch(sb)
        sb.state, sb.reason, sb.paused_at = "restoring", "restoring", None
        try:
            await sb.no_threads()
            # Counted as a thread: a kill or a shutdown that comes meanwhile waits for the
            # reset, then destroys what it made (not the runtime being replaced under it).
            sb.enter_thread()
            try:
                runtime = await asyncio.to_thread(substrate.reset, sb.rt, spec, image)
            finally:
                sb.leave_thread()
        except BaseException:
            store.release(rec["layers"])
            if sb.stopping is None:
                sb.reason = None
                self._lose(sb)  # the old init is gone or in an unknown state
            raise
        if sb.procs:
            for p in sb.procs.values():
                p.release()
            sb.procs = None
        runtime.extra["layers"] = list(rec["layers"])
        if sb.runtime is not None and sb.runtime.extra.get("exposed"):
            runtime.extra["exposed"] = sb.runtime.extra["exposed"]  # its relays stay open
        sb.runtime, sb.spec = runtime, spec
        if sb.stopping is not None:  # killed or shut down while restoring: it stays so
            store.release(old_layers)  # (the destroy in flight releases the new ones)
            raise self._gone(sid, sb)
        sb.state, sb.reason = "running", None
        sb.last_active = self.clock.time()
        persist.write_json_atomic(os.path.join(self.sandboxes_dir, sid, persist.META), sb.meta())
        store.release(old_layers)
        self._watch(sb)
        self._schedule(sb, self.clock.time())
        return sb

    def snapshot_list(self: EngineHost) -> builtins.list[dict[str, Any]]:
        return self._snaps().list()

    def snapshot_get(self: EngineHost, key: str) -> dict[str, Any]:
        return self._snaps().get(key)

    def snapshot_delete(self: EngineHost, key: str) -> dict[str, Any]:
        return self._snaps().delete(key)

    # ---- moving a snapshot between nodes (corral.daemon.snapxfer) --------------------------
    def snapshot_export(self: EngineHost, key: str,
                        have: set[str]) -> tuple[dict[str, Any], Callable[[], None]]:
        """The export manifest of snapshot ``key`` (the layers in ``have`` left out) and the
        release of its chain, which is held until the stream is written (an rm meanwhile
        does not remove a layer being sent)."""
        store = self._snaps()
        rec = store.get(key)
        store.acquire(rec["layers"])
        try:
            man = snapxfer.plan(store, rec, have)
        except BaseException:
            store.release(rec["layers"])
            raise
        return man, lambda: store.release(rec["layers"])

    async def snapshot_export_stream(self: EngineHost, man: dict[str, Any],
                                     write: Callable[[bytes], Any]) -> None:
        await snapxfer.send(self._snaps(), man, write)
        self.counters["snapshots_exported"] += 1

    async def snapshot_import(self: EngineHost, recv: Callable[[int], Any],
                              tenant: str | None = None) -> tuple[dict[str, Any], bool]:
        """A snapshot from another node's export stream read with ``recv``, owned by
        ``tenant`` (None: the admin): (record, made); an id this node has already is
        answered as it is if it is the same tenant's."""
        rec, made = await snapxfer.receive(
            self._snaps(), recv, self._import_image, tenant,
            self.disk.check if self.disk is not None else None)
        self.counters["snapshots_imported"] += made
        return rec, made

    async def _import_image(self: EngineHost, name: str) -> str:
        """The image an imported snapshot stands on, as this node names it: pulled if it is a
        registry reference the node lacks; a local name the node lacks is image_not_found."""
        found = await self._image_name(name)
        self._image(found)
        return found


def _within_quota(store: snapshots.SnapshotStore, tenant: str, quota: tuple[int, int],
                  new: tuple[str, int] | None = None) -> None:
    """Raise QuotaExceeded unless ``tenant`` may make one more snapshot (``new`` None: before
    its capture, counting those in flight) or keep the one just captured (``new``: its
    layer's digest and bytes, counted unless the tenant's snapshots hold that layer)."""
    max_count, max_bytes = quota
    count, held, layers = store.usage(tenant)
    if new is None:
        count += store.pending.get(tenant, 0)
        if count >= max_count:
            raise QuotaExceeded(
                f"snapshot quota exceeded: tenant {tenant!r} holds {count} of its "
                f"{max_count} snapshots (delete some)",
                details={"tenant": tenant, "resource": "snapshots", "in_use": count,
                         "limit": max_count})
        if held < max_bytes:
            return
    else:
        digest, size = new
        if digest in layers or held + size <= max_bytes:
            return
        held += size
    raise QuotaExceeded(
        f"snapshot quota exceeded: tenant {tenant!r}'s snapshots would hold {held} bytes, "
        f"of its {max_bytes} (delete some)",
        details={"tenant": tenant, "resource": "snapshot_bytes", "in_use": held,
                 "limit": max_bytes})


# How often a capture's copy is looked at, and how far ahead of what it has taken its disk
# claim is raised (a copy writes ~1-2 GB/s: a look every 20 ms keeps a fast copy from waiting
# on its allowance).
WATCH_S = 0.02
CLAIM_AHEAD = 64 << 20


def _allow_first(control: snapshots.CaptureControl, held: diskguard.Claim | None) -> None:
    """Before the copy starts: its allowance, the claim (the estimate, raised ahead of it as
    far as the disk has room); none without a disk guard."""
    if held is None:
        return
    held.grow_up_to(held.bytes + CLAIM_AHEAD)
    control.allow(held.bytes)


async def _within_claim(copy: asyncio.Future[tuple[str, str, int]],
                        control: snapshots.CaptureControl, held: diskguard.Claim | None,
                        disk_mb: int, inodes: diskguard.InodeClaim | None = None) -> None:
    """Until ``copy`` ends: the disk it takes (``control.charged()``: its file data, a block
    for each entry it makes, xattrs) stays within its allowance (``_allow_first``), which is
    its disk claim, raised ahead of it; the copy waits at it, so it never writes past what
    was claimed. A claim from an estimate that lagged (the scratch's quota counts catch up at
    its next commit) once let a copy cut into the daemon's reserve, and so could files that
    cost the copy a block each but the scratch a few bytes of metadata. Its file data stays
    under the sandbox's ``disk_mb`` (the most its files hold on a disk of their own): files
    that share their blocks (reflinks, made without privilege on a btrfs scratch) cost the
    sandbox's quota once and the copy each time; 60 reflinks of 100 MB in a 1 GiB sandbox
    made a 5.7 GB copy (the entries' blocks count in the disk's claim, not in the
    sandbox's disk_mb: small files are inline on the btrfs scratch). Its inode claim is
    raised the same way as it lists entries, up to the share of the state dir's inodes one
    capture may make. Raises TooLarge (the sandbox's
    files: its disk_mb, that share) or CapacityExceeded (the disk's room)."""
    cap = disk_mb << 20
    while True:
        await asyncio.wait([copy], timeout=WATCH_S)
        if control.copied() > cap:
            raise TooLarge(
                f"cannot snapshot: the copy of the sandbox's files passes its disk_mb "
                f"({disk_mb} MiB); files that share their blocks (reflinks) are copied whole",
                details={"limit": "disk_mb", "max": disk_mb})
        listed = control.entries()
        if inodes is not None and inodes.share is not None and listed > inodes.share:
            raise TooLarge(
                f"cannot snapshot: the sandbox holds more than {inodes.share} files and "
                f"directories, the most one snapshot may make on this daemon's disk",
                details={"limit": "snapshot_entries", "max": inodes.share})
        if copy.done():  # a last look at what it copied, then the copy's own outcome
            return
        if held is not None:
            charged = control.charged()
            held.wrote(charged)
            wanted = control.wanted()  # a copy waiting at its allowance: what it needs
            if wanted > held.bytes:
                held.grow_to(wanted)  # CapacityExceeded when the disk has no room for it
            held.grow_up_to(max(wanted, charged) + CLAIM_AHEAD)
            control.allow(held.bytes)
        if inodes is not None and listed > inodes.n:  # each entry listed is one it makes
            inodes.grow_to(listed + diskguard.INODE_CLAIM)


async def _to_the_end(copy: asyncio.Future[tuple[str, str, int]],
                      control: snapshots.CaptureControl,
                      store: snapshots.SnapshotStore,
                      watch: Coroutine[Any, Any, None] | None = None) -> tuple[str, str, int]:
    """The capture's result; cancelled, or stopped by ``watch`` (which raises to stop it,
    also after the copy ended: its last look), it stops the copy and returns only once the
    worker thread is done (the sandbox thawed, the partial layer removed), then raises."""
    watcher = asyncio.ensure_future(watch) if watch is not None else None
    try:
        if watcher is None:
            return await asyncio.shield(copy)
        both: set[asyncio.Future[Any]] = {copy, watcher}
        await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
        if not watcher.done():  # the copy ended: the watcher's last look at it
            await asyncio.wait([watcher])
        if not watcher.cancelled() and watcher.exception() is not None:
            control.cancel()
            await _stopped(copy, store)
            raise watcher.exception()  # type: ignore[misc]
        return await asyncio.shield(copy)
    except asyncio.CancelledError:
        control.cancel()
        await _stopped(copy, store)
        raise
    finally:
        if watcher is not None and not watcher.done():
            watcher.cancel()


async def _stopped(copy: asyncio.Future[tuple[str, str, int]],
                   store: snapshots.SnapshotStore) -> None:
    """Wait for a cancelled copy's worker thread to end; a copy that ended before it saw the
    cancel is dropped."""
    while not copy.done():
        with contextlib.suppress(BaseException):  # a second cancel still waits for it
            await asyncio.shield(copy)
    if not copy.cancelled() and copy.exception() is None:
        store.drop(copy.result()[0])


def _check_fork_key(key: str) -> None:
    """An explicit key of a trajectory's fork names the children's trajectories
    ``T/fork{key}/{i}``: digits only, it named the children of the fork at that step too (a
    resume of one child ran calls in the other), and a ``/`` in it split the name where a
    resume could not find the parent."""
    if key.isdigit() or "/" in key:
        raise InvalidRequest(
            f"bad fork key {key!r}: an explicit key names its children's trajectories "
            f"(T/fork{{key}}/{{i}}), so it cannot be digits only (a step's) or hold a '/'",
            details={"key": key})
