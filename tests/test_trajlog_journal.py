"""The trajectory log's write path (corral.daemon.trajlog and corral.daemon.journal,
docs/trajectory.md "Storage"): a call's record is journaled (one write) before the call
returns, the ingester thread moves journaled records into SQLite behind the calls, in order,
and a start ingests whatever a dead writer left in the journal. In process, on a private
state dir (no daemon), except the kill -9 test, which kills a real process."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest

from corral.daemon import journal, trajlog
from corral.daemon.journal import Journal
from corral.daemon.trajlog import TrajLog, ingest
from corral.errors import InternalError, ReplayDivergence


def _rows(path: str, sid: str = "sb") -> list[tuple[Any, ...]]:
    """What another process would read: a fresh connection, only committed rows."""
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT op, request, status FROM entries WHERE sandbox_id=? "
                            "ORDER BY seq", (sid,)).fetchall()
    finally:
        conn.close()


def _sandboxes(path: str) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT sandbox_id, reason FROM sandboxes ORDER BY 1").fetchall()
    finally:
        conn.close()


def _journaled(state_dir: str) -> list[tuple[int, str, tuple[Any, ...]]]:
    return Journal(state_dir).read(after=0)[0]


async def _ok() -> dict[str, Any]:
    await asyncio.sleep(0)
    return {"exit_code": 0, "stdout": "", "stderr": ""}


async def _until(cond: Any) -> None:
    """Poll ``cond`` on the loop (the caller bounds the wait)."""
    while not cond():
        await asyncio.sleep(0.005)


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


@pytest.fixture
def held_ingest(tmp_path, monkeypatch):
    """The ingester holds its batches while the returned file exists: records are
    journaled, not in the database."""
    from corral.daemon.trajlog.ingest import Ingester

    hold = tmp_path / "hold-ingest"
    ingest = Ingester._ingest

    def held(self, conn, batch, size=0):  # type: ignore[no-untyped-def]
        if not hold.exists():
            return ingest(self, conn, batch, size)
        while hold.exists() and not self._closing:
            time.sleep(0.01)
        with self._mu:  # what came meanwhile joins the batch: one batch, as when held before
            batch, self._pending = batch + self._pending, []  # it was taken
            size, self._pending_bytes = size + self._pending_bytes, 0
        return ingest(self, conn, batch, size)

    monkeypatch.setattr(Ingester, "_ingest", held)
    hold.touch()
    yield hold
    hold.unlink(missing_ok=True)


def test_calls_are_journaled_before_they_return_and_ingested_behind(tmp_path, held_ingest):
    async def body(tl: TrajLog) -> None:
        for i in range(20):
            await tl.run("sb", "exec", {"i": i}, None, _ok)
            # Durable at return: its line is in the journal, whatever the ingester does.
            assert [r[2][5] for r in _journaled(tl.state_dir) if r[1] == "e"][-1] == \
                f'{{"i":{i}}}'
        await asyncio.sleep(0.1)  # several ingest intervals
        assert _rows(tl.path) == []  # held: nothing in the database yet
        held_ingest.unlink()
        await tl.flushed()
        assert [r[1] for r in _rows(tl.path)] == [f'{{"i":{i}}}' for i in range(20)]
        assert tl.stats["records"] == 20 and tl.stats["commits"] >= 1

    _run(tmp_path / "s", body)
    # Closed with everything ingested: no journal left behind.
    assert Journal(str(tmp_path / "s")).files() == []


_WRITER = """
import asyncio, sys, time
from corral.daemon.trajlog import TrajLog

async def ok():
    return {"exit_code": 0, "stdout": "x", "stderr": ""}

