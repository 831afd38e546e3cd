"""Perplexity: the scoring protocol shared by pieceworks' eval and the `transformers` reference.

Protocol (what `plan_windows()` returns and both sides must follow):

1. The text is tokenized once, as a whole, with the model's tokenizer and no special tokens
   (`tokenizer(text, add_special_tokens=False)`; SmolLM2 adds none anyway): ids t[0..N-1].
2. Window k feeds t[k*stride : k*stride + window] (the last window may be shorter) as a fresh
   sequence at positions 0.. with no cache from earlier windows. Windows continue until one
   reaches t[N-1]; a last window of a single token (nothing to score) is dropped.
3. In a window starting at s, the logits at position i predict t[s+i+1]. A token is scored in the
   first window that has context for it and has not scored it yet: window k scores t[j] for
   max(s+1, end of window k-1) <= j < end of window k. So t[0] is never scored, and with
   stride == window (the default, non-overlapping windows) the first token of every window is
   context only: num_scored = N - number of windows.
4. nll_sum = sum over scored tokens of -log softmax(logits)[target], accumulated in float64 from
   fp32 log-probs; ppl = exp(nll_sum / num_scored).

`pieceworks eval-ppl` uses the default (stride == window): `windows(ids)` gives the chunks to feed,
`perplexity_from_logits` scores the executor's logits for them. `reference_perplexity_transformers`
is the same protocol run by `transformers`, for parity checks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEFAULT_WINDOW = 512  # tokens per window (`pieceworks eval-ppl` takes the model's context where that is shorter)


def perplexity(nll_sum: float, num_tokens: int) -> float:
    """exp(mean negative log-likelihood) over `num_tokens` scored tokens (natural log)."""
    if num_tokens <= 0:
        raise ValueError(f"perplexity needs at least one scored token, got num_tokens={num_tokens}")
    return math.exp(nll_sum / num_tokens)


@dataclass(frozen=True)
class Window:
    """One forward pass of the protocol: feed ids[start:end], score targets ids[first_scored:end].

    The logit row predicting ids[j] is row j - start - 1 of this window's [end - start, vocab] logits.
    """

    start: int
    end: int
    first_scored: int

    @property
    def num_scored(self) -> int:
        return self.end - self.first_scored


def plan_windows(num_tokens: int, window: int = DEFAULT_WINDOW, stride: int = DEFAULT_WINDOW) -> list[Window]:
    """The windows of the protocol for a text of `num_tokens` tokens (see the module docstring).

    Raises:
        ValueError: window < 2, or stride outside 1..window.
    """
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens (one context, one scored), got {window}")
    if not 1 <= stride <= window:
        raise ValueError(f"stride must be in 1..window ({window}), got {stride}")
    out: list[Window] = []
    scored_until = 1  # t[0] has no context
    start = 0
    while scored_until < num_tokens and start + 1 < num_tokens:
        end = min(start + window, num_tokens)
        first = max(start + 1, scored_until)
        assert first < end, (start, end, first)
        out.append(Window(start, end, first))
        scored_until = end
        start += stride
    return out


def windows(ids: Sequence[int], window: int = DEFAULT_WINDOW) -> list[list[int]]:
    """The token chunks to feed for non-overlapping windows (stride == window), one list per forward.

    Score them with `perplexity_from_logits`: every chunk's first token is context only.
    """
    return [list(ids[w.start : w.end]) for w in plan_windows(len(ids), window, window)]


def window_nll(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Sum of -log softmax(logits)[target] in float64 from float32 log-probs.

    Args:
        logits: [T, vocab] any float dtype, row t predicting targets[t].
        targets: [T] int64 token ids.
    """
    import torch

    logp = torch.log_softmax(logits.float(), dim=-1).gather(1, targets.long()[:, None])
    return -logp.double().sum().item()


def perplexity_from_logits(logits: Sequence[torch.Tensor], chunks: Sequence[Sequence[int]]) -> tuple[float, int]:
    """Perplexity of chunks from `windows()` given their per-position logits.

    Args:
        logits: one [len(chunk), vocab] tensor per chunk (row i predicts chunk[i + 1]).
        chunks: the token chunks, as `windows()` returns them.

    Returns:
        (ppl, num_scored), num_scored = sum(len(chunk) - 1).
    """
    import torch

    if len(logits) != len(chunks):
        raise ValueError(f"got logits for {len(logits)} chunks but {len(chunks)} chunks")
    nll_sum, num_scored = 0.0, 0
    for lg, chunk in zip(logits, chunks):
        if lg.shape[0] != len(chunk):
            raise ValueError(f"logits have {lg.shape[0]} rows for a chunk of {len(chunk)} tokens")
        nll_sum += window_nll(lg[:-1], torch.as_tensor(chunk[1:], device=lg.device))
        num_scored += len(chunk) - 1
    return perplexity(nll_sum, num_scored), num_scored


@dataclass(frozen=True)
class PerplexityResult:
    """A perplexity with its parts: `ppl == perplexity(nll_sum, num_scored)`."""

    ppl: float
    nll_sum: float
    num_scored: int
    num_windows: int


def encode(model_dir: str | Path, text: str) -> list[int]:
    """The token ids of `text` under the protocol: the checkpoint's tokenizer, no special tokens."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)(text, add_special_tokens=False)["input_ids"]


def reference_perplexity_transformers(
    model_dir: str | Path, text: str, window: int = DEFAULT_WINDOW, stride: int = DEFAULT_WINDOW, dtype=None
) -> PerplexityResult:
    """Perplexity of `text` under the checkpoint in `model_dir`, computed by `transformers`.

    Args:
        model_dir: a Hugging Face checkpoint directory with its tokenizer.
        text: the text to score (tokenized whole; see the module docstring for the protocol).
        window: tokens per forward pass (at most the model's context).
        stride: tokens between window starts; `window` gives non-overlapping windows.
        dtype: compute dtype, default torch.float32 (weights are upcast on load).

    Returns:
        `PerplexityResult` (ppl, nll_sum, num_scored, num_windows).
    """
    import torch
    from transformers import AutoModelForCausalLM

    ids = torch.tensor(encode(model_dir, text), dtype=torch.long)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype or torch.float32)
    model.eval()
    nll_sum, num_scored = 0.0, 0
    plan = plan_windows(len(ids), window, stride)
    with torch.inference_mode():
        for w in plan:
            logits = model(input_ids=ids[w.start : w.end][None]).logits[0]  # [T, vocab]
            rows = logits[w.first_scored - w.start - 1 : w.end - w.start - 1]
            nll_sum += window_nll(rows, ids[w.first_scored : w.end])
            num_scored += w.num_scored
    return PerplexityResult(perplexity(nll_sum, num_scored), nll_sum, num_scored, len(plan))
