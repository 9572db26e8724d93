"""A create through a cluster gateway: ask the gateway where, then make the sandbox there
(corral.placing has the protocol; docs/cluster.md, "Creates").

Sans-I/O, as the Call layer: ``create_steps`` yields the (endpoint, call) pairs to send and
is sent each call's result, or has its error thrown in; ``drive`` and ``drive_async`` are the
two facades' loops around it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Awaitable, Callable, Generator
from typing import Any, cast

from corral import placing
from corral.errors import CorralError, SandboxLost
from corral.models import SandboxInfo
from corral.sdk.call import Call
from corral.sdk.endpoint import Endpoint

# Nodes that did not answer a placed create before the SDK gives up (the gateway also drops
# a node from placement once its reports stop, within seconds).
MAX_UNANSWERED = 3

Steps = Generator[tuple[Endpoint, Call[Any]], Any, tuple[Endpoint, SandboxInfo]]


@dataclasses.dataclass(frozen=True, slots=True)
class Placed:
    """A gateway's placement: the node to send the create to."""

    node: str
    endpoint: str


def _info_or_placed(body: bytes) -> SandboxInfo | Placed:
    got = json.loads(body)
    where = got.get("placed") if isinstance(got, dict) and "id" not in got else None
    if isinstance(where, dict):
        return Placed(str(where["node"]), str(where["endpoint"]))
    return SandboxInfo.model_validate(got)


def create_steps(ep: Endpoint, call: Call[SandboxInfo]) -> Steps:
    """The calls that make ``call``'s sandbox from ``ep``; returns (the endpoint the sandbox
    lives at, its info). To a unix socket or a cluster node: ``call`` itself. To a URL that
    may be a gateway: the create asks for a placement, and goes to the placed node (a daemon
    ignores the ask and makes the sandbox; a gateway making it itself, as for a create from a
    snapshot, answers with its node). A placed node that cannot be reached made nothing: the
    gateway is asked again without it."""
    if ep.unix_path is not None or ep.node is not None:
        info = yield ep, call
        return ep.placed(info), info
    unanswered: list[str] = []
    while True:
        ask = dataclasses.replace(
            cast(Call[Any], call), parse=_info_or_placed,
            headers={**(call.headers or {}),
                     placing.HEADER: placing.format_request(unanswered)})
        got = yield ep, ask
        if isinstance(got, SandboxInfo):
            return ep.placed(got), got
        node = ep.on_node(got.endpoint, got.node)
        try:
            # Same body and key; the node needs no node selector.
            info = yield node, dataclasses.replace(call, headers=None)
        except SandboxLost as e:
            if (e.details or {}).get("connected") is not False \
                    or len(unanswered) >= MAX_UNANSWERED:
                raise
            unanswered.append(got.node)
            continue
        return node, info.model_copy(update={"node": got.node, "endpoint": got.endpoint})


def drive(steps: Steps, send: Callable[[Endpoint, Call[Any]], Any]
          ) -> tuple[Endpoint, SandboxInfo]:
    """Run ``steps`` with a blocking ``send``."""
    to, call = next(steps)
    while True:
        try:
            try:
                got = send(to, call)
            except CorralError as e:
                to, call = steps.throw(e)
            else:
                to, call = steps.send(got)
        except StopIteration as done:
            return cast(tuple[Endpoint, SandboxInfo], done.value)


async def drive_async(steps: Steps, send: Callable[[Endpoint, Call[Any]], Awaitable[Any]]
                      ) -> tuple[Endpoint, SandboxInfo]:
    """Run ``steps`` with an async ``send``."""
    to, call = next(steps)
    while True:
        try:
            try:
                got = await send(to, call)
            except CorralError as e:
                to, call = steps.throw(e)
            else:
                to, call = steps.send(got)
        except StopIteration as done:
            return cast(tuple[Endpoint, SandboxInfo], done.value)
