"""Triton kernels for the fused NVFP4 MoE (w4a16): grouped gate_up GEMM with SwiGLU, grouped down GEMM
with the routing weight, and the top-k combine. Weights are in the k32 layout of
`pieceworks.backends.fp4_gemm.triton_kernels` (one [rows, Kp/2] matrix per expert, in the tiled storage of
`repack_k32`; w13's gate and up halves each padded to whole 64-row tiles by the backend's `prepare`).

Rows are processed in expert-sorted blocks of BLOCK_M (see `moe_align` in align.py): block b holds
`sorted_ids[b*BM : (b+1)*BM]`, flat (token * top_k + slot) indices of one expert `expert_ids[b]`, padded
with the sentinel T * top_k. Blocks at or past `num_post[0]` exit at once, so the grid is sized for the
worst case and nothing is read back to the host. Imported only by the backend's methods.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pieceworks.backends import pdl, pdl_kernels
from pieceworks.backends.fp4_gemm.triton_k32 import OUT_BIAS, fp4_tile_loop, tile_row_bases


@triton.jit(do_not_specialize=["num_valid", "num_iters"])
def _moe_gemm_kernel(
    a_ptr, w_ptr, s_ptr, gs_ptr, out_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_ptr, topk_w_ptr,
    N, K, Kp, num_valid, num_iters,
    stride_am, stride_we, stride_se, stride_ge, stride_om,
    A_DIV: tl.constexpr, SWIGLU: tl.constexpr, ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, W_AS_A: tl.constexpr, USE_ASM: tl.constexpr, ONE_DOT: tl.constexpr,
    PDL: tl.constexpr = False, PERM_K: tl.constexpr = False,
):
    """SWIGLU: out[id, n] = silu(a @ Wg.T) * (a @ Wu.T) with Wg = rows [0, N), Wu = rows [N, 2N) of the
    expert's w13; else out[id, n] = (a @ W.T)[n] (times topk_w[id] with ROUTED_WEIGHT). a's row for a
    flat id is id // A_DIV (A_DIV = top_k when a is the token activations)."""
    pdl_kernels.wait(PDL)  # the routing (which experts) comes from the kernels before
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return
    e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(sorted_ids_ptr + rm)
    row_ok = ids < num_valid
    a_rows = tl.where(row_ok, ids // A_DIV, 0).to(tl.int64) * stride_am
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_c = tl.where(rn < N, rn, N - 1).to(tl.int64)
    w_e = w_ptr + e * stride_we
    s_e = s_ptr + e * stride_se
    if W_AS_A:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_rows, s_rows = tile_row_bases(n_c, Kp)
    w_rows2, s_rows2 = tile_row_bases(n_c + N, Kp)  # SWIGLU: the up rows
    acc, acc2 = fp4_tile_loop(
        acc, acc, a_ptr, a_rows, row_ok, w_e, w_rows, w_rows2,
        s_e, s_rows, s_rows2, 0, num_iters, K, Kp,
        BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, W_AS_A, USE_ASM, SWIGLU, ONE_DOT, PERM_K=PERM_K,
    )
    pdl_kernels.launch_dependents(PDL)
    if W_AS_A:
        acc = tl.trans(acc)
        acc2 = tl.trans(acc2)
    if SWIGLU:
        gate = acc * (tl.load(gs_ptr + e * stride_ge) * OUT_BIAS)
        up = acc2 * (tl.load(gs_ptr + e * stride_ge + 1) * OUT_BIAS)
        res = gate / (1.0 + tl.exp(-gate)) * up
    else:
        res = acc * (tl.load(gs_ptr + e * stride_ge) * OUT_BIAS)
        if ROUTED_WEIGHT:
            res = res * tl.load(topk_w_ptr + ids, mask=row_ok, other=0.0)[:, None]
    offs = ids[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out_ptr + offs, res.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (rn[None, :] < N))


@triton.jit
def _combine_kernel(y_ptr, out_ptr, H, TOPK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """out[t] = sum over slots of y[t * TOPK + slot] (float32 sum, fixed order)."""
    pdl_kernels.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = h < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(TOPK):
        acc += tl.load(y_ptr + (t * TOPK + s) * H + h, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + h, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _num_iters(kp: int, block_k: int) -> tuple[int, bool]:
    iters, rem = divmod(kp, block_k)
    assert rem == 0, "expert weights must come from repack_k32 (K padded to a multiple of 512)"
    return iters, True


def fused_moe(x, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, topk_weights,
              sorted_ids, expert_ids, num_post, top_k, cfg):
    """Experts for routed, block-aligned tokens.

    Args:
        x: [T, H] activations.
        w13: uint8 [E, 2I, Hp/2] (k32, tiled; I a multiple of 64: gate rows [0, I), up rows [I, 2I)),
            w13_scale e4m3 [E, 2I, Hp/16], w13_scale_2 float32 [E, 2].
        w2: uint8 [E, Hr, Ip/2] (k32, tiled; Hr = H rounded up to 64), w2_scale e4m3 [E, Hr, Ip/16],
            w2_scale_2 float32 [E].
        topk_weights: float32 [T, top_k].
        sorted_ids: int32 [num_blocks * BLOCK_M]; expert_ids: int32 [num_blocks]; num_post: int32 [1]
            (from `moe_align` with cfg.block_m).
        cfg: a fp4_gemm `TileConfig`.

    Returns:
        [T, H] in x.dtype.
    """
    T, H = x.shape
    inter = w13.shape[1] // 2
    assert inter % 64 == 0, "w13's gate and up halves must each fill whole 64-row tiles (TritonMoEBackend.prepare)"
    num_valid = T * top_k
    num_blocks = expert_ids.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    use_pdl, launch = pdl.launch_options(x.device)
    common = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                  W_AS_A=cfg.w_as_a, USE_ASM=cfg.asm, ONE_DOT=cfg.one_dot, PERM_K=cfg.perm_k,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages, PDL=use_pdl, **launch)

    h = torch.empty((num_valid, inter), dtype=torch.bfloat16, device=x.device)
    iters, even = _num_iters(w13.shape[2] * 2, cfg.block_k)
    _moe_gemm_kernel[(num_blocks, triton.cdiv(inter, cfg.block_n))](
        x, w13.view(torch.int16), w13_scale.view(torch.int16), w13_scale_2, h, sorted_ids, expert_ids,
        num_post, topk_weights, inter, H, w13.shape[2] * 2, num_valid, iters,
        x.stride(0), w13.stride(0) // 2, w13_scale.stride(0) // 2, w13_scale_2.stride(0), h.stride(0),
        A_DIV=top_k, SWIGLU=True, ROUTED_WEIGHT=False, EVEN_K=even and H == w13.shape[2] * 2,
        **common,
    )
    y = torch.empty((num_valid, H), dtype=torch.bfloat16, device=x.device)
    iters, even = _num_iters(w2.shape[2] * 2, cfg.block_k)
    _moe_gemm_kernel[(num_blocks, triton.cdiv(H, cfg.block_n))](
        h, w2.view(torch.int16), w2_scale.view(torch.int16), w2_scale_2, y, sorted_ids, expert_ids, num_post,
        topk_weights, H, inter, w2.shape[2] * 2, num_valid, iters,
        h.stride(0), w2.stride(0) // 2, w2_scale.stride(0) // 2, w2_scale_2.stride(0), y.stride(0),
        A_DIV=1, SWIGLU=False, ROUTED_WEIGHT=True, EVEN_K=even and inter == w2.shape[2] * 2,
        **common,
    )
    return combine(y, T, top_k, x.dtype)


def combine(y: torch.Tensor, num_tokens: int, top_k: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, H] in dtype: out[t] = sum over slots of y[t * top_k + slot] (y [T * top_k, H], float32 sums in a
    fixed order); one launch."""
    H = y.shape[1]
    out = torch.empty((num_tokens, H), dtype=dtype, device=y.device)
    use_pdl, launch = pdl.launch_options(y.device)
    block = 1024
    _combine_kernel[(num_tokens, triton.cdiv(H, block))](y, out, H, TOPK=top_k, BLOCK=block, PDL=use_pdl,
                                                         num_warps=4, **launch)
    return out


@triton.jit
def _align_kernel(topk_ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_ptr, cursor_ptr,
                  num_pairs, num_blocks, num_experts,
                  E_P2: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                  BLOCK_CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    """One program: the GPU twin of `moe_align` (rows within an expert in atomic order, not stable)."""
    pdl_kernels.enter(PDL)
    e = tl.arange(0, E_P2)
    counts = tl.zeros((E_P2,), dtype=tl.int32)
    for p0 in range(0, num_pairs, CHUNK):
        p = p0 + tl.arange(0, CHUNK)
        ids = tl.load(topk_ids_ptr + p, mask=p < num_pairs, other=0).to(tl.int32)
        counts += tl.histogram(ids, E_P2, mask=p < num_pairs)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.atomic_xchg(cursor_ptr + e, ends - padded, mask=e < num_experts)  # at L2, like the adds below
    tl.store(num_post_ptr, tl.sum(padded, 0))
    for r0 in range(0, num_blocks * BLOCK_M, CHUNK):
        r = r0 + tl.arange(0, CHUNK)
        tl.store(sorted_ids_ptr + r, tl.full((CHUNK,), 0, tl.int32) + num_pairs,
                 mask=r < num_blocks * BLOCK_M)
    for b0 in range(0, num_blocks, BLOCK_CHUNK):
        b = b0 + tl.arange(0, BLOCK_CHUNK)
        below = (ends[None, :] <= (b * BLOCK_M)[:, None]) & (e < num_experts)[None, :]
        eid = tl.minimum(tl.sum(below.to(tl.int32), 1), num_experts - 1)
        tl.store(expert_ids_ptr + b, eid, mask=b < num_blocks)
    tl.debug_barrier()  # the cursors and the sentinel fill are visible to every thread below
    for p0 in range(0, num_pairs, CHUNK):
        p = p0 + tl.arange(0, CHUNK)
        pm = p < num_pairs
        ids = tl.load(topk_ids_ptr + p, mask=pm, other=0).to(tl.int32)
        pos = tl.atomic_add(cursor_ptr + ids, 1, mask=pm)
        tl.store(sorted_ids_ptr + pos, p, mask=pm)


def align_gpu(topk_ids, num_experts, block_m, num_blocks):
    """Triton `moe_align`: (sorted_ids int32 [num_blocks*block_m], expert_ids int32 [num_blocks],
    num_post int32 [1]); one launch, no host sync."""
    dev = topk_ids.device
    sorted_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    num_post = torch.empty(1, dtype=torch.int32, device=dev)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=dev)
    use_pdl, launch = pdl.launch_options(dev)
    _align_kernel[(1,)](
        topk_ids.reshape(-1), sorted_ids, expert_ids, num_post, cursor, topk_ids.numel(), num_blocks,
        num_experts, E_P2=triton.next_power_of_2(num_experts), BLOCK_M=block_m, CHUNK=1024,
        BLOCK_CHUNK=32, PDL=use_pdl, num_warps=8, **launch,
    )
    return sorted_ids, expert_ids, num_post
