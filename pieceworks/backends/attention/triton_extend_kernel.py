"""Paged causal GQA attention for extend and mixed steps in Triton, planned on the device (imports triton).

One program per (query block, KV head): the step's query blocks are numbered over all sequences, sequence s's
starting at qo[s] // BLOCK_Q + s (so a grid of T // BLOCK_Q + B programs covers every layout of T tokens over B
sequences), and each program finds its sequence by a binary search over `qo` on the device. It attends the
BLOCK_Q queries' GQA group (BLOCK_Q x GP rows, GP the group size rounded up to a power of 2 as tl.arange needs:
a group of 3, 7 or 12 query heads per KV head gets masked rows) over the sequence's cached prefix and the new tokens
up to each query, gathering K/V rows through the page table, with an online float32 softmax (P rounded to the query
dtype for the PV dot). No host work but two small index copies: no scheduler, no per-step plan.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _extend_kernel(q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, qo_ptr, lens_ptr, num_seqs,
                   sq_t, sq_h, so_t, so_h, sk_p, sk_s, sk_h, sv_p, sv_s, sv_h, st_b, scale_log2,
                   G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, PS: tl.constexpr, BLOCK_Q: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    # the sequence whose query blocks hold pid: the last s with qo[s] // BLOCK_Q + s <= pid
    lo = 0
    hi = num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tl.load(qo_ptr + mid) // BLOCK_Q + mid <= pid:
            lo = mid
        else:
            hi = mid
    q0 = tl.load(qo_ptr + lo)
    q_len = tl.load(qo_ptr + lo + 1) - q0
    qb = pid - (q0 // BLOCK_Q + lo)
    if qb * BLOCK_Q < q_len:
        seq_len = tl.load(lens_ptr + lo)
        prefix = seq_len - q_len
        BLOCK_M: tl.constexpr = BLOCK_Q * GP
        r = tl.arange(0, BLOCK_M)
        qi = qb * BLOCK_Q + r // GP  # query index within the sequence's new tokens
        g = r % GP
        head = kvh * G + g
        rmask = (qi < q_len) & (g < G)  # rows past the group (GP > G) are neither read nor written
        d = tl.arange(0, D)
        q = tl.load(q_ptr + (q0 + qi)[:, None] * sq_t + head[:, None] * sq_h + d[None, :], mask=rmask[:, None],
                    other=0.0)
        qpos = prefix + qi  # each query's position: it sees keys 0 .. qpos
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        end = tl.minimum(seq_len, prefix + (qb + 1) * BLOCK_Q)
        for n0 in range(0, end, BLOCK_N):
            kpos = n0 + tl.arange(0, BLOCK_N)
            kmask = kpos < end
            page = tl.load(table_ptr + lo * st_b + kpos // PS, mask=kmask, other=0).to(tl.int64)
            off = kpos % PS
            k = tl.load(k_ptr + page[:, None] * sk_p + off[:, None] * sk_s + kvh * sk_h + d[None, :],
                        mask=kmask[:, None], other=0.0)
            v = tl.load(v_ptr + page[:, None] * sv_p + off[:, None] * sv_s + kvh * sv_h + d[None, :],
                        mask=kmask[:, None], other=0.0)
            qk = tl.dot(q, tl.trans(k)) * scale_log2
            seen = (kpos[None, :] <= qpos[:, None]) & kmask[None, :]
            qk = tl.where(seen, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # masked rows: no key yet
            alpha = tl.math.exp2(m_i - m_safe)
            p = tl.math.exp2(qk - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + (q0 + qi)[:, None] * so_t + head[:, None] * so_h + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=rmask[:, None])


def launch_shape(hq: int, hkv: int, block_q: int = 16) -> tuple[int, int, int]:
    """(G, GP, BLOCK_Q) of a launch: the query heads per KV head, that rounded up to a power of 2 (tl.arange's
    need), and block_q lowered to keep BLOCK_Q x GP rows a program at most 128 (as a group of 8 has at 16)."""
    group = hq // hkv
    padded = triton.next_power_of_2(group)
    return group, padded, min(block_q, max(1, 128 // padded))


def extend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, table: torch.Tensor,
           qo: torch.Tensor, lens: torch.Tensor, num_seqs: int, num_tokens: int, scale: float,
           block_q: int = 16, block_n: int = 64, num_warps: int = 4, num_stages: int = 2) -> None:
    """out[t] = causal attention of q[t] over its sequence's first lens[s] - (qo[s + 1] - t) + 1 keys.

    q, out: [>= num_tokens, Hq, D] (unit stride over D); k_cache, v_cache: [P, PS, Hkv, D] holding the step's new
    rows already; table: [>= num_seqs, pages] int32 page ids; qo: [num_seqs + 1] int32 offsets of each sequence's
    new tokens in q (qo[0] = 0, qo[num_seqs] = num_tokens); lens: [num_seqs] int32 KV lengths after the step.
    Rows of out past num_tokens are left as they are. A program holds block_q x GP rows (GP: the query heads per KV
    head rounded up to a power of 2), block_q lowered to keep that at most 128."""
    _, hq, dim = q.shape
    _, page_size, hkv, _ = k_cache.shape
    group, padded, block_q = launch_shape(hq, hkv, block_q)
    grid = (num_tokens // block_q + num_seqs, hkv)
    _extend_kernel[grid](q, k_cache, v_cache, out, table, qo, lens, num_seqs,
                         q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                         k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                         v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), table.stride(0),
                         scale * 1.4426950408889634, G=group, GP=padded, D=dim, PS=page_size, BLOCK_Q=block_q,
                         BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages)
