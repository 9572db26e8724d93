"""Kills of abandoned gvisor commands against the sandbox's destruction. Destroying a sandbox
ends every command's wrapper, and each wrapper's end schedules a kill, which made a file in
the sandbox's directory: one made while the directory was being removed left the directory
behind for good. A sandbox being destroyed (or gone) gets no kill file and no kill. runsc is
a recorder here (tests/test_gvisor.py runs the real one)."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from typing import Any

import pytest

from corral.daemon.substrates.gvisor.runsc import Runsc
from corral.daemon.substrates.gvisor.substrate import GvisorSubstrate

SID = "sb-0123456789abcdef"


class RecordingRunsc(Runsc):
    """Records the commands it is asked to run; ``on_forget`` runs in the middle of a
    destroy, where a wrapper's end can land."""

    def __init__(self, root: str) -> None:
        super().__init__("/nonexistent/runsc", root, "systrap", os.devnull)  # never run
        self.runs: list[tuple[str, ...]] = []
        self.on_forget: Callable[[], None] = lambda: None

    def run(self, *args: str, timeout: float = 0, log: str | None = None,
            flags: tuple[str, ...] = ()) -> None:
        self.runs.append(args)

    def forget(self, sandbox_id: str) -> None:
        self.on_forget()
        super().forget(sandbox_id)


async def _drain(sub: GvisorSubstrate) -> None:
    """Wait for the kills on the kill threads (a sandbox's next turn is queued as one ends)."""
    while sub._pending or sub._kills:
        await asyncio.gather(*list(sub._pending))
        await asyncio.sleep(0.001)


@pytest.fixture
def substrate(tmp_path):  # type: ignore[no-untyped-def]
    runsc = RecordingRunsc(str(tmp_path / "runsc"))
    sub = GvisorSubstrate(str(tmp_path), "corral-unit-test", runsc, 1 << 20)
    yield sub, runsc
    sub.close()


def test_a_wrapper_ending_during_the_destroy_leaves_no_file_and_sends_no_kill(substrate):
    sub, runsc = substrate
    exec_dir = os.path.join(sub.dirs, SID, "exec")
    os.makedirs(exec_dir)
    loop = asyncio.new_event_loop()
    seen: list[list[str]] = []

    def wrappers_end() -> None:
        sub._schedule_kill(loop, SID, 41)  # a wrapper's end, on the loop
        sub._kill_inner(loop, SID, 42)     # a kill already on a kill thread
        seen.append(sorted(os.listdir(exec_dir)))

    runsc.on_forget = wrappers_end
    try:
        sub._destroy_id(SID, 0)
        assert seen == [[]]
        assert not os.path.exists(os.path.join(sub.dirs, SID))
        sub._schedule_kill(loop, SID, 43)  # one that ends after: the sandbox is gone
        sub._kill_inner(loop, SID, 44)
        loop.run_until_complete(_drain(sub))
    finally:
        loop.close()
    assert runsc.runs == [], runsc.runs
    assert not os.path.exists(os.path.join(sub.dirs, SID))


def test_a_live_sandboxs_abandoned_command_is_killed_and_its_record_removed(substrate):
    """The same path for a sandbox that lives on: the kill is recorded on disk until sent
    (a daemon that dies first leaves it to the next), sent, then the record is gone."""
    sub, runsc = substrate
    exec_dir = os.path.join(sub.dirs, SID, "exec")
    os.makedirs(exec_dir)
    on_disk: list[list[str]] = []
    record = runsc.run

    def run(*args: str, **kw: Any) -> None:  # what is on disk as each runsc call is made
        on_disk.append(sorted(os.listdir(exec_dir)))
        record(*args, **kw)

    runsc.run = run  # type: ignore[method-assign]
    loop = asyncio.new_event_loop()
    try:
        sub._schedule_kill(loop, SID, 41)
        loop.run_until_complete(_drain(sub))
    finally:
        loop.close()
    assert [r[0] for r in runsc.runs] == ["kill", "exec"], runsc.runs
    assert all(any("41" in name for name in names) for names in on_disk), on_disk
    assert os.listdir(exec_dir) == []


class HeldRunsc(RecordingRunsc):
    """A sandbox whose processes stop each kill's process as it starts: its `runsc exec`
    runs until released (in life, to its timeout)."""

    def __init__(self, root: str, held: str) -> None:
        super().__init__(root)
        self.held = held
        self.release = threading.Event()
        self.others_sent = threading.Event()

    def run(self, *args: str, timeout: float = 0, log: str | None = None,
            flags: tuple[str, ...] = ()) -> None:
        super().run(*args, timeout=timeout, log=log, flags=flags)
        if args[0] == "exec" and args[-1] == self.held:
            self.release.wait(30)
        elif args[0] == "exec":
            self.others_sent.set()


def test_a_sandbox_whose_kills_hang_holds_one_kill_thread_and_others_go_between(tmp_path):
    """Kills of abandoned commands share KILL_THREADS threads. A sandbox that stops each
    kill's process as it starts held every thread with its kills, each to its timeout:
    another sandbox's command, answered as timed out, ran on meanwhile (90 s measured)."""
    runsc = HeldRunsc(str(tmp_path / "runsc"), "sb-hog")
    sub = GvisorSubstrate(str(tmp_path), "corral-unit-test", runsc, 1 << 20)
    for sid in ("sb-hog", "sb-victim"):
        os.makedirs(os.path.join(sub.dirs, sid, "exec"))
    loop = asyncio.new_event_loop()

    async def attack() -> bool:
        for pid in range(100, 110):  # ten timed-out commands of the hog first
            sub._schedule_kill(loop, "sb-hog", pid)
        sub._schedule_kill(loop, "sb-victim", 7)
        return await asyncio.to_thread(runsc.others_sent.wait, 10)

    try:
        sent = loop.run_until_complete(attack())
        hog = [r for r in runsc.runs if r[-1] == "sb-hog" or "sb-hog" in r]
        assert sent, runsc.runs
        assert len([r for r in hog if r[0] == "exec"]) == 1, hog  # one thread, the hog's
        runsc.release.set()
        loop.run_until_complete(_drain(sub))
    finally:
        runsc.release.set()
        loop.close()
        sub.close()
    kills = [r for r in runsc.runs if r[0] == "kill"]
    assert len(kills) == 11, kills  # every command was killed in the end
