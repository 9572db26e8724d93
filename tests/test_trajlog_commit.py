"""The trajectory log's write path (corral.daemon.trajlog, docs/trajectory.md "Overhead"):
entries committed inline on the event loop when the writer thread is idle, queued for it
otherwise, in submission order either way, and durable before a call returns. In process,
on a private state dir (no daemon)."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from typing import Any

import pytest

from corral.daemon import trajlog
from corral.daemon.trajlog import TrajLog
from corral.errors import InternalError


def _rows(path: str, sid: str = "sb") -> list[tuple[Any, ...]]:
    """What another process would read: a fresh connection, only committed rows."""
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT op, request, status FROM entries WHERE sandbox_id=? "
                            "ORDER BY seq", (sid,)).fetchall()
    finally:
        conn.close()


def _sandboxes(path: str) -> list[str]:
    conn = sqlite3.connect(path)
    try:
        return [r[0] for r in conn.execute("SELECT sandbox_id FROM sandboxes ORDER BY 1")]
    finally:
        conn.close()


async def _ok() -> dict[str, Any]:
    await asyncio.sleep(0)
    return {"exit_code": 0, "stdout": "", "stderr": ""}


@pytest.fixture(autouse=True)
def _never_slow(monkeypatch):
    """No inline commit counts as slow (a loaded test machine preempts the process in the
    middle of one), unless a test says otherwise."""
    monkeypatch.setattr(trajlog, "INLINE_SLOW_S", 1e9)


def _run(tmp_path, body, **kw: Any) -> TrajLog:
    tl = TrajLog(str(tmp_path), **kw)

    async def main() -> None:
        tl.open(asyncio.get_running_loop())
        try:
            await body(tl)
        finally:
            tl.close()

    asyncio.run(main())
    return tl


def test_idle_writer_means_inline_commits_visible_at_return(tmp_path):
    async def body(tl: TrajLog) -> None:
        for i in range(20):
            await tl.run("sb", "exec", {"i": i}, None, _ok)
            # Committed before the call returned: another connection sees it.
            assert len(_rows(tl.path)) == i + 1

    tl = _run(tmp_path, body)
    assert tl.stats["inline"] == 20 and tl.stats["records"] == 20


def test_a_backlog_sends_entries_to_the_writer_in_order(tmp_path):
    """While the writer has records it has not committed, an entry is queued behind them,
    never committed inline ahead of them."""
    async def body(tl: TrajLog) -> None:
        gate = threading.Event()
        real = tl._commit

        def held(conn: sqlite3.Connection, batch: list[Any]) -> None:
            gate.wait(10)  # the writer is stuck in a slow commit
            real(conn, batch)

        tl._commit = held  # type: ignore[method-assign]
        tl.logged("sb", "read", {"i": 0}, {"size": 0}, 0.0)  # queued, never waited for
        task = asyncio.ensure_future(tl.run("sb", "exec", {"i": 1}, None, _ok))
        await asyncio.sleep(0.1)
        assert not task.done()  # waits for the writer: its entry is behind the queued one
        assert tl.stats["inline"] == 0
        gate.set()
        await task
        assert [r[1] for r in _rows(tl.path)] == ['{"i":0}', '{"i":1}']
        # Backlog drained: the next one is inline again.
        await tl.run("sb", "exec", {"i": 2}, None, _ok)
        assert tl.stats["inline"] == 1

    _run(tmp_path, body)


def test_a_slow_inline_commit_backs_off_to_the_writer(tmp_path, monkeypatch):
    monkeypatch.setattr(trajlog, "INLINE_SLOW_S", 0.0)  # every inline commit is "slow"
    monkeypatch.setattr(trajlog, "INLINE_BACKOFF_S", 30.0)
    monkeypatch.setattr(trajlog, "INLINE_BACKOFF_MAX_S", 300.0)

    async def body(tl: TrajLog) -> None:
        for i in range(5):
            await tl.run("sb", "exec", {"i": i}, None, _ok)
        assert tl.stats["inline"] == 1 and tl.stats["inline_slow"] == 1
        assert tl._backoff == 60.0  # doubled for the next slow one
        assert len(_rows(tl.path)) == 5  # the other four: through the writer thread

    _run(tmp_path, body)


def test_sync_full_never_commits_on_the_loop(tmp_path):
    async def body(tl: TrajLog) -> None:
        await asyncio.gather(*(tl.run("sb", "exec", {"i": i}, None, _ok) for i in range(10)))
        assert len(_rows(tl.path)) == 10

    tl = _run(tmp_path, body, sync="full")
    assert tl.stats["inline"] == 0 and tl.stats["records"] == 10


def test_checkpoints_run_off_the_loop(tmp_path, monkeypatch):
    monkeypatch.setattr(trajlog, "CHECKPOINT_EVERY", 10)

    async def body(tl: TrajLog) -> None:
        for i in range(35):
            await tl.run("sb", "exec", {"i": i}, None, _ok)
        for _ in range(100):
            if tl.stats["checkpoints"]:
                break
            await asyncio.sleep(0.02)
        # The loop's connection never checkpoints by itself.
        assert tl._conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0

    tl = _run(tmp_path, body)
    assert tl.stats["checkpoints"] >= 1  # (requests made while one runs are merged)
    assert len(_rows(tl.path)) == 35


def test_started_rows_then_inline_finish_in_place(tmp_path):
    """A call that outlives the hold gets a started row (via the writer); its end, inline,
    finishes that row in place."""
    async def body(tl: TrajLog) -> None:
        async def slow() -> dict[str, Any]:
            await asyncio.sleep(0.2)
            return {"ok": True}

        task = asyncio.ensure_future(tl.run("sb", "mkdir", {"path": "/x"}, None, slow))
        await asyncio.sleep(0.1)
        assert [r[2] for r in _rows(tl.path)] == ["started"]
        await task
        assert [r[2] for r in _rows(tl.path)] == [None]

    tl = _run(tmp_path, body, start_ms=10)
    assert tl.stats["started_rows"] == 1


def test_an_inline_write_failure_is_internal(tmp_path):
    async def body(tl: TrajLog) -> None:
        tl._conn.execute("DROP TABLE entries")
        with pytest.raises(InternalError, match="trajectory log"):
            await tl.run("sb", "exec", {}, None, _ok)

    _run(tmp_path, body)


def test_calls_ending_in_the_same_turn_share_a_commit(tmp_path):
    """Calls in flight together that end in the same turn of the loop: one commit for all,
    and none of them returns before it."""
    async def body(tl: TrajLog) -> None:
        gate = asyncio.Event()

        async def held() -> dict[str, Any]:
            await gate.wait()
            return {"exit_code": 0}

        tasks = [asyncio.ensure_future(tl.run("sb", "exec", {"i": i}, None, held))
                 for i in range(4)]
        await asyncio.sleep(0.01)
        gate.set()  # all four wake in the same turn
        commits = tl.stats["commits"]
        for t in asyncio.as_completed(tasks):
            await t
            assert len(_rows(tl.path)) == 4  # the first to return already sees all four
        assert tl.stats["commits"] - commits < 4

    tl = _run(tmp_path, body)
    assert tl.stats["inline"] == 4


def test_a_create_is_durable_before_it_returns_even_with_a_busy_writer(tmp_path):
    """Writer idle: a create's sandbox row and entry are committed inline, in one commit,
    before it returns. Writer busy: the create (with or without a key) does not return until
    its entry is committed (a crash can lose nothing its client has seen)."""
    async def body(tl: TrajLog) -> None:
        async def made() -> dict[str, Any]:
            tl.sandbox_created("sb", {"image": "host"}, 1.0)  # what engine.create does
            return {"id": "sb"}

        commits = tl.stats["commits"]
        await tl.run("", "create", {"n": 0}, None, made)
        assert [r[0] for r in _rows(tl.path)] == ["create"]  # inline, already durable
        assert tl.stats["commits"] == commits + 1  # the sandbox row rode along
        assert _sandboxes(tl.path) == ["sb"]
        gate = threading.Event()
        real = tl._commit

        def held(conn: sqlite3.Connection, batch: list[Any]) -> None:
            gate.wait(10)
            real(conn, batch)

        tl._commit = held  # type: ignore[method-assign]
        tl.logged("other", "read", {}, {}, 0.0)  # the writer is busy with this one
        task = asyncio.ensure_future(tl.run("", "create", {"n": 1}, None, made))
        await asyncio.sleep(0.1)
        assert not task.done()  # no answer before the entry is committed
        assert [r[0] for r in _rows(tl.path)] == ["create"]
        gate.set()
        await asyncio.wait_for(task, 5)
        assert [r[0] for r in _rows(tl.path)] == ["create", "create"]

    _run(tmp_path, body)


def test_a_sandbox_row_alone_is_written_at_the_end_of_its_turn(tmp_path):
    """A sandbox made without a logged call (batch create path) still gets its row, and a
    later end of it is applied after it (FIFO behind the row)."""
    async def body(tl: TrajLog) -> None:
        tl.sandbox_created("a", {}, 1.0)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert _sandboxes(tl.path) == ["a"]  # inline at the end of the turn
        tl.sandbox_created("b", {}, 2.0)
        tl.sandbox_ended("b", "killed")  # queued: the row goes to the writer first
        await tl.flushed()
        conn = sqlite3.connect(tl.path)
        try:
            got = conn.execute("SELECT sandbox_id, reason FROM sandboxes ORDER BY sandbox_id"
                               ).fetchall()
        finally:
            conn.close()
        assert got == [("a", None), ("b", "killed")]

    _run(tmp_path, body)


def _by_sandbox(path: str) -> set[tuple[str, int]]:
    conn = sqlite3.connect(path)
    try:
        return set(conn.execute("SELECT sandbox_id, seq FROM entries_by_sandbox"))
    finally:
        conn.close()


def test_the_per_sandbox_index_is_filled_in_batches_and_reads_see_the_tail(tmp_path,
                                                                           monkeypatch):
    """Commits write the row only; every INDEX_EVERY entries one commit indexes them all.
    A sandbox's log reads the indexed part and the tail alike, in order, and what a reopen
    finds unindexed (a crash) is indexed then."""
    monkeypatch.setattr(trajlog, "INDEX_EVERY", 8)

    async def body(tl: TrajLog) -> None:
        for i in range(21):
            await tl.run(f"sb{i % 3}", "exec", {"i": i}, None, _ok)
        assert len(_by_sandbox(tl.path)) == 16  # two batches of 8; 5 in the tail
        for k in range(3):
            assert [e["request"]["i"] for e in tl.read(f"sb{k}")[1]] == list(range(k, 21, 3))
        assert tl.logged_result("sb2", "exec") == {"exit_code": 0, "stdout": "",
                                                   "stderr": ""}

    tl = _run(tmp_path, body)
    assert len(_by_sandbox(tl.path)) == 16  # closed with a tail: as after a crash

    async def reopen(tl: TrajLog) -> None:
        assert len(_by_sandbox(tl.path)) == 21  # open indexed the tail
        assert [e["request"]["i"] for e in tl.read("sb1")[1]] == list(range(1, 21, 3))

    _run(tmp_path, reopen)


def test_deleting_the_last_entries_keeps_new_ones_findable(tmp_path, monkeypatch):
    """Seqs are rowids: deleting the newest entries (a dropped started row, a prune) hands
    their seqs to the next entries, which must still be indexed and read."""
    monkeypatch.setattr(trajlog, "INDEX_EVERY", 2)

    async def body(tl: TrajLog) -> None:
        for i in range(4):
            await tl.run("old", "exec", {"i": i}, None, _ok)
        tl.sandbox_created("old", {}, 1.0)
        tl.sandbox_ended("old", "killed")
        assert await tl.prune(now=4e9) == 1  # every entry gone: seqs start again at 1
        assert _rows(tl.path, "old") == [] and _by_sandbox(tl.path) == set()
        for i in range(3):
            await tl.run("new", "exec", {"i": i}, None, _ok)
        assert [e["request"]["i"] for e in tl.read("new")[1]] == [0, 1, 2]
        assert {s for s, _ in _by_sandbox(tl.path)} == {"new"}

    _run(tmp_path, body)


def test_a_prune_by_another_writer_does_not_hide_later_entries(tmp_path, monkeypatch):
    """The index watermark is read from the database, not cached: when another connection
    deletes the newest entries (an offline prune; not supported while the daemon runs, but
    cheap to survive), the entries written next are still indexed and read."""
    monkeypatch.setattr(trajlog, "INDEX_EVERY", 4)

    async def body(tl: TrajLog) -> None:
        for i in range(9):
            await tl.run("old", "exec", {"i": i}, None, _ok)
        tl.sandbox_created("old", {}, 1.0)
        tl.sandbox_ended("old", "killed")
        await tl.flushed()
        other = TrajLog(str(tmp_path), retention_s=0)  # a second writer, own loop thread
        pruned: list[int] = []

        def offline() -> None:
            async def go() -> None:
                other.open(asyncio.get_running_loop())
                try:
                    pruned.append(await other.prune(now=4e9))
                finally:
                    other.close()
            asyncio.run(go())

        t = threading.Thread(target=offline)
        t.start()
        t.join(30)
        assert pruned == [1] and _by_sandbox(tl.path) == set()
        for i in range(10):  # past INDEX_EVERY twice: two index updates
            await tl.run("new", "exec", {"i": i}, None, _ok)
        assert [e["request"]["i"] for e in tl.read("new")[1]] == list(range(10))
        assert len(_by_sandbox(tl.path)) >= 8

    _run(tmp_path, body)


def test_a_log_with_the_old_per_row_index_is_migrated(tmp_path):
    """A log written with the entries_sandbox index (one index entry per commit) opens with
    that index dropped and every entry in entries_by_sandbox."""
    conn = sqlite3.connect(tmp_path / "trajlog.db")
    conn.executescript(trajlog._SCHEMA.split("-- A sandbox")[0] + """
        CREATE INDEX entries_sandbox ON entries (sandbox_id, seq);""")
    conn.executemany("INSERT INTO entries (sandbox_id, op, request, started_at, ended_at) "
                     "VALUES (?, 'exec', ?, 1.0, 2.0)",
                     [(f"sb{i % 2}", f'{{"i":{i}}}') for i in range(5)])
    conn.commit()
    conn.close()

    async def body(tl: TrajLog) -> None:
        assert len(_by_sandbox(tl.path)) == 5
        assert [e["request"]["i"] for e in tl.read("sb0")[1]] == [0, 2, 4]
        await tl.run("sb0", "exec", {"i": 5}, None, _ok)
        assert [e["request"]["i"] for e in tl.read("sb0")[1]] == [0, 2, 4, 5]
        conn = sqlite3.connect(tl.path)
        try:
            names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
        finally:
            conn.close()
        assert "entries_sandbox" not in names

    _run(tmp_path, body)


def test_readopted_sandboxes_without_a_create_get_one_from_their_record(tmp_path):
    """At a restart: a re-adopted sandbox whose create never committed (its client saw no
    answer) gets its sandbox row and a create entry marked recovered; others are left be."""
    async def body(tl: TrajLog) -> None:
        async def made() -> dict[str, Any]:
            tl.sandbox_created("a", {"image": "host"}, 1.0)
            return {"id": "a"}

        await tl.run("", "create", {"image": "host"}, None, made)
        tl.readopted([("a", {"image": "host"}, 1.0, {"id": "a"}),
                      ("b", {"image": "host"}, 2.0, {"id": "b", "snapshot": "snap-1"})])
        tl.readopted([("b", {"image": "host"}, 2.0, {"id": "b"})])  # a second restart
        await tl.flushed()
        assert [r[0] for r in _rows(tl.path, "a")] == ["create"]
        (b,) = tl.read("b")[1]
        assert b["op"] == "create" and b["request"] == {"image": "host"}
        assert b["result"] == {"id": "b", "snapshot": "snap-1", "recovered": True}
        assert b["snapshot_ids"] == ["snap-1"]
        assert _sandboxes(tl.path) == ["a", "b"]

    _run(tmp_path, body)


def test_a_kill_and_the_sandbox_end_share_one_inline_commit(tmp_path):
    """The end of a sandbox (sandboxes.ended_at) joins the kill's entry: no writer-thread
    hand-off, so the next create does not find the writer busy."""
    async def body(tl: TrajLog) -> None:
        async def made() -> dict[str, Any]:
            tl.sandbox_created("sb", {}, 1.0)
            return {"id": "sb"}

        async def kill() -> dict[str, Any]:
            tl.sandbox_ended("sb", "killed")  # what engine._destroy does
            return {"id": "sb", "killed": True}

        await tl.run("", "create", {}, None, made)
        commits = tl.stats["commits"]
        await tl.run("sb", "kill", {}, None, kill)
        assert tl.stats["commits"] == commits + 1 and tl._backlog == 0
        conn = sqlite3.connect(tl.path)
        try:
            assert conn.execute("SELECT reason FROM sandboxes").fetchall() == [("killed",)]
        finally:
            conn.close()
        assert [r[0] for r in _rows(tl.path)] == ["create", "kill"]

    _run(tmp_path, body)
