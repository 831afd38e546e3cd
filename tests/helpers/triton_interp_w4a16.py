"""Run by tests/test_triton_w4a16_interp.py in a subprocess with TRITON_INTERPRET=1: `triton_w4a16.w4a16_gemm` (the
whole launch: K splits, the in-kernel or second-kernel reduction, x by TMA descriptor or pointers) on k32 weights,
on the CPU. Importing triton_interp_loop sets the interpreter mode and swaps the same three device functions for
float32 equivalents (its docstring says why), so this checks the index arithmetic, the split bookkeeping and the
epilogue. Prints one JSON line per case: the relative error against x @ dequantize(W).T * weight_scale_2 in float64,
(the output has x's dtype: float32 x goes by pointer loads, bfloat16 x by TMA where asked).
"""

from __future__ import annotations

import json
import sys

import triton_interp_loop  # noqa: F401  (interpreter mode and the float32 stand-ins, before the kernels load)
import torch  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from pieceworks.backends.fp4_gemm import triton_w4a16  # noqa: E402
from pieceworks.backends.fp4_gemm.k32 import repack_k32  # noqa: E402
from pieceworks.quant import nvfp4  # noqa: E402

_patch_lang_tensor = interpreter._patch_lang_tensor


def _patch_index(tensor, scope):
    # The interpreter's scalars are one-element arrays, and int() of one raises under NumPy >= 2.4: a loop bound
    # computed from program ids (the split's iteration count) would not run.
    _patch_lang_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


interpreter._patch_lang_tensor = _patch_index


def run(m: int, n: int, k: int, block_m: int, block_n: int, block_k: int, x_dtype: str, tma_x: bool,
        target_ctas: int, counters: bool, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen)
    packed, scale, _ = nvfp4.quantize_weight(w)
    gs = torch.tensor(0.375)
    x = torch.randn(m, k, generator=gen).bfloat16()
    ref = x.double() @ nvfp4.dequantize(packed, scale, torch.ones(())).double().t() * 0.375
    codes, scales = repack_k32(packed, scale)
    tile = triton_w4a16.W4a16Tile(block_m=block_m, block_n=block_n, block_k=block_k, tma_x=tma_x, asm=False,
                                  target_ctas=target_ctas, max_split=4, min_split_iters=1)
    count = torch.zeros(64, dtype=torch.int32) if counters else None
    out = triton_w4a16.w4a16_gemm(x.to(getattr(torch, x_dtype)), codes, scales, gs, n, tile, count)
    return {"err": float((out.double() - ref).norm() / ref.norm()), "split": tile.split_k(m, n, codes.shape[1] * 2),
            "dtype": str(out.dtype), "shape": list(out.shape),
            "counters_zero": bool(count is None or not count.any())}


if __name__ == "__main__":
    for case in json.loads(sys.argv[1]):
        print(json.dumps({"case": case, **run(*case)}), flush=True)
