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
    def run(self, *args: Any, **kwargs: Any) -> None:
        raise RunscError(f"runsc {args[0]}: no answer within 30 s")


@pytest.mark.parametrize("step", ["freeze", "thaw"])
def test_a_runsc_that_fails_a_pause_or_resume_is_infra(step: str):
    substrate = object.__new__(GvisorSubstrate)  # only its runsc is used by these steps
    substrate.runsc = _FailingRunsc()  # type: ignore[assignment]
    runtime = SimpleNamespace(sandbox_id="sb-0123456789abcdef")
    with pytest.raises(CorralError) as got:
        getattr(substrate, step)(runtime)
    assert got.value.category == "infra" and got.value.details["cause"] == "runsc", got.value
