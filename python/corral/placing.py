"""A create that asks a cluster gateway where to go, then goes there itself (docs/cluster.md,
"Using it").

The SDK sends ``POST /v1/sandboxes`` to a remote endpoint with ``X-Corral-Placement: node``.
A gateway then places the sandbox and answers ``307`` with the chosen node, ``{"placed":
{"node": ..., "endpoint": ...}}`` (and ``Location``), instead of making the sandbox there
itself; the SDK sends the same create, same body and idempotency key, to that node. The gateway
so carries no create's body or answer, only its placement. A single daemon ignores the header
and makes the sandbox.

Parameters, ``;``-separated after ``node``:

* ``exclude=<node>,<node>``: nodes that did not answer the client (never placed on);
* ``ahead=<n>``: place up to ``n`` more creates like this one now, listed in ``"ahead"``: the
  client sends its next creates of the same kind straight to those nodes while they are
  fresh. Each counts as placed on its node until that node's next report, as any create
  does, so placement stays even and a spare left unused costs a slot for a report's time.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from corral.errors import InvalidRequest

HEADER = "X-Corral-Placement"
ASK = "node"
STATUS = 307  # "send this request again, there"
MAX_EXCLUDED = 64  # a header longer than this is not a client of ours
MAX_AHEAD = 8


@dataclass(frozen=True)
class Ask:
    """What a create's placement header asks for."""

    node_only: bool = False  # answer with the node instead of making the sandbox
    exclude: frozenset[str] = frozenset()
    ahead: int = 0


def format_request(exclude: Collection[str] = (), ahead: int = 0) -> str:
    """The header value: answer with the node, never one of ``exclude`` (node ids), and with
    ``ahead`` more placements."""
    out = ASK
    if exclude:
        out += f"; exclude={','.join(exclude)}"
    if ahead:
        out += f"; ahead={ahead}"
    return out


def _bad(value: str) -> InvalidRequest:
    return InvalidRequest(
        f"bad {HEADER} header {value!r}: use '{ASK}', optionally followed by "
        f"'; exclude=<node>,<node>' (at most {MAX_EXCLUDED}) and '; ahead=<0..{MAX_AHEAD}>'",
        details={"header": HEADER})


def parse_request(value: str) -> Ask:
    """The ask of a header value; an absent header (``""``) asks for the sandbox."""
    value = value.strip()
    if not value:
        return Ask()
    first, *params = value.split(";")
    if first.strip() != ASK:
        raise _bad(value)
    exclude: frozenset[str] = frozenset()
    ahead = 0
    seen: set[str] = set()
    for param in params:
        name, eq, arg = (p.strip() for p in param.partition("="))
        if not eq or name in seen:
            raise _bad(value)
        seen.add(name)
        if name == "exclude":
            exclude = frozenset(n.strip() for n in arg.split(",") if n.strip())
            if len(exclude) > MAX_EXCLUDED:
                raise _bad(value)
        elif name == "ahead":
            if not arg.isdigit() or int(arg) > MAX_AHEAD:
                raise _bad(value)
            ahead = int(arg)
        else:
            raise _bad(value)
    return Ask(True, exclude, ahead)


def where(node: str, endpoint: str) -> dict[str, str]:
    return {"node": node, "endpoint": endpoint}


def answer(node: str, endpoint: str, ahead: list[dict[str, str]] | None = None
           ) -> dict[str, object]:
    """The body of a gateway's placement answer (``ahead``: more placements, ``where``)."""
    out: dict[str, object] = {"placed": where(node, endpoint)}
    if ahead:
        out["ahead"] = ahead
    return out
