"""Fused NVFP4 MoE with the CUDA decode kernel of `fp4_gemm.cuda` (w4a16), grouped over experts.

forward: the Triton MoE's routing (`routing.route`) and expert sort (`triton_kernels.align_gpu`, blocks of 8
(token, slot) pairs of one expert; a one-token step skips it: a block per pair), then two launches of
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
from pieceworks.backends.fp4_gemm.cuda import CudaDecodeOptions, kernel_reasons
from pieceworks.backends.fp4_gemm.r16c64 import CHUNK, repack_decode
from pieceworks.backends.fp4_gemm.triton import interleave_gate_up
from pieceworks.backends.moe.base import MoEBackend, MoEWeights
from pieceworks.backends.moe.routing import route

BLOCK_M = 8  # pairs per block: one n-tile of the kernel's mma


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


_ONE_TOKEN: dict = {}  # (top_k, device) -> (sorted_ids, num_post) of a one-token step


def one_token_blocks(top_k: int, device: torch.device):
    """(sorted_ids, num_post) of one token's top_k pairs, a block each: block b = [b, then the padding id
    top_k]; built once per (top_k, device) and kept, at fixed addresses (graph-safe; read only). A token's
    top-k experts are distinct, so no expert is read twice."""
    key = (top_k, str(device))
    if key not in _ONE_TOKEN:
        ids = torch.full((top_k, BLOCK_M), top_k, dtype=torch.int32)
        ids[:, 0] = torch.arange(top_k, dtype=torch.int32)
        _ONE_TOKEN[key] = (ids.reshape(-1).to(device),
                           torch.tensor([top_k * BLOCK_M], dtype=torch.int32, device=device))
    return _ONE_TOKEN[key]


def grouped_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w: MoEWeights,
                    layout: str) -> torch.Tensor:
    """The expert part of the CUDA MoE for routed pairs (topk_weights float32 [T, top_k], topk_ids [T, top_k]):
    the sort (skipped at one token), the gate/up GEMM with SwiGLU, the down GEMM with the routing weights and
    the combine (one token: the down GEMM and the combine in one launch). `layout`: "r16c64" (`moe.cuda`'s
    prepared experts: gate/up rows interleaved) or "k32" (`moe.triton`'s: gate and up halves, K padded to
    512 and rows to 64 by `repack_k32`)."""
    if x.shape[0] == 0:  # no launch: a grid with no blocks is a launch error
        return torch.empty_like(x)
    from pieceworks.backends import pdl
    from pieceworks.backends.fp4_gemm.cuda import plan
    from pieceworks.backends.fp4_gemm.triton import multiprocessors
    from pieceworks.backends.moe import cuda_kernels, triton_kernels
    from pieceworks.backends.moe.triton import num_aligned_blocks

    tokens, hidden = x.shape
    num_experts = w.w13.shape[0]
    rg13, _, kp13 = cuda_kernels.expert_geometry(w.w13, layout)
    rg2, _, kp2 = cuda_kernels.expert_geometry(w.w2, layout)
    inter = rg13 * 8  # SwiGLU outputs per pair: gate rows (r16c64: I; k32: I padded to 64)
    if x.dtype != torch.bfloat16:
        raise ValueError(f"the CUDA MoE kernels take bf16 activations, got {x.dtype}: use backends.moe: triton")
    if hidden > kp13 or (layout == "r16c64" and hidden != kp13) or hidden > rg2 * 16:
        raise ValueError(f"x [T, {hidden}] does not match the experts' hidden size ({kp13} columns of gate/up, "
                         f"{rg2 * 16} rows of down)")
    top_k = topk_ids.shape[1]
    pairs = tokens * top_k
    if tokens == 1:  # a block per pair, the routing's ids as the blocks' experts: no sort launch
        sorted_ids, num_post = one_token_blocks(top_k, x.device)
        expert_ids, blocks = topk_ids.reshape(-1).contiguous(), top_k
    else:
        blocks = num_aligned_blocks(pairs, num_experts, BLOCK_M)
        sorted_ids, expert_ids, num_post = triton_kernels.align_gpu(topk_ids, num_experts, BLOCK_M, blocks)
    if hidden != kp13:  # the kernel reads x in whole chunks (k32: K padded to 512)
        x = torch.nn.functional.pad(x, (0, kp13 - hidden))
    elif x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        x = x.contiguous()
    on = pdl.enabled(x.device)
    sms = multiprocessors(x.device)
    # the down GEMM reads h in whole chunks: columns past the SwiGLU outputs must be zero
    h = (torch.zeros if kp2 > inter else torch.empty)(pairs, kp2, dtype=torch.bfloat16, device=x.device)
    warps, depth = plan(rg13 * 16 * min(blocks, num_experts), sms)
    cuda_kernels.moe_gemm(x, w.w13, w.w13_scale, w.w13_scale_2, 2 * inter, sorted_ids, expert_ids, num_post,
                          pairs, top_k, h, None, warps, depth, on, layout)
    gs2 = w.w2_scale_2.reshape(num_experts)
    if tokens == 1 and top_k <= 32:  # the down GEMM and the combine in one launch
        warps = top_k * max(1, min(32 // top_k, plan(rg2 * 16, sms)[0] // top_k))
        out = torch.empty(1, hidden, dtype=x.dtype, device=x.device)
        return cuda_kernels.moe_down_one_token(h, w.w2, w.w2_scale, gs2, hidden, expert_ids,
                                               topk_weights.reshape(-1).float().contiguous(), out, warps, pdl=on,
                                               layout=layout)
    y = torch.empty(pairs, hidden, dtype=torch.bfloat16, device=x.device)
    warps, depth = plan(rg2 * 16 * min(blocks, num_experts), sms)
    cuda_kernels.moe_gemm(h, w.w2, w.w2_scale, gs2, hidden, sorted_ids, expert_ids, num_post, pairs, 1, y,
                          topk_weights.reshape(-1).float().contiguous(), warps, depth, on, layout)
    return triton_kernels.combine(y, tokens, top_k, x.dtype)
