"""Deterministic replay: run a logged session again in a fresh sandbox and compare, step by step.

``replay(sandbox_id)`` reads the sandbox's trajectory log, creates a new sandbox from the same
spec (``image=`` overrides the image), sends every logged exec and file operation again in the
same order (file writes and uploads with the bytes the log kept), then compares the new
sandbox's own log with the original, entry by entry: exit code, stdout/stderr hashes and
timeouts for commands, size and hash for reads, the error code for failed calls.

Sandbox state calls: ``snapshot`` takes a snapshot of the replay sandbox (it must succeed) and
remembers which replay snapshot stands for which logged one; ``restore`` restores the replay
snapshot that stands for the logged one (or the logged snapshot itself if the replay did not
make it and it still exists); ``fork`` is replayed as a snapshot only (its children have logs
of their own: replay them by id); ``pause``/``resume`` are sent as they are. Snapshots the
replay made are deleted at the end unless ``keep``. Calls interrupted by a daemon crash are
skipped (their outcome is unknown).

A session that started on a snapshot starts on it again. If that snapshot is gone and the
session is a fork child, the parent's logged session up to the fork is replayed first in the
same sandbox (recursively), which rebuilds the state the child started from.
"""

from __future__ import annotations

import base64
from dataclasses import asdict, dataclass, field
from typing import Any

from corral.errors import CorralError, SnapshotNotFound
from corral.sdk import api
from corral.sdk.endpoint import Endpoint
from corral.sdk.sandbox import Sandbox
from corral.sdk.sync_transport import transport

# What decides "same" for each kind of entry (keys of the logged result).
_COMPARE = {
    "exec": ("exit_code", "timed_out", "stdout_sha256", "stderr_sha256", "pid"),
    "wait": ("exit_code", "timed_out", "stdout_sha256", "stderr_sha256"),
    "read": ("size", "sha256", "truncated"),
    "list": ("count", "sha256"),
    "stat": ("type", "size", "mode"),
    # A snapshot's size is what its copy took of the state dir's disk (holes as the
    # filesystem reports them): not the session's doing, so not compared.
    "snapshot": (),
    "fork": (),
}
SKIP_OPS = ("create", "kill", "info")  # info: the sandbox as it was, not replayed
REPLAYED_AS = {"fork": "snapshot"}  # what the replay sandbox logs for a logged op


@dataclass
class ReplayStep:
    index: int
    op: str
    what: str
    status: str                    # same | differs | skipped
    diffs: dict[str, tuple[Any, Any]] = field(default_factory=dict)   # key -> (logged, replayed)
    note: str = ""


@dataclass
class ReplayReport:
    source_id: str
    replay_id: str | None
    image: str
    steps: list[ReplayStep]
    #: What the replay sandbox started from: "image IMG", "snapshot ID", or, for a fork child
    #: whose snapshot is gone, "PARENT up to step N" (those parent steps were sent first).
    base: str = ""

    @property
    def differences(self) -> list[ReplayStep]:
        return [s for s in self.steps if s.status == "differs"]

    @property
    def identical(self) -> bool:
        return not self.differences

    def to_json(self) -> dict[str, Any]:
        return {"source_id": self.source_id, "replay_id": self.replay_id, "image": self.image,
                "base": self.base, "identical": self.identical,
                "steps": [asdict(s) for s in self.steps]}


def describe(entry: dict[str, Any]) -> str:
    req = entry.get("request") or {}
    op = entry.get("op", "")
    if op == "exec":
        cmd = req.get("cmd")
        text = cmd if isinstance(cmd, str) else " ".join(map(str, cmd or []))
        return text + (" &" if req.get("background") else "")
    if op == "rename":
        return f"{req.get('src')} -> {req.get('dst')}"
    if op == "wait":
        return f"pid {req.get('pid')}"
    if op == "fork":
        return f"{req.get('count')} children"
    if op == "restore":
        return str(req.get("snapshot", ""))
    if op == "snapshot":
        return str(req.get("name") or "")
    if op == "create" and req.get("parent"):
        return f"fork of {req['parent']}"
    return str(req.get("path", ""))


