"""Tool calls read from a chat answer's text (serve/tools.py plans them): each `--tool-call-parser` format under
tool_choice auto, and the JSON that required and named choices are held to.

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes, Qwen 2.5 / 3 and models
  trained like them); the text before the first is the content.
- `llama3_json`: Llama 3.1 / 3.2's calls, an answer that is one or more `{"name": ..., "parameters": {...}}`
  objects (";" between them, after an optional `<|python_tag|>`); any other answer is content.
- `deepseek_v3`: DeepSeek-V3 / R1's section `<｜tool▁calls▁begin｜>` of calls `<｜tool▁call▁begin｜>function
  <｜tool▁sep｜>NAME` + the arguments in a json code fence + `<｜tool▁call▁end｜>`; `deepseek_v31`: DeepSeek-V3.1's
  `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS<｜tool▁call▁end｜>`; the text before the section is the content.
- `mistral`: Mistral's `[TOOL_CALLS]` followed by a JSON array of `{"name", "arguments"}` objects (Mistral 7B
  v0.3's form), or by `NAME[ARGS]ARGUMENTS` per call (tokenizer v11 on, as vLLM's parser reads it; `[ARGS]` may
  be absent). Call ids are 9 letters and digits, which Mistral's chat templates ask of earlier turns.
- `glm45`: GLM-4.5 / 4.6 / 4.7's `<tool_call>NAME` + `<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>` per
  argument + `</tool_call>`; `qwen3_coder`: Qwen3-Coder's `<tool_call><function=NAME>` + `<parameter=KEY>VALUE
  </parameter>` per argument + `</function></tool_call>`; `seed_oss`: Seed-OSS's, Qwen3-Coder's form in
  `<seed:tool_call>` ... `</seed:tool_call>` (blanks between the parts in all three). The arguments are built
  as `{"KEY": VALUE, ...}`, each value typed by the tool's schema (serve/tool_pairs.py), and stream an argument at a
  time. The text before the first call is the content.
- required: a JSON array of `{"name", "arguments"}` objects; named: the output is the arguments.

A call's arguments are one JSON value in every other format, and a call gets that value's text as the model wrote it
(checked to parse). So the arguments can stream: `streamed` finds, in an answer so far, each call whose name is
complete and the part of its arguments written yet, a prefix of what `parse` gives the finished answer. A hermes or
mistral marker inside an argument's string is text (markers are looked for outside the call's JSON). The parsers
read decoded text: `lost_markers` names the markers a tokenizer drops as special tokens.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, NamedTuple

from pieceworks.serve import tool_pairs
from pieceworks.serve.json_text import ends_in_string, loads_or_none, skip_blanks, value_end
from pieceworks.serve.reasoning import held_tail
from pieceworks.serve.tools import NAME, ToolPlan

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
# DeepSeek-V3 / V3.1: single tokens of DeepSeek's tokenizer
DS_SECTION, DS_OPEN, DS_SEP, DS_CLOSE = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
                                         "<｜tool▁call▁end｜>")
V3_FENCE = re.compile(r"[^\n]*\n```(?:json)?\n")  # V3's NAME, a newline and the fence's first line
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
#: the text by which each parser's calls begin
MARKERS = {"hermes": (OPEN,), "llama3_json": (), "mistral": (MISTRAL_CALLS,), "deepseek_v3": (DS_SECTION, DS_OPEN),
           "deepseek_v31": (DS_SECTION, DS_OPEN), "glm45": (OPEN,), "qwen3_coder": (OPEN,),
           "seed_oss": ("<seed:tool_call>",)}
_NAME_CHARS = re.compile(r"[A-Za-z0-9_-]*")
_ALNUM = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"


class Found(NamedTuple):
    """A call in an answer (so far): its name (None until complete), where its arguments begin in the text (None
    if not yet reached, or absent) and end (None until complete), and whether the call is closed; `built`: the
    arguments (so far) where the parser builds them (glm45, qwen3_coder, seed_oss) rather than finding them in the
    text."""

    name: str | None
    start: int | None
    end: int | None
    closed: bool
    built: str | None = None

    def arguments(self, text: str) -> str:
        """The call's arguments (so far)."""
        if self.built is not None:
            return self.built
        return "" if self.start is None else text[self.start : len(text) if self.end is None else self.end]


