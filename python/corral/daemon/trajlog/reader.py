"""Queries: a sandbox's log, trajectories, the entries API."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from typing import Any

from corral.errors import SandboxNotFound, Unsupported

from .base import _Base
from .keys import sha256
from .schema import _BINDS, _SANDBOX_SEQS


class Reader(_Base):
    def read(self, sid: str) -> tuple[dict[str, Any] | None, list[dict[str, Any]]] | None:
        """(sandbox row, entries) of ``sid``; None if the log never heard of it. Runs on its
        own connection (callers use a thread: a log can be long)."""
        if not self.enabled:
            raise Unsupported("the trajectory log is off on this daemon (CORRAL_TRAJLOG=0)")
        conn = self._connect()
        try:
            srow = conn.execute("SELECT spec, created_at, ended_at, reason, net FROM sandboxes "
                                "WHERE sandbox_id=?", (sid,)).fetchone()
            rows = conn.execute(
                "SELECT seq, op, idem_key, request, result, error, started_at, ended_at, "
                f"snapshot_ids, status FROM entries WHERE seq IN ({_SANDBOX_SEQS}) "
                "ORDER BY seq", {"sid": sid}).fetchall()
        finally:
            conn.close()
        if srow is None and not rows:
            return None
        sandbox = None
        if srow is not None:
            sandbox = {"spec": json.loads(srow[0]) if srow[0] else None,
                       "created_at": srow[1], "ended_at": srow[2], "reason": srow[3],
                       "net": json.loads(srow[4]) if srow[4] else None}
        entries = []
        for i, r in enumerate(rows):
            done = r[9] is None
            entries.append({
                "index": i, "seq": r[0], "sandbox_id": sid, "op": r[1],
                "status": r[9] or "done",
                "idempotency_key": r[2], "request": json.loads(r[3]),
                "result": json.loads(r[4]) if r[4] is not None else None,
                "error": json.loads(r[5]) if r[5] is not None else None,
                "started_at": r[6], "ended_at": r[7] if done else None,
                "duration_s": round(max(0.0, r[7] - r[6]), 6) if done else None,
                "snapshot_ids": json.loads(r[8]) if r[8] else [],
            })
        return sandbox, entries

    async def knows(self, sid: str) -> bool:
        """Whether the log has sandbox ``sid`` (also long after it is gone, until pruned)."""
        if not self.enabled:
            return False
        await self.flushed()
        assert self._reader is not None
        return self._reader.execute("SELECT 1 FROM sandboxes WHERE sandbox_id=?",
                                    (sid,)).fetchone() is not None

    async def trajectory(self, tid: str) -> tuple[str, int] | None:
        """(sandbox id, next step) of trajectory ``tid``: the sandbox its create (key
        ``{tid}:create``) made, or, for a fork child's ``{parent}/fork{step}/{i}``, child
        ``i`` of that fork; the step after the highest ``{tid}:{n}`` its log binds. None if
        the log has no such trajectory."""
        if not self.enabled:
            raise Unsupported("the trajectory log is off on this daemon (CORRAL_TRAJLOG=0)")
        await self.flushed()
        return await asyncio.to_thread(self._trajectory, tid)

    def _trajectory(self, tid: str) -> tuple[str, int] | None:
        conn = self._connect()
        try:
            sid = self._trajectory_sandbox(conn, tid)
            if sid is None:
                return None
            rows = conn.execute(
                f"SELECT idem_key FROM entries WHERE seq IN ({_SANDBOX_SEQS}) AND {_BINDS} "
                "AND substr(idem_key, 1, :n) = :p",
                {"sid": sid, "n": len(tid) + 1, "p": tid + ":"}).fetchall()
        finally:
            conn.close()
        steps = [int(k[len(tid) + 1:]) for (k,) in rows if k[len(tid) + 1:].isdigit()]
        return sid, (max(steps) + 1 if steps else 0)

    def _trajectory_sandbox(self, conn: sqlite3.Connection, tid: str) -> str | None:
        row = conn.execute("SELECT sandbox_id FROM entries WHERE idem_key=? AND op='create' "
                           "AND status IS NULL ORDER BY seq LIMIT 1",
                           (tid + ":create",)).fetchone()
        if row is not None:
            return str(row[0])
        parent_tid, sep, tail = tid.rpartition("/fork")
        step, _, child = tail.partition("/")
        if not sep or not child.isdigit():
            return None
        parent = self._trajectory_sandbox(conn, parent_tid)
        if parent is None:
            return None
        for key in (f"{parent_tid}:{step}", step):  # a stepped key, or an explicit one
            row = conn.execute(
                f"SELECT result FROM entries WHERE seq IN ({_SANDBOX_SEQS}) AND idem_key="
                ":k AND op='fork' AND status IS NULL AND result IS NOT NULL LIMIT 1",
                {"sid": parent, "k": key}).fetchone()
            if row is not None:
                kids = json.loads(row[0]).get("sandboxes") or []
                return str(kids[int(child)]) if int(child) < len(kids) else None
        return None

    async def entries(self, sid: str, known: bool) -> dict[str, Any]:
        await self.flushed()
        got = await asyncio.to_thread(self.read, sid)
        if got is None:
            if not known:
                raise SandboxNotFound(f"no sandbox {sid} and no trajectory log for it",
                                      details={"id": sid})
            got = (None, [])
        sandbox, entries = got
        return {"sandbox_id": sid, "sandbox": sandbox, "entries": entries}

    def exec_result(self, res: dict[str, Any]) -> dict[str, Any]:
        """An exec's result as logged: outputs cut to the log's cap, with hashes of the full
        output (``_sha``, added by the engine) and the sizes."""
        sha = res.pop("_sha", None)
        out = dict(res)
        if sha is not None:
            out["stdout_sha256"], out["stderr_sha256"] = sha
        cap = self.output_cap
        for name in ("stdout", "stderr"):
            text = out.get(name)
            if isinstance(text, str) and (sha is None or len(text) > cap):
                if sha is None:
                    out[f"{name}_sha256"] = sha256(text.encode("utf-8", "surrogateescape"))
                if len(text) > cap:
                    out[name] = text[:cap]
                    out["log_truncated"] = True
        return out
