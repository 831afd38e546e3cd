"""SamplingParams: what a request asks of the sampler, with vLLM's names and defaults.

Every field is checked once, in `__post_init__`, so a bad request is refused with a `RequestError`
that names the field, the value and the allowed range before it reaches the scheduler. numpy and
0-dim torch scalars are accepted and stored as plain Python numbers (the sampler reads these fields
every step and must not touch a tensor to do so); `bool` is never taken for a number.
"""

from __future__ import annotations

import copy
import json
import math
import numbers
from dataclasses import dataclass
from typing import Any

from pieceworks.errors import RequestError

#: Temperatures below this are greedy, as in vLLM: dividing logits by ~0 overflows float32.
GREEDY_TEMPERATURE = 1e-5
#: Most top logprobs a request may ask for per generated token (vLLM's default cap).
MAX_LOGPROBS = 20
#: Most completions per prompt: each is a request of its own, built at once (Engine.add_request with n = 65,536:
#: 0.51 s on the 2-core CPU VM, tiny Llama, 2026-12-07).
MAX_N = 65536
OUTPUT_KINDS = ("cumulative", "delta")
_SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts
# the magnitudes float32 (the sampler's dtype, as vLLM's) holds as normal numbers
_F32_TINY, _F32_MAX = 1.1754943508222875e-38, 3.4028234663852886e38


def _scalar(value: Any) -> Any:
    """A 0-dim torch tensor as its Python number; anything else unchanged (torch stays optional here)."""
    if type(value).__module__ == "torch" and getattr(value, "ndim", None) == 0:
        return value.item()
    return value


