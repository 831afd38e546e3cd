"""An OpenAI request's prompts as the token ids the engine takes: /v1/completions' prompts (text or ids), their
echo, and /v1/chat/completions' messages, checked by OpenAI's rules and rendered by the model's chat template.

Every check raises `BadRequest` before anything reaches the engine (serve/mapping.py maps the sampling fields).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from pieceworks.errors import RequestError
from pieceworks.models.tokenizer import render_chat
from pieceworks.serve import tools
from pieceworks.serve.protocol import BadRequest, ChatCompletionRequest, CompletionRequest

# apply_chat_template's own arguments, which chat_template_kwargs may not set: they would reach the renderer or
# the tokenizer (truncation, padding, ...) instead of the template; `_template_arguments` adds the installed
# transformers' named parameters
TEMPLATE_ARGUMENTS = {"conversation", "messages", "tokenize", "return_dict", "add_generation_prompt",
                      "continue_final_message", "tools", "documents", "chat_template", "return_tensors", "padding",
                      "truncation", "max_length", "return_assistant_tokens_mask", "tokenizer_kwargs",
                      "sanitize_control_tokens"}


def completion_prompts(req: CompletionRequest, tokenizer: Any, vocab_size: int,
                       check_count: Callable[[int], None] | None = None) -> list[list[int]]:
    """The request's prompts as token-id lists (text needs the model's tokenizer). `check_count(number of prompts)`
    runs before any prompt is read (the server's bound on one request's completions)."""
    p = req.prompt
    prompts: list[str | list[int]]
    if isinstance(p, str):
        prompts = [p]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [p]
    else:
        prompts = list(p)
    if not prompts:
        raise BadRequest("prompt is empty: give a string, a list of token ids, or a list of either", param="prompt")
    if check_count is not None:
        check_count(len(prompts))
    out = []
    for prompt in prompts:
        if isinstance(prompt, str):
            if tokenizer is None:
                raise BadRequest("this model has no tokenizer (random weights): give the prompt as token ids",
                                 param="prompt")
            ids = tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise BadRequest(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})",
                                 param="prompt")
        if not ids:
            raise BadRequest("a prompt is empty (no tokens)", param="prompt")
        out.append(ids)
    return out


def echo_texts(req: CompletionRequest, tokenizer: Any, prompts: list[list[int]]) -> list[str] | None:
    """With `echo`, each prompt's text as the response repeats it: a text prompt as given, token ids
    decoded (empty without a tokenizer)."""
    if not req.echo:
        return None
    texts = [req.prompt] if isinstance(req.prompt, str) else [p for p in req.prompt if isinstance(p, str)]
    if len(texts) == len(prompts):
        return texts
    return [tokenizer.decode(ids) if tokenizer is not None else "" for ids in prompts]


def _template_arguments(tokenizer: Any) -> set[str]:
    try:
        params = inspect.signature(tokenizer.apply_chat_template).parameters.values()
    except (TypeError, ValueError):  # no signature to read
        params = []
    return TEMPLATE_ARGUMENTS | {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def check_messages(req: ChatCompletionRequest) -> None:
    """OpenAI's rules for a message's fields: content on every role but the assistant's, whose turn may instead
    carry tool_calls or a refusal; `refusal`, `annotations`, `audio`, `function_call` and `reasoning_content` on
    assistant messages only, `audio` and `function_call` null (an audio answer, a legacy call: this server makes
    neither)."""
    if not req.messages:
        raise BadRequest("messages is empty: give at least one message", param="messages")
    for i, m in enumerate(req.messages):
        at = f"messages.{i}"
        empty = m.content is None or m.content == []
        if m.role != "assistant":
            fields = ("refusal", "annotations", "audio", "function_call", "reasoning_content")
            extra = next((f for f in fields if getattr(m, f) is not None), None)
            if extra is not None:
                raise BadRequest(f"{at}.{extra}: only assistant messages carry {extra}; this is a {m.role!r} "
                                 "message", param=f"{at}.{extra}")
            if empty:
                raise BadRequest(f"{at}.content: a {m.role!r} message needs content: a string or a list of "
                                 '{"type": "text", "text": ...} parts', param=f"{at}.content")
            continue
        if m.audio is not None:
            raise BadRequest(f"{at}.audio: audio is not supported (this server answers in text only); send the "
                             "turn's transcript as content and leave audio out or null", param=f"{at}.audio")
        if m.function_call is not None:
            raise BadRequest(f"{at}.function_call: the legacy function_call is not supported; send the call as "
                             "tool_calls", param=f"{at}.function_call")
        if empty and not m.tool_calls and m.refusal is None:
            raise BadRequest(f"{at}.content: an assistant message needs content, tool_calls or a refusal",
                             param=f"{at}.content")


def chat_prompt(req: ChatCompletionRequest, tokenizer: Any, tool_plan: tools.ToolPlan | None = None) -> list[int]:
    """The messages rendered by the tokenizer's chat template, with the assistant turn opened (and the
    plan's tools as the template's `tools`); `reasoning_effort` is the template's variable of that name."""
    check_messages(req)
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise BadRequest("this model has no chat template: use /v1/completions", param="messages")
    if req.continue_final_message and (req.add_generation_prompt or req.messages[-1].role != "assistant"):
        raise BadRequest("continue_final_message continues the last message: it must be the assistant's, with "
                         "add_generation_prompt: false", param="continue_final_message")
    reserved = set(req.chat_template_kwargs or ()) & _template_arguments(tokenizer)
    if reserved:
        raise BadRequest(f"chat_template_kwargs sets {sorted(reserved)}: apply_chat_template's own arguments, "
                         "not template variables; the server sets them (use the request's own fields, such as "
                         "add_generation_prompt or tools)", param="chat_template_kwargs")
    given = (req.chat_template_kwargs or {}).get("reasoning_effort", req.reasoning_effort)
    if req.reasoning_effort is not None and given != req.reasoning_effort:
        raise BadRequest(f"reasoning_effort={req.reasoning_effort!r} and chat_template_kwargs' reasoning_effort="
                         f"{given!r} disagree: give one of them", param="reasoning_effort")
    msgs = tools.template_messages(req)
    kwargs = {**({"reasoning_effort": req.reasoning_effort} if req.reasoning_effort is not None else {}),
              **(req.chat_template_kwargs or {}), **({"tools": tool_plan.tools} if tool_plan else {})}
    try:
        try:
            return render_chat(tokenizer, msgs, add_generation_prompt=req.add_generation_prompt,
                               continue_final_message=req.continue_final_message, template_kwargs=kwargs or None)
        except RequestError as exc:
            # Earlier tool calls' arguments go in as objects (Hugging Face's convention); a template that adds
            # them to a string (DeepSeek-V3's) fails on that with a TypeError and reads them as JSON text.
            if not isinstance(exc.__cause__, TypeError) or not any(m.tool_calls for m in req.messages):
                raise
            return render_chat(tokenizer, tools.template_messages(req, arguments_as_text=True),
                               add_generation_prompt=req.add_generation_prompt,
                               continue_final_message=req.continue_final_message, template_kwargs=kwargs or None)
    except RequestError as exc:  # the template refused the conversation (e.g. roles out of order); the client
        # gets Jinja's message, not the server's file paths. Errors that are not the template's are a 500.
        cause = exc.__cause__
        raise BadRequest(f"the chat template refused the messages: {type(cause).__name__}: {cause}",
                         param="messages") from exc
