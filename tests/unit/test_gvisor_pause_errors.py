"""runsc's sentry stops and starts a gVisor sandbox's tasks itself: nothing in the sandbox can
hold off a pause or a resume, so a failure of runsc is the platform's. It was an OSError
(EIO) that the engine answered as ``unsupported`` and the request layer as
``invalid_request``: both the caller's (task), scored against an agent for a fault of the
platform."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from corral.daemon.substrates.gvisor.runsc import RunscError
from corral.daemon.substrates.gvisor.substrate import GvisorSubstrate
from corral.errors import CorralError


class _FailingRunsc:
    def __init__(self, status: str = "running") -> None:
        self.status = status

    def run(self, *args: Any, **kwargs: Any) -> None:
        raise RunscError(f"runsc {args[0]}: no answer within 30 s")

    def state(self, sid: str) -> dict[str, Any]:
        return {"status": self.status}


@pytest.mark.parametrize("step", ["freeze", "thaw"])
def test_a_runsc_that_fails_a_pause_or_resume_is_infra(step: str):
    substrate = object.__new__(GvisorSubstrate)  # only its runsc is used by these steps
    substrate.runsc = _FailingRunsc()  # type: ignore[assignment]
    substrate.is_alive = lambda runtime: True  # type: ignore[method-assign]
    runtime = SimpleNamespace(sandbox_id="sb-0123456789abcdef")
    with pytest.raises(CorralError) as got:
        getattr(substrate, step)(runtime)
    assert got.value.category == "infra" and got.value.details["cause"] == "runsc", got.value


def test_a_pause_of_a_sandbox_that_ended_is_not_running_not_infra():
    """A sandbox whose init ended on its own is its own end (the engine tells why), not the
    platform's."""
    substrate = object.__new__(GvisorSubstrate)
    substrate.runsc = _FailingRunsc("stopped")  # type: ignore[assignment]
    substrate.is_alive = lambda runtime: True  # type: ignore[method-assign]
    with pytest.raises(CorralError) as got:
        substrate.freeze(SimpleNamespace(sandbox_id="sb-0123456789abcdef"))  # type: ignore[arg-type]
    assert got.value.code == "sandbox_not_running" and not got.value.infra, got.value
