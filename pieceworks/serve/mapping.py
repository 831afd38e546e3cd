"""From an OpenAI request to what the engine takes: its `SamplingParams` (its prompts as token ids:
serve/prompts.py).

Every check here raises `BadRequest` (a `RequestError`) before anything reaches the engine, so a
refused request holds no KV page. `SamplingParams` validates the ranges of its own fields; its
`RequestError` becomes a 400 too.
"""

from __future__ import annotations

import re
from typing import Any

from pieceworks.engine import SamplingParams, StructuredOutputsParams
from pieceworks.errors import RequestError
from pieceworks.serve import tools
from pieceworks.serve.protocol import (
    MAX_LOGPROBS,
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)

# OpenAI's default for /v1/completions; chat completions default to the rest of the context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# stop strings one request may give (OpenAI takes 4, vLLM any number): each is looked for after every token of
# each of its completions, on the engine's thread
MAX_STOP_STRINGS, MAX_STOP_CHARS = 64, 4096


def check_model(model: str | None, served: str) -> None:
    """A 404 `model_not_found` (OpenAI's answer) unless `model` is the served one (None: the served one)."""
    if model is not None and model != served:
        raise BadRequest(f"the model {model!r} does not exist; this server serves {served!r}",
                         param="model", code="model_not_found", status=404)


def tokenizer_for(req: Any, served: str, tokenizer: Any) -> Any:
    """The tokenizer that /tokenize and /detokenize use: the model's (`req.model`, when given, names it)."""
    check_model(req.model, served)
    if tokenizer is None:
        raise BadRequest("this model has no tokenizer (random weights): token ids are all it takes", param="model")
    return tokenizer


# OpenAI's chat fields whose behaviour pieceworks lacks, and what to do instead; refused where set (not null)
UNSUPPORTED_CHAT = {"functions": "the legacy functions API is not supported: use tools",
                    "function_call": "the legacy function_call is not supported: use tool_choice",
                    "prediction": "predicted outputs are not supported: leave prediction out",
                    "web_search_options": "this server does not search the web: leave web_search_options out",
                    "audio": "this server answers in text only: leave audio out",
                    "verbosity": "this server has no verbosity control: ask for the length in the prompt, bound it "
                                 "with max_completion_tokens, and leave verbosity out"}


def refuse_unsupported(req: SamplingFields) -> None:
    """OpenAI fields whose behaviour pieceworks lacks: refused by name rather than ignored."""
    unsupported: dict[str, Any] = {}
    if isinstance(req, CompletionRequest):
        unsupported |= {"suffix": req.suffix,
                        "best_of": req.best_of if req.best_of not in (None, req.n or 1) else None}
    for name, value in unsupported.items():
        if value is not None:
            raise BadRequest(f"{name}={value!r} is not supported by this server; leave it out", param=name)
    if isinstance(req, ChatCompletionRequest):
        for name, why in UNSUPPORTED_CHAT.items():
            if getattr(req, name) is not None:
                raise BadRequest(f"{name}: {why}", param=name)
        if req.store:
            raise BadRequest("store: true asks for the completion to be stored, and this server stores nothing: "
                             "leave store out or false", param="store")
        if set(req.modalities or ()) - {"text"}:
            raise BadRequest(f"modalities={req.modalities!r}: this server answers in text only: leave modalities "
                             'out or ["text"]', param="modalities")
    if req.stream_options is not None and not req.stream:  # OpenAI's and vLLM's rule
        raise BadRequest("stream_options is only allowed with stream: true", param="stream_options")


def max_tokens_for(req: SamplingFields, prompt_len: int, max_context: int) -> int:
    """The request's max_tokens, checked against the context left after the prompt."""
    if prompt_len >= max_context:
        raise BadRequest(f"this model's maximum context length is {max_context} tokens, and the prompt has "
                         f"{prompt_len}: shorten the prompt", param="prompt" if isinstance(req, CompletionRequest)
                         else "messages", code="context_length_exceeded")
    asked = req.max_tokens
    name = "max_tokens"
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        asked, name = req.max_completion_tokens, "max_completion_tokens"
    if asked is None:
        room = max_context - prompt_len
        if req.min_tokens > room:
            raise BadRequest(f"this model's maximum context length is {max_context} tokens; min_tokens = "
                             f"{req.min_tokens} with a {prompt_len}-token prompt needs {prompt_len + req.min_tokens}: "
                             f"ask for at most {room}", param="min_tokens", code="context_length_exceeded")
        if isinstance(req, CompletionRequest):
            if req.min_tokens > COMPLETIONS_DEFAULT_MAX_TOKENS:
                raise BadRequest(f"min_tokens = {req.min_tokens} exceeds max_tokens, which is "
                                 f"{COMPLETIONS_DEFAULT_MAX_TOKENS} when not given (OpenAI's default for "
                                 "completions): give max_tokens too", param="min_tokens")
            return min(COMPLETIONS_DEFAULT_MAX_TOKENS, room)
        return room
    if asked == 0 and isinstance(req, CompletionRequest) and req.echo:
        return 1  # the prompt alone is scored: the one token generated is left out of the response
    if asked < 1:
        raise BadRequest(f"{name} = {asked}: must be at least 1", param=name)
    if prompt_len + asked > max_context:
        raise BadRequest(f"this model's maximum context length is {max_context} tokens; {name} = {asked} with "
                         f"a {prompt_len}-token prompt needs {prompt_len + asked}: ask for at most "
                         f"{max_context - prompt_len}", param=name, code="context_length_exceeded")
    return asked


