"""Tool calls whose arguments a model writes as key / value pairs rather than JSON (serve/tool_parsers.py finds the
blocks): GLM-4.5's `NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...` and Qwen3-Coder's
`<function=NAME><parameter=KEY>VALUE</parameter>...</function>`, each inside `<tool_call>` ... `</tool_call>`, and
Seed-OSS's, Qwen3-Coder's form inside `<seed:tool_call>` ... `</seed:tool_call>`.

A call's arguments are built as `{"KEY": VALUE, ...}`, each value typed by the tool's JSON schema as vLLM's parsers of
the same names type them (`glm_value`, `coder_value`). While a call is being written its arguments grow a whole pair
at a time (no closing brace until the block closes), each a prefix of the finished call's.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, NamedTuple

from pieceworks.serve.json_text import skip_blanks
from pieceworks.serve.tools import NAME

_NO_JSON = object()
_TO_MARKER = re.compile(r"[^<\n]*")


def glm_value(raw: str, schema: Any) -> str:
    """GLM-4.5's value (written raw by its template): the text as written where it is JSON and the schema does not
    type it a string, else the JSON string of the text; `null` is null where the schema's types include null (the
    template writes None and "null" alike)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list) and "null" in kind and raw.strip() == "null":
        return "null"
    if not (kind == "string" or (isinstance(kind, list) and "string" in kind)):
        try:
            json.loads(raw, parse_constant=_no_constant)
            return raw.strip()
        except (ValueError, RecursionError):
            pass
    return json.dumps(raw, ensure_ascii=False)


def coder_value(raw: str, schema: Any) -> str:
    """Qwen3-Coder's value (its template writes it between newlines, objects and lists as JSON, anything else as
    text): a string unless the schema types the parameter as a number, integer or boolean that the text is, or as
    an object, array or other type whose JSON the text is (a parameter the schema does not name is a string);
    `null` in any case is null whatever the type (the template writes None so), as vLLM's parser reads it."""
    raw = raw[1:] if raw.startswith("\n") else raw
    raw = raw[:-1] if raw.endswith("\n") else raw
    if raw.lower() == "null":
        return "null"
    kind = schema.get("type") if isinstance(schema, dict) else "string"
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    text = raw.strip()
    if kind in (None, "string"):
        pass
    elif kind == "boolean":
        if text.lower() in ("true", "false"):
            return text.lower()
    else:
        try:
            value = json.loads(text, parse_constant=_no_constant)
        except (ValueError, RecursionError):
            value = _NO_JSON
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        if (kind == "integer" and isinstance(value, int) and numeric) or (kind == "number" and numeric) or (
                kind not in ("integer", "number") and value is not _NO_JSON):
            return text
    return json.dumps(raw, ensure_ascii=False)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is no JSON")


class PairFormat(NamedTuple):
    """A call's block from `open` to `close`; in it the name between `name_open` and `name_close` ("" and "": the
    block's first text up to a `<` or a newline), pairs `key_open` KEY `key_close` [blanks `value_open`] VALUE
    `value_close`, then `end` ("": none); `value` turns (raw value, its schema) into JSON text."""

    open: str
    close: str
    name_open: str
    name_close: str
    key_open: str
    key_close: str
    value_open: str
    value_close: str
    end: str
    value: Callable[[str, Any], str]


_CODER = ("<function=", ">", "<parameter=", ">", "", "</parameter>", "</function>", coder_value)
FORMATS = {
    "glm45": PairFormat("<tool_call>", "</tool_call>", "", "", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
                        "", glm_value),
    "qwen3_coder": PairFormat("<tool_call>", "</tool_call>", *_CODER),
    "seed_oss": PairFormat("<seed:tool_call>", "</seed:tool_call>", *_CODER),
}