def _outcome(entry: dict[str, Any]) -> dict[str, Any]:
    if entry.get("error"):
        return {"error": entry["error"]["error"]["code"]}
    res = entry.get("result") or {}
    if entry["op"] == "fork":
        res = res.get("snapshot") or {}
    keys = _COMPARE.get(entry["op"], ())
    return {k: res.get(k) for k in keys}


def _send_step(sb: Sandbox, entry: dict[str, Any], pids: dict[int, int],
               snaps: dict[str, str]) -> str:
    """Send one logged call to the replay sandbox; errors are part of the outcome (logged by
    the daemon), so they are swallowed here. Returns a note ('' if replayed as is).
    ``snaps``: logged snapshot id -> the replay's snapshot standing for it."""
    op, req = entry["op"], entry["request"]
    sid = sb.id
    if entry.get("status", "done") != "done":
        return ("interrupted by a daemon crash (outcome unknown): not replayed"
                if entry.get("status") == "interrupted" else "still in flight: not replayed")

    def data() -> bytes | None:
        b64 = req.get("data_b64")
        return None if b64 is None else base64.b64decode(b64)

    try:
        if op == "exec":
            call = api.exec_(sid, req["cmd"], timeout=req.get("timeout"), env=req.get("env"),
                             cwd=req.get("cwd"), user=req.get("user"), stdin=req.get("stdin"),
                             background=bool(req.get("background")),
                             max_output_bytes=req.get("max_output_bytes",
                                                      api.DEFAULT_MAX_OUTPUT_BYTES))
            res = sb._call(call)
            old = (entry.get("result") or {}).get("pid")
            if req.get("background") and old is not None:
                pids[old] = res.pid
        elif op == "wait":
            pid = pids.get(req["pid"], req["pid"])
            sb._call(api.proc_wait(sid, pid, req.get("timeout")))
        elif op == "write":
            body = data()
            if body is None:
                return "content not in the log (over its size cap): not replayed"
            sb._call(api.write(sid, req["path"], body, req.get("mode", 0o644)))
        elif op == "upload":
            body = data()
            if body is None:
                return "content not in the log (over its size cap): not replayed"
            sb._call(api.put_tar(sid, req["path"], body))
        elif op == "mkdir":
            sb._call(api.mkdir(sid, req["path"], req.get("parents", True)))
        elif op == "remove":
            sb._call(api.remove(sid, req["path"], req.get("recursive", False)))
        elif op == "rename":
            sb._call(api.rename(sid, req["src"], req["dst"]))
        elif op == "read":
            sb._call(api.read(sid, req["path"], req.get("max_bytes")))
        elif op == "list":
            sb._call(api.list_dir(sid, req["path"]))
        elif op == "stat":
            sb._call(api.stat(sid, req["path"]))
        elif op == "download":
            sb._call(api.get_tar(sid, req["path"]))
        elif op in ("snapshot", "fork"):
            made = sb._call(api.snapshot(sid))  # unnamed: the logged name is taken
            logged = entry.get("snapshot_ids") or []
            if logged:
                snaps[logged[0]] = made.id
            if op == "fork":
                return "replayed as a snapshot: replay each child by its id"
        elif op == "restore":
            logged = (entry.get("snapshot_ids") or [None])[0]
            target = snaps.get(logged or "") or logged or req["snapshot"]
            if logged and logged not in snaps:
                try:
                    sb._call(api.snapshot_get(logged))
                except CorralError as e:
                    if e.infra:
                        raise
                    return f"snapshot {logged} was not made by this replay and is gone"
            sb._call(api.restore(sid, target))
        elif op == "pause":
            sb._call(api.pause(sid))
        elif op == "resume":
            sb._call(api.resume(sid))
        else:
            return f"op {op!r} is not replayed"
    except CorralError as e:
        if e.infra:
            raise
    return ""


