"""Split-KV paged GQA decode attention in Triton (imports triton); see attention/triton.py.

One program per (sequence, KV head, split): with the step's new K/V rows passed in, the split whose
range ends at the new token first writes them into the caches; then it attends the GQA group's
queries (padded to 16 rows for the tensor-core dots) over its split's share of the sequence,
gathering K/V rows through the page table, with an online float32 softmax (P is rounded to the query
dtype for the PV dot, as FlashInfer does). With several splits each program that has keys stores its
normalized partial output and log-sum-exp (a short sequence leaves the last splits empty: splits
cover whole BLOCK_N steps); the program that arrives last at the (sequence, head) counter merges the
stored partials in split order (so the result does not depend on arrival order), writes the output
and resets the counter to zero. Over an FP8 pool the new rows are quantized as they are written and the
K/V tiles are read as 32-bit words decoded into the query dtype (`e4m3_rows`), the layer's k_scale folded
into the softmax scale and its v_scale applied to the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pieceworks.backends import pdl, pdl_kernels
from pieceworks.backends.fp4_gemm.triton_epilogue import publish_and_count  # the split-K handshake
from pieceworks.backends.kv_write_kernel import quantize_e4m3

# An FP8 pool's K/V tile read as 32-bit words, each decoded in registers into four 16-bit values by bit moves: a
# byte's exponent and mantissa shifted into the target type's fields, its sign kept, then one exact multiply by 2^120
# (bf16) or 2^8 (fp16), the exponent biases' difference, which also scales e4m3's subnormals right. Triton's own
# `.to()` reads the tile as bytes, which reach the PV dot's operand layout through shared memory a byte at a time
# (64 byte loads per thread and key block on sm_90), and converts with three conversion instructions per pair for
# bf16; the bit moves run on the integer and 16-bit ALUs and hand the dot 16-bit values (docs/benchmarks.md). Exact for
# every finite byte; e4m3's NaN bytes (0x7f, 0xff) read as +-480 (quantize_kv stores NaN only for a NaN input).
_E4M3_WORD = """{{
.reg .b32 a<2>, b<2>, s, z;
mov.b32 s, {scale};
mov.b32 z, 0x80008000;
prmt.b32 a0, 0, $4, 0x5140;
prmt.b32 a1, 0, $4, 0x7362;
lop3.b32 b0, a0, 0x7fff7fff, 0, 0xc0;
lop3.b32 b1, a1, 0x7fff7fff, 0, 0xc0;
shr.b32 b0, b0, {shift};
shr.b32 b1, b1, {shift};
lop3.b32 b0, b0, 0x80008000, a0, 0xf8;
lop3.b32 b1, b1, 0x80008000, a1, 0xf8;
fma.rn.{kind}x2 b0, b0, s, z;
fma.rn.{kind}x2 b1, b1, s, z;
mov.b32 {{$0, $1}}, b0;
mov.b32 {{$2, $3}}, b1;
}}"""
_E4M3_WORD_BF16 = tl.constexpr(_E4M3_WORD.format(scale="0x7b807b80", shift=4, kind="bf16"))  # 2^120
_E4M3_WORD_F16 = tl.constexpr(_E4M3_WORD.format(scale="0x5c005c00", shift=1, kind="f16"))  # 2^8


@triton.jit
def e4m3_rows(ptr, rows, D: tl.constexpr, mask, DT: tl.constexpr):
    """[R, D] of DT (bf16 or fp16): the e4m3 rows of D elements at element offsets `rows` (multiples of 4) of `ptr`,
    rows outside `mask` zero."""
    d4 = tl.arange(0, D // 4)
    w = tl.load(ptr.to(tl.pointer_type(tl.int32)) + (rows // 4)[:, None] + d4[None, :], mask=mask[:, None], other=0)
    if DT == tl.float16:
        a, b, c, e = tl.inline_asm_elementwise(_E4M3_WORD_F16, "=h,=h,=h,=h,r", [w], dtype=(tl.float16,) * 4,
                                               is_pure=True, pack=1)
    else:
        a, b, c, e = tl.inline_asm_elementwise(_E4M3_WORD_BF16, "=h,=h,=h,=h,r", [w], dtype=(tl.bfloat16,) * 4,
                                               is_pure=True, pack=1)
    # word element i of four: a, b, c, e -> columns 4j + i
    return tl.reshape(tl.join(tl.join(a, c), tl.join(b, e)), (rows.shape[0], D))


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, lens_ptr, part_o_ptr, part_lse_ptr, count_ptr,
                   kn_ptr, vn_ptr, slot_ptr, stride_qt, stride_qh, stride_ot, stride_oh, stride_kp, stride_ks,
                   stride_kh, stride_vp, stride_vs, stride_vh, stride_tb, stride_knt, stride_knh, stride_vnt,
                   stride_vnh, scale_log2, v_scale, inv_k, inv_v, G: tl.constexpr, GP: tl.constexpr,
                   D: tl.constexpr, PS: tl.constexpr, S: tl.constexpr, BLOCK_N: tl.constexpr, HKV: tl.constexpr,
                   WRITE: tl.constexpr, LENS_ARE_POSITIONS: tl.constexpr, QUANT: tl.constexpr = False,
                   FP8_WORDS: tl.constexpr = False, PDL: tl.constexpr = False):
    pdl_kernels.wait(PDL)  # q and the new K/V rows come from the kernels before (pdl.py)
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    if LENS_ARE_POSITIONS:
        seq_len = (tl.load(lens_ptr + b) + 1).to(tl.int32)  # the new token's position + 1
    else:
        seq_len = tl.load(lens_ptr + b).to(tl.int32)
    chunk = tl.cdiv(tl.cdiv(seq_len, S), BLOCK_N) * BLOCK_N
    active = tl.cdiv(seq_len, chunk)  # splits with keys; the others only count themselves in
    start = s * chunk
    end = tl.minimum(start + chunk, seq_len)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    rows = h * G + g
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qt + rows[:, None] * stride_qh + d[None, :],
                mask=(g < G)[:, None], other=0.0)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    table = table_ptr + b.to(tl.int64) * stride_tb
    if WRITE:
        # The step's new K/V row goes into the cache here, at its slot (for a real row the slot of
        # position seq_len - 1; a graph padding row's is the reserved slot), by the split whose range
        # ends with it (no other program reads that row); the barrier makes the row this program's
        # threads stored visible to all of them before the loop loads it.
        if s == active - 1:
            slot = tl.load(slot_ptr + b).to(tl.int64)
            page_new = slot // PS
            kn = tl.load(kn_ptr + b.to(tl.int64) * stride_knt + h * stride_knh + d)
            vn = tl.load(vn_ptr + b.to(tl.int64) * stride_vnt + h * stride_vnh + d)
            if QUANT:  # an FP8 pool's rows, as core.kv.quantize_kv and the write kernel store them
                kn = quantize_e4m3(kn, inv_k, k_ptr.dtype.element_ty)
                vn = quantize_e4m3(vn, inv_v, v_ptr.dtype.element_ty)
            tl.store(k_ptr + page_new * stride_kp + (slot % PS) * stride_ks + h * stride_kh + d, kn)
            tl.store(v_ptr + page_new * stride_vp + (slot % PS) * stride_vs + h * stride_vh + d, vn)
        tl.debug_barrier()
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        valid = offs < end
        page = tl.load(table + offs // PS, mask=valid, other=0).to(tl.int64)
        k_rows = page * stride_kp + (offs % PS) * stride_ks + h * stride_kh
        if FP8_WORDS:
            k = e4m3_rows(k_ptr, k_rows, D, valid, q.dtype)
        else:
            k = tl.load(k_ptr + k_rows[:, None] + d[None, :], mask=valid[:, None], other=0.0).to(q.dtype)
        qk = tl.dot(q, tl.trans(k)) * scale_log2  # scores in log2 units (an FP8 pool's k_scale folded in)
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_rows = page * stride_vp + (offs % PS) * stride_vs + h * stride_vh
        if FP8_WORDS:
            v = e4m3_rows(v_ptr, v_rows, D, valid, q.dtype)
        else:
            v = tl.load(v_ptr + v_rows[:, None] + d[None, :], mask=valid[:, None], other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    pdl_kernels.launch_dependents(PDL)  # the next kernel's launch overlaps the merge
    out_rows = out_ptr + b.to(tl.int64) * stride_ot + rows[:, None] * stride_oh + d[None, :]
    omask = (g < G)[:, None]
    acc = acc * v_scale  # an FP8 pool's values are V / v_scale (1.0 otherwise); partials merge linearly
    if S == 1:
        tl.store(out_rows, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=omask)
    else:
        # partials of (b, h): [S, GP, D] and [S, GP], written by the `active` splits that have keys
        base = (b * HKV + h).to(tl.int64) * S
        if s < active:
            lse = m_i + tl.math.log2(l_i)
            tl.store(part_o_ptr + ((base + s) * GP + g[:, None]) * D + d[None, :], acc / l_i[:, None])
            tl.store(part_lse_ptr + (base + s) * GP + g, lse)
        arrived = publish_and_count(count_ptr + b * HKV + h)
        if arrived == S - 1:
            # unrolled over the constexpr S, splits without keys masked out: with the run-time bound
            # `active` as the loop's end the batch-1 call was much slower on the H200 (16 splits of 32
            # keys, 512 tokens: 15.6 us in the 11:10 sweep against 8.8 us with the bound S at 10:34)
            m = tl.full([GP], float("-inf"), tl.float32)
            for si in tl.static_range(S):
                lse_si = tl.load(part_lse_ptr + (base + si) * GP + g, mask=(g < GP) & (si < active),
                                 other=float("-inf"), cache_modifier=".cg")
                m = tl.maximum(m, lse_si)
            total = tl.zeros([GP, D], tl.float32)
            weight = tl.zeros([GP], tl.float32)
            for si in tl.static_range(S):
                has = si < active
                lse_si = tl.load(part_lse_ptr + (base + si) * GP + g, mask=(g < GP) & has,
                                 other=float("-inf"), cache_modifier=".cg")
                w = tl.math.exp2(lse_si - m)
                total += w[:, None] * tl.load(part_o_ptr + ((base + si) * GP + g[:, None]) * D + d[None, :],
                                              mask=((g < GP)[:, None] & (d < D)[None, :]) & has, other=0.0,
                                              cache_modifier=".cg")
                weight += w
            tl.store(out_rows, (total / weight[:, None]).to(out_ptr.dtype.element_ty), mask=omask)
            tl.store(count_ptr + b * HKV + h, 0)


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
           table: torch.Tensor, lens: torch.Tensor, scale: float, splits: int, part_o: torch.Tensor,
           part_lse: torch.Tensor, counters: torch.Tensor, block_n: int = 64, num_warps: int = 4,
           num_stages: int = 2, k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
           lens_are_positions: bool = False, slots: torch.Tensor | None = None,
           kv_scales: tuple[float, float] = (1.0, 1.0), fp8_words: bool = True) -> None:
    """out[b] = attention of q[b] over the first lens[b] tokens of sequence b's pages.

    kv_scales: (k_scale, v_scale) of an FP8 pool (float8_e4m3fn caches, read as q's dtype times them).
    k_new, v_new: [B, Hkv, D] (unit stride over D; the caches' dtype, or any over an FP8 pool, whose rows
    the kernel quantizes as `core.kv.quantize_kv` does), or None: the step's new rows,
    written to the caches at slots[b] (int64 [B]: page * PS + offset; for a real row the slot of
    position lens[b] - 1) by the kernel before it reads them (saves the separate K/V write launch of
    a decode step). Without them the caches must already hold them.
    lens_are_positions: `lens` holds each sequence's new-token position instead (any integer dtype;
    length = position + 1), as a decode step's positions tensor does.

    q, out: [B, Hq, D] (row stride free, unit stride over D); k_cache, v_cache: [P, PS, Hkv, D];
    table: [B, >= pages] int32 page ids; lens: [B] int32 (>= 1); part_o: float32 with room for
    B * Hkv * splits * GP * D, part_lse: B * Hkv * splits * GP (GP = max(16, pow2 >= Hq / Hkv));
    counters: int32 [>= B * Hkv], zero (left zero). block_n: keys per loop step (a split covers a whole
    number of them); num_warps, num_stages: Triton's launch options. fp8_words: an FP8 pool read as words
    decoded by bit moves (`e4m3_rows`; caches whose rows start off 4-byte boundaries are read as bytes);
    False: through Triton's conversion (the same values, slower)."""
    b, hq, dim = q.shape
    _, page_size, hkv, _ = k_cache.shape
    group = hq // hkv
    gp = max(16, triton.next_power_of_2(group))
    write = k_new is not None
    if write and slots is None:
        raise ValueError("decode: k_new/v_new need slots (the slot of each new row)")
    kn, vn = (k_new, v_new) if write else (q, q)  # placeholders, never read
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    # word reads need every row to start on a 4-byte boundary (the pool's layouts do; a strided view might not)
    words = fp8_words and fp8 and all(c.data_ptr() % 4 == 0 and all(st % 4 == 0 for st in c.stride()[:3])
                                      for c in (k_cache, v_cache))
    quant = write and fp8 and k_new.dtype != k_cache.dtype
    slots = slots if write else lens  # placeholder, never read
    # Launched in stream order, not early behind the q/k/v GEMM: every input but the page table comes from
    # that GEMM, and the early launch makes the kernel finish later (batch-1 step on the H200: 8.3 us after
    # the GEMM's end per layer against 6.5; docs/benchmarks.md). Its PDL wait then returns at once, and its
    # trigger still lets the o GEMM launch before the merge.
    use_pdl, launch = pdl.launch_options(q.device, early=False)
    _decode_kernel[(b, hkv, splits)](
        q, k_cache, v_cache, out, table, lens, part_o, part_lse, counters, kn, vn, slots,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), table.stride(0),
        kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1),
        scale * kv_scales[0] * 1.4426950408889634, kv_scales[1], 1.0 / kv_scales[0], 1.0 / kv_scales[1],
        G=group, GP=gp, D=dim, PS=page_size, S=splits, BLOCK_N=block_n, HKV=hkv,
        WRITE=write, LENS_ARE_POSITIONS=lens_are_positions, QUANT=quant, FP8_WORDS=words, PDL=use_pdl,
        num_warps=num_warps, num_stages=num_stages, **launch)
