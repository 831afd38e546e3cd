"""A request's prompt as token ids, checked before anything is queued (`Engine.add_request`): text through
the tokenizer, token ids from a list, tuple, range, 1-D integer tensor or numpy array; every id an int in
the vocabulary, at least one, within the context limit with room for the tokens asked for. Each refusal is
a RequestError that names the fault. `new_request_id`: a new request's id; `check_abort_id`: an abort's.
"""

from __future__ import annotations

import uuid
from typing import Any

import torch

from pieceworks.engine.params import SamplingParams
from pieceworks.errors import RequestError
from pieceworks.executor.inputs import only_ints


def prompt_ids(prompt: Any, tokenizer: Any, vocab: int, max_context: int) -> list[int]:
    """The prompt's token ids (`tokenizer` None: no text prompts)."""
    ints = False  # every id known to be a plain int
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestError("a text prompt needs a tokenizer; this model has none (random weights): "
                               "pass token ids")
        try:
            ids = list(tokenizer(prompt)["input_ids"])
        except Exception as exc:  # the tokenizer's own refusal (e.g. a lone surrogate): this request's
            raise RequestError(f"the tokenizer can't encode this prompt ({type(exc).__name__}: {exc}); "
                               "send valid UTF-8 text or token ids") from None
    elif isinstance(prompt, torch.Tensor):
        if (prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.dtype.is_complex
                or prompt.dtype == torch.bool):
            raise RequestError(f"prompt tensor must be 1-D integer token ids, got {prompt.dtype} "
                               f"{list(prompt.shape)}")
        ids, ints = prompt.tolist(), True
    elif isinstance(prompt, list) and only_ints(prompt):  # the common case: plain ints
        ids, ints = list(prompt), True
    elif isinstance(prompt, (list, tuple, range)) or is_1d_array(prompt):
        ids = [int(t) if is_int(t) else t for t in prompt]
    else:  # bytes, a set or a dict would iterate as ids silently
        raise RequestError(f"prompt must be a str, a list of token ids or a 1-D integer array or tensor, "
                           f"got {type(prompt).__name__}")
    # plain ints in range: min and max say so (a per-id check costs ~0.5 us a token on a long prompt)
    plain = (ints or only_ints(ids)) and (not ids or (min(ids) >= 0 and max(ids) < vocab))
    bad = [] if plain else [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise RequestError(f"prompt token id(s) {bad[:5]} are not ints in the vocabulary "
                           f"[0, {vocab})")
    if not ids:
        raise RequestError("the prompt is empty; give at least one token")
    if len(ids) > max_context:
        raise RequestError(f"the prompt has {len(ids)} tokens, more than the context limit of "
                           f"{max_context} (model.max_context / KV pool size)")
    return ids


def check_fits(ids: list[int], params: SamplingParams, max_context: int) -> None:
    """Room in the context for the prompt and at least one (with max_tokens: that many; with min_tokens: that many)
    generated tokens."""
    if params.max_tokens is None and len(ids) >= max_context:
        raise RequestError(f"the prompt ({len(ids)} tokens) fills the context limit of {max_context}: no "
                           "room for a generated token; shorten the prompt")
    if params.max_tokens is None and len(ids) + params.min_tokens > max_context:  # (with max_tokens: min <= max)
        raise RequestError(f"SamplingParams.min_tokens: prompt ({len(ids)} tokens) + min_tokens ({params.min_tokens}) "
                           f"exceed the context limit of {max_context}; lower min_tokens or shorten the prompt")
    if params.max_tokens is not None and len(ids) + params.max_tokens > max_context:
        raise RequestError(
            f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceed the context limit "
            f"of {max_context}; lower max_tokens or shorten the prompt"
        )


def check_token_ids(params: SamplingParams, vocab: int, eos_ids: frozenset[int]) -> None:
    """logit_bias keys, allowed_token_ids and stop_token_ids name tokens of the vocabulary [0, vocab), and
    allowed_token_ids leaves a token that min_tokens does not hold back."""
    for name, ids in (("logit_bias", params.logit_bias), ("allowed_token_ids", params.allowed_token_ids),
                      ("stop_token_ids", params.stop_token_ids)):
        bad = sorted(t for t in ids or () if t >= vocab)
        if bad:
            raise RequestError(f"SamplingParams.{name}: token ids {bad[:5]} are outside the vocabulary [0, {vocab}); "
                               "use the model's token ids")
    held = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else set(eos_ids))
    if params.min_tokens and params.allowed_token_ids and held.issuperset(params.allowed_token_ids):
        raise RequestError(f"SamplingParams.allowed_token_ids={params.allowed_token_ids} holds only EOS / stop ids, "
                           f"which min_tokens={params.min_tokens} holds back: no token could be generated; allow "
                           "another token or drop min_tokens")


