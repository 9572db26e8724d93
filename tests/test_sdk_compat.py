"""An older SDK keeps working against a newer daemon: responses may carry fields the SDK does
not know (ignored), while request bodies stay strict (an unknown field is refused)."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel, ValidationError

from corral import Sandbox, models
from corral.sdk import api
from corral.sdk.results import ExecResult

RESPONSE_MODELS = [m for m in vars(models).values()
                   if isinstance(m, type) and issubclass(m, models._Response)
                   and m is not models._Response]
REQUEST_MODELS = [m for m in vars(models).values()
                  if isinstance(m, type) and issubclass(m, models._Model)
                  and m is not models._Model]


def test_every_model_is_a_request_or_a_response():
    every = [m for m in vars(models).values() if isinstance(m, type)
             and issubclass(m, BaseModel)
             and m not in (BaseModel, models._Model, models._Response)]
    assert set(every) == set(RESPONSE_MODELS) | set(REQUEST_MODELS)
    assert not set(RESPONSE_MODELS) & set(REQUEST_MODELS)
    assert {models.SandboxInfo, models.ExecResult, models.LogEntry} <= set(RESPONSE_MODELS)


@pytest.mark.parametrize("model", REQUEST_MODELS, ids=lambda m: m.__name__)
def test_requests_refuse_unknown_fields(model: type[BaseModel]):
    with pytest.raises(ValidationError, match="extra"):
        model.model_validate({"surely_not_a_field": 1})


@pytest.fixture(scope="module")
def sandbox(daemon):
    with Sandbox(timeout=120, labels={"test": "sdk-compat"}) as box:
        yield box


def test_sandbox_info_from_a_newer_daemon(sandbox):
    got = json.loads(sandbox.info().model_dump_json())
    got["placement"] = {"node": "n1"}          # fields a newer daemon might add
    got["gpu"] = None
    info = api._info(json.dumps(got).encode())
    assert info.id == sandbox.id and not hasattr(info, "placement")
    listed = api._infos_or_errors(json.dumps({"sandboxes": [got]}).encode())
    assert listed[0].id == sandbox.id


def test_exec_result_from_a_newer_daemon(sandbox):
    got = json.loads(sandbox.exec("echo hi").model_dump_json())
    got["cpu_time_s"] = 0.01
    res = ExecResult.model_validate_json(json.dumps(got))
    assert res.stdout == "hi\n" and res.ok


def test_a_streams_last_line_from_an_older_or_newer_daemon():
    """The status a stream ends with: all of it from this daemon; an older one's (exit code
    and timed_out only) reads as no signal and no OOM kill; a newer one's extra fields are
    ignored."""
    full = api.stream_event(b'{"pid": 3, "running": false, "exit_code": 137, '
                            b'"timed_out": false, "signal": 9, "oom_killed": true}')
    assert (full.pid, full.exit_code, full.signal, full.oom_killed) == (3, 137, 9, True)
    old = api.stream_event(b'{"exit_code": 143, "timed_out": false}')
    assert (old.exit_code, old.signal, old.oom_killed, old.running) == (143, None, False, False)
    newer = api.stream_event(b'{"exit_code": 0, "timed_out": false, "signal": null, '
                             b'"cpu_time_s": 0.5}')
    assert newer.exit_code == 0 and newer.signal is None