async def main():
    tl = TrajLog(sys.argv[1], start_ms=10)
    tl.open(asyncio.get_running_loop())
    tl.sandbox_created("sb", {"image": "host"}, 1.0)
    for i in range(30):
        await tl.run("sb", "exec", {"i": i}, f"k{i}" if i % 3 == 0 else None, ok)
    tl.sandbox_created("gone", {}, 2.0)
    tl.sandbox_ended("gone", "killed")
    async def slow():
        await asyncio.sleep(60)
    n = tl.stats["started_rows"]
    asyncio.ensure_future(tl.run("sb", "exec", {"i": "slow"}, None, slow))
    while tl.stats["started_rows"] == n:  # its started row is journaled (after 10 ms)
        await asyncio.sleep(0.005)
    print("ready", flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


def test_a_writer_killed_before_ingesting_loses_nothing_it_answered(tmp_path, held_ingest):
    """kill -9 of a process whose ingester never ran: the next open ingests the journal
    (entries in order, sandbox rows, a bound key, the call in flight as interrupted), then
    removes it."""
    state = tmp_path / "s"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_WRITER), str(state)],
                            stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        db = state / trajlog.DB_NAME
        assert _rows(str(db)) == []  # the ingester never ran
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    held_ingest.unlink()

    async def body(tl: TrajLog) -> None:
        # 2 sandbox rows, 1 end, 30 entries, 10 keyed calls' started rows, 1 started
        assert tl.recovered_records == 44
        assert tl.interrupted == 1
        _, entries = tl.read("sb")
        assert [e["request"]["i"] for e in entries] == [*range(30), "slow"]
        assert [e["status"] for e in entries] == ["done"] * 30 + ["interrupted"]
        assert [e["seq"] for e in entries] == sorted(e["seq"] for e in entries)
        assert _sandboxes(tl.path) == [("gone", "killed"), ("sb", None)]

        async def never() -> dict[str, Any]:
            raise AssertionError("a logged key must fast-forward")

        assert await tl.run("sb", "exec", {"i": 3}, "k3", never) == \
            {"exit_code": 0, "stdout": "x", "stderr": ""}
        # Only the new journal file of this writer, nothing of the dead one.
        assert len(Journal(tl.state_dir).files()) == 1

    _run(state, body)


def test_a_torn_last_line_is_skipped(tmp_path):
    """A writer killed in the middle of its write() leaves a line without its newline: the
    call never answered; the lines before it are ingested."""
    state = tmp_path / "s"
    state.mkdir()
    lines = []
    for n in (1, 2):
        lines.append(trajlog._dumps((n, "e", n, "sb", "exec", None, None, f'{{"i":{n}}}',
                                     '{"exit_code":0}', None, 1.0, 2.0, None, None)))
    torn = trajlog._dumps((3, "e", 3, "sb", "exec", None, None, '{"i":3}', None, None, 1.0,
                           2.0, None, None))[:-9]
    (state / f"{journal.PREFIX}{1:020d}").write_text("\n".join(lines) + "\n" + torn)

    async def body(tl: TrajLog) -> None:
        assert tl.recovered_records == 2
        assert [e["request"] for e in tl.read("sb")[1]] == [{"i": 1}, {"i": 2}]
        await tl.run("sb", "exec", {"i": 4}, None, _ok)
        await tl.flushed()
        assert [e["request"] for e in tl.read("sb")[1]] == [{"i": 1}, {"i": 2}, {"i": 4}]

    _run(state, body)


def test_a_damaged_record_does_not_keep_the_log_from_opening(tmp_path):
    """A record of the right shape that the database refuses (a damaged file: an object
    where a text belongs) is skipped at recovery; the records around it are ingested."""
    state = tmp_path / "s"
    state.mkdir()

    def line(n: int, request: Any) -> str:
        return trajlog._dumps((n, "e", n, "sb", "exec", None, None, request, None, None, 1.0,
                               2.0, None, None))

    (state / f"{journal.PREFIX}{1:020d}").write_text(
        "\n".join([line(1, '{"i":1}'), line(2, {"not": "text"}), line(3, '{"i":3}')]) + "\n")

    async def body(tl: TrajLog) -> None:
        assert tl.recovered_records == 2
        assert [e["request"] for e in tl.read("sb")[1]] == [{"i": 1}, {"i": 3}]

    _run(state, body)
    assert len(Journal(str(state)).files()) == 0