def checked_request(prompt: Any, params: Any, tokenizer: Any, vocab: int, max_context: int,
                    eos_ids: frozenset[int]) -> tuple[list[int], SamplingParams]:
    """A request's prompt ids and params as `Engine.add_request` takes them (its checks of the prompt and params)."""
    params = checked_params(params)
    ids = prompt_ids(prompt, tokenizer, vocab, max_context)
    check_fits(ids, params, max_context)
    check_token_ids(params, vocab, eos_ids)
    return ids, params


def prompt_list(prompts: Any) -> Any:
    """`Engine.generate`'s prompts as a sequence of prompts: one prompt (`is_one_prompt`) in a list, a list or a
    2-D array or tensor (a prompt per row) as it is."""
    if is_one_prompt(prompts):
        return [prompts]
    if not isinstance(prompts, (list, tuple)) and getattr(prompts, "ndim", None) != 2:
        raise RequestError(f"prompts must be a str, a list of token ids, a 1-D integer array or tensor, or a "
                           f"list of those, got {type(prompts).__name__}")
    return prompts


def checked_params(params: Any) -> SamplingParams:
    """`params`, or the defaults for None; RequestError for anything but a SamplingParams."""
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise RequestError(f"params must be a SamplingParams, got {type(params).__name__}")
    return params


def is_one_prompt(prompts: Any) -> bool:
    """Whether `Engine.generate`'s argument is one prompt (a str, a flat sequence of ids, a 1-D tensor or
    numpy array) rather than a list of prompts."""
    if isinstance(prompts, str) or is_1d_array(prompts):
        return True
    if isinstance(prompts, torch.Tensor):
        return prompts.dim() == 1
    return isinstance(prompts, (list, tuple)) and bool(prompts) and all(is_int(t) for t in prompts)


def is_1d_array(x: Any) -> bool:
    """A 1-D numpy array (one prompt of ids; its dtype is checked with the ids)."""
    return type(x).__module__ == "numpy" and getattr(x, "ndim", None) == 1


def is_int(t: Any) -> bool:
    """An int, numpy integer or 0-dim integer tensor (not a bool)."""
    if isinstance(t, bool):
        return False
    if isinstance(t, int):
        return True
    if isinstance(t, torch.Tensor):
        return t.dim() == 0 and not t.dtype.is_floating_point and t.dtype != torch.bool
    return type(t).__module__ == "numpy" and "int" in type(t).__name__


def check_abort_id(request_id: Any) -> None:
    """`abort` takes one request id, a str (AsyncEngine checks it before its loop thread meets it)."""
    if not isinstance(request_id, str):
        raise RequestError(f"abort takes one request id (a str), got {type(request_id).__name__} {request_id!r}")


def new_request_id(request_id: Any, running: dict, ready: list) -> str:
    """`request_id` checked (a non-empty str, not running, not just aborted with its outputs still in `ready`), or a
    fresh one where it is None."""
    request_id = uuid.uuid4().hex if request_id is None else request_id
    if not isinstance(request_id, str) or not request_id:
        raise RequestError(f"request_id must be a non-empty str, got {request_id!r}")
    if request_id in running:
        raise RequestError(f"request_id {request_id!r} is already running; use a new id")
    if any(o.request_id == request_id for o in ready):  # its abort outputs would mix in
        raise RequestError(f"request_id {request_id!r} was just aborted and its final outputs come "
                           "with the next step; use a new id (or step first)")
    return request_id
