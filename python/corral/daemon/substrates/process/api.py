"""The run_code routes: their handlers and their entries in the route table (``app.ROUTES``
includes ``ROUTES``; ``install`` gives the app its service)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from corral.daemon import jsonbody
from corral.daemon.bodies import parse
from corral.daemon.clientgone import unless_gone
from corral.daemon.routes import Route
from corral.daemon.substrates.process.pool import RunCodeService
from corral.daemon.tenancy import tenant_of
from corral.errors import InfraError
from corral.runcode_models import (
    RunCodeManyRequest,
    RunCodeManyResponse,
    RunCodeRequest,
    RunCodeResult,
    RunCodeStatus,
)

SERVICE: web.AppKey[RunCodeService] = web.AppKey("runcode", RunCodeService)


def _json(obj: Any) -> web.Response:
    return jsonbody.response(obj)


def _service(request: web.Request) -> RunCodeService:
    svc = request.app.get(SERVICE)
    if svc is None:
        raise InfraError("run_code is not available on this daemon")
    return svc


async def run_code(request: web.Request) -> web.Response:
    req = parse(await request.read(), RunCodeRequest)
    return _json(await unless_gone(request, _service(request).run(req, tenant_of(request))))


async def run_code_batch(request: web.Request) -> web.Response:
    req = parse(await request.read(), RunCodeManyRequest)
    results = await unless_gone(request, _service(request).run_many(req.requests,
                                                                    tenant_of(request)))
    return _json({"results": results})


async def run_code_pools(request: web.Request) -> web.Response:
    return _json(_service(request).status())


ROUTES: tuple[Route, ...] = (
    Route("POST", "/v1/run_code", run_code, "Run a snippet in a fresh locked-down process of a "
          "pre-warmed interpreter (the process substrate's function-call tier)",
          body=RunCodeRequest, response=RunCodeResult, errors=(429, 503)),
    Route("POST", "/v1/run_code/batch", run_code_batch, "Run many snippets (one result or "
          "error per request, in order; all admitted or none)", body=RunCodeManyRequest,
          response=RunCodeManyResponse, errors=(429, 503)),
    Route("GET", "/v1/run_code/pools", run_code_pools, "The run_code pools: zygotes, slots, "
          "busy and queued requests", response=RunCodeStatus),
)


def install(app: web.Application, state_dir: str, cgroup_name: str) -> None:
    """Give ``app`` a run_code service, closed with the app."""
    svc = RunCodeService(state_dir, cgroup_name)
    app[SERVICE] = svc

    async def _close(_: web.Application) -> None:
        await svc.close()

    app.on_shutdown.append(_close)
