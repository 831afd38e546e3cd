"""Tool calls in chat completions: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`, as vLLM serves them.

- `tools` (functions, each with a JSON schema of its `parameters`) reach the chat template as its `tools`
  variable, and earlier turns pass through: an assistant message's `tool_calls` (their JSON `arguments` as
  objects, which Hugging Face templates read; as the client's JSON text for a template that adds them to a
  string, DeepSeek-V3's: `prompts.chat_prompt`) and `tool` messages with their `tool_call_id`.
- `tool_choice: "none"`: the model answers in text.
- `"required"` and a named function (`{"type": "function", "function": {"name": ...}}`): the output is held to a
  JSON schema with structured outputs, so it always parses. Required: a JSON array of one or more
  `{"name", "arguments"}` objects over the tools (exactly one with `parallel_tool_calls: false`); named: that
  function's arguments object. The message carries them as `tool_calls` (content null) with finish_reason
  "tool_calls" (required) or "stop" (named), OpenAI's and vLLM's.
- `"auto"` (the default when tools are given) reads the model's own format, so it needs the server's parser
  (`pieceworks serve --tool-call-parser P`, serve/tool_parsers.py: hermes, llama3_json, mistral, deepseek_v3,
  deepseek_v31, glm45, qwen3_coder, seed_oss). Without a parser, auto is a 400 that names the alternatives, as in
  vLLM. Where the tokenizer marks the parser's markers special, auto requests decode with special tokens kept, as
  vLLM's mistral and internlm parsers do (so the stop token's text joins the text where the request asks for
  include_stop_str_in_output, as there).
Streamed, each call's name arrives once complete and its arguments as the model writes them (writers.py); under
auto, content streams until a call may begin, under required and named nothing streams as content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pieceworks.engine import StructuredOutputsParams
from pieceworks.serve import TOOL_CALL_PARSERS as PARSERS
from pieceworks.serve.protocol import BadRequest, ChatCompletionRequest

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass
class ToolPlan:
    """What a chat request's tools ask of the server: `mode` "none", "auto", "required" or "named" (`name`)."""

    mode: str
    tools: list[dict[str, Any]]
    name: str | None = None
    parallel: bool = True
    parser: str | None = None
    keep_special: bool = False  # auto under a parser whose markers are special tokens: decode them (Server)

    @property
    def constrains(self) -> bool:
        """The output is a tool call by construction (required, named)."""
        return self.mode in ("required", "named")

    @property
    def parses(self) -> bool:
        return self.mode != "none"


def plan(req: ChatCompletionRequest, parser: str | None, keep_special: bool = False) -> ToolPlan | None:
    """The request's tool plan, or None without tools; a malformed tool or choice is a 400 naming it.
    `keep_special`: the parser's markers are special tokens, which an auto plan's text must keep."""
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
        if not isinstance(name, str) or not NAME.fullmatch(name) or name in names:
            raise BadRequest(f"tools[{i}].function.name={name!r}: each tool needs its own name of 1-64 letters, "
                             "digits, _ or -", param="tools")
        if not isinstance(params, dict):
            raise BadRequest(f"tools[{i}].function.parameters must be a JSON schema object, got {params!r}",
                             param="tools")
        props = params.get("properties", {})
        if not isinstance(props, dict) or not all(isinstance(v, (dict, bool)) for v in props.values()):
            raise BadRequest(f"tools[{i}].function.parameters.properties must be an object of JSON schemas, one per "
                             f"argument, got {props!r}", param="tools")
        names.append(name)
        tools.append({"type": "function", "function": {**fn, "parameters": params}})
    parallel = req.parallel_tool_calls is not False
    if choice in (None, "auto"):
        if parser is None:
            raise BadRequest("tool_choice 'auto' (the default with tools) reads the model's own tool-call format, "
                             "which this server was not started for (pieceworks serve --tool-call-parser "
                             f"{'|'.join(PARSERS)}); set tool_choice to 'required', a named function or 'none'",
                             param="tool_choice")
        return ToolPlan("auto", tools, parallel=parallel, parser=parser, keep_special=keep_special)
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
    `arguments_as_text`, as the JSON text the client sent, checked); OpenAI's developer role as the system role,
    which templates know."""
    out = []
    for i, m in enumerate(req.messages):
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.name is not None:  # OpenAI's participant (or tool result) name; templates that know it show it
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [_template_call(i, j, c, arguments_as_text) for j, c in enumerate(m.tool_calls)]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:  # templates that show earlier reasoning (Qwen3's) read it
            msg["reasoning_content"] = m.reasoning_content
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
    except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than Python's stack
        raise BadRequest(f"{where}.function.arguments is not JSON: {exc}", param="messages") from None
    return {"id": call.get("id"), "type": "function",
            "function": {"name": fn["name"], "arguments": fn["arguments"] if as_text else arguments}}