def _shown(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _int(name: str, value: Any, allowed: str) -> int:
    if type(value) is int:  # the common case, without the slower abstract-class checks
        return value
    value = _scalar(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise RequestError(f"SamplingParams.{name} must be an int ({allowed}), got {_shown(value)}")
    return int(value)


def _float(name: str, value: Any, allowed: str) -> float:
    if type(value) in (float, int):
        value = float(value)
        if not math.isfinite(value):
            raise RequestError(f"SamplingParams.{name} must be finite ({allowed}), got {value!r}")
        return value
    value = _scalar(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RequestError(f"SamplingParams.{name} must be a number ({allowed}), got {_shown(value)}")
    value = float(value)
    if not math.isfinite(value):
        raise RequestError(f"SamplingParams.{name} must be finite ({allowed}), got {value!r}")
    return value


def _in_float32(name: str, value: float, allowed: str, tiny_ok: bool = False) -> None:
    """Refuse a value the sampler's float32 can't hold: one that overflows to inf or (unless `tiny_ok`) a
    nonzero one that underflows toward 0 (temperature 1e39 would sample token 0 every step)."""
    if abs(value) > _F32_MAX or (not tiny_ok and value != 0 and abs(value) < _F32_TINY):
        raise RequestError(f"SamplingParams.{name}={value!r} is out of range: the sampler computes in float32, "
                           f"which holds magnitudes {_F32_TINY:.3g}..{_F32_MAX:.3g} ({allowed})")


def _check(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise RequestError(f"SamplingParams.{name}={value!r} is out of range: allowed {allowed}")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What a request's output must match (vLLM's `StructuredOutputsParams`): exactly one of `json` (a JSON
    schema, as a dict or its JSON text), `regex`, `choice` (a list of strings: the output is one of them),
    `grammar` (Lark, or llama.cpp's GBNF) or `json_object` (any JSON object). Enforced token by token with
    llguidance (engine/structured.py); `disable_any_whitespace` keeps JSON to the compact separators
    instead of any whitespace between tokens (vLLM's flag: small models otherwise tend to emit runs of it).
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        where = "StructuredOutputsParams"
        for name in ("json_object", "disable_any_whitespace"):
            if type(getattr(self, name)) is not bool:
                raise RequestError(f"{where}.{name} must be a bool, got {_shown(getattr(self, name))}")
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise RequestError(f"{where} takes exactly one of json, regex, choice, grammar or json_object=True; "
                               f"got {', '.join(given) if given else 'none'}")
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than Python's stack
                raise RequestError(f"{where}.json is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise RequestError(f"{where}.json must be a JSON schema (an object), got {self.json!r}")
            if schema is False:
                raise RequestError(f"{where}.json is the schema false, which no JSON value matches; give a schema "
                                   "that some value satisfies (true, or {}, for any value)")
        elif self.json is not None and not isinstance(self.json, dict):
            raise RequestError(f"{where}.json must be a JSON schema (a dict or its JSON text), got {_shown(self.json)}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise RequestError(f"{where}.{name} must be a non-empty str, got {_shown(value)}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or not all(
                    isinstance(c, str) and c for c in self.choice):
                raise RequestError(f"{where}.choice must be a non-empty list of non-empty str, got {self.choice!r}")
            object.__setattr__(self, "choice", list(self.choice))

    @property
    def kind(self) -> str:
        """Which of the fields is set: "json", "regex", "choice", "grammar" or "json_object"."""
        if self.json_object:
            return "json_object"
        return next(n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples; names and defaults as vLLM's `SamplingParams`.

    Processing order per step (vLLM v1's): tokens outside allowed_token_ids and (min_tokens) EOS/stop ids
    are masked, logit_bias is added, then the penalties, then greedy rows take the argmax; sampled rows
    apply temperature, min_p, top_k, top_p and draw.
    """

    max_tokens: int | None = 16
    """Most tokens to generate; None: up to the context limit."""
    temperature: float = 1.0
    """Softmax temperature, >= 0; below 1e-5 (0 included) the request is greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of top tokens whose probability reaches top_p, (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1: off."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's, [0, 1]; 0: off."""
    seed: int | None = None
    """Seed of the request's own generator: the same prompt and seed give the same tokens whatever else
    is in the batch (under speculative decoding, for the same batches only: docs/sampling.md). None: the
    engine's shared generator."""
    stop: list[str] | None = None
    """Stop strings (need a tokenizer); the text ends before them. A single str is taken as [str]."""
    include_stop_str_in_output: bool = False
    """Keep the stop string that ended the text at its end, or the text of the EOS / stop token id that ended the
    request (empty for a special token under skip_special_tokens) (vLLM's field)."""
    skip_special_tokens: bool = True
    """Leave special tokens (EOS, chat markers) out of the text (vLLM's field; the token ids keep them)."""
    stop_token_ids: list[int] | None = None
    """Token ids that end the request besides EOS (the stop token is in the output ids, its text only with
    include_stop_str_in_output); ids below the vocabulary size."""
    ignore_eos: bool = False
    """Keep generating past EOS (stop_token_ids still stop)."""
    min_tokens: int = 0
    """EOS and stop_token_ids can't be sampled before this many tokens are generated."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already generated, [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was generated, [-2, 2]."""
    repetition_penalty: float = 1.0
    """Divides positive (multiplies negative) logits of tokens in the prompt or output; > 0, 1: off."""
    logprobs: int | None = None
    """Return this many top logprobs per generated token plus the sampled token's, 0..20; None: off."""
    prompt_logprobs: int | None = None
    """Also return the prompt's logprobs: per prompt token after the first, {token id: logprob} of that
    token and the top `prompt_logprobs` at its position, 0..20 (vLLM's field); the first token's entry
    is None. Such a completion computes its whole prompt (no prefix-cache reuse), at most 1,024 tokens per
    step; those steps wait for their logits on the host before sampling. None: off."""
    n: int = 1
    """Completions per prompt (they share the prompt's KV pages; seeded ones use seed + index)."""
    allowed_token_ids: list[int] | None = None
    """Only these token ids can be generated (vLLM's allowed_token_ids): every other logit is -inf before
    min_tokens, logit_bias and the penalties; a non-empty list of ids below the vocabulary size. None: off."""
    logit_bias: dict[int, float] | None = None
    """Added to the logits of these token ids (ints >= 0, below the vocabulary size) before the penalties
    and sampling, greedy rows included (OpenAI's and vLLM's logit_bias; -100 all but bans a token, 100
    all but forces it); finite values. Logprobs stay those of the raw logits. None or {}: off."""
    structured_outputs: StructuredOutputsParams | None = None
    """Hold the output to a JSON schema, regex, choice or grammar (needs the model's tokenizer and
    llguidance). Tokens the grammar does not allow next are -inf before every other step of the
    processing; the completion ends with "stop" once the grammar is complete. None: off."""
    output_kind: str = "cumulative"
    """What each `RequestOutput` carries (vLLM's RequestOutputKind): "cumulative", the whole output so far in
    token_ids, logprobs and text; "delta", this step's part of them only (token_ids as new_token_ids, text as
    text_delta), so that a consumer which keeps its own copy (a server's stream) costs no copy of the whole
    output per step."""

    def __post_init__(self) -> None:
        put = object.__setattr__  # frozen: normalized values are written once here
        if self.max_tokens is not None:
            put(self, "max_tokens", _int("max_tokens", self.max_tokens, ">= 1 or None"))
            _check(self.max_tokens >= 1, "max_tokens", self.max_tokens, ">= 1 or None")
        put(self, "temperature", _float("temperature", self.temperature, ">= 0"))
        _check(self.temperature >= 0, "temperature", self.temperature, ">= 0 (0 = greedy)")
        put(self, "top_p", _float("top_p", self.top_p, "0 < top_p <= 1"))
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "0 < top_p <= 1 (1 = off)")
        put(self, "top_k", _int("top_k", self.top_k, "-1 or >= 0"))
        _check(self.top_k >= -1, "top_k", self.top_k, "-1 or >= 0 (0 and -1 = off)")
        put(self, "min_p", _float("min_p", self.min_p, "0 <= min_p <= 1"))
        _check(0 <= self.min_p <= 1, "min_p", self.min_p, "0 <= min_p <= 1 (0 = off)")
        if self.seed is not None:
            put(self, "seed", _int("seed", self.seed, "an int or None"))
            lo, hi = _SEED_RANGE
            _check(lo <= self.seed <= hi, "seed", self.seed, f"{lo} <= seed <= {hi} or None")
        put(self, "stop", self._stop_strings(self.stop))
        put(self, "stop_token_ids", self._ids("stop_token_ids", self.stop_token_ids))
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            flag = _scalar(getattr(self, name))
            if type(flag).__name__ not in ("bool", "bool_"):
                raise RequestError(f"SamplingParams.{name} must be a bool, got {_shown(flag)}")
            put(self, name, bool(flag))
        put(self, "min_tokens", _int("min_tokens", self.min_tokens, ">= 0"))
        _check(self.min_tokens >= 0, "min_tokens", self.min_tokens, ">= 0")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
                   f"<= max_tokens ({self.max_tokens})")
        for name in ("presence_penalty", "frequency_penalty"):
            put(self, name, _float(name, getattr(self, name), "-2 <= value <= 2"))
            _check(-2 <= getattr(self, name) <= 2, name, getattr(self, name), "-2 <= value <= 2 (0 = off)")
        put(self, "repetition_penalty", _float("repetition_penalty", self.repetition_penalty, "> 0"))
        _check(self.repetition_penalty > 0, "repetition_penalty", self.repetition_penalty, "> 0 (1 = off)")
        if self.logprobs is not None:
            put(self, "logprobs", _int("logprobs", self.logprobs, f"0..{MAX_LOGPROBS} or None"))
            _check(0 <= self.logprobs <= MAX_LOGPROBS, "logprobs", self.logprobs, f"0..{MAX_LOGPROBS} or None")
        put(self, "logit_bias", self._bias(self.logit_bias))
        if self.allowed_token_ids is not None:
            put(self, "allowed_token_ids", self._ids("allowed_token_ids", self.allowed_token_ids))
            _check(len(self.allowed_token_ids) > 0, "allowed_token_ids", self.allowed_token_ids,
                   "a non-empty list of ints >= 0 or None")
        if self.prompt_logprobs is not None:
            put(self, "prompt_logprobs", _int("prompt_logprobs", self.prompt_logprobs, f"0..{MAX_LOGPROBS} or None"))
            _check(0 <= self.prompt_logprobs <= MAX_LOGPROBS, "prompt_logprobs", self.prompt_logprobs,
                   f"0..{MAX_LOGPROBS} or None")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise RequestError("SamplingParams.structured_outputs must be a StructuredOutputsParams or None, got "
                               f"{_shown(self.structured_outputs)}")
        if self.output_kind not in OUTPUT_KINDS:
            raise RequestError(f"SamplingParams.output_kind must be one of {', '.join(OUTPUT_KINDS)}, got "
                               f"{_shown(self.output_kind)}")
        put(self, "n", _int("n", self.n, f"1..{MAX_N}"))
        _check(1 <= self.n <= MAX_N, "n", self.n, f"1..{MAX_N}")
        _in_float32("temperature", self.temperature, ">= 0", tiny_ok=True)  # below 1e-5: greedy
        for name, allowed in (("top_p", "0 < top_p <= 1"), ("min_p", "0 or 0 < min_p <= 1"),
                              ("presence_penalty", "0 or 0 < |value| <= 2"),
                              ("frequency_penalty", "0 or 0 < |value| <= 2"), ("repetition_penalty", "> 0")):
            _in_float32(name, getattr(self, name), allowed)

    def with_max_tokens(self, max_tokens: int | None) -> "SamplingParams":
        """A copy with another max_tokens, checked as construction checks it (RequestError), the other fields
        shared as they are: a server's prompts of one request check their stop strings, ids and logit_bias once."""
        if max_tokens is not None:
            max_tokens = _int("max_tokens", max_tokens, ">= 1 or None")
            _check(max_tokens >= 1, "max_tokens", max_tokens, ">= 1 or None")
            _check(self.min_tokens <= max_tokens, "min_tokens", self.min_tokens, f"<= max_tokens ({max_tokens})")
        out = copy.copy(self)
        object.__setattr__(out, "max_tokens", max_tokens)
        return out

    @staticmethod
    def _stop_strings(stop: Any) -> list[str] | None:
        if stop is None:
            return None
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)):
            raise RequestError(f"SamplingParams.stop must be a str, a list of str or None, got {_shown(stop)}")
        for s in stop:
            if not isinstance(s, str) or not s:
                raise RequestError(f"SamplingParams.stop holds {s!r}: every stop string must be a non-empty str")
        return list(stop)

    @staticmethod
    def _ids(name: str, ids: Any) -> list[int] | None:
        if ids is None:
            return None
        if hasattr(ids, "tolist") and not isinstance(ids, (list, tuple)):  # numpy array or 1-dim tensor
            ids = ids.tolist()
        if not isinstance(ids, (list, tuple)):
            raise RequestError(f"SamplingParams.{name} must be a list of ints >= 0 or None, got {_shown(ids)}")
        out = [_int(name, i, "a list of ints >= 0") for i in ids]
        for i in out:
            _check(i >= 0, name, ids, "a list of ints >= 0")
        return out

    @staticmethod
    def _bias(bias: Any) -> dict[int, float] | None:
        if bias is None:
            return None
        if not isinstance(bias, dict):
            raise RequestError(f"SamplingParams.logit_bias must be a dict of token id -> bias or None, got "
                               f"{_shown(bias)}")
        out = {}
        for tok, value in bias.items():
            tok = _int("logit_bias", tok, "token ids >= 0 as keys")
            _check(tok >= 0, "logit_bias", tok, "token ids >= 0 as keys")
            out[tok] = _float("logit_bias", value, "finite biases")
            _in_float32("logit_bias", out[tok], "finite biases", tiny_ok=True)
        return out or None

    @property
    def greedy(self) -> bool:
        """Argmax instead of sampling: temperature below 1e-5 (0 included) or top_k == 1."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        """Whether any of presence, frequency or repetition penalty changes the logits."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


__all__ = ["SamplingParams", "StructuredOutputsParams", "GREEDY_TEMPERATURE", "MAX_LOGPROBS"]
