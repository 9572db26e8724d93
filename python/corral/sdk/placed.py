"""A create through a cluster gateway: ask the gateway where, then make the sandbox there
(corral.placing has the protocol; docs/cluster.md, "Using it").

Sans-I/O, as the Call layer: ``create_steps`` yields the (endpoint, call) pairs to send and
is sent each call's result, or has its error thrown in; ``drive`` and ``drive_async`` are the
two facades' loops around it.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
import time
from collections.abc import Awaitable, Callable, Generator
from typing import Any, cast

from corral import nodeselector, placing
from corral.errors import CapacityExceeded, CorralError, SandboxLost
from corral.models import SandboxInfo
from corral.sdk.call import Call
from corral.sdk.endpoint import Endpoint

# Placed nodes that did not answer a create, or were full, before the SDK gives up (the
# gateway also drops a node from placement once its reports stop, within seconds).
MAX_UNANSWERED = 3
# Placements asked for ahead with each one (corral.placing): a process creating one sandbox
# after another asks the gateway for every third create only.
AHEAD = 2
# How long a placement made ahead stays usable: about one load report of the gateway's (it
# counts the placement on its node until a report asked for after it).
SPARE_TTL_S = 0.5

Steps = Generator[tuple[Endpoint, Call[Any]], Any, tuple[Endpoint, SandboxInfo]]
Kind = tuple[str, str | None, str | None, str | None]


@dataclasses.dataclass(frozen=True, slots=True)
class Placed:
    """A gateway's placement: the node to send the create to (and those it placed ahead)."""

    node: str
    endpoint: str
    ahead: tuple[Placed, ...] = ()


def _info_or_placed(body: bytes) -> SandboxInfo | Placed:
    got = json.loads(body)
    where = got.get("placed") if isinstance(got, dict) and "id" not in got else None
    if isinstance(where, dict):
        ahead = tuple(Placed(str(a["node"]), str(a["endpoint"]))
                      for a in got.get("ahead") or () if isinstance(a, dict))
        return Placed(str(where["node"]), str(where["endpoint"]), ahead)
    return SandboxInfo.model_validate(got)


class Spares:
    """Placements a gateway made ahead, for this process's next creates of the same kind
    (same gateway, token, node selector and image); each is used once, within
    ``SPARE_TTL_S``. Shared by every thread and event loop of the process."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._by_kind: dict[Kind, collections.deque[tuple[float, Placed]]] = {}

    def take(self, kind: Kind) -> Placed | None:
        now = self._clock()
        with self._lock:
            q = self._by_kind.get(kind)
            while q:
                made, p = q.popleft()
                if now - made <= SPARE_TTL_S:
                    return p
            self._by_kind.pop(kind, None)
        return None

    def keep(self, kind: Kind, ahead: tuple[Placed, ...]) -> None:
        if not ahead:
            return
        now = self._clock()
        with self._lock:
            q = self._by_kind.setdefault(kind, collections.deque())
            q.extend((now, p) for p in ahead)

    def drop_node(self, node: str) -> None:
        """Forget every spare on ``node`` (it did not answer)."""
        with self._lock:
            for kind, q in list(self._by_kind.items()):
                kept = [(t, p) for t, p in q if p.node != node]
                if kept:
                    self._by_kind[kind] = collections.deque(kept)
                else:
                    del self._by_kind[kind]


_spares = Spares()


def kind_of(ep: Endpoint, call: Call[Any]) -> Kind | None:
    """What makes ``call``'s create interchangeable with others for placement; None when
    the gateway must place it itself: a keyed create (the gateway keeps the node of each
    key, for the create's retries) or one from a snapshot (made where the snapshot is)."""
    if call.key is not None:
        return None
    try:
        spec = json.loads(call.body or b"{}")
    except ValueError:
        return None
    if not isinstance(spec, dict) or spec.get("snapshot"):
        return None
    image = spec.get("image")
    return (ep.url, ep.auth_header(), (call.headers or {}).get(nodeselector.HEADER),
            image if isinstance(image, str) else None)


def create_steps(ep: Endpoint, call: Call[SandboxInfo], spares: Spares | None = None) -> Steps:
    """The calls that make ``call``'s sandbox from ``ep``; returns (the endpoint the sandbox
    lives at, its info). To a unix socket or a cluster node: ``call`` itself. To a URL that
    may be a gateway: the create asks for a placement (and ``AHEAD`` more, kept in
    ``spares`` for the next creates of its kind, which then skip the gateway), and goes to
    the placed node (a daemon ignores the ask and makes the sandbox; a gateway making it
    itself, as for a create from a snapshot, answers with its node). A placed node that
    cannot be reached, or is full, made nothing: the gateway is asked again without it."""
    if ep.unix_path is not None or ep.node is not None:
        info = yield ep, call
        return ep.placed(info), info
    spares = spares if spares is not None else _spares
    kind = kind_of(ep, call)
    unanswered: list[str] = []
    while True:
        got = spares.take(kind) if kind is not None and not unanswered else None
        if got is None:
            ask = dataclasses.replace(
                cast(Call[Any], call), parse=_info_or_placed,
                headers={**(call.headers or {}), placing.HEADER: placing.format_request(
                    unanswered, AHEAD if kind is not None else 0)})
            answer = yield ep, ask
            if isinstance(answer, SandboxInfo):
                return ep.placed(answer), answer
            got = answer
            if kind is not None:
                spares.keep(kind, got.ahead)
        node = ep.on_node(got.endpoint, got.node)
        try:
            # Same body and key; the node needs no node selector.
            info = yield node, dataclasses.replace(call, headers=None)
        except (SandboxLost, CapacityExceeded) as e:
            # Made nothing there: not reached, or full (a placement made ahead can find its
            # node full once a report has let the gateway fill the slot again). The gateway
            # places it elsewhere, or refuses it itself: a refusal its autoscaler counts.
            if isinstance(e, SandboxLost) and (e.details or {}).get("connected") is not False \
                    or len(unanswered) >= MAX_UNANSWERED:
                raise
            unanswered.append(got.node)
            spares.drop_node(got.node)
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
