"""FlashInfer's NVFP4 fused MoE on Blackwell: `cutlass_fused_moe` (routing in torch, `moe/routing.py`) and
`trtllm_fp4_block_scale_moe` (routes itself with its DeepSeekV3 method: sigmoid, bias, top-2 per group,
top groups, top-k, renormalize, scale; the same routing as `moe/routing.py`).

Both are w4a4: activations are quantized once per token with one global scale for every expert, the
largest `input_scale` among the experts (as vLLM and SGLang do; the torch reference uses each expert's
own, so results match it exactly only where the experts share their input scales, as in the suite).
Both kernels take one dequant scale per expert for the fused gate/up GEMM, so the gate and up halves
must share `weight_scale_2` (ModelOpt exports do); `prepare` refuses experts where they differ.

`prepare` converts the stacked checkpoint tensors once (pure torch, tested on CPU):
- both: gate/up halves swapped to TRT-LLM's [up; gate] (w3, w1) order; block scales 128x4-tiled per
  expert; the per-expert dequant scales alpha = input_scale * weight_scale_2 precomputed;
- trtllm: rows of w13 (and its scales) interleaved for the fused gated activation and shuffled for the
  128-row epilogue tile, rows of w2 shuffled, with FlashInfer's own helpers giving the permutations.
The prepared tensors travel in the MoEWeights slots (documented per backend below); the `moe` custom
op keeps either kernel opaque inside piecewise graphs.

Written against FlashInfer 0.7.2's documented API; no Blackwell GPU was available to run it.
"""

from __future__ import annotations

import torch

from pieceworks.backends.attention.flashinfer import GPU_INSTALL_HINT
from pieceworks.backends.base import ALL_GRAPH_MODES, Requirements
from pieceworks.backends.fp4_gemm.flashinfer import TRTLLM_EPILOGUE_TILE_M, fp4_quantize_activation
from pieceworks.backends.moe.base import MoEBackend, MoEWeights
from pieceworks.backends.moe.routing import deepseek_route
from pieceworks.quant import nvfp4

DEEPSEEK_V3_ROUTING = 2  # flashinfer.RoutingMethodType.DeepSeekV3


def up_gate(t: torch.Tensor) -> torch.Tensor:
    """[E, 2I, ...] gate rows then up rows -> up rows then gate rows (TRT-LLM's w3/w1 order)."""
    inter = t.shape[1] // 2
    return torch.cat([t[:, inter:], t[:, :inter]], dim=1)


def shared_gate_up_scale(w13_scale_2: torch.Tensor) -> torch.Tensor:
    """[E] the weight_scale_2 shared by each expert's gate and up halves ([E, 2] in the checkpoint)."""
    if not torch.equal(w13_scale_2[:, 0], w13_scale_2[:, 1]):
        bad = (w13_scale_2[:, 0] != w13_scale_2[:, 1]).nonzero().flatten().tolist()
        raise ValueError(f"experts {bad[:8]} have different weight_scale_2 for gate_proj and up_proj; "
                         "FlashInfer's fused MoE takes one per expert: quantize gate and up with a shared "
                         "global scale (ModelOpt does), or use backends.moe=torch")
    return w13_scale_2[:, 0].float()


def moe_scales(w: MoEWeights) -> dict[str, torch.Tensor]:
    """Global activation scales (one for all experts) and per-expert dequant scales, float32."""
    in1, in2 = w.w13_input_scale.float().max(), w.w2_input_scale.float().max()
    return dict(a1_gs=(1.0 / in1).reshape(1), a2_gs=(1.0 / in2).reshape(1),
                alpha1=in1 * shared_gate_up_scale(w.w13_scale_2), alpha2=in2 * w.w2_scale_2.float())


