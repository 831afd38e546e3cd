"""Tokenizers built in the tests (no downloads): a Llama-2-style SentencePiece one with byte fallback."""

from __future__ import annotations

import pytest


def byte_fallback_tokenizer():
    """A Llama-2-style tokenizer (BPE whose <0xNN> byte tokens are plain vocabulary, decoded by Replace / ByteFallback
    / Fuse / Strip), built here: its decoder turns a whole run of byte tokens that is not valid UTF-8 into U+FFFD."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from tokenizers import decoders, models, normalizers

    pieces = ["<unk>"] + [f"<0x{b:02X}>" for b in range(256)] + list("\u2581Iloveabcdk") + ["\u2581o", "\u2581ok"]
    merges = [("\u2581", "o"), ("\u2581o", "k")]
    tk = tokenizers.Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, merges, unk_token="<unk>",
                                         byte_fallback=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>")
