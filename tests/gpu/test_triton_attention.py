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


def paged_case(lens: list[int], hq: int, hkv: int, d: int, gen: torch.Generator, ps: int = 16):
    """Random bf16 K/V caches of pages of `ps` slots, each sequence's pages at random (page 0 unused),
    and random queries: (k_cache, v_cache, table [B, width] int32, q [B, hq, d])."""
    b = len(lens)
    width = max(-(-n // ps) for n in lens)
    pages = 1 + b * width
    kc = torch.randn(pages, ps, hkv, d, device="cuda", generator=gen).bfloat16()
    vc = torch.randn(pages, ps, hkv, d, device="cuda", generator=gen).bfloat16()
    table = (torch.randperm(pages - 1, device="cuda", generator=gen)[: b * width] + 1).view(b, width).int()
    q = torch.randn(b, hq, d, device="cuda", generator=gen).bfloat16()
    return kc, vc, table, q


@pytest.mark.parametrize("lens,hq,hkv,d", [([1], 32, 8, 128), ([513], 32, 8, 128), ([4097, 3, 700, 16, 1, 64, 250, 33], 32, 8, 128),
                                           ([90] * 32, 32, 8, 128), ([300, 1200], 64, 8, 64), ([77], 8, 8, 256)])
def test_decode_kernel_matches_reference(lens, hq, hkv, d):
    gen = torch.Generator("cuda").manual_seed(len(lens) * 1000 + hq)
    ps, b = 16, len(lens)
    kc, vc, table, q = paged_case(lens, hq, hkv, d, gen, ps)
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


@pytest.mark.parametrize("lens", [[1, 16, 17, 260], [4097, 3, 700, 16, 1, 64, 250, 33], [90] * 32])
def test_fused_kv_write_matches_write_then_decode(lens):
    """With the step's new K/V rows passed in, the kernel writes them into the caches (the split that
    ends at the new token, before reading it): the caches and the output equal, bit for bit, those of
    the rows written first and the kernel run without them. Also with the lengths given as the new
    tokens' positions (`lens_are_positions`, as the backend passes them)."""
    gen = torch.Generator("cuda").manual_seed(sum(lens))
    hq, hkv, d, ps, b = 32, 8, 128, 16, len(lens)
    kc0, vc0, table, q = paged_case(lens, hq, hkv, d, gen, ps)
    qkv = torch.randn(b, (hq + 2 * hkv) * d, device="cuda", generator=gen).bfloat16()
    k_new = qkv[:, hq * d:(hq + hkv) * d].view(b, hkv, d)  # strided views, as the model passes them
    v_new = qkv[:, (hq + hkv) * d:].view(b, hkv, d)
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    pos = lens_t.long() - 1
    slots = table.long().gather(1, (pos // ps)[:, None])[:, 0] * ps + pos % ps
    for splits in sorted({1, 4, num_splits(b, hkv)}):
        gp = max(16, 1 << (hq // hkv - 1).bit_length())
        results = []
        for fused_write, from_positions in ((False, False), (True, False), (True, True)):
            kc, vc = kc0.clone(), vc0.clone()
            if not fused_write:
                kc.view(-1, hkv, d)[slots] = k_new
                vc.view(-1, hkv, d)[slots] = v_new
            out = torch.full_like(q, float("nan"))
            part_o = torch.full((b * hkv * splits * gp * d,), float("nan"), device="cuda")
            part_lse = torch.full((b * hkv * splits * gp,), float("nan"), device="cuda")
            counters = torch.zeros(b * hkv, dtype=torch.int32, device="cuda")
            tk.decode(q, kc, vc, out, table, pos if from_positions else lens_t, d**-0.5, splits, part_o,
                      part_lse, counters, k_new=k_new if fused_write else None,
                      v_new=v_new if fused_write else None, lens_are_positions=from_positions,
                      slots=slots if fused_write else None)
            assert torch.isfinite(out).all() and int(counters.abs().sum()) == 0
            results.append((out, kc, vc))
        o0, k0, v0 = results[0]
        for o1, k1, v1 in results[1:]:  # fused write; fused write with lengths from int64 positions
            assert torch.equal(k1, k0) and torch.equal(v1, v0), splits
            assert torch.equal(o1, o0), splits
