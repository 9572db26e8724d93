"""A node selector: the labels a cluster node must have to take a create (docs/cluster.md,
"Placement"). Sent to a cluster gateway as one header, ``X-Corral-Node-Selector:
key=value,key2=value2``; written by the SDK (``node_selector=``), read by the gateway. A
single daemon has no labels and ignores it."""

from __future__ import annotations

from collections.abc import Mapping

from corral.errors import InvalidRequest

HEADER = "X-Corral-Node-Selector"


def _bad(value: object, why: str) -> InvalidRequest:
    return InvalidRequest(f"bad node selector {value!r}: {why}",
                          details={"field": "node_selector"})


def format_selector(selector: Mapping[str, str]) -> str:
    """The header value for ``selector``; raises InvalidRequest for what the header cannot
    carry unchanged (a key with ``=`` or ``,``, a value with ``,``, surrounding spaces,
    control characters, non-strings)."""
    if not isinstance(selector, Mapping):
        raise _bad(selector, "a mapping of label names to values")
    parts = []
    for k, v in selector.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise _bad(selector, "label names and values are strings")
        if not k or k != k.strip() or v != v.strip():
            raise _bad(selector, "a label name is not empty, and neither has surrounding "
                       "spaces")
        if "=" in k or "," in k or "," in v:
            raise _bad(selector, "a label name holds no '=' or ',', a value no ','")
        if not (k + v).isprintable():
            raise _bad(selector, "no control characters")
        parts.append(f"{k}={v}")
    return ",".join(parts)


def parse_selector(value: str) -> dict[str, str]:
    """The labels of a header value (empty: any node); raises InvalidRequest."""
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in value.split(","))):
        k, sep, v = part.partition("=")
        if not sep or not k.strip():
            raise _bad(value, "use key=value[,key=value]")
        out[k.strip()] = v.strip()
    return out
