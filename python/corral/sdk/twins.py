"""The async facade mirrors the sync one: one docstring per operation, written once on the sync
class and carried over to its async twin with the class names swapped, so the two cannot drift
(tests/test_sdk.py holds names, kinds, defaults, annotations and docstrings together)."""

from __future__ import annotations

import inspect
import re
from typing import Any

# Sync name -> async name, in docstrings and annotations.
_TWINS = re.compile(r"\b(Sandbox|Files|Process|Snapshot|Iterator)\b")


def to_async(text: str) -> str:
    """``text`` (a docstring or an annotation) as the async twin would say it."""
    return _TWINS.sub(lambda m: "Async" + m.group(1), text)


def public_methods(cls: type) -> dict[str, Any]:
    """Public callables defined on ``cls`` or its bases, by name."""
    return {n: getattr(cls, n) for n in dir(cls)
            if not n.startswith("_") and callable(getattr(cls, n))}


def mirror_docs(async_cls: type, sync_cls: type) -> None:
    """Give each of ``async_cls``'s own public methods the sync twin's docstring (the classes
    keep their own: their examples differ by ``async with`` and ``await``)."""
    for name, attr in vars(async_cls).items():
        if name.startswith("_"):
            continue
        fn = attr.__func__ if isinstance(attr, (classmethod, staticmethod)) else attr
        doc = inspect.getdoc(getattr(sync_cls, name, None))
        if callable(fn) and doc:
            fn.__doc__ = to_async(doc)