def parse(p: ToolPlan, text: str) -> tuple[str | None, list[dict[str, str]]]:
    """A finished choice's (content, tool calls): calls as {"id", "name", "arguments" (JSON text)}. Output that
    is not calls in the plan's format (cut off by max_tokens, or malformed) stays content, with no calls."""
    found, content_end = _scan(p, text)
    if found is None or not found or any(f.name is None or not f.closed for f in found):
        return text, []
    calls = []
    for f in found:
        arguments = "{}" if f.start is None and f.built is None else f.arguments(text)
        try:
            json.loads(arguments)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than Python's stack
            return text, []
        calls.append({"id": call_id(p.parser), "name": f.name, "arguments": arguments})
    content = text[:content_end]
    return (content if content.strip() else None), calls


def streamed(p: ToolPlan, text: str) -> list[tuple[str, str]]:
    """The calls of an answer so far as (name, arguments written yet), up to the first whose name is incomplete;
    [] while the text may not be calls. Each is a prefix of what `parse` gives the finished answer."""
    found, _ = _scan(p, text)
    out = []
    for f in found or []:
        if f.name is None:
            break
        out.append((f.name, f.arguments(text)))
    return out


def call_id(parser: str | None) -> str:
    """A new call's id: `call_` and 24 hex digits, or for mistral 9 letters and digits."""
    if parser == "mistral":
        return "".join(_ALNUM[b % len(_ALNUM)] for b in uuid.uuid4().bytes[:9])
    return f"call_{uuid.uuid4().hex[:24]}"


def visible_prefix(text: str, parser: str | None = "hermes") -> int:
    """How much of an auto choice's text may stream as content: hermes and deepseek, up to a call's marker or a
    tail that could still become one; llama3_json, nothing while the answer may be calls (blank so far, or its
    first non-blank character `{` or `<`), all of it once it can't be."""
    if parser == "llama3_json":
        head = text.lstrip()[:1]
        return 0 if head in ("", "{", "<") else len(text)
    markers = MARKERS.get(parser or "hermes", (OPEN,))
    found = [i for i in (text.find(m) for m in markers) if i >= 0]
    return min(found) if found else len(text) - max(held_tail(text, m) for m in markers)


def lost_markers(tokenizer: Any, parser: str) -> list[str]:
    """The parser's markers that decoding drops (special tokens of this tokenizer, left out of the text of every
    request that keeps `skip_special_tokens`): the parser never sees calls in such text."""
    every = tool_pairs.markers(parser) if parser in tool_pairs.FORMATS else MARKERS[parser]
    return [m for m in every
            if tokenizer.decode(tokenizer.encode(m, add_special_tokens=False), skip_special_tokens=True) != m]


# ---------------------------------------------------------------------------------------------- the formats
def _scan(p: ToolPlan, text: str) -> tuple[list[Found] | None, int]:
    """The calls in `text` (None: it is not calls in the plan's format) and where the content ends."""
    if p.mode == "named":
        at = skip_blanks(text, 0)
        end = value_end(text, at)
        if end is not None and skip_blanks(text, end) < len(text):
            return None, 0  # more than one value
        return [Found(p.name, at if at < len(text) else None, end, end is not None)], 0
    if p.mode == "required":
        return _sequence(text, skip_blanks(text, 0), "[", ",", "]"), 0
    if p.parser == "llama3_json":
        at = skip_blanks(text, 0)
        at = skip_blanks(text, at + len(PYTHON_TAG)) if text.startswith(PYTHON_TAG, at) else at
        return _sequence(text, at, "", ";", "", after=True), 0
    if p.parser == "mistral":
        return _mistral(text)
    if p.parser in tool_pairs.FORMATS:
        return _pairs(p, text)
    v3 = p.parser == "deepseek_v3"
    deepseek = v3 or p.parser == "deepseek_v31"
    opener, closer = (DS_OPEN, DS_CLOSE) if deepseek else (OPEN, CLOSE)
    starts = [i for i in (text.find(m) for m in MARKERS[p.parser or "hermes"]) if i >= 0]
    found, at = [], text.find(opener)
    while at >= 0:  # one block per call, from its opening marker to its closing one (or the text's end)
        body = at + len(opener)
        close = text.find(closer, body) if deepseek else _hermes_close(text, body)
        stop = len(text) if close < 0 else close
        if deepseek:
            f = _deepseek_call(text, body, stop, close >= 0, v3)
        else:
            obj = _call_object(text, skip_blanks(text, body, stop), stop)
            done = obj is not None and obj[1] is not None
            f = None if obj is None or (close >= 0 and not done) or (done and skip_blanks(text, obj[1], stop) < stop) \
                else obj[0]
        if f is None:
            return None, min(starts)
        found.append(f)
        if f.name is None:
            break
        at = text.find(opener, close) if close >= 0 else -1
    return found, min(starts, default=len(text))


