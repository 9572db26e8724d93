"""``corral.run_code``: run a snippet in a fresh process of a pre-warmed, locked-down
interpreter (the ``process`` substrate's function-call tier: docs/substrates.md). No sandbox to
create or destroy: one call, one result.

    r = corral.run_code("print(1 + 1)")            # r.status == "ok", r.stdout == "2\\n"
    rs = corral.run_code_many(["print(1)", {"code": "echo hi", "language": "bash"}])
    r = await corral.run_code_async("import numpy; print(numpy.pi)")
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import ConfigDict

from corral import runcode_models as m
from corral.errors import CorralError, error_from_payload
from corral.sdk.api import validated
from corral.sdk.call import Call
from corral.sdk.endpoint import Endpoint


class RunCodeResult(m.RunCodeResult):
    """What a snippet did: ``status`` (``ok``, ``error``, ``timeout``, ``memory_exceeded``,
    ``output_truncated``), ``stdout``, ``stderr``, ``exit_code``, ``signal``, ``duration_s``,
    ``truncated``."""

    model_config = ConfigDict(extra="ignore")  # a newer daemon may add fields

    @property
    def ok(self) -> bool:
        return self.status == "ok"


Item = str | Mapping[str, Any] | m.RunCodeRequest


def _request(**fields: Any) -> m.RunCodeRequest:
    return validated(m.RunCodeRequest, **{k: v for k, v in fields.items() if v is not None})


def _item(x: Item, defaults: dict[str, Any]) -> m.RunCodeRequest:
    if isinstance(x, m.RunCodeRequest):
        return x
    if isinstance(x, str):
        return _request(**defaults, code=x)
    return _request(**{**defaults, **dict(x)})


def _parse_one(body: bytes) -> RunCodeResult:
    return RunCodeResult.model_validate_json(body)


def _parse_many(body: bytes) -> list[RunCodeResult | CorralError]:
    out: list[RunCodeResult | CorralError] = []
    for x in json.loads(body)["results"]:
        out.append(error_from_payload(x) if "error" in x else RunCodeResult.model_validate(x))
    return out


def call_one(req: m.RunCodeRequest) -> Call[RunCodeResult]:
    # No read timeout: a request may wait its turn in the pool's queue first (bounded in
    # length, not in time); its own timeout is enforced by the daemon.
    return Call("POST", "/v1/run_code", _parse_one,
                body=req.model_dump_json(exclude_unset=True).encode(), timeout=None)


def call_many(reqs: list[m.RunCodeRequest]) -> Call[list[RunCodeResult | CorralError]]:
    body = m.RunCodeManyRequest(requests=reqs)
    return Call("POST", "/v1/run_code/batch", _parse_many,
                body=body.model_dump_json(exclude_unset=True).encode(), timeout=None)


def call_pools() -> Call[m.RunCodeStatus]:
    return Call("GET", "/v1/run_code/pools", m.RunCodeStatus.model_validate_json,
                retry_safe=True)


def _sync(endpoint: str | Endpoint | None) -> Any:
    from corral.sdk.sync_transport import transport

    return transport(Endpoint.parse(endpoint))


def _async(endpoint: str | Endpoint | None) -> Any:
    from corral.sdk.async_sandbox import transport

    return transport(Endpoint.parse(endpoint))


def _raise_first(results: list[RunCodeResult | CorralError],
                 return_exceptions: bool) -> list[RunCodeResult | CorralError]:
    if not return_exceptions:
        for r in results:
            if isinstance(r, CorralError):
                raise r
    return results


def run_code(code: str, language: str = "python", stdin: str | None = None,
             files: Mapping[str, str] | None = None, timeout: float = m.DEFAULT_TIMEOUT_S,
             memory_mb: int = m.DEFAULT_MEMORY_MB,
             max_output_bytes: int = m.DEFAULT_OUTPUT_BYTES, *,
             endpoint: str | Endpoint | None = None) -> RunCodeResult:
    """Run ``code`` (``python`` or ``bash``) with ``stdin``, ``files`` (relative path -> text,
    written into its working directory) within ``timeout`` seconds and ``memory_mb``. The
    program's own failure is a result (``status``), never an exception; a full pool raises
    corral.CapacityExceeded."""
    req = _request(code=code, language=language, stdin=stdin,
                   files=dict(files) if files is not None else None, timeout=timeout,
                   memory_mb=memory_mb, max_output_bytes=max_output_bytes)
    return _sync(endpoint).call(call_one(req))


def run_code_many(items: Iterable[Item], *, return_exceptions: bool = False,
                  endpoint: str | Endpoint | None = None,
                  **defaults: Any) -> list[RunCodeResult | CorralError]:
    """Run many snippets at once, results in order. An item is the code (a str), a dict of
    run_code's arguments, or a RunCodeRequest; ``defaults`` apply to every item
    (``language="bash"``, ``timeout=5``...). An item that could not run (not its program
    failing: a pool full, a zygote lost) raises, or with ``return_exceptions`` stands in the
    list as its exception."""
    reqs = [_item(x, defaults) for x in items]
    if not reqs:
        return []
    return _raise_first(_sync(endpoint).call(call_many(reqs)), return_exceptions)


async def run_code_async(code: str, language: str = "python", stdin: str | None = None,
                         files: Mapping[str, str] | None = None,
                         timeout: float = m.DEFAULT_TIMEOUT_S,
                         memory_mb: int = m.DEFAULT_MEMORY_MB,
                         max_output_bytes: int = m.DEFAULT_OUTPUT_BYTES, *,
                         endpoint: str | Endpoint | None = None) -> RunCodeResult:
    """run_code for asyncio."""
    req = _request(code=code, language=language, stdin=stdin,
                   files=dict(files) if files is not None else None, timeout=timeout,
                   memory_mb=memory_mb, max_output_bytes=max_output_bytes)
    return await _async(endpoint).call(call_one(req))


async def run_code_many_async(items: Iterable[Item], *, return_exceptions: bool = False,
                              endpoint: str | Endpoint | None = None,
                              **defaults: Any) -> list[RunCodeResult | CorralError]:
    """run_code_many for asyncio."""
    reqs = [_item(x, defaults) for x in items]
    if not reqs:
        return []
    return _raise_first(await _async(endpoint).call(call_many(reqs)), return_exceptions)


def run_code_pools(endpoint: str | Endpoint | None = None) -> m.RunCodeStatus:
    """The daemon's run_code pools (zygotes, slots, busy, queued)."""
    return _sync(endpoint).call(call_pools())
