"""Tool calls in chat completions: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`, as vLLM serves them.

- `tools` (functions, each with a JSON schema of its `parameters`) reach the chat template as its `tools`
  variable, and earlier turns pass through: an assistant message's `tool_calls` (their JSON `arguments` as
  objects, which Hugging Face templates read; as the client's JSON text for a template that adds them to a
  string, DeepSeek-V3's: `mapping.chat_prompt`) and `tool` messages with their `tool_call_id`.
- `tool_choice: "none"`: the model answers in text.
- `"required"` and a named function (`{"type": "function", "function": {"name": ...}}`): the output is held to a
  JSON schema with structured outputs, so it always parses. Required: a JSON array of one or more
  `{"name", "arguments"}` objects over the tools (exactly one with `parallel_tool_calls: false`); named: that
  function's arguments object. The message carries them as `tool_calls` (content null) with finish_reason
  "tool_calls".
- `"auto"` (the default when tools are given) reads the model's own format, so it needs the server's parser
  (`pieceworks serve --tool-call-parser P`). `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks, the format of Hermes, Qwen 2.5 / 3 and models trained like them; the text before the first is the
  content. `llama3_json`: Llama 3.1 / 3.2's JSON calls, an answer that is one or more `{"name": ...,
  "parameters": {...}}` objects (separated by ";", after an optional `<|python_tag|>`); any other answer is
  content. `deepseek_v3`: DeepSeek-V3 / R1's section `<｜tool▁calls▁begin｜>` of calls
  `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` + a json code fence of the arguments + `<｜tool▁call▁end｜>`;
  `deepseek_v31`: DeepSeek-V3.1's `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS<｜tool▁call▁end｜>`; for both the
  text before the section is the content. Without a parser, auto is a 400 that names the alternatives, as in vLLM.
  A parser reads the decoded text, so its markers must survive decoding: `Server` warns where the tokenizer
  drops them as special tokens (requests then need `skip_special_tokens: false`).
Streamed, the calls arrive whole in one delta at the end; under auto, content streams until a call may begin
(hermes, deepseek: a call's marker, or text that may be the start of one; llama3_json: an answer whose first
non-blank character is `{` or `<` is held to the end), under required and named nothing streams as content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pieceworks.engine import StructuredOutputsParams
from pieceworks.serve import TOOL_CALL_PARSERS as PARSERS
from pieceworks.serve.protocol import BadRequest, ChatCompletionRequest
from pieceworks.serve.reasoning import held_tail
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_BLOCK = re.compile(re.escape(_OPEN) + r"(.*?)(?:" + re.escape(_CLOSE) + r"|$)", re.S)
# DeepSeek-V3 / V3.1: single tokens of DeepSeek's tokenizer
DS_SECTION, DS_OPEN, DS_SEP, DS_CLOSE = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
                                         "<｜tool▁call▁end｜>")
_DS_BLOCK = re.compile(re.escape(DS_OPEN) + r"(.*?)(?:" + re.escape(DS_CLOSE) + r"|$)", re.S)
_DS_FENCE = re.compile(r"([^\n]*)\n```(?:json)?\n(.*?)\n?```\s*", re.S)  # V3: NAME, a newline, the fenced arguments
#: the text by which each parser's calls begin (`Server` checks that decoding keeps them)
MARKERS = {"hermes": (_OPEN,), "llama3_json": (), "deepseek_v3": (DS_SECTION, DS_OPEN),
           "deepseek_v31": (DS_SECTION, DS_OPEN)}


@dataclass
class ToolPlan:
    """What a chat request's tools ask of the server: `mode` "none", "auto", "required" or "named" (`name`)."""

    mode: str
    tools: list[dict[str, Any]]
    name: str | None = None
    parallel: bool = True
    parser: str | None = None

    @property
    def constrains(self) -> bool:
        """The output is a tool call by construction (required, named)."""
        return self.mode in ("required", "named")

    @property
    def parses(self) -> bool:
        return self.mode != "none"


