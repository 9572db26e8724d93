"""JSON request bodies, parsed strictly into the shared pydantic models.

JSON numbers are read as JSON Schema reads them: ``12`` and ``12.0`` are the integer 12, and a
string is never a number (``"12"``, ``"0x1ff"`` and ``"4_2_0"`` are refused where an integer
is expected). ``NaN`` and ``Infinity`` are not JSON and are refused.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ValidationError

from corral.daemon.trajlog.keys import is_text
from corral.errors import InvalidNetwork, InvalidPath, InvalidRequest
from corral.models import NETWORK_MODES

# Requests naming paths inside the sandbox: a malformed one is invalid_path (a missing one,
# or a SandboxSpec's cwd, stays invalid_request).
PATH_MODELS = frozenset({"MkdirRequest", "RemoveRequest", "RenameRequest", "ExecRequest"})
PATH_FIELDS = frozenset({"path", "src", "dst", "cwd"})
PATH_ERRORS = frozenset({"string_pattern_mismatch", "value_error", "string_too_short"})
# Fields that may carry a name that is not UTF-8, as surrogate escapes (models.AbsPath): JSON
# writes them as lone surrogates (\udcff). Anywhere else a lone surrogate is refused: the
# daemon could not encode it (a command, its environment, stdin, a label).
SURROGATE_FIELDS: dict[str, frozenset[str]] = {
    "MkdirRequest": frozenset({"path"}), "RemoveRequest": frozenset({"path"}),
    "RenameRequest": frozenset({"src", "dst"})}


def _number(text: str) -> float | int:
    value = float(text)
    return int(value) if value.is_integer() and abs(value) < 2**63 else value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _lone_surrogate(data: Any, allowed: frozenset[str]) -> str | None:
    """Where in ``data`` (a dotted path) a string holds a lone surrogate; None if nowhere.
    ``allowed``: top-level fields that may (file names)."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        where, x = stack.pop()
        if isinstance(x, str):
            if not is_text(x):
                return where
        elif isinstance(x, dict):
            for k, v in x.items():
                at = f"{where}.{k}" if where else str(k)
                if not is_text(k):
                    return at
                if not (where == "" and k in allowed):
                    stack.append((at, v))
        elif isinstance(x, list):
            stack.extend((f"{where}.{i}", v) for i, v in enumerate(x))
    return None


def validation_message(e: ValidationError) -> tuple[str, list[dict[str, Any]]]:
    errs = [{"loc": [str(x) for x in d["loc"]], "msg": d["msg"], "type": d["type"]}
            for d in e.errors(include_url=False, include_input=False, include_context=False)]
    text = "; ".join(f"{'.'.join(d['loc']) or 'body'}: {d['msg']}" for d in errs[:5])
    return text, errs


def parse(raw: bytes, model: type[BaseModel]) -> Any:
    """The request body (empty: ``{}``) as ``model``, or invalid_request (invalid_network for
    a bad network mode: clients branch on it, and the message lists the modes)."""
    try:  # the common case, at pydantic's speed: every integer spelled as one
        return model.model_validate_json(raw or b"{}", strict=True)
    except ValidationError:
        pass
    try:
        data = json.loads(raw or b"{}", parse_float=_number, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise InvalidRequest(f"invalid {model.__name__}: the body is not JSON: "
                             f"{str(e)[:200]}") from None
    where = _lone_surrogate(data, SURROGATE_FIELDS.get(model.__name__, frozenset()))
    if where is not None:
        loc = where.encode("utf-8", "backslashreplace").decode() or "body"
        raise InvalidRequest(f"invalid {model.__name__}: {loc}: a string holds a lone "
                             "surrogate (\\ud800-\\udfff), which is not Unicode text",
                             details={"loc": loc}) from None
    try:
        return model.model_validate(data, strict=True)
    except ValidationError as e:
        text, errs = validation_message(e)
        if model.__name__ in PATH_MODELS and all(
                d["loc"] and d["loc"][-1] in PATH_FIELDS and d["type"] in PATH_ERRORS
                for d in errs):
            raise InvalidPath(f"invalid {model.__name__}: {text}",
                              details={"errors": errs}) from None
        if any("network" in d["loc"] for d in errs):
            raise InvalidNetwork(f"invalid {model.__name__}: {text} (network: a mode, "
                                 f"{', '.join(NETWORK_MODES)}, a named allowlist, or a "
                                 "policy {allow, deny})",
                                 details={"errors": errs, "modes": list(NETWORK_MODES)}) from None
        raise InvalidRequest(f"invalid {model.__name__}: {text}",
                             details={"errors": errs}) from None