def test_a_journal_that_cannot_grow_fails_the_call_as_infra_and_recovers(tmp_path,
                                                                          monkeypatch):
    """A full disk shows when a new journal file is allocated (posix_fallocate: never a
    SIGBUS on a write to an unallocated page): that call gets internal, the next one writes
    to a new file."""
    monkeypatch.setattr(journal, "FILE_BYTES", 1024)  # a new file every few records
    real = os.posix_fallocate
    full = {"on": False}

    def fallocate(fd: int, offset: int, length: int) -> None:
        if full["on"]:
            raise OSError(28, "No space left on device")
        real(fd, offset, length)

    monkeypatch.setattr(journal.os, "posix_fallocate", fallocate)

    async def body(tl: TrajLog) -> None:
        for i in range(4):
            await tl.run("sb", "exec", {"i": i}, None, _ok)
        full["on"] = True
        with pytest.raises(InternalError, match="trajectory log"):
            for i in range(4, 40):  # until the file is full and a new one is needed
                await tl.run("sb", "exec", {"i": i}, None, _ok)
        failed = i
        full["on"] = False
        await tl.run("sb", "exec", {"i": 99}, None, _ok)
        await tl.flushed()
        got = [r[1] for r in _rows(tl.path)]
        assert got == [f'{{"i":{k}}}' for k in [*range(failed), 99]]

    _run(tmp_path, body)


def test_an_ingest_failure_keeps_the_records_for_the_next_open(tmp_path):
    async def body(tl: TrajLog) -> None:
        assert tl._conn is not None
        tl._conn.execute("DROP TABLE entries")
        await tl.run("sb", "exec", {"i": 0}, None, _ok)  # journaled: the call succeeds
        with pytest.raises(InternalError, match="trajectory log"):
            await tl.flushed()  # a reader is told, not served a log without it
        assert tl.stats["ingest_errors"] >= 1

    _run(tmp_path, body)
    assert Journal(str(tmp_path)).files()  # kept: not all of it is in the database

    async def reopen(tl: TrajLog) -> None:
        assert tl.recovered_records == 1
        assert [e["request"] for e in tl.read("sb")[1]] == [{"i": 0}]

    _run(tmp_path, reopen)
    assert Journal(str(tmp_path)).files() == []


def test_sync_full_returns_only_once_in_the_database(tmp_path):
    async def body(tl: TrajLog) -> None:
        for i in range(5):
            await tl.run("sb", "exec", {"i": i}, None, _ok)
            assert len(_rows(tl.path)) == i + 1
        await asyncio.gather(*(tl.run("sb", "exec", {"i": i}, None, _ok) for i in range(10)))
        assert len(_rows(tl.path)) == 15

    _run(tmp_path, body, sync="full")


def test_checkpoints_run_in_the_ingester(tmp_path, monkeypatch):
    monkeypatch.setattr(ingest, "CHECKPOINT_EVERY", 10)

    async def body(tl: TrajLog) -> None:
        for i in range(35):
            await tl.run("sb", "exec", {"i": i}, None, _ok)
            if i % 5 == 4:
                await tl.flushed()
        assert tl._conn is not None
        assert tl._conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0

    tl = _run(tmp_path, body)
    assert tl.stats["checkpoints"] >= 2
    assert len(_rows(tl.path)) == 35


def test_the_wal_is_bounded_in_bytes_not_only_in_records(tmp_path, monkeypatch):
    """Big entries (a sandbox's outputs: up to ~12 MiB of JSON each) checkpoint the WAL by
    bytes, and a WAL started over is cut back: before, the WAL waited for 1000 records and
    never shrank (a 716 MB WAL after 186 execs of 1 MiB of binary output on a 768 MiB state
    dir, which then filled)."""
    monkeypatch.setattr(ingest, "CHECKPOINT_BYTES", 4 << 20)
    monkeypatch.setattr(trajlog.writer, "WAL_SIZE_LIMIT", 4 << 20)
    out = "x" * (1 << 20)
    wal = os.path.join(str(tmp_path), "trajlog.db-wal")
    sizes: list[int] = []

    async def body(tl: TrajLog) -> None:
        for i in range(40):
            await tl.run("sb", "exec", {"i": i}, None,
                         lambda: asyncio.sleep(0, {"exit_code": 0, "stdout": out}))
            await tl.flushed()
            sizes.append(os.path.getsize(wal))

    tl = _run(tmp_path, body)
    assert tl.stats["checkpoints"] >= 5
    assert max(sizes) < 12 << 20, sizes
    assert len(_rows(tl.path)) == 40


