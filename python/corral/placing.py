"""A create that asks a cluster gateway where to go, then goes there itself (docs/cluster.md,
"Creates").

The SDK sends ``POST /v1/sandboxes`` to a remote endpoint with ``X-Corral-Placement: node``
(after a placed node did not answer: ``node; exclude=<node>,<node>``). A gateway then places
the sandbox and answers ``307`` with the chosen node, ``{"placed": {"node": ..., "endpoint":
...}}`` (and ``Location``), instead of making the sandbox there itself; the SDK sends the same
create, same body and idempotency key, to that node. The gateway so carries no create's body or
answer, only its placement: one short round trip instead of a second HTTP hop on the create's
path. A single daemon ignores the header and makes the sandbox.
"""

from __future__ import annotations

from collections.abc import Collection

from corral.errors import InvalidRequest

HEADER = "X-Corral-Placement"
ASK = "node"
STATUS = 307  # "send this request again, there"
MAX_EXCLUDED = 64  # a header longer than this is not a client of ours


def format_request(exclude: Collection[str] = ()) -> str:
    """The header value: answer with the node, never one of ``exclude`` (node ids)."""
    return f"{ASK}; exclude={','.join(exclude)}" if exclude else ASK


def parse_request(value: str) -> tuple[bool, frozenset[str]]:
    """(whether the client asks for the node instead of the sandbox, the nodes to leave
    out); an absent header (``""``) asks for the sandbox."""
    value = value.strip()
    if not value:
        return False, frozenset()
    ask, _, rest = value.partition(";")
    if ask.strip() != ASK:
        raise InvalidRequest(f"bad {HEADER} header {value!r}: use {ASK!r} or "
                             f"'{ASK}; exclude=<node>,<node>'", details={"header": HEADER})
    rest = rest.strip()
    if not rest:
        return True, frozenset()
    name, eq, nodes = rest.partition("=")
    excluded = frozenset(n.strip() for n in nodes.split(",") if n.strip())
    if name.strip() != "exclude" or not eq or len(excluded) > MAX_EXCLUDED:
        raise InvalidRequest(f"bad {HEADER} header {value!r}: use {ASK!r} or "
                             f"'{ASK}; exclude=<node>,<node>' (at most {MAX_EXCLUDED})",
                             details={"header": HEADER})
    return True, excluded


def answer(node: str, endpoint: str) -> dict[str, dict[str, str]]:
    """The body of a gateway's placement answer."""
    return {"placed": {"node": node, "endpoint": endpoint}}
