"""JSON values found in text as a model writes it (serve/tool_parsers.py): where a value ends, blanks skipped, a
value decoded or None. Regular expressions skip the plain characters: every step of a stream scans its calls'
arguments again."""

from __future__ import annotations

import json
import re
from typing import Any

_BLANK = " \t\r\n"
_STRUCTURE, _DELIMITER = re.compile(r'[{}\[\]"]'), re.compile(r"[,}\];\s]")
_STRING_BODY = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*', re.S)  # matches at once, without backtracking


def loads_or_none(text: str) -> Any:
    """The JSON value of `text`, or None where it is no JSON (a call's name and keys must be strings)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than Python's stack
        return None


def skip_blanks(text: str, at: int, stop: int | None = None) -> int:
    """The index of the first character from `at` (before `stop`) that is not a JSON blank."""
    stop = len(text) if stop is None else stop
    while at < stop and text[at] in _BLANK:
        at += 1
    return at


def value_end(text: str, at: int, stop: int | None = None) -> int | None:
    """The index after the JSON value that begins at `at`, None if the text (up to `stop`) ends inside it. A
    number or literal ends at a delimiter (one reaching `stop` may go on)."""
    stop = len(text) if stop is None else stop
    if at >= stop:
        return None
    if text[at] == '"':
        return string_end(text, at + 1, stop)
    if text[at] not in "{[":
        m = _DELIMITER.search(text, at, stop)
        return m.start() if m else None
    depth, i = 0, at
    while (m := _STRUCTURE.search(text, i, stop)) is not None:
        ch = m.group()
        if ch == '"':
            i = string_end(text, m.end(), stop)
            if i is None:
                return None
            continue
        depth += 1 if ch in "{[" else -1
        if depth == 0:
            return m.end()
        i = m.end()
    return None


def ends_in_string(text: str, at: int, stop: int) -> bool:
    """Whether the text of a JSON value that begins at `at`, cut at `stop`, ends inside one of its strings."""
    i = at
    while (m := _STRUCTURE.search(text, i, stop)) is not None:
        if m.group() == '"':
            i = string_end(text, m.end(), stop)
            if i is None:
                return True
        else:
            i = m.end()
    return False


def string_end(text: str, at: int, stop: int) -> int | None:
    """The index after the closing quote of a JSON string whose body begins at `at`; None if it runs past `stop`."""
    end = _STRING_BODY.match(text, at, stop).end()
    return end + 1 if end < stop and text[end] == '"' else None
