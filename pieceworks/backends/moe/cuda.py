"""Fused NVFP4 MoE with the CUDA decode kernel of `fp4_gemm.cuda` (w4a16), grouped over experts.

forward: the Triton MoE's routing (`routing.route`), then `cuda_experts.grouped_experts`: the expert sort
(`triton_kernels.align_gpu`, blocks of 8 (token, slot) pairs of one expert; a one-token step skips it: a
block per pair), two launches of
`cuda_kernels.moe_gemm`, one CTA per (16 weight rows, block): gate/up with SwiGLU in the epilogue (each
expert's gate and up global scales), down with the routing weight, and the Triton top-k combine. The
kernel is the dense decode GEMM's (integer decode of the codes, bf16 mma.sync with the weights as A, a
2-chunk register ring) on each expert's r16c64 weights; a CTA finds its expert and pair rows after the PDL
wait (they come from the kernels before). A one-token step runs the down GEMM and the combine as one
launch (`moe_down_one_token`: the CTA's warps split the token's top-k experts, each scaling its sums by the
slot's routing weight and the expert's global scale). Every buffer has
a size fixed by (T, top_k, E), blocks past the routed rows exit on a device-side count: capturable in FULL
and PIECEWISE graphs.

Each block of 8 pairs reads its expert's weights once, so an expert with c pairs is read ceil(c / 8) times:
made for decode batches (docs/benchmarks.md has the measured range); the Triton MoE (priority 50) stays
`auto`'s pick, and runs its decode steps through the same code on its own k32 experts (`grouped_experts`
with layout "k32", `backends.options.triton.cuda_moe_max_t`); `backends.moe: cuda` selects this one.
Hidden and expert intermediate sizes must be multiples of 64 (DeepSeek-V3: 7168, 2048).
"""

from __future__ import annotations

import torch

from pieceworks.backends.base import ALL_GRAPH_MODES, Requirements
from pieceworks.backends.fp4_gemm.cuda import CudaDecodeOptions
from pieceworks.backends.fp4_gemm.cuda_launch import kernel_reasons
from pieceworks.backends.fp4_gemm.interleave import interleave_gate_up
from pieceworks.backends.fp4_gemm.r16c64 import CHUNK, repack_decode
from pieceworks.backends.moe.base import MoEBackend, MoEWeights
from pieceworks.backends.moe.cuda_experts import grouped_experts
from pieceworks.backends.moe.routing import route

def repack_experts(w: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor | None = None):
    """Stacked checkpoint experts [E, N, K/2] + [E, N, K/16] -> r16c64 per expert: codes uint8 [E, R, C, 512],
    scales uint8 [E, R, C, 64] (`repack_decode`), rows taken in the order `rows` when given; filled expert by
    expert into preallocated tensors (no stacked copy)."""
    codes = scales = None
    for e in range(w.shape[0]):
        we, se = (w[e], scale[e]) if rows is None else (w[e][rows], scale[e][rows])
        c, s = repack_decode(we, se)
        if codes is None:
            codes = torch.empty((w.shape[0], *c.shape), dtype=c.dtype, device=c.device)
            scales = torch.empty((w.shape[0], *s.shape), dtype=s.dtype, device=s.device)
        codes[e], scales[e] = c, s
    return codes, scales


class CudaMoEBackend(MoEBackend):
    name = "cuda"
    priority = 40
    graph_modes = ALL_GRAPH_MODES
    requires = Requirements(devices=("cuda",), min_capability=(9, 0), modules=("triton",),
                            install_hint="pip install triton (routing, sort and combine are Triton kernels)")
    numerics = ("w4a16",)
    weight_formats = ("nvfp4",)
    weight_layout = "r16c64"
    Options = CudaDecodeOptions  # backends.options.cuda is shared with fp4_gemm.cuda; none of them applies here
    description = "CUDA w4a16 fused MoE (NVRTC): the decode GEMM grouped over expert-sorted blocks of 8 pairs"

    @classmethod
    def check(cls, spec):
        return kernel_reasons(super().check(spec), bool(spec.model.moe_experts), spec.model.dtype)

    def prepare(self, w: MoEWeights) -> MoEWeights:
        """Gate row j and up row j side by side (`interleave_gate_up`), then r16c64 per expert."""
        if not w.is_fp4:
            raise ValueError("CudaMoEBackend serves NVFP4 experts only (weight_formats)")
        num_experts, two_i, half_h = w.w13.shape
        hidden, inter = half_h * 2, two_i // 2
        if hidden % CHUNK or inter % CHUNK:
            raise ValueError(f"the cuda MoE needs hidden and expert intermediate sizes that are multiples of "
                             f"{CHUNK}, got {hidden} and {inter}: use backends.moe: triton")
        w13, w13_scale = repack_experts(w.w13, w.w13_scale, interleave_gate_up(two_i).to(w.w13.device))
        w2, w2_scale = repack_experts(w.w2, w.w2_scale)
        return MoEWeights(w13, w13_scale, w.w13_scale_2.float().contiguous(), w.w13_input_scale,
                          w2, w2_scale, w.w2_scale_2.float().reshape(num_experts).contiguous(), w.w2_input_scale)

    def forward(self, x, router_logits, correction_bias, w, top_k, num_expert_group, topk_group,
                renormalize, routed_scaling_factor):
        if x.shape[0] == 0:
            return torch.empty_like(x)
        weights, ids = route(router_logits, correction_bias, top_k, num_expert_group, topk_group,
                             renormalize, routed_scaling_factor)
        return self.experts(x, weights.contiguous(), ids, w)

    def experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                w: MoEWeights) -> torch.Tensor:
        """Sort, both grouped GEMMs and the combine for routed pairs (topk_weights float32 [T, top_k])."""
        return grouped_experts(x, topk_weights, topk_ids, w, "r16c64")
