"""Queries: a sandbox's log, trajectories, the entries API."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Iterator
from typing import Any

from corral.errors import SandboxNotFound, Unsupported

from .base import _Base
from .keys import _dumps
from .schema import _BINDS, _SANDBOX_SEQS

LOG_PAGE_ROWS = 64  # rows a page of a streamed log, at most
PAGE_BYTES = 4 << 20  # ... and about this many bytes (one exec's row can hold ~2 x 12 MiB)

# An exec result with an output cut to :cap characters, in SQLite (no row is parsed in
# Python but one with a NUL; a small row is not parsed at all): what a viewer of the log
# (the dashboard) needs.
# Not a row whose text has a NUL (\u0000): SQLite's json_extract ends a string at its first
# NUL, so an output with a NUL in its first :cap characters passed whole (an agent printing
# one NUL and 12 MiB sent them all to a viewer asking for 8 KiB). Such a row is cut in
# Python (_cut_row), by the same rule.
_CUT = ("CASE WHEN length({r}) <= :cap * 2 + 4096 OR instr({r}, '\\u0000') THEN {r} "
        "WHEN json_type({r}, '$.{k}') = 'text' AND length(json_extract({r}, '$.{k}')) > :cap "
        "THEN json_set({r}, '$.{k}', substr(json_extract({r}, '$.{k}'), 1, :cap), "
        "'$.view_truncated', json('true')) ELSE {r} END")
_NUL = b"\\u0000"  # a NUL as the stored JSON text spells it


def _cut_row(result: bytes, cap: int) -> bytes:
    """``_CUT`` of a result with a NUL, in Python: stdout then stderr, each cut to ``cap``
    characters while the row's text is longer than ``cap * 2 + 4096``."""
    text = result.decode()
    obj: Any = None
    for k in ("stdout", "stderr"):
        if len(text) <= cap * 2 + 4096:
            break
        if obj is None:
            obj = json.loads(text)
            if not isinstance(obj, dict):
                return result
        v = obj.get(k)
        if isinstance(v, str) and len(v) > cap:
            obj[k] = v[:cap]
            obj["view_truncated"] = True
            text = _dumps(obj)
    return text.encode()


_COLUMNS = "seq, op, idem_key, request, {result}, error, started_at, ended_at, snapshot_ids, status"


