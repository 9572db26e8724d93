"""Unit tests: the engine, the reaper and the trajectory log over a fake substrate and a
manual clock. They need no root and no daemon (tests/test_unit_unprivileged.py runs them as
an unprivileged user)."""

from __future__ import annotations

import pytest

from corral.daemon.clock import ManualClock


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def state(tmp_path) -> str:  # type: ignore[no-untyped-def]
    return str(tmp_path)
