"""attention.triton's split-KV decode kernel against the float32 torch attention, at Llama-3.1-8B head
shapes, on the GPU. (Every scenario of the backend-matrix suite runs it too: tests/test_backend_matrix.py.)"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not importable here")

from pieceworks.backends.attention import triton_decode_kernel as tk  # noqa: E402
from pieceworks.backends.attention.torch import attend  # noqa: E402
from pieceworks.backends.attention.triton import num_splits  # noqa: E402


@pytest.mark.parametrize("lens,hq,hkv,d", [([1], 32, 8, 128), ([513], 32, 8, 128), ([4097, 3, 700, 16, 1, 64, 250, 33], 32, 8, 128),
                                           ([90] * 32, 32, 8, 128), ([300, 1200], 64, 8, 64), ([77], 8, 8, 256)])
def test_decode_kernel_matches_reference(lens, hq, hkv, d):
    gen = torch.Generator("cuda").manual_seed(len(lens) * 1000 + hq)
    ps, b = 16, len(lens)
    width = max(-(-n // ps) for n in lens)
    pages = 1 + b * width
    kc = torch.randn(pages, ps, hkv, d, device="cuda", generator=gen).bfloat16()
    vc = torch.randn(pages, ps, hkv, d, device="cuda", generator=gen).bfloat16()
    table = (torch.randperm(pages - 1, device="cuda", generator=gen)[: b * width] + 1).view(b, width).int()
    q = torch.randn(b, hq, d, device="cuda", generator=gen).bfloat16()
    out = torch.full_like(q, float("nan"))
    splits = num_splits(b, hkv)
    gp = max(16, 1 << (hq // hkv - 1).bit_length())
    part_o = torch.empty(b * hkv * splits * gp * d, device="cuda")
    part_lse = torch.empty(b * hkv * splits * gp, device="cuda")
    counters = torch.zeros(b * hkv, dtype=torch.int32, device="cuda")
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    for _ in range(2):  # counters are left at zero: a second call is as good as the first
        tk.decode(q, kc, vc, out, table, lens_t, d**-0.5, splits, part_o, part_lse, counters)
        assert torch.isfinite(out).all() and int(counters.abs().sum()) == 0
        for i, n in enumerate(lens):
            pg = table[i, : -(-n // ps)].long()
            ref = attend(q[i : i + 1], kc[pg].flatten(0, 1)[:n], vc[pg].flatten(0, 1)[:n], d**-0.5, n - 1)[0]
            err = float((out[i].float() - ref).norm() / ref.norm())
            assert err < 1e-2, (i, n, splits, err)