def _num(v: Any) -> str:
    """A number (or null) as JSON, as json.dumps writes it."""
    return json.dumps(v)


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

    def stream(self, sid: str, tail: int | None = None, max_output: int | None = None,
               jsonl: bool = False, more: bytes = b"") -> Iterator[list[bytes]] | None:
        """``sid``'s log as pieces of one JSON document (``jsonl``: one entry a line), a
        list of pieces for each page of rows: the daemon holds one page, never the whole
        log (a sandbox decides how big its entries are). The stored JSON texts are spliced
        in as they are. ``tail``: only the last entries; ``max_output``: exec outputs cut
        to that many characters (``view_truncated``). None if the log never heard of
        ``sid``. ``more``: members added to the document at its end (``,"k":v``). Call
        ``next`` from a worker thread: each page is a query."""
        if not self.enabled:
            raise Unsupported("the trajectory log is off on this daemon (CORRAL_TRAJLOG=0)")
        conn = self._connect()
        try:
            srow = conn.execute("SELECT spec, created_at, ended_at, reason, net FROM sandboxes "
                                "WHERE sandbox_id=?", (sid,)).fetchone()
            # One statement: the count and the last row of one state of the log; the pages
            # stop at that row (rows logged meanwhile made a tail longer than asked for).
            count, top = conn.execute(f"SELECT count(*), max(seq) FROM ({_SANDBOX_SEQS})",
                                      {"sid": sid}).fetchone()
        except BaseException:
            conn.close()
            raise
        if srow is None and not count:
            conn.close()
            return None
        return self._pages(conn, sid, srow, count, -1 if top is None else top, tail,
                           max_output, jsonl, more)

    def _pages(self, conn: sqlite3.Connection, sid: str, srow: tuple[Any, ...] | None,
               count: int, top: int, tail: int | None, max_output: int | None,
               jsonl: bool, more: bytes = b"") -> Iterator[list[bytes]]:
        try:
            first = max(0, count - tail) if tail is not None else 0
            if not jsonl:
                sandbox = "null" if srow is None else (
                    f'{{"spec":{srow[0] or "null"},"created_at":{_num(srow[1])},'
                    f'"ended_at":{_num(srow[2])},"reason":{json.dumps(srow[3])},'
                    f'"net":{srow[4] or "null"}}}')
                yield [f'{{"sandbox_id":{json.dumps(sid)},"sandbox":{sandbox},"entries":['
                       .encode()]
            index, last = first, -1
            if first:
                row = conn.execute(f"SELECT seq FROM ({_SANDBOX_SEQS}) ORDER BY seq "
                                   "LIMIT 1 OFFSET :o", {"sid": sid, "o": first - 1}).fetchone()
                last = row[0] if row is not None else -1
            sid_json = json.dumps(sid).encode()
            while True:
                page = (f"SELECT {_COLUMNS.format(result='result')} FROM entries WHERE seq "
                        f"IN ({_SANDBOX_SEQS}) AND seq > :last AND seq <= :top ORDER BY seq "
                        f"LIMIT {LOG_PAGE_ROWS}")
                if max_output is not None:  # stdout cut in a subquery, then stderr
                    cut_out = _COLUMNS.format(result=_CUT.format(r="result", k="stdout")
                                              + " AS r1")
                    cut_err = _COLUMNS.format(result=_CUT.format(r="r1", k="stderr")
                                              + " AS result")
                    page = (f"SELECT {cut_err} FROM (SELECT {cut_out} FROM ({page})) "
                            "ORDER BY seq")
                # Rows until PAGE_BYTES, then the statement ends (no read transaction is
                # held while a slow client takes the page).
                cur = conn.execute(f"SELECT seq, op, idem_key, CAST(request AS BLOB), "
                                   f"CAST(result AS BLOB), CAST(error AS BLOB), started_at, "
                                   f"ended_at, snapshot_ids, status FROM ({page})",
                                   {"sid": sid, "last": last, "top": top,
                                    "cap": max_output})
                parts: list[bytes] = []
                size = 0
                try:
                    for r in cur:
                        done = r[9] is None
                        if max_output is not None and r[4] is not None and _NUL in r[4]:
                            r = (*r[:4], _cut_row(r[4], max_output), *r[5:])
                        duration = _num(round(max(0.0, r[7] - r[6]), 6)) if done else "null"
                        head = (f'{"" if jsonl or index == first else ","}'
                                f'{{"index":{index},"seq":{r[0]},"sandbox_id":').encode()
                        tail_ = (f',"error":{"null" if r[5] is None else r[5].decode()},'
                                 f'"started_at":{_num(r[6])},'
                                 f'"ended_at":{_num(r[7]) if done else "null"},'
                                 f'"duration_s":{duration},"snapshot_ids":{r[8] or "[]"}}}'
                                 f'{chr(10) if jsonl else ""}').encode()
                        parts += [head, sid_json,
                                  (f',"op":{json.dumps(r[1])},"status":'
                                   f'{json.dumps(r[9] or "done")},"idempotency_key":'
                                   f'{json.dumps(r[2])},"request":').encode(),
                                  r[3] or b"null", b',"result":', r[4] or b"null", tail_]
                        size += len(r[3] or b"") + len(r[4] or b"")
                        index += 1
                        last = r[0]
                        if size >= PAGE_BYTES:
                            break
                finally:
                    cur.close()
                if not parts:
                    break
                yield [b"".join(parts)] if size < PAGE_BYTES else parts
            if not jsonl:
                yield [b"]" + more + b"}"]
        finally:
            conn.close()

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
        """A fork child's id resolves through its parent's fork first: a create keyed with
        such an id (another tenant's, made before or after the fork) never takes its place."""
        forked = self._fork_child(conn, tid)
        if forked is not None:
            return forked
        row = conn.execute("SELECT sandbox_id FROM entries WHERE idem_key=? AND op='create' "
                           "AND status IS NULL ORDER BY seq LIMIT 1",
                           (tid + ":create",)).fetchone()
        return None if row is None else str(row[0])

    def _fork_child(self, conn: sqlite3.Connection, tid: str) -> str | None:
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

    async def pages(self, sid: str, known: bool, tail: int | None = None,
                    max_output: int | None = None, jsonl: bool = False
                    ) -> Iterator[list[bytes]]:
        """``stream`` once the log has every finished call; a sandbox the daemon ``known``s
        but the log does not has an empty log."""
        await self.flushed()
        got = await asyncio.to_thread(self.stream, sid, tail, max_output, jsonl)
        if got is None:
            if not known:
                raise SandboxNotFound(f"no sandbox {sid} and no trajectory log for it",
                                      details={"id": sid})
            empty = b"" if jsonl else (f'{{"sandbox_id":{json.dumps(sid)},"sandbox":null,'
                                       '"entries":[]}').encode()
            return iter([[empty]])
        return got
