"""What the RL adapters, the gym env, the tools and the task runner mask (corral.rl.episode.
is_infra): the platform's failures and a sandbox ended from outside the episode, never how the
sandbox ended of its own. Every masking error the daemon can send, as the SDK rebuilds it from
the wire, against the rule."""

from __future__ import annotations

from typing import Any

import pytest

from corral import errors as ce
from corral.rl.episode import is_infra


def _wire(code: str, **details: Any) -> ce.CorralError:
    """As the SDK rebuilds it from a daemon's answer (the class's own category)."""
    return ce.error_from_payload({"error": {"code": code, "message": code, "details": details}})


@pytest.mark.parametrize("err, masked", [
    # The sandbox's own ending: scored, never masked.
    (_wire("sandbox_crashed", cause="init_exited", status=9), False),
    (_wire("sandbox_crashed", cause="oom"), False),
    (_wire("sandbox_crashed", cause="pids"), False),
    (_wire("sandbox_expired", reason="expired"), False),
    (_wire("sandbox_expired", reason="idle_timeout"), False),
    (_wire("sandbox_at_limit"), False),
    (_wire("exec_stalled"), False),
    (_wire("file_not_found"), False),
    # Ended from outside the episode, or the platform's.
    (_wire("sandbox_not_running", reason="killed"), True),
    (_wire("sandbox_killed", reason="operator_killed"), True),
    (_wire("sandbox_lost"), True),
    (_wire("daemon_restarted"), True),
    (_wire("step_interrupted"), True),
    (_wire("timeout"), True),
    (_wire("internal"), True),
], ids=lambda v: "-".join([v.code, *map(str, v.details.values())])
   if isinstance(v, ce.CorralError) else str(v))
def test_what_is_masked(err: ce.CorralError, masked: bool) -> None:
    assert is_infra(err) is masked, (err.code, err.category, err.details)
