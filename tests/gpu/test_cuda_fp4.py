"""The CUDA NVFP4 decode GEMM (backends/fp4_gemm/cuda.py) against the torch reference, on the GPU.

Run on the H200: `python -m pytest tests/gpu/test_cuda_fp4.py -m gpu -q`. Fresh random inputs per case,
relative error ||y - ref|| / ||ref|| < 1e-2 against the w4a16 torch backend; outputs are checked finite.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from pieceworks.backends import pdl  # noqa: E402
from pieceworks.backends.base import BackendSpec  # noqa: E402
from pieceworks.backends.fp4_gemm.base import Fp4Weight  # noqa: E402
from pieceworks.backends.fp4_gemm.cuda import CudaDecodeOptions, CudaFp4GemmBackend  # noqa: E402
from pieceworks.backends.fp4_gemm.torch import TorchFp4GemmBackend  # noqa: E402
from pieceworks.backends import fused  # noqa: E402
from pieceworks.quant import nvfp4  # noqa: E402

DEV = "cuda"
TOL = 1e-2
SPEC = BackendSpec.for_device(DEV, fp4_numerics="w4a16")
if CudaFp4GemmBackend.check(SPEC):
    pytest.skip(f"cuda fp4_gemm unavailable: {CudaFp4GemmBackend.check(SPEC)}", allow_module_level=True)


def rel_err(y, ref) -> float:
    assert torch.isfinite(y).all(), "non-finite output (unwritten element?)"
    return float((y.float() - ref.float()).norm() / ref.float().norm())


def random_fp4(n, k, gen) -> Fp4Weight:
    w = torch.randn(n, k, device=DEV, generator=gen) * torch.rand(n, 1, device=DEV, generator=gen)
    packed, scale, scale_2 = nvfp4.quantize_weight(w)
    return Fp4Weight(packed, scale, scale_2, torch.ones((), device=DEV))


def reference(x, w: Fp4Weight):
    return TorchFp4GemmBackend(SPEC).forward(x, *w, w.weight.shape[0])


@pytest.mark.parametrize("n,k", [(16, 64), (40, 208), (4096, 4096), (6144, 4096), (28672, 512), (4096, 14336)])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16, 17, 24, 32, 33, 70, 100])  # 17..70: 16-row slices; 100: dequant
def test_forward_matches_reference(n, k, m):
    gen = torch.Generator(device=DEV).manual_seed(n + 7 * k + 31 * m)
    w = random_fp4(n, k, gen)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)
    backend = CudaFp4GemmBackend(SPEC)
    y = backend.forward(x, *backend.prepare(w), n)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    assert rel_err(y, reference(x, w)) < TOL


@pytest.mark.parametrize("m", [9, 16])
@pytest.mark.parametrize("epilogue", ["plain", "swiglu", "residual"])
def test_register_cap_same_bits(m, epilogue):
    """Two token tiles compiled with and without the register cap (`min_blocks`) give the same bits, and
    the automatic choice is one of them. 7168 rows at 8 warps (448 CTAs) is where the H200's plan caps."""
    from pieceworks.backends.fp4_gemm import cuda_decode

    n, k = 7168, 320
    gen = torch.Generator(device=DEV).manual_seed(m + len(epilogue))
    w = random_fp4(n, k, gen)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)
    codes, scales = CudaFp4GemmBackend(SPEC).prepare(w)[:2]
    gs = w.weight_scale_2.float().reshape(())
    kw = {"swiglu": epilogue == "swiglu"}
    if epilogue == "residual":
        kw["residual"] = torch.randn(m, n, device=DEV, dtype=torch.bfloat16, generator=gen)
    ys = [cuda_decode.decode_gemm(x, codes, scales, gs, n, 8, 2, min_blocks=cap, **kw) for cap in (0, 4, None)]
    assert torch.equal(ys[0], ys[1]) and torch.equal(ys[0], ys[2])
    if epilogue == "plain":
        assert rel_err(ys[0], reference(x, w)) < TOL