def markers(parser: str) -> tuple[str, ...]:
    """Every marker of the parser's blocks (the tokenizer check of `tool_parsers.lost_markers`)."""
    f = FORMATS[parser]
    return tuple(m for m in (f.open, f.close, f.name_open, f.key_open, f.key_close, f.value_open, f.value_close,
                             f.end) if len(m) > 1)


def call(parser: str, tools: list[dict], text: str, body: int, stop: int,
         closed: bool) -> tuple[str | None, str] | None:
    """The call in a block (`body` to `stop`; `closed`: its closing marker follows) as (name, arguments so far), the
    name None while it is being written; None if the block is no call in the parser's format."""
    f = FORMATS[parser]
    at = skip_blanks(text, body, stop)
    if f.name_open:
        if not text.startswith(f.name_open, at):
            return (None, "") if not closed and f.name_open.startswith(text[at:stop]) else None
        start = at + len(f.name_open)
        name_end = text.find(f.name_close, start, stop)
        if name_end < 0:
            return (None, "") if not closed else None
        after = name_end + len(f.name_close)
    else:
        start = at
        name_end = after = _TO_MARKER.match(text, at, stop).end()
        if name_end == stop and not closed:
            return None, ""  # the name may go on
    name = text[start:name_end].strip()
    if not NAME.fullmatch(name):
        return None
    tool = next((t["function"] for t in tools if t["function"]["name"] == name), {})
    props = tool.get("parameters", {}).get("properties", {})
    pairs, at = [], after
    while (at := skip_blanks(text, at, stop)) < stop:
        if f.end and text.startswith(f.end, at):
            rest = skip_blanks(text, at + len(f.end), stop)
            if rest < stop and (closed or not f.close.startswith(text[rest:stop])):
                return None  # text after the function's end
            break
        pair = _pair(f, text, at, stop)
        if pair is None:  # no whole pair here: in a call being written, the rest must be the start of one
            if closed or not _partial(f, text, at, stop):
                return None
            break
        key, value, at = pair
        pairs.append(f"{json.dumps(key, ensure_ascii=False)}: {f.value(value, props.get(key))}")
    args = ", ".join(pairs)
    return name, "{" + args + "}" if closed else "{" + args if pairs else ""


def _pair(f: PairFormat, text: str, at: int, stop: int) -> tuple[str, str, int] | None:
    """(key, raw value, the index after the pair) of a whole pair at `at`, else None."""
    if not text.startswith(f.key_open, at):
        return None
    key_end = text.find(f.key_close, at + len(f.key_open), stop)
    if key_end < 0:
        return None
    value = key_end + len(f.key_close)
    if f.value_open:
        value = skip_blanks(text, value, stop)
        if not text.startswith(f.value_open, value):
            return None
        value += len(f.value_open)
    value_end = text.find(f.value_close, value, stop)
    after = value_end + len(f.value_close)
    if f.end:  # Qwen3-Coder's form: a value left open ends at the next parameter or the function's end (vLLM's)
        cut = min((i for i in (text.find(f.key_open, value, stop), text.find(f.end, value, stop)) if i >= 0),
                  default=-1)
        if cut >= 0 and not 0 <= value_end < cut:
            value_end = after = cut
    if value_end < 0:
        return None
    return text[at + len(f.key_open) : key_end].strip(), text[value:value_end], after


def _partial(f: PairFormat, text: str, at: int, stop: int) -> bool:
    """Whether `text[at:stop]` may still become a pair, the function's end or the block's."""
    rest = text[at:stop]
    if any(m.startswith(rest) for m in (f.key_open, f.end, f.close) if m):
        return True
    if not text.startswith(f.key_open, at):
        return False
    key_end = text.find(f.key_close, at + len(f.key_open), stop)
    if key_end < 0:
        return True  # the key being written
    if not f.value_open:
        return True  # the value being written
    value = skip_blanks(text, key_end + len(f.key_close), stop)
    return f.value_open.startswith(text[value:stop]) or text.startswith(f.value_open, value)
