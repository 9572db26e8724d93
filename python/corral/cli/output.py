"""How the CLI talks: rich tables on stdout, messages and errors on stderr, plain JSON for
scripts, and one error format (``error [code]: message``) with a non-zero exit code."""

from __future__ import annotations

import functools
import json
import re
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

import typer
from pydantic import BaseModel
from rich.console import Console
from rich.table import Table
from rich.text import Text

from corral.errors import CorralError

# C0 and C1 control characters but tab and newline, DEL, and the bidirectional overrides: what
# would let text a sandbox, a tenant or an image author wrote (labels, metadata, command
# output, names, image configs, error messages) move the cursor, erase or restyle lines, write
# the clipboard, hide a link or reorder what the operator's terminal shows.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029"
                      "\u202a-\u202e\u2066-\u2069]")


def inert(text: str) -> str:
    """``text`` with every control character shown as its escape (``\x1b``), never sent."""
    return _CONTROL.sub(lambda m: (f"\\x{ord(m[0]):02x}" if ord(m[0]) < 0x100
                                   else f"\\u{ord(m[0]):04x}"), text)


class InertConsole(Console):
    """A console that shows every string as the text it is: no markup (labels, outputs and
    names hold brackets: "[/x]" made a listing fail, "[timeout]" vanished) and no control
    sequence. Strings reach the terminal through ``render_str`` (tables' cells too); a
    ``Text`` made by hand must be made of ``inert`` text."""

    def render_str(self, text: str, **kwargs: Any) -> Text:
        return super().render_str(inert(text), **kwargs)


out = InertConsole(highlight=False, markup=False, emoji=False)
err = InertConsole(stderr=True, highlight=False, markup=False, emoji=False)

F = TypeVar("F", bound=Callable[..., Any])

EXIT_ERROR = 1          # a corral error in most commands
EXIT_EXEC_ERROR = 125   # exec/run: a corral error, not the command's own code (docker's)
EXIT_TIMED_OUT = 124    # exec/run: the command hit its timeout (coreutils timeout's code)


def fail(e: CorralError, code: int = EXIT_ERROR) -> typer.Exit:
    # Text, not markup: messages may contain brackets.
    err.print(Text.assemble(("error", "bold red"), inert(f" [{e.code}]: {e.message}")),
              soft_wrap=True)
    return typer.Exit(code)


def handled(exit_code: int = EXIT_ERROR) -> Callable[[F], F]:
    """Turn a CorralError escaping the command into ``error [code]: message`` + exit code."""

    def deco(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except CorralError as e:
                raise fail(e, exit_code) from None
            except KeyboardInterrupt:
                err.print("interrupted")
                raise typer.Exit(130) from None

        return wrapper  # type: ignore[return-value]

    return deco


def to_jsonable(obj: Any) -> Any:
    if isinstance(obj, BaseModel):
        return obj.model_dump(mode="json")
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_jsonable(v) for k, v in obj.items()}
    return obj


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(to_jsonable(obj), indent=2) + "\n")
    sys.stdout.flush()


def duration(seconds: float) -> str:
    """12s, 4m03s, 2h05m, 3d04h."""
    s = int(max(0, seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def since(ts: float) -> str:
    return duration(time.time() - ts)


def until(ts: float) -> str:
    return duration(ts - time.time())


def kv_table(rows: list[tuple[str, Any]]) -> Table:
    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column()
    for k, v in rows:
        t.add_row(k, "" if v is None else str(v))
    return t


def labels_text(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def parse_pairs(items: list[str] | None, what: str) -> dict[str, str]:
    """``["k=v", ...]`` -> dict; a bad item is a usage error."""
    out_: dict[str, str] = {}
    for item in items or []:
        key, eq, value = item.partition("=")
        if not key or not eq:
            raise typer.BadParameter(f"{what} must look like KEY=VALUE, got {item!r}")
        out_[key] = value
    return out_