def test_started_rows_then_finish_in_place(tmp_path):
    """A call that outlives the hold gets a started row; its end replaces that row (same
    seq)."""
    async def body(tl: TrajLog) -> None:
        gate = asyncio.Event()

        async def slow() -> dict[str, Any]:
            await gate.wait()
            return {"ok": True}

        task = asyncio.ensure_future(tl.run("sb", "mkdir", {"path": "/x"}, None, slow))
        await asyncio.wait_for(_until(lambda: tl.stats["started_rows"] == 1), 10)  # the hold
        await tl.flushed()
        assert [r[2] for r in _rows(tl.path)] == ["started"]
        (first,) = tl.read("sb")[1]
        gate.set()
        await task
        await tl.flushed()
        assert [r[2] for r in _rows(tl.path)] == [None]
        (done,) = tl.read("sb")[1]
        assert done["seq"] == first["seq"] and done["result"] == {"ok": True}

    tl = _run(tmp_path, body, start_ms=10)
    assert tl.stats["started_rows"] == 1


def test_one_batch_keeps_the_order_of_every_kind_of_record(tmp_path, held_ingest):
    """With the ingester held, a sandbox row, a call's start and end, a dropped start and a
    sandbox end all land in one batch; ingested, the database is as if written one by one."""
    async def body(tl: TrajLog) -> None:
        async def made() -> dict[str, Any]:
            tl.sandbox_created("sb", {"image": "host"}, 1.0)  # what engine.create does
            return {"id": "sb"}

        async def slow() -> dict[str, Any]:
            await asyncio.sleep(0.1)
            return {"ok": True}

        async def lost() -> dict[str, Any]:
            await asyncio.sleep(0.1)
            raise RuntimeError("a daemon bug: not a call")

        async def kill() -> dict[str, Any]:
            tl.sandbox_ended("sb", "killed")  # what engine._destroy does
            return {"killed": True}

        await tl.run("", "create", {"image": "host"}, None, made)
        await tl.run("sb", "mkdir", {"path": "/a"}, None, slow)  # started, then finished
        with pytest.raises(RuntimeError):
            await tl.run("sb", "mkdir", {"path": "/b"}, None, lost)  # started, then dropped
        await tl.run("sb", "kill", {}, None, kill)
        assert [r[1] for r in _journaled(tl.state_dir)] == \
            ["sc", "e", "e", "e", "e", "d", "se", "e"]
        held_ingest.unlink()
        await tl.flushed()
        assert tl.stats["commits"] == 1  # one batch
        assert [(r[0], r[2]) for r in _rows(tl.path)] == \
            [("create", None), ("mkdir", None), ("kill", None)]
        assert _sandboxes(tl.path) == [("sb", "killed")]

    _run(tmp_path, body, start_ms=10)


def test_a_key_binds_before_its_entry_is_ingested(tmp_path, held_ingest):
    calls = []

    async def append() -> dict[str, Any]:
        calls.append(1)
        return {"exit_code": 0, "stdout": f"{len(calls)}\n", "stderr": ""}

    async def body(tl: TrajLog) -> None:
        first = await tl.run("sb", "exec", {"cmd": "echo x >> f"}, "t:1", append)
        again = await tl.run("sb", "exec", {"cmd": "echo x >> f"}, "t:1", append)
        assert calls == [1] and again == first  # fast-forwarded from the journal tier
        with pytest.raises(ReplayDivergence):
            await tl.run("sb", "exec", {"cmd": "other"}, "t:1", append)
        assert _rows(tl.path) == []
        held_ingest.unlink()
        await tl.flushed()
        assert tl._unbound == {}  # ingested: the database answers now
        assert await tl.run("sb", "exec", {"cmd": "echo x >> f"}, "t:1", append) == first
        assert calls == [1]

    _run(tmp_path, body)


def test_a_key_with_a_lone_surrogate_is_refused(tmp_path):
    async def body(tl: TrajLog) -> None:
        from corral.errors import InvalidRequest

        with pytest.raises(InvalidRequest):
            await tl.run("sb", "exec", {}, "bad\udcff", _ok)

    _run(tmp_path, body)


