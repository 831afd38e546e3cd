"""Incremental detokenization with stop strings.

Decoding a whole output at every step costs O(length) per token; decoding only the tail is wrong
wherever a character spans several tokens (byte-level BPE) or a tokenizer merges spaces. So each step
decodes a short window twice, the tokens already read and the same plus the new ones, and keeps the
difference once it no longer ends in a partial character (TGI's and vLLM's method).

Stop strings end the text before they start. Text that might still turn into a stop string (the last
len(longest stop) - 1 characters) is held back from `delta` until the next token settles it, so the
deltas of a request always add up to its final text; with include_stop nothing is held back (the text then ends
where the stop string does, and the stop is found in the step that completes it: vLLM's rule).

The checkpoint side of the Engine's text handling lives here too: its tokenizer and EOS ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pieceworks.errors import CheckpointError, TokenizerError
from pieceworks.util import load_json_object

PROMPT_CONTEXT = 5  # prompt tokens decoded with the first output tokens, for their leading spaces
MAX_PROMPT_CONTEXT = 24  # the longest context tried where the last PROMPT_CONTEXT start inside a character


class Detokenizer:
    """One completion's text, token by token.

    Args:
        tokenizer: a Hugging Face tokenizer (`decode(ids, skip_special_tokens=...)`).
        prompt_ids: the prompt's token ids (its last few give the first output token its context).
        stop: stop strings; the text ends before the first one that appears (after it, with
            `include_stop`).
        skip_special: leave special tokens (EOS, chat markers) out of the text.
        min_tokens: stop strings are looked for once more tokens than this are out (vLLM's rule): one that ends
            in the first min_tokens tokens' text does not stop the completion.
    """

    def __init__(self, tokenizer: Any, prompt_ids: list[int], stop: list[str] | None = None,
                 include_stop: bool = False, skip_special: bool = True, min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.min_tokens, self._num_added = min_tokens, 0
        self.include_stop, self.skip_special = include_stop, skip_special
        self.stop = [s for s in stop or [] if s]
        # text a stop string may still claim; none with include_stop (the text ends with the stop, not before it)
        self.holdback = 0 if include_stop else max((len(s) for s in self.stop), default=1) - 1
        self._ids = self._context(prompt_ids)
        self._prefix = 0  # window start
        self._read = len(self._ids)  # tokens whose text is already in self.text
        self.text = ""
        self._emitted = 0  # characters of self.text already returned as deltas
        self.stopped = False

    def _context(self, prompt_ids: list[int]) -> list[int]:
        """The prompt's last PROMPT_CONTEXT tokens, or where they start inside a character the shortest longer
        suffix (up to MAX_PROMPT_CONTEXT tokens) that decodes without U+FFFD, as vLLM's detokenizer starts: a
        byte-fallback decoder (Llama-2's, Gemma's) turns a whole run of byte tokens that is not valid UTF-8 into
        U+FFFD, and the output's own bytes, joining that run, would never decode."""
        for n in range(PROMPT_CONTEXT, min(len(prompt_ids), MAX_PROMPT_CONTEXT) + 1):
            if "\ufffd" not in self._decode(prompt_ids[-n:]):
                return list(prompt_ids[-n:])
        return list(prompt_ids[-PROMPT_CONTEXT:])

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def add(self, token_id: int) -> None:
        """Append one generated token; sets `stopped` when a stop string appeared (then text is cut)."""
        if self.stopped:
            return
        self._ids.append(token_id)
        self._num_added += 1
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return  # an incomplete character: wait for the next token
        old = len(self.text)
        self.text += after[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        if self._num_added <= self.min_tokens:
            return
        # only the stops that end in the new text (one wholly inside the first min_tokens tokens' text does not count)
        hits = [(i, i + len(s)) for s in self.stop if (i := self.text.find(s, max(0, old - len(s) + 1))) >= 0]
        if hits:
            first = min(hits)
            self.text = self.text[: first[1] if self.include_stop else first[0]]
            self.stopped = True

    @property
    def emitted(self) -> str:
        """The text returned by `delta` so far."""
        return self.text[: self._emitted]

    def delta(self, final: bool) -> str:
        """Text not returned yet; without `final`, short of what a stop string might still claim."""
        end = len(self.text) if final or self.stopped else max(self._emitted, len(self.text) - self.holdback)
        out = self.text[self._emitted : end]
        self._emitted = end
        return out


def eos_token_ids(model_dir: Path | None, vocab_size: int | None = None) -> frozenset[int]:
    """EOS ids of a checkpoint: generation_config.json's eos_token_id (an int or a list), else
    config.json's, each below `vocab_size` where given (one past it could never stop a request); empty for
    random weights."""
    if model_dir is None:
        return frozenset()
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            eos = load_json_object(path).get("eos_token_id")
            if eos is not None:
                ids = eos if isinstance(eos, list) else [eos]
                if not all(type(i) is int and i >= 0 for i in ids):
                    raise CheckpointError(f"{path}: eos_token_id {eos!r} must be a token id (an int >= 0) or a "
                                          "list of them")
                outside = sorted(i for i in ids if vocab_size is not None and i >= vocab_size)
                if outside:
                    raise CheckpointError(f"{path}: eos_token_id {outside[0]} is outside the model's vocabulary "
                                          f"[0, {vocab_size}) (config.json vocab_size), so it could never end a "
                                          "request: fix the file")
                return frozenset(ids)
    return frozenset()


def load_tokenizer(executor: Any) -> Any:
    """The model directory's tokenizer, or None (random weights, no tokenizer files, no transformers).

    Raises:
        TokenizerError: tokenizer files are there but don't load (not taken as "no tokenizer")."""
    if executor.model_dir is None:
        return None
    try:
        return executor.tokenizer
    except TokenizerError:
        raise
    except (ValueError, OSError):
        return None