def cutlass_moe_layout(w: MoEWeights) -> MoEWeights:
    """Slots: w13 [E, 2I, H/2] (up; gate), w13_scale [E, 2Ip, Hp/16] tiled, w13_scale_2 = alpha1 [E],
    w13_input_scale = a1_gs [1], w2 [E, H, I/2], w2_scale [E, Hp, Ip/16] tiled, w2_scale_2 = alpha2 [E],
    w2_input_scale = a2_gs [1]."""
    s = moe_scales(w)
    return MoEWeights(up_gate(w.w13).contiguous(), nvfp4.swizzle_128x4(up_gate(w.w13_scale)), s["alpha1"],
                      s["a1_gs"], w.w2.contiguous(), nvfp4.swizzle_128x4(w.w2_scale), s["alpha2"], s["a2_gs"])


def trtllm_moe_layout(w: MoEWeights, perm13: torch.Tensor, perm2: torch.Tensor) -> MoEWeights:
    """Slots: w13 [E, 2I, H/2] and w13_scale [E, 2I, H/16] (tiled) with rows in `perm13` order of the
    (up; gate) stack; w13_scale_2 = [2, E] (alpha1 * a2_gs: output1_scale_scalar, alpha1:
    output1_scale_gate_scalar); w13_input_scale = a1_gs [1]; w2, w2_scale rows in `perm2` order;
    w2_scale_2 = alpha2 [E] (output2_scale_scalar); w2_input_scale = a2_gs [1]."""
    s = moe_scales(w)
    e, rows13, rows2 = w.w13.shape[0], w.w13.shape[1], w.w2.shape[1]
    p13, p2 = perm13.to(w.w13.device), perm2.to(w.w2.device)
    scale13 = nvfp4.swizzle_128x4(up_gate(w.w13_scale)[:, p13]).reshape(e, rows13, -1)
    scale2 = nvfp4.swizzle_128x4(w.w2_scale[:, p2]).reshape(e, rows2, -1)
    out1 = torch.stack([s["alpha1"] * s["a2_gs"], s["alpha1"]])
    return MoEWeights(up_gate(w.w13)[:, p13].contiguous(), scale13, out1, s["a1_gs"],
                      w.w2[:, p2].contiguous(), scale2, s["alpha2"], s["a2_gs"])