def _history(t: Any, sandbox_id: str, image: str | None,
             ) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]], str]:
    """(spec fields, parent prefix, the session's entries, base) of a replay: the spec to
    create the replay sandbox with; the entries of ancestors to send first (for a fork child
    whose snapshot is gone); the session's own entries."""
    src = t.call(api.log_raw(sandbox_id))
    entries = src["entries"]
    creates = [e for e in entries if e["op"] == "create"]
    spec_fields = dict(((src.get("sandbox") or {}).get("spec")) or {})
    if not spec_fields:
        spec_fields = dict(creates[0]["request"]) if creates else {}
    spec_fields.pop("parent", None)
    parent = creates[0]["request"].get("parent") if creates else None
    if image is not None:
        spec_fields["image"] = image
        spec_fields.pop("snapshot", None)
        return spec_fields, [], entries, f"image {image}"
    snap = spec_fields.get("snapshot")
    if not snap:
        return spec_fields, [], entries, f"image {spec_fields.get('image', 'host')}"
    try:
        t.call(api.snapshot_get(snap))
        return spec_fields, [], entries, f"snapshot {snap}"
    except CorralError as e:
        if e.infra or not parent:
            raise
    # A fork child whose snapshot is gone: the parent's session up to the fork, then its own.
    pspec, pprefix, pentries, pbase = _history(t, parent, None)
    upto = next((e["index"] for e in pentries if e["op"] == "fork"
                 and sandbox_id in ((e.get("result") or {}).get("sandboxes") or [])), None)
    if upto is None:
        raise SnapshotNotFound(f"snapshot {snap} of {sandbox_id} is gone and the fork that "
                               f"made it is not in {parent}'s log: replay with an image",
                               details={"snapshot": snap})
    prefix = pprefix + [e for e in pentries if e["index"] < upto]
    return pspec, prefix, entries, f"{parent} up to step {upto} ({pbase})"


def replay(sandbox_id: str, *, image: str | None = None,
           endpoint: str | Endpoint | None = None, keep: bool = False) -> ReplayReport:
    """Replay sandbox ``sandbox_id``'s logged session in a fresh sandbox (from the same spec;
    ``image`` overrides its image) and report where the outcomes differ. The replay sandbox
    (and the snapshots the replay made) are removed at the end unless ``keep``."""
    ep = Endpoint.parse(endpoint)
    t = transport(ep)
    spec_fields, prefix, entries, base = _history(t, sandbox_id, image)
    spec = api.spec(**spec_fields)
    info = t.call(api.create(spec))
    # Through a cluster gateway the replay sandbox lives on the node it was placed on (a
    # live one; the logged session may come from a lost node's copy at the gateway).
    sb = Sandbox._bind(ep.placed(info), info.id, info)
    pids: dict[int, int] = {}
    snaps: dict[str, str] = {}
    notes: dict[int, str] = {}
    try:
        sent_prefix = 0
        for e in prefix:  # the ancestors' steps, not compared (replay them by their own id)
            if e["op"] in SKIP_OPS:
                continue
            if not _send_step(sb, e, pids, snaps) or e["op"] == "fork":
                sent_prefix += 1
        for e in entries:
            if e["op"] in SKIP_OPS:
                continue
            notes[e["index"]] = _send_step(sb, e, pids, snaps)
        mine = [e for e in sb._call(api.log_raw(sb.id))["entries"]
                if e["op"] not in SKIP_OPS][sent_prefix:]
    finally:
        if not keep:
            for made in snaps.values():
                try:
                    sb._call(api.snapshot_delete(made))
                except CorralError:
                    pass
            try:
                sb.kill()
            except CorralError:
                pass
    steps: list[ReplayStep] = []
    got = iter(mine)
    for e in entries:
        if e["op"] in SKIP_OPS:
            steps.append(ReplayStep(e["index"], e["op"], describe(e), "skipped"))
            continue
        note = notes.get(e["index"], "")
        if note and e["op"] != "fork":
            steps.append(ReplayStep(e["index"], e["op"], describe(e), "skipped", note=note))
            continue
        mine_e = next(got, None)
        if mine_e is None or mine_e["op"] != REPLAYED_AS.get(e["op"], e["op"]):
            steps.append(ReplayStep(e["index"], e["op"], describe(e), "differs",
                                    note="the replay did not log this call"))
            continue
        a, b = _outcome(e), _outcome(mine_e)
        if e["op"] == "exec" and "pid" in a:  # pids of background commands differ by nature
            a.pop("pid")
            b.pop("pid", None)
        diffs = {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
        steps.append(ReplayStep(e["index"], e["op"], describe(e),
                                "differs" if diffs else "same", diffs, note))
    return ReplayReport(sandbox_id, info.id, spec.image, steps, base)
