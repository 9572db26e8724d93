"""Holds for a daemon under test: Python's site module imports this file at start when a
test puts its directory on the daemon's PYTHONPATH (conftest.with_holds). Each hold named
in the environment makes the daemon wait at one point while its file exists, so that a test
can act there (kill -9 it, make another call). The daemon's own code has no test hooks;
these wrap its functions from outside.

- CORRAL_TEST_HOLD_ENTRY_FILE: a finished call's entry waits before it is journaled (the
  call does not answer; the daemon's loop waits with it).
- CORRAL_TEST_HOLD_INGEST_FILE: the log's ingester holds each batch before its
  transaction (calls are journaled, not in the database).
- CORRAL_TEST_HOLD_SNAPSHOT_FILE: a snapshot's capture holds the sandbox frozen before it
  copies.
- CORRAL_TEST_HOLD_SPAWN_ERROR_FILE: a container command refused a process (EAGAIN) waits
  before the daemon judges whose refusal it was (it makes ``<file>.held`` first; the
  daemon's loop waits with it).
- CORRAL_TEST_HOLD_GVISOR_KILL_FILE: the kill of a gvisor command that was abandoned (its
  timeout) waits before it is sent (in its thread).
"""

from __future__ import annotations

import os
import time
from typing import Any

POLL_S = 0.01


def _wait(path: str) -> None:
    while os.path.exists(path):
        time.sleep(POLL_S)


def _install() -> None:
    entry = os.environ.get("CORRAL_TEST_HOLD_ENTRY_FILE")
    ingest = os.environ.get("CORRAL_TEST_HOLD_INGEST_FILE")
    snapshot = os.environ.get("CORRAL_TEST_HOLD_SNAPSHOT_FILE")
    spawn_error = os.environ.get("CORRAL_TEST_HOLD_SPAWN_ERROR_FILE")
    gvisor_kill = os.environ.get("CORRAL_TEST_HOLD_GVISOR_KILL_FILE")
    if entry or ingest:
        from corral.daemon.trajlog.ingest import Ingester
        from corral.daemon.trajlog.writer import Writer

        if entry:
            write_entry = Writer._write_entry

            def held_write_entry(self: Any, *a: Any, **kw: Any) -> int:
                _wait(entry)
                return write_entry(self, *a, **kw)

            Writer._write_entry = held_write_entry
        if ingest:
            ingest_batch = Ingester._ingest

            def held_ingest(self: Any, conn: Any, batch: list[Any], size: int = 0) -> bool:
                if not os.path.exists(ingest):
                    return ingest_batch(self, conn, batch, size)
                while os.path.exists(ingest) and not self._closing:
                    time.sleep(POLL_S)
                with self._mu:  # what came meanwhile joins the batch taken before the hold
                    batch, self._pending = batch + self._pending, []
                    size, self._pending_bytes = size + self._pending_bytes, 0
                return ingest_batch(self, conn, batch, size)

            Ingester._ingest = held_ingest
    if snapshot:
        from corral.daemon.snapshots import SnapshotStore

        capture = SnapshotStore.capture

        def held_capture(self: Any, uppers: Any, freeze: Any, thaw: Any,
                         *a: Any, **kw: Any) -> Any:
            def freeze_and_hold() -> Any:
                out = freeze()
                _wait(snapshot)
                return out

            return capture(self, uppers, freeze_and_hold, thaw, *a, **kw)

        SnapshotStore.capture = held_capture
    if spawn_error:
        import errno

        from corral.daemon.substrates.container.substrate import ContainerSubstrate

        judge = ContainerSubstrate._spawn_error

        def held_spawn_error(self: Any, runtime: Any, e: BaseException,
                             *a: Any, **kw: Any) -> Any:
            if getattr(e, "errno", None) == errno.EAGAIN and os.path.exists(spawn_error):
                with open(spawn_error + ".held", "w"):
                    pass
                _wait(spawn_error)
            return judge(self, runtime, e, *a, **kw)

        ContainerSubstrate._spawn_error = held_spawn_error
    if gvisor_kill:
        from corral.daemon.substrates.gvisor.substrate import GvisorSubstrate

        kill_inner = GvisorSubstrate._kill_inner

        def held_kill_inner(self: Any, *a: Any, **kw: Any) -> None:
            _wait(gvisor_kill)
            kill_inner(self, *a, **kw)

        GvisorSubstrate._kill_inner = held_kill_inner


_install()
