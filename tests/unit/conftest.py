"""Unit tests: the engine, the reaper and the trajectory log over a fake substrate and a
manual clock. They need no root and no daemon (tests/test_unit_unprivileged.py runs them as
an unprivileged user)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from corral.daemon.clock import ManualClock  # noqa: E402


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def state(tmp_path) -> str:  # type: ignore[no-untyped-def]
    return str(tmp_path)
