"""`linear(x, w)` = x @ w.T for a CPU, in the form its BLAS streams the weight fastest at each row count.

On the 2-core CPU machine (torch 2.13's MKL, float32) `x @ w.T` over a row-major [N, K] weight is slow for
decode-sized x: a one-row product runs as a matrix-vector product that reads the weight at ~11 GB/s, and
2-64 rows take a path that reads it up to 6x slower than `(w @ x.T).T`, which MKL runs as a product with
a few columns at ~30 GB/s. So 2..SKINNY_ROWS rows go through `(w @ x.T).T`, one row as two (the row twice,
one result kept), more rows through `F.linear`. The same products summed in another order: results differ
from `F.linear`'s in their low bits. End to end (`pieceworks run`, SmolLM2-135M, docs/backends.md): decode
steps 1.3-2.5x faster. Callers use it on CPU tensors only; CUDA keeps `F.linear` (cuBLAS).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SKINNY_ROWS = 64  # up to this many rows: (w @ x.T).T


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w[N, K].T -> [M, N], contiguous (x and w on the CPU, one dtype)."""
    m = x.shape[0]
    if m == 1:
        return (w @ torch.cat([x, x]).T)[:, :1].T.contiguous()
    if m <= SKINNY_ROWS:
        return (w @ x.T).T.contiguous()
    return F.linear(x, w)
