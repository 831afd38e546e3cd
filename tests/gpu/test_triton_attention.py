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


@pytest.mark.parametrize("lens,hq,hkv,d", [([1], 32, 8, 128), ([513], 32, 8, 128),
                                           ([4097, 3, 700, 16, 1, 64, 250, 33], 32, 8, 128),
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_e4m3_word_reads_are_exact_for_every_byte(dtype):
    """The FP8 pool's reads by bit moves (`e4m3_rows`: 32-bit words, each decoded into four values) against
    torch's conversion for all 256 bytes, in rows as the kernel reads them: equal bits for every finite byte
    (subnormals and both zeros included); the two NaN bytes read as +-480."""
    import triton
    import triton.language as tl

    @triton.jit
    def convert(x_ptr, y_ptr, R: tl.constexpr, D: tl.constexpr, DT: tl.constexpr):
        r = tl.arange(0, R)
        y = tk.e4m3_rows(x_ptr, r * D, D, r < R, DT)
        tl.store(y_ptr + r[:, None] * D + tl.arange(0, D)[None, :], y)

    x = torch.arange(256, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    y = torch.empty(256, dtype=dtype, device="cuda")
    convert[(1,)](x, y, R=4, D=64, DT=tl.float16 if dtype == torch.float16 else tl.bfloat16)
    ref = x.to(dtype)
    finite = torch.isfinite(ref)
    assert int(finite.sum()) == 254
    assert torch.equal(y[finite].view(torch.int16), ref[finite].view(torch.int16))
    assert y[~finite].tolist() == [480.0, -480.0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lens", [[1], [4097, 3, 700, 16, 1, 64, 250, 33], [90] * 32])
def test_fp8_word_reads_equal_tritons_conversion(lens, dtype):
    """Over an FP8 pool with scales, the decode kernel's word reads (the default) give the output bits of the kernel
    reading through Triton's own e4m3 conversion, within 1e-2 of float32 attention over the dequantized pool."""
    from pieceworks.core.kv import dequantize_kv, quantize_kv

    gen = torch.Generator("cuda").manual_seed(7 + len(lens))
    hq, hkv, d, ps, b = 32, 8, 128, 16, len(lens)
    kc, vc, table, q = paged_case(lens, hq, hkv, d, gen, ps)
    q = q.to(dtype)
    scales = (0.0125, 0.01)
    kq, vq = quantize_kv(kc, scales[0]), quantize_kv(vc, scales[1])
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    splits = num_splits(b, hkv)
    outs = []
    for words in (True, False):
        out = torch.full_like(q, float("nan"))
        part_o = torch.empty(b * hkv * splits * 16 * d, device="cuda")
        part_lse = torch.empty(b * hkv * splits * 16, device="cuda")
        counters = torch.zeros(b * hkv, dtype=torch.int32, device="cuda")
        tk.decode(q, kq, vq, out, table, lens_t, d**-0.5, splits, part_o, part_lse, counters, num_stages=1,
                  kv_scales=scales, fp8_words=words)
        assert torch.isfinite(out).all()
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    kd, vd = dequantize_kv(kq, scales[0]), dequantize_kv(vq, scales[1])
    for i, n in enumerate(lens):
        pg = table[i, : -(-n // ps)].long()
        ref = attend(q[i : i + 1].float(), kd[pg].flatten(0, 1)[:n], vd[pg].flatten(0, 1)[:n], d**-0.5, n - 1)[0]
        err = float((outs[0][i].float() - ref).norm() / ref.norm())
        assert err < 1e-2, (i, n, err)


def test_fp8_caches_off_word_boundaries_read_as_bytes():
    """Caches whose rows start off 4-byte boundaries (a view one byte into its storage) are read byte by byte even
    with fp8_words on: the output bits equal those over the same bytes at an aligned address."""
    from pieceworks.core.kv import quantize_kv

    lens = [4097, 3, 700, 16, 1, 64, 250, 33]
    gen = torch.Generator("cuda").manual_seed(23)
    hq, hkv, d, ps, b = 32, 8, 128, 16, len(lens)
    kc, vc, table, q = paged_case(lens, hq, hkv, d, gen, ps)
    scales = (0.0125, 0.01)
    aligned = quantize_kv(kc, scales[0]), quantize_kv(vc, scales[1])
    shifted = []
    for c in aligned:
        buf = torch.empty(c.numel() + 1, dtype=torch.uint8, device="cuda")
        view = buf[1:].view(torch.float8_e4m3fn).view(c.shape)
        view.copy_(c)
        assert view.data_ptr() % 4 == 1
        shifted.append(view)
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    splits = num_splits(b, hkv)
    outs = []
    for kq, vq in (aligned, shifted):
        out = torch.full_like(q, float("nan"))
        part_o = torch.empty(b * hkv * splits * 16 * d, device="cuda")
        part_lse = torch.empty(b * hkv * splits * 16, device="cuda")
        counters = torch.zeros(b * hkv, dtype=torch.int32, device="cuda")
        tk.decode(q, kq, vq, out, table, lens_t, d**-0.5, splits, part_o, part_lse, counters, kv_scales=scales)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("lens", [[1, 16, 17, 260], [4097, 3, 700, 16, 1, 64, 250, 33], [90] * 32])
def test_fused_fp8_write_matches_quantizing_write_then_decode(lens):
    """Over an FP8 pool the kernel quantizes the step's new bf16 rows as it writes them (the backend's decode step):
    the caches' bytes equal those of the quantizing K/V write (`write_rows` with the layer's scales, which stores
    quantize_kv's bits), and the output equals that of the kernel run after that write, bit for bit."""
    from pieceworks.backends.kv_write import write_rows
    from pieceworks.core.kv import quantize_kv

    gen = torch.Generator("cuda").manual_seed(11 + sum(lens))
    hq, hkv, d, ps, b = 32, 8, 128, 16, len(lens)
    kc, vc, table, q = paged_case(lens, hq, hkv, d, gen, ps)
    scales = (0.0125, 0.01)
    kq0, vq0 = quantize_kv(kc, scales[0]), quantize_kv(vc, scales[1])
    qkv = torch.randn(b, (hq + 2 * hkv) * d, device="cuda", generator=gen).bfloat16()
    k_new = qkv[:, hq * d:(hq + hkv) * d].view(b, hkv, d)
    v_new = qkv[:, (hq + hkv) * d:].view(b, hkv, d)
    pos = torch.tensor(lens, dtype=torch.int64, device="cuda") - 1
    slots = table.long().gather(1, (pos // ps)[:, None])[:, 0] * ps + pos % ps
    splits = num_splits(b, hkv)
    results = []
    for fused in (False, True):
        kq, vq = kq0.clone(), vq0.clone()
        if not fused:
            write_rows(kq.view(-1, hkv * d), k_new.reshape(b, -1), vq.view(-1, hkv * d), v_new.reshape(b, -1),
                       slots, scales)
        out = torch.full_like(q, float("nan"))
        part_o = torch.empty(b * hkv * splits * 16 * d, device="cuda")
        part_lse = torch.empty(b * hkv * splits * 16, device="cuda")
        counters = torch.zeros(b * hkv, dtype=torch.int32, device="cuda")
        tk.decode(q, kq, vq, out, table, pos, d**-0.5, splits, part_o, part_lse, counters,
                  k_new=k_new if fused else None, v_new=v_new if fused else None, lens_are_positions=True,
                  slots=slots if fused else None, kv_scales=scales, num_stages=1)
        assert torch.isfinite(out).all() and int(counters.abs().sum()) == 0
        results.append((out, kq.view(torch.uint8), vq.view(torch.uint8)))
    (o0, k0, v0), (o1, k1, v1) = results
    assert torch.equal(k1, k0) and torch.equal(v1, v0)
    assert torch.equal(k1.view(-1, hkv, d)[slots], quantize_kv(k_new, scales[0]).view(torch.uint8))
    assert not torch.equal(k1, kq0.view(torch.uint8))  # the rows were written
    assert torch.equal(o1, o0)


# (query lengths, cached prefixes, Hq, Hkv, head_dim): query heads per KV head 1-64, powers of 2 and not (Llama 3.2
# 3B's 3, Qwen2.5-7B's 7, GLM-4.5-Air's 12: the kernel pads the group to a power of 2 and masks the extra rows)
EXTEND_GROUPS = [([37, 1, 5], [0, 40, 12], 8, 8, 128), ([50, 1], [0, 77], 32, 8, 128),
                 ([21, 1, 1], [9, 40, 3], 24, 8, 128), ([19, 2], [0, 17], 28, 4, 128),
                 ([33, 1], [5, 60], 96, 8, 128), ([40], [3], 64, 2, 64), ([12, 1], [30, 8], 64, 1, 64),
                 ([70, 3], [0, 100], 12, 1, 256)]


@pytest.mark.parametrize("q_lens,prefixes,hq,hkv,d", EXTEND_GROUPS)
def test_extend_kernel_matches_reference_for_every_group(q_lens, prefixes, hq, hkv, d):
    """attention.triton_all's extend kernel (bf16) against the float32 torch attention, sequences of prompt chunks
    over cached prefixes beside decode rows; rows past the step's tokens untouched."""
    from pieceworks.backends.attention import triton_extend_kernel as ek

    gen = torch.Generator("cuda").manual_seed(hq * 100 + hkv)
    ps = 16
    lens = [p + n for p, n in zip(prefixes, q_lens)]
    kc, vc, table, _ = paged_case(lens, hq, hkv, d, gen, ps)
    t = sum(q_lens)
    q = torch.randn(t + 3, hq, d, device="cuda", generator=gen).bfloat16()
    out = torch.full_like(q, float("nan"))
    qo = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    ek.extend(q, kc, vc, out, table, qo, torch.tensor(lens, dtype=torch.int32, device="cuda"), len(lens), t, d**-0.5)
    assert torch.isnan(out[t:]).all()
    for i, n in enumerate(lens):
        pg = table[i, : -(-n // ps)].long()
        rows = slice(int(qo[i]), int(qo[i + 1]))
        ref = attend(q[rows], kc[pg].flatten(0, 1)[:n], vc[pg].flatten(0, 1)[:n], d**-0.5, prefixes[i])
        err = float((out[rows].float() - ref).norm() / ref.norm())
        assert err < 1e-2, (i, n, err)
