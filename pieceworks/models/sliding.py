"""Models whose sliding-window layers rotate with a rope table of their own (Gemma 2 / 3, OLMo 3): the per-layer
windows (`ModelFacts.sliding_windows`, served by attention backends that declare `windows`), the second table, and a
forward that hands each layer its table."""

from __future__ import annotations

import dataclasses

import torch

from pieceworks.backends.base import ModelFacts
from pieceworks.models.rope import RotaryEmbedding, rope_parameters


class SlidingLayers:
    """A mixin ahead of a Llama-derived model class; the model calls `set_sliding` at the end of its __init__."""

    windows: tuple[int, ...] = ()

    def set_sliding(self, local: dict, sliding: tuple[bool, ...], window: int) -> None:
        """Per layer, whether it slides (over `window` keys: itself and the window - 1 before it) and so rotates
        with the table of `local` (rope settings, as config.json's rope_parameters)."""
        self.windows = tuple(window if s else 0 for s in sliding)
        for block, s in zip(self.layers, sliding):
            block.sliding = s
        a = self.args
        self.rotary_local = RotaryEmbedding(rope_parameters({"max_position_embeddings": a.max_position_embeddings,
                                                             "rope_parameters": local}),
                                            a.rotary_dim, a.max_position_embeddings)

    def rope_tables(self) -> list[RotaryEmbedding]:
        return [self.rotary, self.rotary_local]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        rope = {False: self.rotary(positions), True: self.rotary_local(positions)}
        h, residual = self.embed(input_ids), None
        for layer in self.layers:
            h, residual = layer(h, residual, *rope[layer.sliding])
        return self.norm(h, residual)[0]

    def facts(self, page_size: int) -> ModelFacts:
        return dataclasses.replace(super().facts(page_size), sliding_windows=self.windows)

    def load_plan(self):
        """The model's, and the sliding-window layers' rope table."""
        return super().load_plan() + [("rotary_local", self.rotary_local, lambda src: self.rotary_local.init_buffers())]
