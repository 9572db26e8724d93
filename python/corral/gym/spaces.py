"""Observation and action text spaces.

gymnasium's ``Text`` space holds strings over a character set; shell output can hold any
character, so the set is every character of the Basic Multilingual Plane but control
characters and surrogates (plus tab, newline, carriage return), and output is fitted into it:
other characters become U+FFFD and only the last ``max_length`` characters are kept (the end
of a long output is what an agent needs most).
"""

from __future__ import annotations

import copy
import functools
import re
from typing import Any

from gymnasium import spaces

CHARSET = "\t\n\r" + "".join(chr(c) for c in range(0x20, 0x7F)) + \
    "".join(chr(c) for c in range(0xA0, 0xD800)) + "".join(chr(c) for c in range(0xE000, 0xFFFE))
_OUTSIDE = re.compile("[^\t\n\r\x20-\x7e\xa0-\ud7ff\ue000-\ufffd]")
REPLACEMENT = "\ufffd"


@functools.cache
def _tables() -> tuple[Any, Any, Any, Any]:
    proto = spaces.Text(max_length=1, min_length=0, charset=CHARSET)
    return proto._char_set, proto._char_list, proto._char_index, proto._char_str


class ShellText(spaces.Text):
    """gymnasium's ``Text`` over CHARSET. Its character tables (63k entries) are built once
    and shared by every instance and copy (they are never changed): building them took tens
    of milliseconds per space, and a vector env of n copies each space n times."""

    def __init__(self, max_length: int, *, seed: int | None = None) -> None:
        self.min_length = 0
        self.max_length = int(max_length)
        self._char_set, self._char_list, self._char_index, self._char_str = _tables()
        spaces.Space.__init__(self, dtype=str, seed=seed)

    def __deepcopy__(self, memo: dict[int, Any]) -> ShellText:
        new = ShellText(self.max_length)
        new._np_random = copy.deepcopy(self._np_random, memo)
        return new


def text(max_length: int) -> spaces.Text:
    return ShellText(max_length)


def fit(s: str, max_length: int) -> str:
    s = _OUTSIDE.sub(REPLACEMENT, s)
    return s[-max_length:] if len(s) > max_length else s
