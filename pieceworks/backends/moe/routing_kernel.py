"""DeepSeek-V3 routing as one Triton kernel (imports triton): `routing.deepseek_route`'s math, one
program per token.

The torch routing launches about a dozen small kernels (sigmoid, add, two top-ks, scatter, masked
fill, gather, sum, divide, multiply): 43 of the 129 us of a DeepSeek-V3 MoE layer at one token on the
H200 (docs/benchmarks.md). Here a program loads the token's E logits and does it all in registers:
sigmoid (libdevice exp and a correctly rounded division, as torch's float sigmoid), bias, the sum of
each group's two best biased scores, the best `topk_group` groups, then `top_k` rounds of argmax over
the kept experts; the weights are the unbiased scores of the chosen experts, renormalized and scaled
in torch's order of operations.

Differences from the torch version: experts come out in descending order of biased score (torch's
unsorted top-k gives them in an unspecified order), so a token's weight sum can round differently in
the last bit; exact ties pick the lowest index.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from pieceworks.backends import pdl, pdl_kernels


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, w_ptr, id_ptr, stride_l, scale,
                  E: tl.constexpr, G: tl.constexpr, TOPK: tl.constexpr, TOPK_P2: tl.constexpr,
                  TOPK_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, GROUPED: tl.constexpr,
                  RENORM: tl.constexpr, PDL: tl.constexpr = False):
    pdl_kernels.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E)
    x = tl.load(logits_ptr + t * stride_l + e).to(tl.float32)
    score = tl.math.div_rn(tl.full([E], 1.0, tl.float32), 1.0 + libdevice.exp(-x))
    choice = score
    if HAS_BIAS:
        choice = score + tl.load(bias_ptr + e).to(tl.float32)
    neg = float("-inf")
    if GROUPED:
        EG: tl.constexpr = E // G
        c2 = tl.reshape(choice, (G, EG))
        col = tl.arange(0, EG)[None, :]
        first = tl.argmax(c2, axis=1)
        best = tl.max(c2, axis=1)
        second = tl.max(tl.where(col == first[:, None], neg, c2), axis=1)
        group_score = best + second
        g = tl.arange(0, G)
        keep = tl.zeros([G], dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            j = tl.argmax(group_score, axis=0)
            keep = keep | (g == j)
            group_score = tl.where(g == j, neg, group_score)
        kept = tl.reshape(tl.broadcast_to(keep[:, None], (G, EG)), (E,))
        choice = tl.where(kept, choice, neg)
    k = tl.arange(0, TOPK_P2)
    ids = tl.zeros([TOPK_P2], dtype=tl.int64)
    ws = tl.zeros([TOPK_P2], dtype=tl.float32)
    for i in tl.static_range(TOPK):
        j = tl.argmax(choice, axis=0)
        ids = tl.where(k == i, j.to(tl.int64), ids)
        ws = tl.where(k == i, tl.sum(tl.where(e == j, score, 0.0), axis=0), ws)
        choice = tl.where(e == j, neg, choice)
    if RENORM:
        ws = tl.math.div_rn(ws, tl.sum(ws, axis=0) + 1e-20)
    ws = ws * scale
    mask = k < TOPK
    tl.store(w_ptr + t * TOPK + k, ws, mask=mask)
    tl.store(id_ptr + t * TOPK + k, ids, mask=mask)


def deepseek_route_triton(router_logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int,
                          num_expert_group: int, topk_group: int, renormalize: bool,
                          routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`routing.deepseek_route` in one launch; returns (weights [T, top_k] float32, ids [T, top_k]
    int64). Call only where `routing.route_supported` holds."""
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if num_tokens:
        has_bias = correction_bias.numel() > 0
        grouped = num_expert_group > 1 and topk_group < num_expert_group
        use_pdl, launch = pdl.launch_options(router_logits.device)
        _route_kernel[(num_tokens,)](
            router_logits, correction_bias if has_bias else router_logits, weights, ids,
            router_logits.stride(0), float(routed_scaling_factor), E=num_experts,
            G=num_expert_group if grouped else 1, TOPK=top_k, TOPK_P2=triton.next_power_of_2(top_k),
            TOPK_GROUP=topk_group, HAS_BIAS=has_bias, GROUPED=grouped, RENORM=bool(renormalize),
            PDL=use_pdl, num_warps=1, **launch)  # 1 warp: 3.2-3.3 us at E = 256 on the H200, 4 warps 4.1-4.2
    return weights, ids
