"""The trajectory log writes into the daemon's reserve: when that is gone too, its write
error says the daemon's disk is full (``internal``, infra: an error class every caller of the
log catches; a CapacityExceeded slipped past them and left a created sandbox unwatched)."""

from __future__ import annotations

import errno
import sqlite3

from corral.daemon.trajlog.base import write_error
from corral.errors import InternalError


def test_a_full_disk_under_the_log_is_the_daemons_capacity_not_internal():
    for e in (OSError(errno.ENOSPC, "No space left on device"),
              sqlite3.OperationalError("database or disk is full")):
        got = write_error(e)
        assert isinstance(got, InternalError) and got.details["disk"] == "state_dir", got
    assert write_error(ValueError("mmap closed")).code == "internal"
