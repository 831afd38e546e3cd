"""Fused NVFP4 MoE in Triton (w4a16), for GPUs without FP4 tensor cores (Hopper, Ampere).

forward: DeepSeek-V3 routing (`routing.route`: one Triton kernel), then one Triton launch that sorts the
(token, slot) pairs by expert into blocks of BLOCK_M rows (`align.moe_align` is its torch twin), a grouped
gate_up GEMM with SwiGLU fused in its epilogue, a grouped down GEMM that applies the routing weights,
and a combine over the top-k slots. Every buffer has a size fixed by (T, top_k, E, BLOCK_M), and
blocks past the routed rows exit on a device-side count: nothing syncs with the host, so the op is
capturable in FULL and PIECEWISE graphs. Expert weights are repacked once into the k32 layout of
fp4_gemm/triton_k32.py.

Decode steps of up to `backends.options.triton.cuda_moe_max_t` tokens (default 128) run the expert part with the
CUDA decode kernel on the same k32 experts instead (`moe.cuda_experts.grouped_experts`: gate/up with SwiGLU over
expert-sorted blocks of 8 pairs, the down GEMM, the combine; one token's down GEMM and combine in one
launch) where it runs: compute capability >= 9.0, NVRTC loadable, bf16 activations.

This module imports torch only; triton is imported when a kernel is first launched.
"""

from __future__ import annotations

import torch

from pieceworks.backends.base import ALL_GRAPH_MODES
from pieceworks.backends.fp4_gemm.cuda_launch import cuda_decode_reason
from pieceworks.backends.fp4_gemm.k32 import TILE_ROWS, repack_k32
from pieceworks.backends.fp4_gemm.triton import (
    TRITON_REQUIREMENTS,
    TileConfig,
    TritonTileOptions,
    load_tile_table,
    parse_table,
    select_tile,
)
from pieceworks.backends.fp4_gemm.triton_tiles import MOE_TILES
from pieceworks.backends.moe.align import num_aligned_blocks
from pieceworks.backends.moe.base import MoEBackend, MoEWeights
from pieceworks.backends.moe.routing import route


def _pad_halves(t: torch.Tensor) -> torch.Tensor:
    """[E, 2I, C] -> [E, 2Ip, C]: each half (gate, up) padded with zero rows to Ip = I rounded up to
    TILE_ROWS."""
    pad = -(t.shape[1] // 2) % TILE_ROWS
    if not pad:
        return t
    zeros = torch.zeros(t.shape[0], pad, t.shape[2], dtype=t.dtype, device=t.device)
    gate, up = t.chunk(2, dim=1)
    return torch.cat([gate, zeros, up, zeros], dim=1)


class TritonMoEBackend(MoEBackend):
    name = "triton"
    priority = 50
    graph_modes = ALL_GRAPH_MODES
    requires = TRITON_REQUIREMENTS
    numerics = ("w4a16",)
    weight_formats = ("nvfp4",)
    weight_layout = "k32"
    Options = TritonTileOptions
    description = ("Triton w4a16 fused MoE: expert-sorted blocks, NVFP4 dequantized in registers (T <= cuda_moe_max_t "
                   "on sm_90+: the CUDA decode kernel's MoE modes on the same experts)")

    def __init__(self, spec, options=None) -> None:
        super().__init__(spec, options)
        path = self.options.moe_tiles
        self.table = load_tile_table(path, "moe_tiles") if path else parse_table(MOE_TILES)
        where = f"backends.options.triton.moe_tiles ({path!r})" if path else "MOE_TILES"
        if any(t.two_acc for t in self.table):  # the grouped gate_up GEMM uses its second accumulator
            raise ValueError(f"{where}: two_acc is a dense-GEMM option; the fused MoE does not take it")
        if any(t.kind != "fused" for t in self.table):
            raise ValueError(f"{where}: the fused MoE has no dequant or wgmma path; every bucket must be kind "
                             "'fused'")

    def prepare(self, w: MoEWeights) -> MoEWeights:
        if not w.is_fp4:
            raise ValueError("TritonMoEBackend serves NVFP4 experts only (weight_formats)")
        # The gate and up halves each fill whole storage tiles (rows [0, Ip) gate, [Ip, 2Ip) up; Ip = I
        # rounded up to 64), so the kernel finds up row j at Ip + j; the extra rows are zero, their
        # SwiGLU outputs zero, and w2's K (I, padded to 512 by the repack) covers Ip.
        w13, w13_scale = repack_k32(_pad_halves(w.w13), _pad_halves(w.w13_scale))
        w2, w2_scale = repack_k32(w.w2, w.w2_scale)
        return MoEWeights(w13, w13_scale, w.w13_scale_2.float().contiguous(), w.w13_input_scale,
                          w2, w2_scale, w.w2_scale_2.float().contiguous(), w.w2_input_scale)

    def tile(self, num_tokens: int) -> TileConfig:
        return select_tile(self.table, num_tokens)

    def forward(self, x, router_logits, correction_bias, w, top_k, num_expert_group, topk_group,
                renormalize, routed_scaling_factor):
        if x.shape[0] == 0:
            return torch.empty_like(x)
        weights, ids = route(router_logits, correction_bias, top_k, num_expert_group, topk_group,
                             renormalize, routed_scaling_factor)
        return self.experts(x, weights.contiguous(), ids, w)

    def experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w: MoEWeights,
                tile: TileConfig | None = None) -> torch.Tensor:
        """Sort, both grouped GEMMs and the combine for routed pairs (topk_weights float32 [T, top_k]): up to
        `cuda_moe_max_t` tokens with the CUDA decode kernel on these k32 experts where it runs
        (`moe.cuda_experts.grouped_experts`), else the Triton kernels with `tile` (None: the table's for T)."""
        if tile is None and x.shape[0] <= self.options.cuda_moe_max_t and cuda_decode_reason(x) is None:
            from pieceworks.backends.moe.cuda_experts import grouped_experts

            return grouped_experts(x, topk_weights, topk_ids, w, "k32")
        from pieceworks.backends.moe import triton_kernels

        num_experts = w.w13.shape[0]
        tile = tile or self.tile(x.shape[0])
        num_blocks = num_aligned_blocks(topk_ids.numel(), num_experts, tile.block_m)
        sorted_ids, expert_ids, num_post = triton_kernels.align_gpu(topk_ids, num_experts, tile.block_m,
                                                                    num_blocks)
        return triton_kernels.fused_moe(
            x, w.w13, w.w13_scale, w.w13_scale_2, w.w2, w.w2_scale, w.w2_scale_2,
            topk_weights, sorted_ids, expert_ids, num_post, topk_ids.shape[1], tile,
        )
