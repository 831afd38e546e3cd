"""Mixture of experts (DeepSeek-V3's, and Qwen2-MoE's, Qwen3-MoE's, Mixtral's and ERNIE 4.5's softmax routing): the
fp32 router and shared experts in the model, routing and the routed experts in the `pieceworks::moe` op.

Tensor parallel, two ways. Default: every rank holds all experts, each with I / N of its intermediate
columns (gate/up rows, down columns), and routes every token itself: its output is a partial sum.
Expert parallel (`parallel.expert_parallel`): rank r holds experts [r E/N, (r+1) E/N) whole; the
model routes on the full router logits (`deepseek_route`, `softmax_route`) and hands the op a local routing problem
whose answer is the same experts and weights (logits = logit(weight / scaling) for the token's chosen
local experts, -inf for the others, no groups, no bias, no renormalization), so every moe backend
serves it unchanged; weights agree to float32 rounding. Both ways sum the ranks' routed outputs and
the shared experts' partial outputs in one all-reduce per layer.

Shape legend: T tokens, H hidden, E routed experts, I expert intermediate size.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pieceworks.backends import ops
from pieceworks.backends.moe.base import MoEBackend, MoEWeights
from pieceworks.backends.moe.routing import deepseek_route, softmax_route
from pieceworks.models.base import GatedMLP
from pieceworks.parallel.comm import reduce
from pieceworks.parallel.layout import Part, TPLayout
from pieceworks.quant.nvfp4 import BLOCK


class Experts(nn.Module):
    """Stacked routed-expert weights as buffers, in the layout `MoEWeights` documents.

    NVFP4: w13 uint8 [E, 2I, H/2], w13_scale e4m3 [E, 2I, H/16], w13_scale_2 f32 [E, 2],
    w13_input_scale f32 [E], w2 uint8 [E, H, I/2], w2_scale e4m3 [E, H, I/16], w2_scale_2 f32 [E],
    w2_input_scale f32 [E]. Unquantized: w13 [E, 2I, H], w2 [E, H, I] in the model dtype, scales empty.

    E and I are this rank's: experts [first_expert, first_expert + E) of `total_experts`, and, where
    `inter_part` is set, that chunk of each expert's intermediate columns (of `total_intermediate`).
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, fp4: bool, first_expert: int = 0,
                 total_experts: int | None = None, inter_part: Part | None = None) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.intermediate, self.fp4 = num_experts, hidden, intermediate, fp4
        self.first_expert, self.total_experts = first_expert, total_experts or num_experts
        self.inter_part = inter_part
        self.total_intermediate = intermediate * (inter_part.count if inter_part else 1)
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
    """Routed experts plus shared experts. Routing: DeepSeek-V3's (`a.scoring_func` "sigmoid": sigmoid scores +
    e_score_correction_bias, grouped top-k), or softmax over the experts then top-k (Qwen3-MoE's "softmax"),
    which the `moe` op runs as its sigmoid routing of logit(softmax(logits)) without groups: the same choice and,
    renormalized or not, the same weights; ERNIE 4.5 adds its correction bias to the softmax scores to choose
    (`a.correction_bias`), the op's bias over those scores."""

    def __init__(self, hidden: int, a, prefix: str, fp4: Callable[[str], bool], tp: TPLayout = TPLayout()) -> None:
        super().__init__()
        self.tp, self.expert_parallel = tp, tp.sharded and tp.expert_parallel
        self.top_k, self.num_groups, self.topk_group = a.num_experts_per_tok, a.n_group, a.topk_group
        self.renormalize, self.scaling = a.norm_topk_prob, float(a.routed_scaling_factor)
        self.softmax = getattr(a, "scoring_func", "sigmoid") == "softmax"
        # routed in the model, the op handed the answer (as expert parallel's local problem): routings the op can't
        # express, DeepSeek-V2's groups ranked by their best softmax score
        self.model_routed = self.expert_parallel or (self.softmax and 1 < self.num_groups and
                                                     self.topk_group < self.num_groups)
        e, i = a.n_routed_experts, a.moe_intermediate_size
        # The router stays float32 whatever the model dtype (as in the released checkpoints).
        self.gate = nn.Linear(hidden, e, bias=False, dtype=torch.float32)
        # DeepSeek's correction bias, and ERNIE 4.5's under softmax scores (its checkpoint name, stored [1, E])
        self.bias_name = getattr(a, "correction_bias", "") or ("" if self.softmax else "gate.e_score_correction_bias")
        if self.bias_name:
            self.register_buffer("e_score_correction_bias", torch.zeros(e, dtype=torch.float32))
        expert_fp4 = all(fp4(f"{prefix}.experts.0.{p}") for p in ("gate_proj", "up_proj", "down_proj"))
        first, stop = tp.expert_range(e)
        inter_part = None if self.expert_parallel else tp.split(0)
        i_local = i // (inter_part.count if inter_part else 1)
        self.experts = Experts(stop - first, hidden, i_local,
                               expert_fp4 and hidden % BLOCK == 0 and i_local % BLOCK == 0, first, e, inter_part)
        self.local_top_k = min(self.top_k, stop - first)
        n_shared = a.n_shared_experts or 0
        self.shared_experts = (GatedMLP(hidden, i * n_shared, f"{prefix}.shared_experts", fp4, tp, reduce_output=False)
                               if n_shared else None)
        gated = getattr(a, "shared_expert_intermediate_size", 0)  # Qwen2-MoE's: sigmoid(gate(x)) * shared_expert(x)
        self.shared_expert = (GatedMLP(hidden, gated, f"{prefix}.shared_expert", fp4, tp, reduce_output=False)
                              if gated else None)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        logits = F.linear(x.float(), self.gate.weight)  # [T, E] float32
        w = self.experts
        # the op's sigmoid routing problem (each branch model-wide: the same in every MoE layer)
        if self.model_routed:  # the model's routing on the full logits, handed to the op for this rank's experts
            routed, bias, k, groups, kept, renorm = (self._local_logits(logits), logits.new_empty(0), self.local_top_k,
                                                     1, 1, False)
        elif self.softmax:
            routed, bias, k, groups, kept, renorm = (torch.logit(torch.softmax(logits, dim=-1)), self._bias(logits),
                                                     self.top_k, 1, 1, self.renormalize)
        else:
            routed, bias, k, groups, kept, renorm = (logits, self.e_score_correction_bias, self.top_k, self.num_groups,
                                                     self.topk_group, self.renormalize)
        y = ops.moe(
            x, routed, bias,
            w.w13, w.w13_scale, w.w13_scale_2, w.w13_input_scale, w.w2, w.w2_scale, w.w2_scale_2,
            w.w2_input_scale, k, groups, kept, renorm, self.scaling,
        )
        if self.shared_experts is not None:  # model-wide: the same branch in every MoE layer
            y = y + self.shared_experts(x)
        if self.shared_expert is not None:  # the gate's input is whole on every rank: it scales each partial sum
            y = y + torch.sigmoid(F.linear(x, self.shared_expert_gate.weight)) * self.shared_expert(x)
        return reduce(y, self.tp)

    def _bias(self, logits: torch.Tensor) -> torch.Tensor:
        return self.e_score_correction_bias if self.bias_name else logits.new_empty(0)

    def _local_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[T, E] router logits -> [T, E / N] logits of this rank's experts whose sigmoid, times the
        scaling, is the full routing's weight of each chosen expert, and 0 (logit -inf) elsewhere."""
        if self.softmax and self.bias_name:  # ERNIE 4.5's: DeepSeek's choice over the softmax scores
            weights, ids = deepseek_route(torch.logit(torch.softmax(logits, dim=-1)), self.e_score_correction_bias,
                                          self.top_k, 1, 1, self.renormalize, self.scaling)
        elif self.softmax:
            weights, ids = softmax_route(logits, self.top_k, self.renormalize, self.num_groups, self.topk_group)
            weights = weights * self.scaling
        else:
            weights, ids = deepseek_route(logits, self.e_score_correction_bias, self.top_k, self.num_groups,
                                          self.topk_group, self.renormalize, self.scaling)
        first, n = self.experts.first_expert, self.experts.num_experts
        local = ids - first
        mine = (local >= 0) & (local < n)
        probs = logits.new_zeros(logits.shape[0], n + 1)  # column n: a sink for other ranks' experts
        probs.scatter_(1, torch.where(mine, local, n), torch.where(mine, weights / self.scaling, 0.0))
        return torch.logit(probs[:, :n].clamp(max=1.0))

    def load(self, src, prefix: str) -> None:
        e, h = self.gate.weight.shape
        self.gate.weight.copy_(src.dense(f"{prefix}.gate", h, e, dtype=torch.float32))
        if self.bias_name:
            shape = (e,) if self.bias_name.startswith("gate.") else (1, e)
            self.e_score_correction_bias.copy_(
                src.tensor(f"{prefix}.{self.bias_name}", shape, dtype=torch.float32).view(e))
        src.experts(self.experts, f"{prefix}.experts")
        if self.shared_experts is not None:
            self.shared_experts.load(src, f"{prefix}.shared_experts")
        if self.shared_expert is not None:
            self.shared_expert.load(src, f"{prefix}.shared_expert")
            self.shared_expert_gate.weight.copy_(src.dense(f"{prefix}.shared_expert_gate", h, 1))