def _mistral(text: str) -> tuple[list[Found] | None, int]:
    """Mistral's calls: after each `[TOOL_CALLS]`, a JSON array of call objects or `NAME[ARGS]ARGUMENTS`; text after
    the last call is left out (as vLLM's parser leaves it)."""
    at = text.find(MISTRAL_CALLS)
    content_end, found = (at if at >= 0 else len(text)), []
    while at >= 0:
        body = skip_blanks(text, at + len(MISTRAL_CALLS))
        nxt = text.find(MISTRAL_CALLS, _json_after(text, body))  # a marker inside an argument's string is text
        stop = len(text) if nxt < 0 else nxt
        if body < stop and text[body] == "[" and not text.startswith(MISTRAL_ARGS, body):
            calls = _sequence(text[:stop], body, "[", ",", "]", after=nxt < 0)
            if calls is None or (nxt >= 0 and not all(f.closed for f in calls)):
                return None, content_end
            found += calls
        else:
            name_end = _NAME_CHARS.match(text, body, stop).end()
            args_at = name_end + len(MISTRAL_ARGS) if text.startswith(MISTRAL_ARGS, name_end) else name_end
            start = skip_blanks(text, args_at, stop)
            if start >= stop:  # the name (or the arguments' start) still being written
                if nxt >= 0:
                    return None, content_end
                found.append(Found(None, None, None, False))
                break
            if text[start] != "{" or not NAME.fullmatch(text[body:name_end]):
                return None, content_end
            end = value_end(text, start, stop)
            if (end is None and nxt >= 0) or (end is not None and nxt >= 0 and skip_blanks(text, end, stop) < stop):
                return None, content_end  # text after the last call's arguments is ignored (vLLM's)
            found.append(Found(text[body:name_end], start, end, end is not None))
        if found and found[-1].name is None:
            break
        at = nxt
    return found, content_end


def _hermes_close(text: str, body: int) -> int:
    """A hermes block's closing marker: the first after `body` that is not inside a string of the call object (a
    marker in an argument's string is text); -1 while there is none."""
    start, close = skip_blanks(text, body), text.find(CLOSE, body)
    if start < len(text) and text[start] == "{":
        while close >= 0 and value_end(text, start, close) is None and ends_in_string(text, start, close):
            close = text.find(CLOSE, close + 1)
    return close


def _json_after(text: str, body: int) -> int:
    """Where a Mistral block's JSON (the array, or the arguments after `NAME[ARGS]`) that begins at `body` ends: the
    text's end while it is unfinished, `body` where there is none to find."""
    name_end = _NAME_CHARS.match(text, body).end()
    if text.startswith(MISTRAL_ARGS, name_end):
        name_end += len(MISTRAL_ARGS)
    start = body if text.startswith("[", body) else skip_blanks(text, name_end)
    if start >= len(text) or text[start] not in "[{":
        return body
    end = value_end(text, start)
    return len(text) if end is None else end


def _pairs(p: ToolPlan, text: str) -> tuple[list[Found] | None, int]:
    """glm45's, qwen3_coder's and seed_oss's calls: a block each, arguments built from its key / value pairs
    (`tool_pairs`)."""
    opener, closer = tool_pairs.FORMATS[p.parser][:2]
    content_end = at = text.find(opener)
    found = []
    while at >= 0:
        close = text.find(closer, at)
        got = tool_pairs.call(p.parser, p.tools, text, at + len(opener), len(text) if close < 0 else close, close >= 0)
        if got is None:
            return None, content_end
        found.append(Found(got[0], None, None, close >= 0 and got[0] is not None, got[1]))
        if close < 0 or got[0] is None:
            break
        at = text.find(opener, close)
    return found, len(text) if content_end < 0 else content_end