def trtllm_moe_permutations(rows13: int, rows2: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row orders FlashInfer's trtllm MoE expects, from its own helpers: w13 rows interleaved (up, gate)
    for the fused gated activation, then shuffled for the epilogue tile; w2 rows shuffled."""
    from flashinfer import shuffle_matrix_a
    from flashinfer.fused_moe import reorder_rows_for_gated_act_gemm

    idx13, idx2 = torch.arange(rows13).unsqueeze(1), torch.arange(rows2).unsqueeze(1)
    perm13 = shuffle_matrix_a(reorder_rows_for_gated_act_gemm(idx13), TRTLLM_EPILOGUE_TILE_M)[:, 0]
    return perm13, shuffle_matrix_a(idx2, TRTLLM_EPILOGUE_TILE_M)[:, 0]


class _FlashInferMoE(MoEBackend):
    numerics = ("w4a4",)
    weight_formats = ("nvfp4",)

    @classmethod
    def check(cls, spec):
        reasons = super().check(spec)
        if spec.model.dtype != torch.bfloat16:
            reasons.append(f"FlashInfer FP4 MoE is run in bf16 here (model dtype: {spec.model.dtype})")
        return reasons

    def _check_fp4(self, w: MoEWeights) -> None:
        if not w.is_fp4:
            raise ValueError(f"{self.key()} serves NVFP4 experts; these are {w.w13.dtype}")


class FlashInferCutlassMoEBackend(_FlashInferMoE):
    name = "cutlass"
    priority = 80
    graph_modes = ALL_GRAPH_MODES
    requires = Requirements(devices=("cuda",), capability_majors=(10, 11, 12), modules=("flashinfer",),
                            install_hint=GPU_INSTALL_HINT)
    weight_layout = "flashinfer_cutlass_moe"
    description = "FlashInfer cutlass_fused_moe, NVFP4 w4a4 (Blackwell); DeepSeek-V3 routing in torch"

    def prepare(self, w: MoEWeights) -> MoEWeights:
        self._check_fp4(w)
        return cutlass_moe_layout(w)

    def forward(self, x, router_logits, correction_bias, w, top_k, num_expert_group, topk_group,
                renormalize, routed_scaling_factor):
        from flashinfer.fused_moe import cutlass_fused_moe

        weights, ids = deepseek_route(router_logits, correction_bias, top_k, num_expert_group, topk_group,
                                      renormalize, routed_scaling_factor)
        quant_scales = [w.w13_input_scale.reshape(()), w.w13_scale.view(torch.int32), w.w13_scale_2,
                        w.w2_input_scale.reshape(()), w.w2_scale.view(torch.int32), w.w2_scale_2]
        return cutlass_fused_moe(x, ids.to(torch.int32), weights, w.w13.view(torch.long), w.w2.view(torch.long),
                                 x.dtype, quant_scales=quant_scales)


class FlashInferTrtllmMoEBackend(_FlashInferMoE):
    name = "trtllm"
    priority = 85
    graph_modes = ALL_GRAPH_MODES
    requires = Requirements(devices=("cuda",), capability_majors=(10,), modules=("flashinfer",),
                            install_hint=GPU_INSTALL_HINT)
    weight_layout = "flashinfer_trtllm_moe"
    description = "FlashInfer trtllm_fp4_block_scale_moe, NVFP4 w4a4 (sm_100/103), DeepSeekV3 routing fused"

    def prepare(self, w: MoEWeights) -> MoEWeights:
        self._check_fp4(w)
        rows13, rows2 = w.w13.shape[1], w.w2.shape[1]
        if rows13 % TRTLLM_EPILOGUE_TILE_M or rows2 % TRTLLM_EPILOGUE_TILE_M:
            raise ValueError(f"trtllm FP4 MoE needs 2 * intermediate ({rows13}) and hidden ({rows2}) sizes "
                             f"that are multiples of {TRTLLM_EPILOGUE_TILE_M}; use backends.moe=cutlass")
        if rows2 % 64 or (rows13 // 2) % 64:
            raise ValueError(f"trtllm FP4 MoE keeps its tiled scales unpadded: hidden ({rows2}) and intermediate "
                             f"({rows13 // 2}) sizes must be multiples of 64; use backends.moe=cutlass")
        return trtllm_moe_layout(w, *trtllm_moe_permutations(rows13, rows2))

    def forward(self, x, router_logits, correction_bias, w, top_k, num_expert_group, topk_group,
                renormalize, routed_scaling_factor):
        from flashinfer import SfLayout
        from flashinfer.fused_moe import trtllm_fp4_block_scale_moe

        codes, scales = fp4_quantize_activation(x, w.w13_input_scale, swizzled=False)
        num_experts = w.w13.shape[0]
        return trtllm_fp4_block_scale_moe(
            routing_logits=router_logits.float(),
            routing_bias=correction_bias if correction_bias.numel() else None,
            hidden_states=codes, hidden_states_scale=scales.reshape(x.shape[0], -1),
            gemm1_weights=w.w13, gemm1_weights_scale=w.w13_scale, gemm1_bias=None, gemm1_alpha=None,
            gemm1_beta=None, gemm1_clamp_limit=None, gemm2_weights=w.w2, gemm2_weights_scale=w.w2_scale,
            gemm2_bias=None, output1_scale_scalar=w.w13_scale_2[0], output1_scale_gate_scalar=w.w13_scale_2[1],
            output2_scale_scalar=w.w2_scale_2, num_experts=num_experts, top_k=top_k, n_group=num_expert_group,
            topk_group=topk_group, intermediate_size=w.w13.shape[1] // 2, local_expert_offset=0,
            local_num_experts=num_experts, routed_scaling_factor=routed_scaling_factor,
            routing_method_type=DEEPSEEK_V3_ROUTING, norm_topk_prob=renormalize,
            hidden_states_scale_layout=SfLayout.layout_linear,
        )[0]
