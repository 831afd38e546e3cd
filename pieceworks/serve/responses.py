"""OpenAI's HTTP API responses as pydantic models: completions and chat completions (whole, or as stream chunks),
the model list, errors, and the server-sent event framing (`sse`)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, ClassVar, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, SerializationInfo, model_serializer


class ResponseModel(BaseModel):
    """A response body. Fields named in `omit_if_none` leave the JSON when they are None (extensions a
    client did not ask for, and the fields a stream delta does not carry: OpenAI's closing delta is {}); every other
    None is null."""

    model_config = ConfigDict(extra="forbid")
    omit_if_none: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _omit_nones(self, handler: Any, info: SerializationInfo) -> Any:
        data = handler(self)
        kept = (info.context or {}).get("nulls", ())  # fields a response sends as null all the same
        for key in self.omit_if_none:
            if data.get(key, 0) is None and key not in kept:
                del data[key]
        return data


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class UsageInfo(ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(ResponseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    token_ids: Optional[list[int]] = None
    omit_if_none: ClassVar[frozenset[str]] = frozenset({"token_ids"})


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None
    system_fingerprint: Optional[str] = None


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(ResponseModel):
    content: Optional[list[ChatLogprobToken]] = None


class FunctionCallOut(ResponseModel):
    name: str
    arguments: str


class ToolCallOut(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class DeltaFunctionCall(ResponseModel):
    """A streamed call's name (its first delta only) and the next piece of its arguments."""

    name: Optional[str] = None
    arguments: str = ""
    omit_if_none: ClassVar[frozenset[str]] = frozenset({"name"})


class DeltaToolCall(ResponseModel):
    """A piece of the `index`-th call: its first delta carries the id, type and name, as OpenAI's streams."""

    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: DeltaFunctionCall
    omit_if_none: ClassVar[frozenset[str]] = frozenset({"id", "type"})


class ChatMessageOut(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[ToolCallOut]] = None
    omit_if_none: ClassVar[frozenset[str]] = frozenset({"tool_calls", "reasoning_content"})


class ChatChoice(ResponseModel):
    index: int
    message: ChatMessageOut
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    token_ids: Optional[list[int]] = None
    omit_if_none: ClassVar[frozenset[str]] = frozenset({"token_ids"})


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Optional[UsageInfo] = None
    system_fingerprint: Optional[str] = None


class DeltaMessage(ResponseModel):
    role: Optional[Literal["assistant"]] = None
    omit_if_none: ClassVar[frozenset[str]] = frozenset({"role", "content", "tool_calls", "reasoning_content"})
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None


class ChatStreamChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    token_ids: Optional[list[int]] = None
    omit_if_none: ClassVar[frozenset[str]] = frozenset({"token_ids"})


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatStreamChoice]
    usage: Optional[UsageInfo] = None
    omit_if_none: ClassVar[frozenset[str]] = frozenset({"usage"})


class CompletionChunk(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None
    omit_if_none: ClassVar[frozenset[str]] = frozenset({"usage"})


class ModelCard(ResponseModel):
    """One served model; `max_model_len` as vLLM's, `vocab_size` so clients can build token-id prompts."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "pieceworks"
    max_model_len: int
    vocab_size: int


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(ResponseModel):
    error: ErrorInfo


def sse(payload: BaseModel | dict | str, nulls: tuple[str, ...] = ()) -> str:
    """One server-sent event: `data: <json>` and a blank line (`data: [DONE]` for the string). `nulls`: fields
    of `omit_if_none` a model's JSON keeps as null (a stream's `usage` before its usage chunk)."""
    if isinstance(payload, BaseModel):
        payload = payload.model_dump_json(context={"nulls": nulls})
    elif isinstance(payload, dict):
        payload = json.dumps(payload)
    return f"data: {payload}\n\n"