def logit_bias(req: SamplingFields, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as decimal strings -> a bias in [-100, 100]) as SamplingParams takes it."""
    if not req.logit_bias:
        return None
    out = {}
    for key, value in req.logit_bias.items():
        if not (key.isascii() and key.isdigit()) or int(key) >= vocab_size:
            raise BadRequest(f"logit_bias key {key!r}: keys are token ids in [0, {vocab_size}) written as decimal "
                             "strings", param="logit_bias")
        if not -100 <= value <= 100:
            raise BadRequest(f"logit_bias[{key!r}] = {value}: biases must be in [-100, 100]", param="logit_bias")
        out[int(key)] = value
    return out


def in_vocab(req: SamplingFields, name: str, vocab_size: int) -> list[int] | None:
    """vLLM's allowed_token_ids or stop_token_ids, checked against the vocabulary (SamplingParams checks the
    rest)."""
    ids = getattr(req, name)
    bad = [t for t in ids or () if not 0 <= t < vocab_size]
    if bad:
        raise BadRequest(f"{name} {bad[:5]} are outside the vocabulary [0, {vocab_size})", param=name)
    return ids


def structured_outputs(req: SamplingFields, tool_plan: tools.ToolPlan | None = None) -> StructuredOutputsParams | None:
    """OpenAI's `response_format` (text, json_object, or json_schema with its `schema`) or vLLM's
    `structured_outputs` (json, regex, choice, grammar, json_object, disable_any_whitespace) as
    `StructuredOutputsParams`, or the schema of a tool_choice that requires tool calls; None for none."""
    fmt, fields = req.response_format, req.structured_outputs
    if fmt is not None and fields is not None:
        raise BadRequest("give response_format or structured_outputs, not both", param="structured_outputs")
    if tool_plan is not None and tool_plan.constrains:
        if fields is not None or (fmt is not None and fmt != {"type": "text"}):
            raise BadRequest(f"tool_choice {tool_plan.mode!r} holds the output to tool calls; leave out "
                             "response_format and structured_outputs", param="tool_choice")
        return tools.structured_outputs(tool_plan)
    if fields is not None:
        try:
            return StructuredOutputsParams(**fields)
        except TypeError:
            known = "json, regex, choice, grammar, json_object, disable_any_whitespace"
            raise BadRequest(f"structured_outputs takes {known}; got {sorted(fields)}",
                             param="structured_outputs") from None
        except RequestError as exc:
            raise client_error(exc, req) from None
    if fmt is None or (fmt.get("type") == "text" and len(fmt) == 1):
        return None
    kind, spec = fmt.get("type"), fmt.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if kind == "json_object" and len(fmt) == 1:
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema" and set(fmt) == {"type", "json_schema"} and isinstance(schema, dict):
        return StructuredOutputsParams(json=schema)
    raise BadRequest(f"response_format={fmt!r}: takes {{'type': 'text'}}, {{'type': 'json_object'}} or "
                     "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}",
                     param="response_format")


def prompt_params(req: SamplingFields, prompts: list[list[int]], max_context: int, vocab_size: int,
                  tool_plan: tools.ToolPlan | None = None) -> list[SamplingParams]:
    """Each prompt's `SamplingParams`: the request's fields, built and checked once, with each prompt's max_tokens
    (`max_tokens_for`)."""
    first = sampling_params(req, max_tokens_for(req, len(prompts[0]), max_context), vocab_size, tool_plan)
    rest = [first.with_max_tokens(max_tokens_for(req, len(p), max_context)) for p in prompts[1:]]
    return [first, *rest]


def sampling_params(req: SamplingFields, max_tokens: int, vocab_size: int,
                    tool_plan: tools.ToolPlan | None = None) -> SamplingParams:
    """The request's sampling fields as `SamplingParams` (OpenAI's defaults where a field is absent)."""
    prompt_logprobs = None
    if isinstance(req, CompletionRequest):
        logprobs = req.logprobs
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise BadRequest(f"logprobs = {logprobs}: must be in [0, {MAX_LOGPROBS}]", param="logprobs")
        if req.echo:
            prompt_logprobs = logprobs
    else:
        top = req.top_logprobs
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise BadRequest(f"top_logprobs = {top}: must be in [0, {MAX_LOGPROBS}]", param="top_logprobs")
        if top is not None and not req.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs = (top or 0) if req.logprobs else None
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    if stop and (len(stop) > MAX_STOP_STRINGS or max(map(len, stop)) > MAX_STOP_CHARS):
        raise BadRequest(f"stop: {len(stop)} string(s) of up to {max(map(len, stop))} characters; the server takes "
                         f"at most {MAX_STOP_STRINGS} of at most {MAX_STOP_CHARS} characters each (each is looked "
                         "for after every token)", param="stop")
    fields = dict(
        max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
        seed=req.seed, stop=stop or None, stop_token_ids=in_vocab(req, "stop_token_ids", vocab_size) or None,
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty, logprobs=logprobs, n=req.n,
        logit_bias=logit_bias(req, vocab_size), allowed_token_ids=in_vocab(req, "allowed_token_ids", vocab_size),
        prompt_logprobs=prompt_logprobs, include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens and not (tool_plan is not None and tool_plan.keep_special),
        structured_outputs=structured_outputs(req, tool_plan),
        output_kind="delta",  # the server keeps each choice's text, ids and logprobs (serve/server.py)
    )
    try:
        return SamplingParams(**{k: v for k, v in fields.items() if v is not None})
    except RequestError as exc:
        raise client_error(exc, req, tool_plan) from exc
    except TypeError as exc:  # a field SamplingParams lacks
        raise BadRequest(str(exc)) from exc


def client_error(exc: RequestError, req: SamplingFields, tool_plan: tools.ToolPlan | None = None) -> BadRequest:
    """A refusal of the request's parameters, in the client's terms: the engine's messages name `SamplingParams`
    and `StructuredOutputsParams` fields (and a grammar conflict's `error_param`), which become the request fields
    they came from (`param` and message). Other messages keep their text and param."""
    text, param = str(exc), getattr(exc, "param", None)
    source = _structured_source(req, tool_plan)
    named = re.match(r"SamplingParams\.(\w+)", text)
    if named is not None:
        name = named.group(1)
        param = source if name == "structured_outputs" else _request_field(req, name)
        text = text.replace(named.group(0), param or name, 1)
    elif re.match(r"StructuredOutputsParams\b|structured outputs\b", text):
        kind = re.match(r"StructuredOutputsParams\.(\w+)", text)
        param = source
        text = re.sub(r"^StructuredOutputsParams(\.\w+)?", _structured_name(source, kind and kind.group(1)), text)
    elif param == "structured_outputs":  # the engine's error_param: a grammar that conflicts with other options
        param = source
        text = re.sub(r"^structured_outputs\b", source, text)
    return BadRequest(text, param=param, code=getattr(exc, "code", None))


def _structured_source(req: SamplingFields, tool_plan: tools.ToolPlan | None) -> str:
    """The request field the structured output comes from."""
    if tool_plan is not None and tool_plan.constrains:
        return "tools"
    return "structured_outputs" if req.structured_outputs is not None else "response_format"


def _structured_name(source: str, kind: str | None) -> str:
    """How a message names the structured output's `kind` (json, regex, ...) as the client gave it."""
    if source == "response_format":
        return "response_format's json_schema.schema" if kind == "json" else "response_format"
    if source == "tools":
        return "the JSON schema of the tools' function.parameters"
    return f"structured_outputs.{kind}" if kind else "structured_outputs"


def _request_field(req: SamplingFields, name: str) -> str | None:
    """The request field a `SamplingParams` field comes from (None: none the client can set)."""
    chat = isinstance(req, ChatCompletionRequest)
    if name == "max_tokens" and chat and req.max_completion_tokens is not None:
        return "max_completion_tokens"
    if name == "logprobs" and chat:
        return "top_logprobs" if req.top_logprobs is not None else "logprobs"
    if name == "prompt_logprobs":
        return "logprobs"  # completions' logprobs with echo
    return name if name in type(req).model_fields else None