def test_rotated_journal_files_are_removed_once_ingested(tmp_path, monkeypatch):
    monkeypatch.setattr(journal, "FILE_BYTES", 2000)

    async def body(tl: TrajLog) -> None:
        for i in range(60):
            await tl.run("sb", "exec", {"i": i, "pad": "x" * 100}, None, _ok)
        assert len(Journal(tl.state_dir).files()) > 3
        await tl.flushed()
        assert len(Journal(tl.state_dir).files()) == 1  # only the current one
        assert [r[1] for r in _rows(tl.path)] == \
            [trajlog._dumps({"i": i, "pad": "x" * 100}) for i in range(60)]

    _run(tmp_path, body)
    assert Journal(str(tmp_path)).files() == []


def test_outputs_and_floats_that_are_not_plain_json_are_logged(tmp_path):
    """Lone surrogates (undecodable output bytes) keep their escapes; an infinite or NaN
    float (not JSON) is logged as its repr."""
    out = "caf\u00e9 \udcff"

    async def weird() -> dict[str, Any]:
        return {"stdout": out, "duration_s": float("inf"), "x": float("nan")}

    async def body(tl: TrajLog) -> None:
        await tl.run("sb", "exec", {"timeout": float("inf")}, None, weird)
        await tl.flushed()
        (e,) = tl.read("sb")[1]
        assert e["request"] == {"timeout": "inf"}
        assert e["result"] == {"stdout": out, "duration_s": "inf", "x": "nan"}

    _run(tmp_path, body)


def test_a_second_writer_on_the_same_state_dir_is_refused(tmp_path):
    async def body(tl: TrajLog) -> None:
        other = TrajLog(str(tmp_path))
        with pytest.raises(InternalError, match="another process"):
            other.open(asyncio.get_running_loop())
        await tl.run("sb", "exec", {}, None, _ok)
        assert len(Journal(tl.state_dir).files()) == 1  # not taken away

    _run(tmp_path, body)


def _by_sandbox(path: str) -> set[tuple[str, int]]:
    conn = sqlite3.connect(path)
    try:
        return set(conn.execute("SELECT sandbox_id, seq FROM entries_by_sandbox"))
    finally:
        conn.close()


def test_the_per_sandbox_index_is_filled_in_batches_and_reads_see_the_tail(tmp_path,
                                                                           monkeypatch):
    """Batches write the rows only; every INDEX_EVERY entries one batch indexes them all.
    A sandbox's log reads the indexed part and the tail alike, in order, and what a reopen
    finds unindexed (a crash) is indexed then."""
    monkeypatch.setattr(ingest, "INDEX_EVERY", 8)

    async def body(tl: TrajLog) -> None:
        for i in range(21):
            await tl.run(f"sb{i % 3}", "exec", {"i": i}, None, _ok)
            if i in (7, 15, 20):
                await tl.flushed()  # batches of 8, 8 and 5
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
    monkeypatch.setattr(ingest, "INDEX_EVERY", 2)

    async def body(tl: TrajLog) -> None:
        for i in range(4):
            await tl.run("old", "exec", {"i": i}, None, _ok)
        tl.sandbox_created("old", {}, 1.0)
        tl.sandbox_ended("old", "killed")
        assert await tl.prune(now=4e9) == 1  # every entry gone
        assert _rows(tl.path, "old") == [] and _by_sandbox(tl.path) == set()
        for i in range(3):
            await tl.run("new", "exec", {"i": i}, None, _ok)
            await tl.flushed()
        assert [e["request"]["i"] for e in tl.read("new")[1]] == [0, 1, 2]
        assert {s for s, _ in _by_sandbox(tl.path)} == {"new"}

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
        await tl.flushed()
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
        await tl.flushed()  # (readopted runs at a start, after the journal's ingest)
        tl.readopted([("a", {"image": "host"}, 1.0, {"id": "a"}),
                      ("b", {"image": "host"}, 2.0, {"id": "b", "snapshot": "snap-1"})])
        await tl.flushed()
        tl.readopted([("b", {"image": "host"}, 2.0, {"id": "b"})])  # a second restart
        await tl.flushed()
        assert [r[0] for r in _rows(tl.path, "a")] == ["create"]
        (b,) = tl.read("b")[1]
        assert b["op"] == "create" and b["request"] == {"image": "host"}
        assert b["result"] == {"id": "b", "snapshot": "snap-1", "recovered": True}
        assert b["snapshot_ids"] == ["snap-1"]
        assert _sandboxes(tl.path) == [("a", None), ("b", None)]

    _run(tmp_path, body)
