"""The `moe` op contract: DeepSeek-V3 routing plus routed SwiGLU experts, NVFP4 or bf16.

Routing (what the torch reference implements, `routing.py`): scores = sigmoid(router_logits); choice
scores = scores + e_score_correction_bias; groups ranked by the sum of their top-2 choice scores;
the best `topk_group` groups kept; top_k experts among them by choice score; weights = scores of the
chosen experts, renormalized when `renormalize`, times `routed_scaling_factor`. Shared experts are
not part of the op (the model adds them). Other routings reach the op in this form (models/moe.py): the softmax top-k
of Qwen2-MoE, Qwen3-MoE and Mixtral as logits logit(softmax(logits)) with one group and no bias, expert parallel's
local problem as logit(weight) of the chosen local experts (-inf elsewhere); a backend sees only sigmoid routing,
whose logits may then hold -inf and +inf.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch

from pieceworks.backends.base import Backend, contract, not_implemented


class MoEWeights(NamedTuple):
    """Stacked expert weights (E experts, hidden H, expert intermediate I).

    NVFP4: w13 uint8 [E, 2I, H/2] (gate rows then up rows), w13_scale e4m3 [E, 2I, H/16],
    w13_scale_2 float32 [E, 2] (gate, up), w13_input_scale float32 [E]; w2 uint8 [E, H, I/2],
    w2_scale e4m3 [E, H, I/16], w2_scale_2 float32 [E], w2_input_scale float32 [E].
    bf16: w13 [E, 2I, H], w2 [E, H, I] in the model dtype; the scale tensors are empty (numel 0).
    """

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w13_scale_2: torch.Tensor
    w13_input_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    w2_scale_2: torch.Tensor
    w2_input_scale: torch.Tensor

    @property
    def is_fp4(self) -> bool:
        return self.w13.dtype == torch.uint8


class MoEBackend(Backend):
    op = "moe"
    weight_formats: ClassVar[tuple[str, ...]] = ("nvfp4", "none")
    """Expert weight formats it serves ("nvfp4", "none" = unquantized)."""
    weight_layout: ClassVar[str] = "linear"

    @classmethod
    def check(cls, spec):
        reasons = super().check(spec)
        if spec.model.moe_experts and spec.model.moe_quant not in cls.weight_formats:
            reasons.append(
                f"serves expert weights {'/'.join(cls.weight_formats)}, model has {spec.model.moe_quant}"
            )
        return reasons

    def prepare(self, w: MoEWeights) -> MoEWeights:
        """Convert stacked checkpoint tensors into this backend's layout, once at load."""
        return w

    @contract
    def forward(
        self,
        x: torch.Tensor,
        router_logits: torch.Tensor,
        correction_bias: torch.Tensor,
        w: MoEWeights,
        top_k: int,
        num_expert_group: int,
        topk_group: int,
        renormalize: bool,
        routed_scaling_factor: float,
    ) -> torch.Tensor:
        """Route and run the experts.

        Args:
            x: [T, H] hidden states.
            router_logits: [T, E] float32.
            correction_bias: [E] float32 (e_score_correction_bias), or empty for none.
            w: the expert weights as `prepare` returned them.

        Returns:
            [T, H] in x.dtype: sum over chosen experts of weight * expert(x).
        """
        raise not_implemented(self, "forward")
