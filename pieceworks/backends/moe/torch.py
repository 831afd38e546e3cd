"""Reference MoE in plain torch: DeepSeek-V3 routing, then SwiGLU experts one at a time.

Eagerly it visits only the experts that got tokens (host sync to find them). While a CUDA graph is
being captured it visits every expert with fixed shapes instead (no host syncs; slow, but correct), so
the reference is safe in every graph mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pieceworks.backends.base import ALL_GRAPH_MODES
from pieceworks.backends.moe.base import MoEBackend, MoEWeights
from pieceworks.backends.moe.routing import deepseek_route
from pieceworks.quant import nvfp4


@dataclass(frozen=True)
class TorchMoEOptions:
    path: str = "auto"
    """auto (sparse eagerly, dense while capturing), sparse, or dense."""

    def __post_init__(self) -> None:
        if self.path not in ("auto", "sparse", "dense"):
            raise ValueError(f"backends.options.torch.path: {self.path!r}; use auto, sparse or dense")


class TorchMoEBackend(MoEBackend):
    name = "torch"
    priority = 0
    graph_modes = ALL_GRAPH_MODES
    numerics = ("w4a16", "w4a4")
    Options = TorchMoEOptions
    description = "reference: per-expert loop"

    def __init__(self, spec, options=None) -> None:
        super().__init__(spec, options)
        self.numerics_used = self.resolved_numerics(spec)

    def _linear(self, x, w, scale, scale_2, input_scale):
        if w.dtype != torch.uint8:
            return x @ w.to(x.dtype).t()
        wd = nvfp4.dequantize(w, scale, scale_2, dtype=x.dtype)
        if self.numerics_used == "w4a4":
            x = nvfp4.fake_quantize_activation(x, input_scale).to(x.dtype)
        return x @ wd.t()

    def expert(self, w: MoEWeights, e: int, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate(x)) * up(x)) for expert e; x [n, H] -> [n, H]."""
        inter = w.w13.shape[1] // 2
        fp4 = w.is_fp4
        gate = self._linear(x, w.w13[e, :inter], w.w13_scale[e, :inter] if fp4 else None,
                            w.w13_scale_2[e, 0] if fp4 else None, w.w13_input_scale[e] if fp4 else None)
        up = self._linear(x, w.w13[e, inter:], w.w13_scale[e, inter:] if fp4 else None,
                          w.w13_scale_2[e, 1] if fp4 else None, w.w13_input_scale[e] if fp4 else None)
        h = F.silu(gate) * up
        return self._linear(h, w.w2[e], w.w2_scale[e] if fp4 else None,
                            w.w2_scale_2[e] if fp4 else None, w.w2_input_scale[e] if fp4 else None)

    def forward(self, x, router_logits, correction_bias, w, top_k, num_expert_group, topk_group,
                renormalize, routed_scaling_factor):
        weights, ids = deepseek_route(router_logits, correction_bias, top_k, num_expert_group,
                                      topk_group, renormalize, routed_scaling_factor)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        dense = self.options.path == "dense" or (self.options.path == "auto" and capturing)
        if dense:
            per_expert = torch.zeros(x.shape[0], w.w13.shape[0], device=x.device)
            per_expert.scatter_add_(1, ids, weights)
            for e in range(w.w13.shape[0]):
                out += per_expert[:, e : e + 1] * self.expert(w, e, x).float()
        else:
            for e in ids.unique().tolist():
                tok, slot = (ids == e).nonzero(as_tuple=True)
                y = self.expert(w, e, x[tok]).float() * weights[tok, slot].unsqueeze(-1)
                out.index_add_(0, tok, y)
        return out.to(x.dtype)