def plan(req: ChatCompletionRequest, parser: str | None) -> ToolPlan | None:
    """The request's tool plan, or None without tools; a malformed tool or choice is a 400 naming it."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise BadRequest(f"tool_choice={choice!r} needs tools: give tools or leave tool_choice out",
                             param="tool_choice")
        return None
    tools, names = [], []
    for i, tool in enumerate(req.tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type") != "function" or not isinstance(fn, dict) or not set(fn) <= {
                "name", "description", "parameters", "strict"}:
            raise BadRequest(f"tools[{i}] must be {{'type': 'function', 'function': {{'name', 'description', "
                             f"'parameters', 'strict'}}}}, got {tool!r}", param="tools")
        name, params = fn.get("name"), fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(name, str) or not _NAME.fullmatch(name) or name in names:
            raise BadRequest(f"tools[{i}].function.name={name!r}: each tool needs its own name of 1-64 letters, "
                             "digits, _ or -", param="tools")
        if not isinstance(params, dict):
            raise BadRequest(f"tools[{i}].function.parameters must be a JSON schema object, got {params!r}",
                             param="tools")
        names.append(name)
        tools.append({"type": "function", "function": {**fn, "parameters": params}})
    parallel = req.parallel_tool_calls is not False
    if choice in (None, "auto"):
        if parser is None:
            raise BadRequest("tool_choice 'auto' (the default with tools) reads the model's own tool-call format, "
                             "which this server was not started for (pieceworks serve --tool-call-parser "
                             f"{'|'.join(PARSERS)}); set tool_choice to 'required', a named function or 'none'",
                             param="tool_choice")
        return ToolPlan("auto", tools, parallel=parallel, parser=parser)
    if choice in ("none", "required"):
        return ToolPlan(choice, tools, parallel=parallel)
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if name not in names:
        raise BadRequest(f"tool_choice={choice!r}: takes 'none', 'auto', 'required' or {{'type': 'function', "
                         f"'function': {{'name': NAME}}}} with NAME one of the tools {names}", param="tool_choice")
    return ToolPlan("named", tools, name=name, parallel=parallel)


def structured_outputs(p: ToolPlan | None) -> StructuredOutputsParams | None:
    """The JSON schema that holds a required or named choice's output to tool calls (None otherwise)."""
    if p is None or not p.constrains:
        return None
    params = {t["function"]["name"]: t["function"]["parameters"] for t in p.tools}
    if p.mode == "named":
        return StructuredOutputsParams(json=params[p.name])
    calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
              "required": ["name", "arguments"], "additionalProperties": False} for name, schema in params.items()]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not p.parallel:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


def template_messages(req: ChatCompletionRequest, arguments_as_text: bool = False) -> list[dict[str, Any]]:
    """The messages as the chat template reads them: earlier tool calls with their arguments as objects (or, with
    `arguments_as_text`, as the JSON text the client sent, checked)."""
    out = []
    for i, m in enumerate(req.messages):
        msg: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            msg["tool_calls"] = [_template_call(i, j, c, arguments_as_text) for j, c in enumerate(m.tool_calls)]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def _template_call(i: int, j: int, call: dict[str, Any], as_text: bool = False) -> dict[str, Any]:
    fn = call.get("function")
    where = f"messages[{i}].tool_calls[{j}]"
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
        raise BadRequest(f"{where} must be {{'id', 'type': 'function', 'function': {{'name': str, 'arguments': "
                         f"JSON text}}}}, got {call!r}", param="messages")
    try:
        arguments = json.loads(fn["arguments"])
    except ValueError as exc:
        raise BadRequest(f"{where}.function.arguments is not JSON: {exc}", param="messages") from None
    return {"id": call.get("id"), "type": "function",
            "function": {"name": fn["name"], "arguments": fn["arguments"] if as_text else arguments}}


