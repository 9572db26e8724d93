"""docs/sdk.md's error table and corral/errors.py say the same: every error code has its row,
with the class's HTTP status and parent."""

from __future__ import annotations

import re
from pathlib import Path

import corral  # noqa: F401 - the SDK's own errors (CommandFailed) join the hierarchy
import corral.errors as errors

SDK_DOC = Path(__file__).resolve().parents[2] / "docs" / "sdk.md"
# code | class | parent | HTTP status ("-": raised by the SDK, never sent) | ...
ROW = re.compile(r"^\| `([a-z_0-9]+)` \| `[\w.]+` \| (\w+|-) \| (\d+|-) \|", re.M)


def _coded() -> dict[str, type[errors.CorralError]]:
    out: dict[str, type[errors.CorralError]] = {}
    todo = [errors.CorralError]
    while todo:
        cls = todo.pop()
        out.setdefault(cls.code, cls)
        todo += cls.__subclasses__()
    return out


def test_every_error_code_has_its_row_with_its_status_and_parent():
    rows = {code: (parent, status) for code, parent, status in ROW.findall(SDK_DOC.read_text())}
    coded = _coded()
    assert len(coded) > 30, sorted(coded)  # the walk found the hierarchy
    missing = sorted(set(coded) - set(rows))
    assert not missing, f"docs/sdk.md's error table lacks {missing}"
    for code, cls in coded.items():
        parent, status = rows[code]
        if status == "-":
            assert cls.__module__ != "corral.errors", f"{code} is sent by the daemon"
        else:
            assert int(status) == cls.status, (code, status, cls.status)
        if cls is not errors.CorralError:
            assert parent == cls.__mro__[1].__name__, (code, parent, cls.__mro__[1].__name__)
    stale = sorted(set(rows) - set(coded))
    assert not stale, f"docs/sdk.md's error table names codes errors.py does not have: {stale}"