def _deepseek_call(text: str, body: int, stop: int, closed: bool, v3: bool) -> Found | None:
    """The call in a DeepSeek block (`body` to `stop`): V3 `TYPE<｜tool▁sep｜>NAME`, a newline and the arguments in a
    json code fence, V3.1 `NAME<｜tool▁sep｜>ARGUMENTS`; None if it is no call."""
    sep = text.find(DS_SEP, body, stop)
    name, args = (text[body:sep], sep + len(DS_SEP)) if sep >= 0 else (None, 0)
    if name is not None and v3:  # V3's head is the call's type: "function" (OpenAI's only one)
        fence = V3_FENCE.match(text, args, stop)
        name, args = (text[args : fence.end()].split("\n", 1)[0], fence.end()) if fence else (None, 0)
    if name is None:  # still being written
        return None if closed else Found(None, None, None, False)
    if not NAME.fullmatch(name.strip()):
        return None
    start = skip_blanks(text, args, stop)
    end = value_end(text, start, stop)
    rest = text[end:stop].strip() if end is not None else ""
    if rest and not (v3 and "```".startswith(rest) and (rest == "```" or not closed)):
        return None  # text after the arguments (V3: but its closing fence)
    if closed and (end is None or (v3 and rest != "```")):
        return None
    return Found(name.strip(), start if start < stop else None, end, closed)


def _sequence(text: str, at: int, opener: str, sep: str, closer: str, after: bool = False) -> list[Found] | None:
    """Call objects from `at` on: inside `opener` ... `closer` (required's array, `sep` between them) or bare
    (llama3_json's, `sep` or blanks between them); None where the text is something else. `after`: text after
    the closer, or after the last of bare calls, is ignored (else the calls are no calls; vLLM's parsers of
    Mistral and Llama 3 ignore it)."""
    if opener:
        if at >= len(text):
            return []
        if text[at] != opener:
            return None
        at = skip_blanks(text, at + 1)
    found = []
    while at < len(text):
        obj = _call_object(text, at, len(text))
        if obj is None:
            return found if after and found and not closer else None
        found.append(obj[0])
        if obj[1] is None:
            return found
        at = skip_blanks(text, obj[1])
        if closer and at < len(text) and text[at] == closer:
            return found if after or skip_blanks(text, at + 1) == len(text) else None
        if at < len(text) and text[at] == sep:
            at = skip_blanks(text, at + 1)
            while not closer and at < len(text) and text[at] == sep:
                at = skip_blanks(text, at + 1)
        elif closer and at < len(text):
            return None
    return [f._replace(closed=False) for f in found] if closer else found


def _call_object(text: str, at: int, stop: int) -> tuple[Found, int | None] | None:
    """The `{"name": ..., "arguments" | "parameters": ...}` object at `at` (before `stop`) and the index after it
    (None while it is unfinished); None if it is no call object: one without arguments (`{"name": "Ada", "age":
    3}` is an answer, as vLLM reads it), or with a second name (`json.loads` would take the second where the first
    streamed). The first arguments count (a later key would not extend what streamed). The name counts (and streams)
    once the arguments have begun."""
    if at >= stop:
        return Found(None, None, None, False), None
    if text[at] != "{":
        return None
    name = start = end = None
    at = skip_blanks(text, at + 1, stop)
    while at < stop:
        if text[at] == "}":
            return (Found(name, start, end, True), at + 1) if name is not None and start is not None else None
        if text[at] != '"':
            return None
        key_end = value_end(text, at, stop)
        if key_end is None:
            break
        key = loads_or_none(text[at:key_end])
        if not isinstance(key, str):
            return None  # a string that does not decode (a bad escape)
        at = skip_blanks(text, key_end, stop)
        if at < stop and text[at] != ":":
            return None
        at = skip_blanks(text, at + 1, stop)
        v_end = value_end(text, at, stop)
        if key == "name" and v_end is not None:
            if name is not None:
                return None
            name = loads_or_none(text[at:v_end])
            if not isinstance(name, str):
                return None
        elif key in ("arguments", "parameters") and start is None and at < stop:
            start, end = at, v_end  # the first such key (a later one would not extend what streamed)
        if v_end is None:
            break
        at = skip_blanks(text, v_end, stop)
        if at < stop and text[at] == ",":
            at = skip_blanks(text, at + 1, stop)
        elif at < stop and text[at] != "}":
            return None
    return Found(name if start is not None else None, start, end, False), None
