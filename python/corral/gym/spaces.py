"""Observation and action text spaces.

gymnasium's ``Text`` space holds strings over a character set; shell output can hold any
character, so the set is every character of the Basic Multilingual Plane but control
characters and surrogates (plus tab, newline, carriage return), and output is fitted into it:
other characters become U+FFFD and only the last ``max_length`` characters are kept (the end
of a long output is what an agent needs most).
"""

from __future__ import annotations

import re

from gymnasium import spaces

CHARSET = "\t\n\r" + "".join(chr(c) for c in range(0x20, 0x7F)) + \
    "".join(chr(c) for c in range(0xA0, 0xD800)) + "".join(chr(c) for c in range(0xE000, 0xFFFE))
_OUTSIDE = re.compile("[^\t\n\r\x20-\x7e\xa0-\ud7ff\ue000-\ufffd]")
REPLACEMENT = "\ufffd"


def text(max_length: int) -> spaces.Text:
    return spaces.Text(max_length=max_length, min_length=0, charset=CHARSET)


def fit(s: str, max_length: int) -> str:
    s = _OUTSIDE.sub(REPLACEMENT, s)
    return s[-max_length:] if len(s) > max_length else s
