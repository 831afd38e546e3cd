"""OpenAI's HTTP API requests as pydantic models (the responses are serve/responses.py's).

The request models mirror OpenAI's `/v1/completions` and `/v1/chat/completions` bodies (names, types,
defaults), plus the extensions vLLM's server accepts (`top_k`, `min_p`, `repetition_penalty`,
`stop_token_ids`, `allowed_token_ids`, `ignore_eos`, `min_tokens`, `include_stop_str_in_output`,
`skip_special_tokens`, `spaces_between_special_tokens`, `return_token_ids`, `priority`, `structured_outputs`, the
chat template options), so clients written for either work unchanged. Requests are strict: a field of the wrong
type or a field the API does not have is a 400, and an OpenAI field whose behaviour pieceworks does not implement
(`suffix`) is refused by name instead of being ignored (OpenAI's fields that change nothing here, such as `metadata`,
are accepted). `parse_body` turns a body into a model, or a 400 that says what is wrong.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, TypeVar, Union

import pydantic
from pydantic import BaseModel, ConfigDict

from pieceworks.errors import RequestError

# OpenAI caps top logprobs at 20 in both APIs.
MAX_LOGPROBS = 20


class BadRequest(RequestError):
    """A request the server refuses with HTTP `status` (400; 404 for a model it does not serve); `param` names the
    offending field (None: the body)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.param = param
        self.code = code
        self.status = status


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# ---- requests ------------------------------------------------------------------------------------


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class SamplingFields(OpenAIModel):
    """The fields both endpoints share; None means the API's default."""

    model: str
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: Optional[int] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    # vLLM's extensions
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    stop_token_ids: Optional[list[int]] = None
    allowed_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # accepted, the same text either way: fast tokenizers (transformers' from tokenizer.json) decode special tokens
    # without spaces between them whatever the value, as vLLM's fast-tokenizer path does
    spaces_between_special_tokens: bool = True
    priority: int = 0
    ignore_eos: bool = False
    min_tokens: int = 0
    return_token_ids: bool = False
    # structured outputs: OpenAI's (chat; vLLM takes it for completions too) and vLLM's
    response_format: Optional[dict[str, Any]] = None
    structured_outputs: Optional[dict[str, Any]] = None


class CompletionRequest(SamplingFields):
    """POST /v1/completions. `prompt`: text, token ids, or a list of either (one choice set each)."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = None
    echo: Optional[bool] = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    """One message. An assistant message as OpenAI's client returns it (`message.model_dump()`) comes back with
    `refusal`, `annotations` (ignored), `audio` and `function_call`; `prompts.check_messages` refuses what of
    them the server can't honour, and content missing where the role needs it."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_call_id: Optional[str] = None
    refusal: Optional[str] = None
    annotations: Optional[list[Any]] = None
    audio: Optional[Any] = None
    function_call: Optional[Any] = None
    reasoning_content: Optional[str] = None  # an answer's reasoning, as `--reasoning-parser` returns it

    def text(self) -> str:
        if isinstance(self.content, list):  # text parts, one per line (vLLM's join for string templates)
            return "\n".join(p.text for p in self.content)
        if not self.content and self.refusal is not None:  # an assistant turn that refused: the refusal is its text
            return self.refusal
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions: the messages go through the tokenizer's chat template."""

    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    reasoning_effort: Optional[str] = None  # the chat template's variable `reasoning_effort`, as vLLM's
    # OpenAI's fields without effect here (store, metadata, service_tier, prompt_cache_key, safety_identifier), or
    # refused where set:
    # `mapping.refuse_unsupported`
    store: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None  # OpenAI's cache routing hint (prefix caching needs none)
    safety_identifier: Optional[str] = None  # OpenAI's end-user id, as `user`
    modalities: Optional[list[str]] = None
    verbosity: Optional[str] = None
    audio: Optional[Any] = None
    prediction: Optional[Any] = None
    web_search_options: Optional[Any] = None
    functions: Optional[Any] = None
    function_call: Optional[Any] = None
    # vLLM's chat template options
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None


class TokenizeRequest(OpenAIModel):
    """POST /tokenize (vLLM's): the token ids a completions prompt of this text gets."""

    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True


class DetokenizeRequest(OpenAIModel):
    """POST /detokenize (vLLM's): the text of token ids."""

    model: Optional[str] = None
    tokens: list[int]


T = TypeVar("T", bound=BaseModel)

# Fields of several shapes (unions): pydantic reports the first shape's complaint ("prompt.str: Input should be
# a valid string"); these say what the field takes instead.
_SHAPES = {
    "prompt": "a string, a list of token ids, or a list of either",
    "content": 'a string or a list of {"type": "text", "text": ...} parts',
}


def parse_body(body: bytes, model: type[T]) -> T:
    """A request body as `model`, or a BadRequest that says what is wrong (invalid JSON; a field's problem, for
    a field of several shapes what it takes)."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than Python's stack
        raise BadRequest(f"the body is not valid JSON: {exc}", code="invalid_json") from exc
    try:
        return model.model_validate_json(body)
    except pydantic.ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        if err["type"] == "json_invalid":  # JSON Python reads and pydantic does not: a lone surrogate escape
            raise BadRequest(f"the body is not valid JSON: {err['msg'].removeprefix('Invalid JSON: ')}",
                             code="invalid_json") from exc
        at = next((i for i, part in enumerate(err["loc"]) if part in _SHAPES), None)
        if at is not None and err["type"] != "missing":
            path = err["loc"][: at + 1]
            name = ".".join(str(x) for x in path)
            raise BadRequest(f"{name} must be {_SHAPES[path[-1]]} (got {_value_at(data, path)!r})",
                             param=name) from exc
        loc = ".".join(str(x) for x in err["loc"])
        raise BadRequest(f"{loc}: {err['msg']} (got {err.get('input')!r})" if loc else err["msg"],
                         param=loc or None) from exc


def _value_at(data: Any, path: tuple) -> Any:
    """The request body's value at a validation error's location (keys and list indices)."""
    for part in path:
        try:
            data = data[part]
        except (KeyError, IndexError, TypeError):
            return None
    return data
