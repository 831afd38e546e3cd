"""DeepSeek-V3 mixture of experts: the fp32 router and shared experts in the model, routing and the
routed experts in the `pieceworks::moe` op.

Shape legend: T tokens, H hidden, E routed experts, I expert intermediate size.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pieceworks.backends.moe.base import MoEBackend, MoEWeights
from pieceworks.models.base import GatedMLP
from pieceworks.quant.nvfp4 import BLOCK


class Experts(nn.Module):
    """Stacked routed-expert weights as buffers, in the layout `MoEWeights` documents.

    NVFP4: w13 uint8 [E, 2I, H/2], w13_scale e4m3 [E, 2I, H/16], w13_scale_2 f32 [E, 2],
    w13_input_scale f32 [E], w2 uint8 [E, H, I/2], w2_scale e4m3 [E, H, I/16], w2_scale_2 f32 [E],
    w2_input_scale f32 [E]. Unquantized: w13 [E, 2I, H], w2 [E, H, I] in the model dtype, scales empty.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, fp4: bool) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.intermediate, self.fp4 = num_experts, hidden, intermediate, fp4
        self.layout = "linear"
        self.weight_dtype = torch.get_default_dtype()  # the model dtype while the model is built
        for name, (shape, dtype) in self.expected().items():
            self.register_buffer(name, torch.empty(shape, dtype=dtype))

    def expected(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Checkpoint-layout shape and dtype of every buffer."""
        e, h, i = self.num_experts, self.hidden, self.intermediate
        if not self.fp4:
            dt, empty = self.weight_dtype, ((0,), torch.float32)
            return {"w13": ((e, 2 * i, h), dt), "w13_scale": empty, "w13_scale_2": empty,
                    "w13_input_scale": empty, "w2": ((e, h, i), dt), "w2_scale": empty,
                    "w2_scale_2": empty, "w2_input_scale": empty}
        u8, f8, f32 = torch.uint8, torch.float8_e4m3fn, torch.float32
        return {"w13": ((e, 2 * i, h // 2), u8), "w13_scale": ((e, 2 * i, h // BLOCK), f8),
                "w13_scale_2": ((e, 2), f32), "w13_input_scale": ((e,), f32),
                "w2": ((e, h, i // 2), u8), "w2_scale": ((e, h, i // BLOCK), f8),
                "w2_scale_2": ((e,), f32), "w2_input_scale": ((e,), f32)}

    def weights(self) -> MoEWeights:
        return MoEWeights(*(getattr(self, n) for n in MoEWeights._fields))

    def load(self, w: MoEWeights, name: str) -> None:
        """Take stacked checkpoint-layout tensors (checked against `expected`; `name` for messages)."""
        for field, (shape, _) in self.expected().items():
            t, buf = getattr(w, field), getattr(self, field)
            if tuple(t.shape) != shape or (self.fp4 and t.dtype != buf.dtype):
                raise ValueError(f"{name}: stacked {field} expected {buf.dtype} {list(shape)}, "
                                 f"got {t.dtype} {list(t.shape)}")
            buf.copy_(t)

    def prepare_experts(self, backend: MoEBackend) -> None:
        """Convert the buffers into `backend`'s layout, once after loading."""
        if self.layout == backend.weight_layout:
            return
        w = backend.prepare(self.weights())
        for field, t in zip(MoEWeights._fields, w):
            self._buffers[field] = t
        self.layout = backend.weight_layout

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden={self.hidden}, intermediate={self.intermediate}, "
                f"fp4={self.fp4}, layout={self.layout}")


class MoE(nn.Module):
    """Routed experts (sigmoid scores + e_score_correction_bias, grouped top-k) plus shared experts."""

    def __init__(self, hidden: int, a, prefix: str, fp4: Callable[[str], bool]) -> None:
        super().__init__()
        self.top_k, self.num_groups, self.topk_group = a.num_experts_per_tok, a.n_group, a.topk_group
        self.renormalize, self.scaling = a.norm_topk_prob, float(a.routed_scaling_factor)
        e, i = a.n_routed_experts, a.moe_intermediate_size
        # The router stays float32 whatever the model dtype (as in the released checkpoints).
        self.gate = nn.Linear(hidden, e, bias=False, dtype=torch.float32)
        self.register_buffer("e_score_correction_bias", torch.zeros(e, dtype=torch.float32))
        expert_fp4 = all(fp4(f"{prefix}.experts.0.{p}") for p in ("gate_proj", "up_proj", "down_proj"))
        self.experts = Experts(e, hidden, i, expert_fp4 and hidden % BLOCK == 0 and i % BLOCK == 0)
        n_shared = a.n_shared_experts or 0
        self.shared_experts = GatedMLP(hidden, i * n_shared, f"{prefix}.shared_experts", fp4) if n_shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        logits = F.linear(x.float(), self.gate.weight)  # [T, E] float32
        w = self.experts
        y = torch.ops.pieceworks.moe(
            x, logits, self.e_score_correction_bias,
            w.w13, w.w13_scale, w.w13_scale_2, w.w13_input_scale, w.w2, w.w2_scale, w.w2_scale_2, w.w2_input_scale,
            self.top_k, self.num_groups, self.topk_group, self.renormalize, self.scaling,
        )
        if self.shared_experts is not None:  # model-wide: the same branch in every MoE layer
            y = y + self.shared_experts(x)
        return y

    def load(self, src, prefix: str) -> None:
        e, h = self.gate.weight.shape
        self.gate.weight.copy_(src.dense(f"{prefix}.gate", h, e, dtype=torch.float32))
        self.e_score_correction_bias.copy_(
            src.tensor(f"{prefix}.gate.e_score_correction_bias", (e,), dtype=torch.float32))
        src.experts(self.experts, f"{prefix}.experts")
        if self.shared_experts is not None:
            self.shared_experts.load(src, f"{prefix}.shared_experts")