def parse(p: ToolPlan, text: str) -> tuple[str | None, list[dict[str, str]]]:
    """A finished choice's (content, tool calls): calls as {"id", "name", "arguments" (JSON text)}. Output that
    does not parse (cut off by max_tokens) stays content, with no calls."""
    if p.mode == "named":
        try:
            json.loads(text)
        except ValueError:
            return text, []
        return None, [_call(p.name, text)]
    if p.mode == "required":
        try:
            items = json.loads(text)
        except ValueError:
            return text, []
        return None, [_call(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in items]
    if p.parser == "llama3_json":
        return _parse_llama3(text)
    if p.parser in ("deepseek_v3", "deepseek_v31"):
        return _parse_deepseek(text, p.parser == "deepseek_v3")
    calls = []  # hermes: the blocks are the calls, the text before the first one the content
    for m in _BLOCK.finditer(text):
        try:
            c = json.loads(m.group(1))
            arguments = c.get("arguments", c.get("parameters", {}))
            calls.append(_call(c["name"], json.dumps(arguments, ensure_ascii=False)))
        except (ValueError, KeyError, TypeError, AttributeError):
            return text, []  # a block that is no call: the text stays as it is
    content = text[: text.find(_OPEN)] if calls else text
    return content if content.strip() else None, calls


def _parse_llama3(text: str) -> tuple[str | None, list[dict[str, str]]]:
    """Llama 3.1's JSON calls: the whole answer is `{"name", "parameters"}` objects, ";" between them."""
    body = text.strip().removeprefix(_PYTHON_TAG).lstrip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            obj, at = decoder.raw_decode(body, at)
            arguments = obj.get("parameters", obj.get("arguments", {}))
            calls.append(_call(obj["name"], json.dumps(arguments, ensure_ascii=False)))
        except (ValueError, KeyError, TypeError, AttributeError):
            return text, []  # not calls after all: the text stays as it is
        while at < len(body) and body[at] in "; \t\r\n":
            at += 1
    return None, calls


def _parse_deepseek(text: str, v3: bool) -> tuple[str | None, list[dict[str, str]]]:
    """DeepSeek-V3 (`v3`) or V3.1 calls; the content is the text before the first marker."""
    calls = [_deepseek_call(m.group(1), v3) for m in _DS_BLOCK.finditer(text)]
    if not calls or None in calls:
        return text, []  # no call, or a block that is no call: the text stays as it is
    content = text[: min(i for i in (text.find(DS_SECTION), text.find(DS_OPEN)) if i >= 0)]
    return content if content.strip() else None, calls


def _deepseek_call(block: str, v3: bool) -> dict[str, str] | None:
    """One block between the call markers: V3 `function<｜tool▁sep｜>NAME` and the arguments in a json code fence,
    V3.1 `NAME<｜tool▁sep｜>ARGUMENTS`; None if it is no call."""
    head, sep, rest = block.partition(DS_SEP)
    fence = _DS_FENCE.fullmatch(rest) if v3 else None
    if not sep or (v3 and fence is None):  # V3's head is the call's type: "function" (OpenAI's only one)
        return None
    name, arguments = fence.groups() if v3 else (head, rest)
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    return _call(name.strip(), json.dumps(value, ensure_ascii=False)) if _NAME.fullmatch(name.strip()) else None


def _call(name: str, arguments: str) -> dict[str, str]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "name": name, "arguments": arguments}


def visible_prefix(text: str, parser: str | None = "hermes") -> int:
    """How much of an auto choice's text may stream as content: hermes and deepseek, up to a call's marker or a
    tail that could still become one; llama3_json, nothing while the answer may be calls (blank so far,
    or its first non-blank character `{` or `<`), all of it once it can't be."""
    if parser == "llama3_json":
        head = text.lstrip()[:1]
        return 0 if head in ("", "{", "<") else len(text)
    markers = MARKERS.get(parser or "hermes", (_OPEN,))
    found = [i for i in (text.find(m) for m in markers) if i >= 0]
    return min(found) if found else len(text) - max(held_tail(text, m) for m in markers)


def lost_markers(tokenizer: Any, parser: str) -> list[str]:
    """The parser's markers that decoding drops (special tokens of this tokenizer, left out of the text of every
    request that keeps `skip_special_tokens`): the parser never sees calls in such text."""
    return [m for m in MARKERS[parser]
            if tokenizer.decode(tokenizer.encode(m, add_special_tokens=False), skip_special_tokens=True) != m]
