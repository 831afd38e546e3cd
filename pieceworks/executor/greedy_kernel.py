"""Each row's greedy token of [B, V] float32 logits on CUDA in two Triton launches (imports triton).

`cuda_graph.greedy_token_ids` runs this on CUDA: torch's `argmax` and `aminmax` took 29 and 17 us on
one row of 128k float32 logits (0.5 MB) in a kernel profile of a Llama-3.1-8B-shaped request on the H200.
Here the first launch splits each row into chunks, one program per (row, chunk), each keeping its chunk's
largest value, that value's first index and a count of NaN / +-inf entries; the second reduces a row's
chunks in order. The ids equal torch's: the first index of the largest value, -1
for a row that is not all finite.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # logits per loop step of a program
MAX_CHUNKS = 256  # chunks per row at most (the second launch reads them as one block)
TARGET_PROGRAMS = 264  # two per SM on an H200


# One compiled kernel serves every batch size (compiled at the first decode graph's warm-up, never inside a
# capture): V and the row stride are the model's, chunk is always a multiple of BLOCK, and S, the one argument
# that varies with the batch (and may be 1), is not specialized. V and stride stay specialized so that the
# loads are vectorized where they divide by 16 (128256 does).
@triton.jit(do_not_specialize=["S"])
def _chunk_kernel(x_ptr, val_ptr, idx_ptr, bad_ptr, V, stride, chunk, S, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    lo = s * chunk
    best_v = tl.full((), float("-inf"), tl.float32)
    best_i = tl.full((), 0, tl.int32)
    bad = tl.full((), 0, tl.int32)
    for off in tl.range(0, chunk, BLOCK):
        cols = lo + off + tl.arange(0, BLOCK)
        live = cols < V  # chunk is a multiple of BLOCK: the loop never crosses into the next chunk
        x = tl.load(x_ptr + row * stride + cols, mask=live, other=float("-inf"))
        bad += tl.sum(((x != x) | (x == float("inf")) | ((x == float("-inf")) & live)).to(tl.int32), axis=0)
        v, i = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        take = v > best_v  # strictly: an equal value later in the row keeps the earlier index
        best_v = tl.where(take, v, best_v)
        best_i = tl.where(take, lo + off + i, best_i)
    at = row * S + s
    tl.store(val_ptr + at, best_v)
    tl.store(idx_ptr + at, best_i)
    tl.store(bad_ptr + at, bad)


@triton.jit(do_not_specialize=["S"])
def _row_kernel(val_ptr, idx_ptr, bad_ptr, out_ptr, S, SBLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, SBLOCK)
    live = c < S
    v = tl.load(val_ptr + row * S + c, mask=live, other=float("-inf"))
    i = tl.load(idx_ptr + row * S + c, mask=live, other=2147483647)
    bad = tl.sum(tl.load(bad_ptr + row * S + c, mask=live, other=0), axis=0)
    top = tl.max(v, axis=0)
    first = tl.min(tl.where(live & (v == top), i, 2147483647), axis=0)  # chunks hold disjoint, ordered ranges
    tl.store(out_ptr + row, tl.where(bad > 0, -1, first).to(tl.int64))


def chunking(rows: int, vocab: int) -> tuple[int, int]:
    """(chunk length, chunks per row): about TARGET_PROGRAMS programs in all, each at least one BLOCK,
    at most MAX_CHUNKS per row, every chunk non-empty."""
    per_row = max(1, min(MAX_CHUNKS, -(-TARGET_PROGRAMS // max(1, rows)), -(-vocab // BLOCK)))
    chunk = -(-(-(-vocab // per_row)) // BLOCK) * BLOCK
    return chunk, -(-vocab // chunk)


def greedy_token_ids(logits: torch.Tensor) -> torch.Tensor:
    """int64 [B]: `cuda_graph.greedy_token_ids` of logits that `cuda_graph.greedy_kernel_supported` takes."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    chunk, per_row = chunking(rows, vocab)
    val = torch.empty(rows * per_row, dtype=torch.float32, device=logits.device)
    idx = torch.empty(rows * per_row, dtype=torch.int32, device=logits.device)
    bad = torch.empty(rows * per_row, dtype=torch.int32, device=logits.device)
    _chunk_kernel[(rows, per_row)](logits, val, idx, bad, vocab, logits.stride(0), chunk, per_row, BLOCK=BLOCK,
                                   num_warps=4)
    _row_kernel[(rows,)](val, idx, bad, out, per_row, SBLOCK=MAX_CHUNKS, num_warps=4)
    return out