@pytest.mark.parametrize("m", [1, 5, 16, 27, 40])
def test_swiglu_same_bits_as_gemm_then_silu_mul(m):
    gen = torch.Generator(device=DEV).manual_seed(m)
    inter, k = 1024 + 8, 2048
    w = random_fp4(2 * inter, k, gen)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)
    backend = CudaFp4GemmBackend(SPEC)
    p = backend.prepare_gate_up(w)
    y = backend.forward_swiglu(x, *p, inter)
    ref = reference(x, w)
    assert rel_err(y, fused.silu_mul(ref[:, :inter], ref[:, inter:])) < TOL
    if m <= 16:  # the decode kernel's epilogue against its own GEMM output + the silu_mul op
        plain = backend.forward(x, *p, 2 * inter)
        assert torch.equal(y, fused.silu_mul(plain[:, 0::2].contiguous(), plain[:, 1::2].contiguous()))


@pytest.mark.parametrize("use_pdl", [False, True])
def test_graph_replay_matches_eager(use_pdl):
    if use_pdl and pdl.unsupported_reason(DEV):
        pytest.skip(pdl.unsupported_reason(DEV))
    gen = torch.Generator(device=DEV).manual_seed(5)
    backend = CudaFp4GemmBackend(SPEC)
    w1, w2 = backend.prepare(random_fp4(4096, 4096, gen)), backend.prepare(random_fp4(4096, 4096, gen))
    x = torch.randn(4, 4096, device=DEV, dtype=torch.bfloat16, generator=gen)
    old = pdl._enabled
    pdl._enabled = use_pdl
    try:
        eager = backend.forward(backend.forward(x, *w1, 4096), *w2, 4096)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = backend.forward(backend.forward(x, *w1, 4096), *w2, 4096)
        x.copy_(torch.randn(4, 4096, device=DEV, dtype=torch.bfloat16, generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, backend.forward(backend.forward(x, *w1, 4096), *w2, 4096))
        assert not torch.equal(out, eager)
    finally:
        pdl._enabled = old


def test_decode_max_m_zero_uses_dequant_path():
    gen = torch.Generator(device=DEV).manual_seed(9)
    w = random_fp4(256, 512, gen)
    x = torch.randn(2, 512, device=DEV, dtype=torch.bfloat16, generator=gen)
    backend = CudaFp4GemmBackend(SPEC, CudaDecodeOptions(decode_max_m=0))
    assert rel_err(backend.forward(x, *backend.prepare(w), 256), reference(x, w)) < TOL


def test_non_bf16_activations_refused():
    gen = torch.Generator(device=DEV).manual_seed(3)
    backend = CudaFp4GemmBackend(SPEC)
    p = backend.prepare(random_fp4(32, 64, gen))
    with pytest.raises(ValueError, match="bf16"):
        backend.forward(torch.randn(1, 64, device=DEV), *p, 32)


@pytest.mark.parametrize("m", [1, 7, 16, 25, 33, 40])
def test_qkv_rope_matches_gemm_then_rope(m):
    gen = torch.Generator(device=DEV).manual_seed(100 + m)
    nh, nkv, hd = 8, 2, 128
    n, k = (nh + 2 * nkv) * hd, 1024
    w = random_fp4(n, k, gen)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)
    pos = torch.randint(0, 4096, (m,), device=DEV, generator=gen).float()
    freqs = pos[:, None] / (10000 ** (torch.arange(hd // 2, device=DEV) / (hd // 2)))
    cos, sin = freqs.cos(), freqs.sin()
    backend = CudaFp4GemmBackend(SPEC)
    assert backend.fuses_qkv_rope and backend.qkv_rope_supported(nh, nkv, hd)
    y = backend.forward_qkv_rope(x, *backend.prepare_qkv_rope(w, nh, nkv, hd), cos, sin, nh, nkv, hd)
    assert y.shape == (m, n)

    def roped(plain):
        q, kk = fused.rope_qk(plain[:, : nh * hd].reshape(-1, nh, hd).clone(),
                              plain[:, nh * hd : (nh + nkv) * hd].reshape(-1, nkv, hd).clone(), cos, sin, False)
        return torch.cat([q.reshape(m, -1), kk.reshape(m, -1), plain[:, (nh + nkv) * hd :]], dim=1)

    assert rel_err(y, roped(reference(x, w))) < TOL
    if m <= 16:  # same bits as the kernel's own GEMM output followed by the rope op
        p = backend.prepare(w)
        assert torch.equal(y, roped(backend.forward(x, *p, n)))


def _stream(m, k, gen):
    """A residual-stream-like s (rows of different scales) and an RMSNorm weight around 1."""
    s = torch.randn(m, k, device=DEV, generator=gen) * (0.1 + 4 * torch.rand(m, 1, device=DEV, generator=gen))
    nw = 1 + 0.5 * torch.randn(k, device=DEV, generator=gen)
    return s.to(torch.bfloat16), nw.to(torch.bfloat16)


FUSING = CudaDecodeOptions(fuse_norm=True)  # the fused norm / residual kernels (off by default)


def _prenormed(s, nw):
    from pieceworks.backends.fp4_gemm.base import norm_inputs

    return norm_inputs(s, nw)


@pytest.mark.parametrize("n,k", [(6144, 4096), (40, 208), (28672, 512)])
@pytest.mark.parametrize("m", [1, 5, 8, 9, 16, 20, 32, 40, 100])  # 20..40: 16-row slices; 100: the unfused default
def test_fused_norm_matches_norm_then_gemm(n, k, m):
    """forward_norm_swiglu / forward_norm_qkv_rope (t = s * norm weight and the partial sums of squares
    given) against the rms_norm op followed by the unfused op: the fused kernel applies 1 / rms after the
    GEMM (a tolerance); M = 100 runs the default, the same bits."""
    gen = torch.Generator(device=DEV).manual_seed(n + 3 * k + 17 * m)
    w = random_fp4(n, k, gen)
    s, nw = _stream(m, k, gen)
    t, parts = _prenormed(s, nw)
    eps = 1e-5
    backend = CudaFp4GemmBackend(SPEC, FUSING)
    assert backend.fuses_norm
    x = fused.rms_norm(s, nw, eps)
    gu = backend.prepare_gate_up(w)
    got = backend.forward_norm_swiglu(s, t, parts, nw, eps, *gu, n // 2)
    ref = backend.forward_swiglu(x, *gu, n // 2)
    assert got.shape == ref.shape == (m, n // 2)
    err = rel_err(got, ref)
    print(f"norm+swiglu n={n} k={k} m={m}: rel err {err:.2e}")
    assert err == 0 if m > 64 else err < TOL, err
    if n % 128 == 0:  # as q/k/v: 8 kv heads of 128 (n / 128 - 16 q heads), rope on q and k
        hd, nkv = 128, 8
        nh = n // hd - 2 * nkv
        pos = torch.randint(0, 4096, (m,), device=DEV, generator=gen).float()
        freqs = pos[:, None] / (10000 ** (torch.arange(hd // 2, device=DEV) / (hd // 2)))
        cos, sin = freqs.cos(), freqs.sin()
        p = backend.prepare_qkv_rope(w, nh, nkv, hd)
        got = backend.forward_norm_qkv_rope(s, t, parts, nw, eps, *p, cos, sin, nh, nkv, hd)
        ref = backend.forward_qkv_rope(x, *p, cos, sin, nh, nkv, hd)
        err = rel_err(got, ref)
        print(f"norm+qkv rope n={n} k={k} m={m}: rel err {err:.2e}")
        assert err == 0 if m > 64 else err < TOL, err


@pytest.mark.parametrize("m", [1, 8, 16])
def test_fused_norm_plain_epilogue(m):
    """The norm with the plain epilogue (decode_gemm directly): against the reference GEMM of the rms_norm
    op's output; a zero row (sum of squares 0; M > 1) gives zeros, not NaN."""
    from pieceworks.backends.fp4_gemm import cuda_decode

    gen = torch.Generator(device=DEV).manual_seed(500 + m)
    n, k = 4096, 4096
    w = random_fp4(n, k, gen)
    s, nw = _stream(m, k, gen)
    s[-1] = 0 if m > 1 else s[-1]
    t, parts = _prenormed(s, nw)
    backend = CudaFp4GemmBackend(SPEC)
    p = backend.prepare(w)
    got = cuda_decode.decode_gemm(t, *p[:3], n, 8, 2, prenormed=(parts, 1e-6))
    ref = reference(fused.rms_norm(s, nw, 1e-6), w)
    assert m == 1 or torch.equal(got[-1], torch.zeros_like(got[-1]))
    assert rel_err(got, ref) < TOL


@pytest.mark.parametrize("n,k", [(4096, 4096), (40, 208), (4096, 14336)])
@pytest.mark.parametrize("m", [1, 9, 24, 40, 100])
def test_add_norm_writes_the_next_norms_inputs(n, k, m):
    """forward_add_norm: s with the bits of forward + add, t with those of norm_inputs(s), the partial sums
    of squares within float rounding of norm_inputs' (another summation order)."""
    gen = torch.Generator(device=DEV).manual_seed(700 + n + m)
    w = random_fp4(n, k, gen)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)
    res, nw = _stream(m, n, gen)
    backend = CudaFp4GemmBackend(SPEC, FUSING)
    p = backend.prepare(w)
    s, t, parts = backend.forward_add_norm(x, *p, n, res, nw)
    assert torch.equal(s, res + backend.forward(x, *p, n))
    ref_t, ref_parts = _prenormed(s, nw)
    assert torch.equal(t, ref_t)
    assert parts.shape == ref_parts.shape == (m, -(-n // 16))
    assert rel_err(parts, ref_parts) < 1e-6


@pytest.mark.parametrize("n,k", [(4096, 4096), (40, 208), (4096, 14336)])
@pytest.mark.parametrize("m", [1, 9, 24, 40, 100])
def test_residual_add_same_bits_as_gemm_then_add(n, k, m):
    gen = torch.Generator(device=DEV).manual_seed(900 + n + m)
    w = random_fp4(n, k, gen)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)
    res = (torch.randn(m, n, device=DEV, generator=gen) * 3).to(torch.bfloat16)
    backend = CudaFp4GemmBackend(SPEC, FUSING)
    p = backend.prepare(w)
    got = backend.forward_add(x, *p, n, res)
    assert torch.equal(got, res + backend.forward(x, *p, n))
    assert rel_err(got, res + reference(x, w)) < TOL


def test_fuse_norm_off():
    backend = CudaFp4GemmBackend(SPEC)
    assert not backend.fuses_norm and CudaDecodeOptions().fuse_norm is False  # the default
    gen = torch.Generator(device=DEV).manual_seed(77)
    w = random_fp4(64, 256, gen)
    s, nw = _stream(3, 256, gen)
    gu = backend.prepare_gate_up(w)
    got = backend.forward_norm_swiglu(s, *_prenormed(s, nw), nw, 1e-6, *gu, 32)
    assert torch.equal(got, backend.forward_swiglu(fused.rms_norm(s, nw, 1e-6), *gu, 32))


@pytest.mark.parametrize("use_pdl", [False, True])
def test_fused_norm_graph_replay_matches_eager(use_pdl):
    """o (add + norm inputs) -> gate/up (norm + SwiGLU) -> down (add + norm inputs) -> q/k/v (norm + rope)
    captured in one CUDA graph replays what eager gives on the new inputs, PDL on and off."""
    if use_pdl and pdl.unsupported_reason(DEV):
        pytest.skip(pdl.unsupported_reason(DEV))
    gen = torch.Generator(device=DEV).manual_seed(12)
    backend = CudaFp4GemmBackend(SPEC, FUSING)
    hd, nh, nkv, hidden, inter = 128, 8, 2, 1024, 1536
    qkv = backend.prepare_qkv_rope(random_fp4((nh + 2 * nkv) * hd, hidden, gen), nh, nkv, hd)
    o = backend.prepare(random_fp4(hidden, nh * hd, gen))
    gu = backend.prepare_gate_up(random_fp4(2 * inter, hidden, gen))
    down = backend.prepare(random_fp4(hidden, inter, gen))
    s0, n1 = _stream(4, hidden, gen)
    n2 = (1 + 0.5 * torch.randn(hidden, device=DEV, generator=gen)).to(torch.bfloat16)
    attn = torch.randn(4, nh * hd, device=DEV, generator=gen).to(torch.bfloat16)
    ang = torch.rand(4, hd // 2, device=DEV, generator=gen) * 30
    cos, sin = ang.cos(), ang.sin()

    def step():
        s, t, parts = backend.forward_add_norm(attn, *o, hidden, s0, n2)
        y = backend.forward_norm_swiglu(s, t, parts, n2, 1e-5, *gu, inter)
        s, t, parts = backend.forward_add_norm(y, *down, hidden, s, n1)
        return backend.forward_norm_qkv_rope(s, t, parts, n1, 1e-5, *qkv, cos, sin, nh, nkv, hd)

    old = pdl._enabled
    pdl._enabled = use_pdl
    try:
        eager = step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        attn.copy_(torch.randn(4, nh * hd, device=DEV, generator=gen).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, step())
        assert not torch.equal(out, eager)
    finally:
        pdl._enabled = old


def _executor(fuse_norm: bool):
    from pieceworks import Executor

    cfg = {
        "model": {"arch": "llama", "preset": "llama-3.1-8b", "sizes": {"num_hidden_layers": 3}, "max_context": 1024},
        "quantization": {"format": "nvfp4"},
        "runtime": {"device": "cuda", "dtype": "bfloat16"},
        "kv_cache": {"num_tokens": 4096, "page_size": 16},
        "backends": {"fp4_gemm": "cuda", "attention": "torch", "options": {"cuda": {"fuse_norm": fuse_norm}}},
        "cuda_graph": {"piecewise": {"enabled": "off"}, "decode": {"enabled": "on", "batch_sizes": [1, 2, 4, 8]}},
    }
    return Executor.from_config(cfg, progress=False)


def test_llama_with_fused_norms_matches_unfused():
    """A 3-layer Llama-3.1-8B-shaped NVFP4 model (the same random weights) with fuse_norm on and off: prefill
    and graphed decode steps give logits within 2e-2 of each other, and the fused executor's blocks run fused."""
    from pieceworks.core.batch import ForwardBatch

    logits = {}
    for on in (True, False):
        ex = _executor(on)
        assert all(b.norms_fused() == on for b in ex.model.layers)
        gen = torch.Generator().manual_seed(0)
        seqs = [ex.new_sequence() for _ in range(3)]
        out = [ex.forward(ForwardBatch(seqs, [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (7, 20, 3)],
                                       return_all_logits=True)).float()]
        for step in range(6):  # decode batches of 3 (graphs), then of 1
            live = seqs if step < 3 else seqs[:1]
            out.append(ex.forward(ForwardBatch(live, [[5 + step + i] for i in range(len(live))])).float())
        logits[on] = out
        del ex
        torch.cuda.empty_cache()
    for i, (a, b) in enumerate(zip(logits[True], logits[False])):
        err = float((a - b).norm() / b.norm())
        print(f"step {i}: fused vs unfused logits rel err {err:.2e}")
        assert err < 2e-2, (i, err)
