"""Triton NVFP4 GEMM and fused MoE against the torch references, on the GPU.

Run on the H200: `python -m pytest tests/gpu/test_triton_fp4.py -m gpu -q`. Every case draws fresh
random inputs (never zeros) and compares by ||y - ref|| / ||ref|| < 1e-2 against the w4a16 torch
backends; outputs are poisoned first so an unwritten element shows up as NaN.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
triton = pytest.importorskip("triton", reason="triton is not importable here")

from pieceworks.backends.base import BackendSpec  # noqa: E402
from pieceworks.backends.fp4_gemm import triton_kernels as gemm_kernels  # noqa: E402
from pieceworks.backends.fp4_gemm.base import Fp4Weight  # noqa: E402
from pieceworks.backends.fp4_gemm.torch import TorchFp4GemmBackend  # noqa: E402
from pieceworks.backends.fp4_gemm.cuda_launch import cuda_decode_reason  # noqa: E402
from pieceworks.backends.fp4_gemm.k32 import repack_k32  # noqa: E402
from pieceworks.backends.fp4_gemm.triton import (  # noqa: E402
    TileConfig,
    TritonFp4GemmBackend,
    TritonTileOptions,
    choose_split_k,
    parse_table,
)
from pieceworks.backends.moe import triton_kernels as moe_kernels  # noqa: E402
from pieceworks.backends.moe.align import moe_align, num_aligned_blocks  # noqa: E402
from pieceworks.backends.moe.base import MoEWeights  # noqa: E402
from pieceworks.backends.moe.routing import deepseek_route, route, route_supported  # noqa: E402
from pieceworks.backends.moe.torch import TorchMoEBackend  # noqa: E402
from pieceworks.backends.moe.triton import TritonMoEBackend  # noqa: E402
from pieceworks.quant import nvfp4  # noqa: E402

DEV = "cuda"
TOL = 1e-2


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(y).all(), "non-finite output (unwritten element?)"
    return float((y.float() - ref.float()).norm() / ref.float().norm())


def spec() -> BackendSpec:
    return BackendSpec.for_device(DEV, fp4_numerics="w4a16")


def random_fp4(n: int, k: int, gen: torch.Generator) -> Fp4Weight:
    w = torch.randn(n, k, device=DEV, generator=gen) * torch.rand(n, 1, device=DEV, generator=gen)
    packed, scale, scale_2 = nvfp4.quantize_weight(w)
    return Fp4Weight(packed, scale, scale_2, torch.ones((), device=DEV))


def gemm_backend(decode: str = "cuda", max_m: int = 16) -> TritonFp4GemmBackend:
    """The Triton GEMM backend; decode "cuda": up to max_m rows on the CUDA decode kernel (k32 weights, the
    default 16), "triton": every M on the Triton kernels (cuda_decode_max_m 0)."""
    reason = cuda_decode_reason(torch.empty(1, device=DEV, dtype=torch.bfloat16))
    if decode == "cuda" and reason:
        pytest.skip(f"the CUDA decode kernel does not run here: {reason}")
    return TritonFp4GemmBackend(spec(), TritonTileOptions(cuda_decode_max_m=max_m if decode == "cuda" else 0))


def with_decode(ms, limit: int = 16):
    """(m, decode) cases: both decode paths where m <= limit (the CUDA kernel serves it), else triton only."""
    return [(m, d) for m in ms for d in (("cuda", "triton") if m <= limit else ("triton",))]


def reference(x: torch.Tensor, w: Fp4Weight) -> torch.Tensor:
    ref = TorchFp4GemmBackend(spec())
    return ref.forward(x, *w, w.weight.shape[0])


# --- GEMM ------------------------------------------------------------------------------------------

# One M per tile bucket (and past the last), with N and K that are not multiples of the tiles.
# M <= 8 through both decode paths (the CUDA decode kernel on k32 and the Triton 8-row tiles).
GEMM_CASES = [(m, n, k, d) for m, d in with_decode((1, 4, 8, 16, 24, 32, 64, 200, 1024, 5000))
              for n, k in ((1000, 4112), (4096, 1024))]


@pytest.mark.parametrize("m,n,k,decode", GEMM_CASES)
def test_backend_matches_reference(m, n, k, decode):
    gen = torch.Generator(DEV).manual_seed(m * 7919 + n + k)
    w = random_fp4(n, k, gen)
    backend = gemm_backend(decode)
    prepared = backend.prepare(w)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)
    y = backend.forward(x, *prepared, n)
    assert y.shape == (m, n) and y.dtype == x.dtype
    assert rel_err(y, reference(x, w)) < TOL


VARIANTS = [
    TileConfig(block_m=8, block_n=64, block_k=256, w_as_a=True, asm=True, two_acc=True),
    TileConfig(block_m=8, block_n=64, block_k=256, w_as_a=True, asm=True, two_acc=True, perm_k=True),
    TileConfig(block_m=8, block_n=128, block_k=512, w_as_a=True, asm=False, perm_k=True),
    TileConfig(block_m=8, block_n=64, block_k=256, w_as_a=True, asm=False),
    TileConfig(block_m=8, block_n=128, block_k=128, w_as_a=True, asm=True, num_warps=8, two_acc=True),
    TileConfig(block_m=16, block_n=64, block_k=256, w_as_a=True, asm=True, num_stages=4),
    TileConfig(block_m=16, block_n=64, block_k=256, w_as_a=True, asm=True, one_dot=True),
    TileConfig(block_m=16, block_n=128, block_k=512, w_as_a=True, asm=False, one_dot=True),
    TileConfig(block_m=32, block_n=64, block_k=256, w_as_a=True, asm=True, one_dot=True),
    TileConfig(block_m=64, block_n=128, block_k=128, w_as_a=True, asm=True, one_dot=True),
    TileConfig(block_m=16, block_n=32, block_k=128, w_as_a=False, asm=True, num_stages=3),
    TileConfig(block_m=16, block_n=64, block_k=256, w_as_a=True, asm=False, num_stages=3),
    TileConfig(block_m=64, block_n=128, block_k=128, w_as_a=False, asm=True, num_warps=8),
    TileConfig(block_m=128, block_n=256, block_k=128, w_as_a=True, asm=True, num_warps=8, group_m=8),
    TileConfig(kind="dequant"),
    TileConfig(kind="wgmma", block_m=32, num_stages=8),
    TileConfig(kind="wgmma", block_m=64, num_stages=8),
    TileConfig(kind="wgmma", block_m=128, num_stages=2),
    TileConfig(kind="wgmma", block_m=256, num_stages=3),
]


@pytest.mark.parametrize("cfg", VARIANTS, ids=lambda c: f"{c.kind}-{c.block_m}x{c.block_n}x{c.block_k}-"
                         f"{'A' if c.w_as_a else 'B'}-{'asm' if c.asm else 'arith'}"
                         f"{'-onedot' if c.one_dot else ''}{'-twoacc' if c.two_acc else ''}"
                         f"{'-permk' if c.perm_k else ''}")
@pytest.mark.parametrize("split_k,fused", [(1, False), (2, False), (3, True), (4, True)])
def test_kernel_variants(cfg, split_k, fused):
    gen = torch.Generator(DEV).manual_seed(split_k)
    n, k = 520, 2064  # K % 32 == 16: a padded half group; N not a multiple of any block_n
    w = random_fp4(n, k, gen)
    wk, sk = repack_k32(w.weight, w.weight_scale)
    counters = torch.zeros(1024, dtype=torch.int32, device=DEV) if fused else None
    for m in (1, 37, 300):
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)
        iters = -(-k // 512) * 512 // cfg.block_k
        split = min(split_k, iters) if cfg.kind == "fused" else 1  # 3 and 4 leave uneven ranges
        y = gemm_kernels.fp4_gemm(x, wk, sk, w.weight_scale_2, n, k, cfg, split, counters)
        assert rel_err(y, reference(x, w)) < TOL, (cfg, m)
        if counters is not None:
            assert not counters.any(), "the fused split-K reduction must leave its counters at zero"


def test_wgmma_kernels_compile_without_serialized_wgmmas():
    """ptxas serializes every wgmma of a kernel (each waits for the one before) when a branch, or a register
    an in-flight wgmma reads, sits among them; it says so in NVRTC's log. None of the wgmma GEMM's instances
    may be compiled that way (needs NVRTC only, not the GPU)."""
    from pieceworks.backends import nvrtc
    from pieceworks.backends.fp4_gemm import cuda_wgmma

    if nvrtc.unavailable_reason():
        pytest.skip(nvrtc.unavailable_reason())
    for bm in (*cuda_wgmma.BLOCK_MS, 80, 144, 240):  # the table's tiles and fitted ones
        for swiglu, split, stream_k in ((0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 0, 1)):
            name = f"fp4_wgmma_tma<{bm}, {cuda_wgmma.max_stages(bm)}, {swiglu}, {split}, {stream_k}>"
            _, _, text = nvrtc._compile(cuda_wgmma.source(bm), name, "sm_90a")
            assert nvrtc.SERIALIZED_WGMMA not in text, f"{name}: {text}"


@pytest.mark.parametrize("block_m", [32, 64, 128, 256])
def test_wgmma_swiglu_same_bits_as_wgmma_then_silu_mul(block_m):
    """The wgmma kernel's SwiGLU epilogue on an interleaved gate/up weight == the plain kernel on the
    checkpoint-order weight, then the silu_mul op (M past one tile, N / 2 not a multiple of 64)."""
    from pieceworks.backends.fp4_gemm import cuda_wgmma
    from pieceworks.backends.fp4_gemm.interleave import interleave_gate_up
    from pieceworks.backends import fused

    x0 = torch.empty(1, device=DEV, dtype=torch.bfloat16)
    if cuda_wgmma.unsupported(x0):
        pytest.skip(cuda_wgmma.unsupported(x0))
    gen = torch.Generator(DEV).manual_seed(block_m)
    inter, k = 1480, 2064
    w = random_fp4(2 * inter, k, gen)
    plain = repack_k32(w.weight, w.weight_scale)
    order = interleave_gate_up(2 * inter).to(DEV)
    inter_w = repack_k32(w.weight[order], w.weight_scale[order])
    x = torch.randn(block_m + 37, k, device=DEV, dtype=torch.bfloat16, generator=gen)
    y = cuda_wgmma.gemm(x, *plain, w.weight_scale_2, 2 * inter, k, block_m)
    assert rel_err(y, reference(x, w)) < TOL
    got = cuda_wgmma.gemm(x, *inter_w, w.weight_scale_2, 2 * inter, k, block_m, swiglu=True)
    assert torch.equal(got, fused.silu_mul(y[:, :inter], y[:, inter:]))


@pytest.mark.parametrize("swiglu", [False, True])
def test_wgmma_tail_launch(swiglu):
    """The wgmma tiles of a last, mostly idle round run as a second launch split over K (2 x 224 row
    blocks of 256-token tiles on 132 SMs: the last 26 row blocks); the whole output matches the reference,
    the SwiGLU one the GEMM followed by silu_mul."""
    from pieceworks.backends.fp4_gemm import cuda_wgmma
    from pieceworks.backends.fp4_gemm.cuda_launch import multiprocessors
    from pieceworks.backends.fp4_gemm.interleave import interleave_gate_up
    from pieceworks.backends import fused

    x0 = torch.empty(1, device=DEV, dtype=torch.bfloat16)
    if cuda_wgmma.unsupported(x0):
        pytest.skip(cuda_wgmma.unsupported(x0))
    n, k, m = 28672, 2048, 300
    if cuda_wgmma.tail_split(m, n, k, 256, multiprocessors(x0.device))[0] == 0:
        pytest.skip("this GPU's SM count leaves no mostly idle last round for this shape")
    gen = torch.Generator(DEV).manual_seed(7)
    w = random_fp4(n, k, gen)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)
    cfg = TileConfig(kind="wgmma", block_m=256, num_stages=3)
    if not swiglu:
        y = gemm_kernels.fp4_gemm(x, *repack_k32(w.weight, w.weight_scale), w.weight_scale_2, n, k, cfg, 1)
        assert rel_err(y, reference(x, w)) < TOL
        return
    order = interleave_gate_up(n).to(DEV)
    got = gemm_kernels.fp4_gemm(x, *repack_k32(w.weight[order], w.weight_scale[order]), w.weight_scale_2, n, k,
                                cfg, 1, swiglu=True)
    ref = reference(x, w)
    assert rel_err(got, fused.silu_mul(ref[:, : n // 2], ref[:, n // 2 :])) < TOL


@pytest.mark.parametrize("block_m", [32, 64, 128, 256])
@pytest.mark.parametrize("swiglu", [False, True])
def test_wgmma_stream_k(block_m, swiglu):
    """Stream-K launches (CTAs sharing the tiles' K iterations) at several CTA counts: each matches the
    reference (the SwiGLU one the GEMM followed by silu_mul), repeats its own bits, and leaves the flags
    zero; with one whole tile per CTA it is the plain launch, bit for bit."""
    from pieceworks.backends.fp4_gemm import cuda_wgmma
    from pieceworks.backends.fp4_gemm.cuda_launch import multiprocessors
    from pieceworks.backends.fp4_gemm.interleave import interleave_gate_up
    from pieceworks.backends import fused

    x0 = torch.empty(1, device=DEV, dtype=torch.bfloat16)
    if cuda_wgmma.unsupported(x0):
        pytest.skip(cuda_wgmma.unsupported(x0))
    n, k, m = 1480 * 2, 2064, block_m + 37  # 24 row blocks, 20 K tiles (K padded to 2560)
    gen = torch.Generator(DEV).manual_seed(block_m + swiglu)
    w = random_fp4(n, k, gen)
    order = interleave_gate_up(n).to(DEV) if swiglu else torch.arange(n, device=DEV)
    packed = (*repack_k32(w.weight[order], w.weight_scale[order]), w.weight_scale_2)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)
    ref = reference(x, w)
    if swiglu:
        ref = fused.silu_mul(ref[:, : n // 2], ref[:, n // 2 :])
    sms = multiprocessors(x.device)
    tiles = -(-m // block_m) * 24
    work = torch.full((cuda_wgmma.workspace_floats(sms, block_m),), float("nan"), device=DEV)
    flags = torch.zeros(tiles, dtype=torch.int32, device=DEV)
    plain = cuda_wgmma.gemm(x, *packed, n, k, block_m, swiglu=swiglu)
    for ctas in sorted({7, 29, tiles, min(sms, 131)}):
        got = cuda_wgmma.gemm(x, *packed, n, k, block_m, swiglu=swiglu, stream_k=ctas, workspace=(work, flags))
        assert rel_err(got, ref) < TOL, ctas
        assert torch.count_nonzero(flags) == 0, ctas
        again = cuda_wgmma.gemm(x, *packed, n, k, block_m, swiglu=swiglu, stream_k=ctas, workspace=(work, flags))
        assert torch.equal(got, again), ctas
        if ctas == tiles:
            assert torch.equal(got, plain)


@pytest.mark.parametrize("n", [4096, 28672])
def test_wgmma_narrow_token_tile(n):
    """A 256-token wgmma bucket with narrow_block_m 128: N = 4096, K = 2048 at 200 rows runs 128-token tiles
    (32 row blocks leave SMs idle; split 2 ways, each CTA would run 8 K tiles), N = 28672 keeps 256-token tiles; both match the reference, and the narrow call
    equals the 128-token bucket's bits."""
    from pieceworks.backends.fp4_gemm import cuda_wgmma
    from pieceworks.backends.fp4_gemm.cuda_launch import multiprocessors

    x0 = torch.empty(1, device=DEV, dtype=torch.bfloat16)
    if cuda_wgmma.unsupported(x0):
        pytest.skip(cuda_wgmma.unsupported(x0))
    k, m = 2048, 200
    gen = torch.Generator(DEV).manual_seed(11)
    w = random_fp4(n, k, gen)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)
    packed = (*repack_k32(w.weight, w.weight_scale), w.weight_scale_2)
    cfg = TileConfig(kind="wgmma", block_m=256, num_stages=3, narrow_block_m=128)
    y = gemm_kernels.fp4_gemm(x, *packed, n, k, cfg, 1)
    assert rel_err(y, reference(x, w)) < TOL
    bm = cuda_wgmma.token_tile(m, n, k, 256, 3, 128, multiprocessors(x.device))[0]
    assert bm == (128 if n == 4096 else 256)
    twin = TileConfig(kind="wgmma", block_m=bm, num_stages=cuda_wgmma.max_stages(bm) if bm == 128 else 3)
    assert torch.equal(y, gemm_kernels.fp4_gemm(x, *packed, n, k, twin, 1))


@pytest.mark.parametrize("block_m", [32, 64, 128, 256])
@pytest.mark.parametrize("split", [1, 3])
def test_wgmma_last_token_tile_same_bits_as_padded_x(block_m, split):
    """The last token tile of M >= block_m rows loads the block_m rows ending at M (no box past M): its
    rows equal, bit for bit, the rows of the same x zero-padded to whole tiles, in plain and split calls."""
    from pieceworks.backends.fp4_gemm import cuda_wgmma

    x0 = torch.empty(1, device=DEV, dtype=torch.bfloat16)
    if cuda_wgmma.unsupported(x0):
        pytest.skip(cuda_wgmma.unsupported(x0))
    n, k, m = 520, 2048, block_m + 37
    gen = torch.Generator(DEV).manual_seed(block_m + split)
    w = random_fp4(n, k, gen)
    packed = (*repack_k32(w.weight, w.weight_scale), w.weight_scale_2)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)
    padded = torch.zeros(-(-m // block_m) * block_m, k, device=DEV, dtype=torch.bfloat16)
    padded[:m] = x
    got = cuda_wgmma.gemm(x, *packed, n, k, block_m, split=split)
    want = cuda_wgmma.gemm(padded, *packed, n, k, block_m, split=split)
    assert torch.equal(got, want[:, :m] if split > 1 else want[:m])
    if split == 1:
        assert rel_err(got, reference(x, w)) < TOL


@pytest.mark.parametrize("m,block_m", [(72, 128), (200, 256), (288, 128), (416, 256)])
@pytest.mark.parametrize("mode", ["plain", "swiglu", "split", "stream_k"])
def test_wgmma_fitted_token_tile_same_bits_as_table_tile(m, block_m, mode):
    """A fitted token tile (`fit_token_tile`: as many tiles as block_m, fewer padded rows) gives the table
    tile's bits in plain, SwiGLU and split calls; stream-K matches the reference and repeats its bits; the
    backend's plan at m picks the fitted tile, and its call (K split, summed by a second kernel) matches the
    reference."""
    from pieceworks.backends.fp4_gemm import cuda_wgmma
    from pieceworks.backends.fp4_gemm.cuda_launch import multiprocessors
    from pieceworks.backends.fp4_gemm.interleave import interleave_gate_up

    x0 = torch.empty(1, device=DEV, dtype=torch.bfloat16)
    if cuda_wgmma.unsupported(x0):
        pytest.skip(cuda_wgmma.unsupported(x0))
    fit = cuda_wgmma.fit_token_tile(m, block_m)
    assert fit < block_m and fit % 16 == 0 and -(-m // fit) == -(-m // block_m)
    n, k = 1480 * 2, 2064
    gen = torch.Generator(DEV).manual_seed(m)
    w = random_fp4(n, k, gen)
    order = interleave_gate_up(n).to(DEV) if mode == "swiglu" else torch.arange(n, device=DEV)
    packed = (*repack_k32(w.weight[order], w.weight_scale[order]), w.weight_scale_2)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)
    sms = multiprocessors(x.device)

    def call(bm):
        kw = dict(swiglu=mode == "swiglu", split=3 if mode == "split" else 1)
        if mode == "stream_k":
            flags = torch.zeros(-(-m // bm) * -(-n // cuda_wgmma.ROWS), dtype=torch.int32, device=DEV)
            kw.update(stream_k=min(sms, 29), workspace=(torch.empty(cuda_wgmma.workspace_floats(sms, bm),
                                                                      device=DEV), flags))
        return cuda_wgmma.gemm(x, *packed, n, k, bm, **kw)

    got, want = call(fit), call(block_m)
    if mode == "stream_k":  # a tile index covers other rows, so CTAs split other tiles' K: other sums
        assert rel_err(got, reference(x, w)) < TOL and torch.equal(got, call(fit))
    else:
        assert torch.equal(got, want)
    if mode == "plain":
        assert rel_err(got, reference(x, w)) < TOL
        cfg = TileConfig(kind="wgmma", block_m=block_m, num_stages=cuda_wgmma.max_stages(block_m))
        kp = -(-k // 512) * 512
        assert cuda_wgmma.plan(m, n, kp, block_m, cfg.num_stages, 0, sms)[0] == fit
        # the backend's call may split K (a second kernel sums the partials): other bits, same values
        assert rel_err(gemm_kernels.fp4_gemm(x, *packed, n, k, cfg, 1), reference(x, w)) < TOL


def test_fused_split_k_matches_two_kernel_split_k_bitwise():
    """Same partials, same summation order: the in-kernel reduction equals the second-kernel one, and
    repeated calls are identical (the split that finishes last does not change the result)."""
    gen = torch.Generator(DEV).manual_seed(5)
    n, k = 6144, 4096
    w = random_fp4(n, k, gen)
    wk, sk = repack_k32(w.weight, w.weight_scale)
    cfg = TileConfig(block_m=16, block_n=64, block_k=256)
    counters = torch.zeros(4096, dtype=torch.int32, device=DEV)
    x = torch.randn(4, k, device=DEV, dtype=torch.bfloat16, generator=gen)
    two = gemm_kernels.fp4_gemm(x, wk, sk, w.weight_scale_2, n, k, cfg, 5)
    for _ in range(5):
        assert torch.equal(gemm_kernels.fp4_gemm(x, wk, sk, w.weight_scale_2, n, k, cfg, 5, counters), two)
    assert rel_err(two, reference(x, w)) < TOL


def test_zero_scale_blocks():
    """Blocks with a zero scale (their codes are zeroed by the repack) give exact zeros, not the
    finite stand-in the scale conversion maps zero to."""
    gen = torch.Generator(DEV).manual_seed(11)
    n, k = 256, 1024
    w = random_fp4(n, k, gen)
    scale = w.weight_scale.clone()
    scale[:, ::3] = 0.0  # every third block of every row
    scale[7] = 0.0  # one whole row
    w = Fp4Weight(w.weight, scale, w.weight_scale_2, w.input_scale)
    backend = TritonFp4GemmBackend(spec())
    prepared = backend.prepare(w)
    for m in (1, 16, 300):
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)
        y = backend.forward(x, *prepared, n)
        assert rel_err(y, reference(x, w)) < TOL
        assert not y[:, 7].any()


def test_split_k_is_used_for_decode():
    backend = TritonFp4GemmBackend(spec())
    tile, split = backend._plan(1, 4096, 4096)
    assert split > 1, "decode of a 4096x4096 weight should split K to fill the SMs"
    assert split == choose_split_k(tile, 1, 4096, 4096)


@pytest.mark.parametrize("m", range(9, 17))
@pytest.mark.parametrize("n,k", [(1000, 4112), (64, 512), (4096, 1024)])
def test_cuda_decode_kernel_up_to_16_rows(m, n, k):
    """cuda_decode_max_m 16 (the default): the CUDA kernel's two token tiles on k32 weights."""
    gen = torch.Generator(DEV).manual_seed(m * 31 + n + k)
    w = random_fp4(n, k, gen)
    backend = gemm_backend("cuda", 16)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)
    assert rel_err(backend.forward(x, *backend.prepare(w), n), reference(x, w)) < TOL


@pytest.mark.parametrize("m,decode", with_decode([1, 16, 256]))
def test_gemm_cuda_graph_replay_matches_eager(m, decode):
    gen = torch.Generator(DEV).manual_seed(m)
    n, k = 3072, 4096
    w = random_fp4(n, k, gen)
    backend = gemm_backend(decode)
    prepared = backend.prepare(w)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)
    eager = backend.forward(x, *prepared, n)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.forward(x, *prepared, n)  # warm-up (compile) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(x, *prepared, n)
    x.copy_(torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, backend.forward(x, *prepared, n))
    assert not torch.equal(out, eager)  # the replay read the new input


@pytest.mark.parametrize("m,decode", with_decode([1, 7, 16, 24, 64, 256, 1024]))
@pytest.mark.parametrize("inter", [1536, 5632])
def test_gemm_swiglu_same_bits_as_gemm_then_silu_mul(m, decode, inter):
    """forward_swiglu on the interleaved weight == forward on the same weight, then the silu_mul op on its
    gate / up columns, and == forward on the plain one, then silu_mul, wherever every column takes the same
    K split (a wgmma tail launch splits the last row blocks only, stream-K splits each tile at its own
    K: other columns in the two row orders, so there within TOL): every M bucket (split-K with the in-kernel and the separate reduction, plain tiles,
    wgmma tiles, dequant + cuBLAS)."""
    from pieceworks.backends import fused

    gen = torch.Generator(DEV).manual_seed(1000 * m + inter)
    k = 2048 + 512  # not a multiple of every block_k's split
    w = random_fp4(2 * inter, k, gen)
    backend = gemm_backend(decode)
    plain, inter_w = backend.prepare(w), backend.prepare_gate_up(w)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)
    y = backend.forward(x, *plain, 2 * inter)
    ref = fused.silu_mul(y[:, :inter], y[:, inter:])
    got = backend.forward_swiglu(x, *inter_w, inter)
    assert got.shape == (m, inter) and torch.isfinite(ref).all()
    y_inter = backend.forward(x, *inter_w, 2 * inter)  # columns gate 0, up 0, gate 1, ...
    assert torch.equal(got, fused.silu_mul(y_inter[:, 0::2], y_inter[:, 1::2]))
    tile, split = backend._plan(m, 2 * inter, inter_w.weight.shape[1] * 2)
    if _mixed_k_splits(tile, m, 2 * inter, inter_w.weight.shape[1] * 2, x):
        assert rel_err(got, ref) < TOL
    else:
        assert torch.equal(got, ref)
    if split > 1 and decode == "triton":  # the separate reduction kernel (no counters) gives the same bits too
        alone = gemm_kernels.fp4_gemm(x, inter_w.weight, inter_w.weight_scale, inter_w.weight_scale_2,
                                      2 * inter, k, tile, split, None, swiglu=True)
        assert torch.equal(alone, got)


def _mixed_k_splits(tile: TileConfig, m: int, n: int, kp: int, x: torch.Tensor, stream_k: bool = True) -> bool:
    """Whether the call runs the wgmma kernel with a second launch split over K for its last row blocks, or
    (with `stream_k`) stream-K, which splits each 128-row tile at its own K tiles."""
    from pieceworks.backends.fp4_gemm import cuda_wgmma
    from pieceworks.backends.fp4_gemm.cuda_launch import multiprocessors

    if tile.kind != "wgmma" or cuda_wgmma.unsupported(x):
        return False
    sms = multiprocessors(x.device)
    plan = cuda_wgmma.plan(m, n, kp, tile.block_m, tile.num_stages, tile.narrow_block_m, sms)
    return plan[3][0] > 0 or (stream_k and plan[4] > 0)


def _rope_angles(m, half, gen):
    pos = torch.randint(0, 8192, (m, 1), device=DEV, generator=gen).float()
    ang = pos / (500000.0 ** (torch.arange(half, device=DEV).float() / half))
    return ang.cos(), ang.sin()


@pytest.mark.parametrize("m,decode", with_decode([1, 7, 16, 24, 64, 256, 1024]))
@pytest.mark.parametrize("heads", [(32, 8, 128), (6, 2, 64)])
def test_gemm_qkv_rope_same_bits_as_gemm_then_rope_qk(m, decode, heads):
    """forward_qkv_rope on the pair-interleaved weight == forward on the plain one, then the rope_qk op
    on the q and k columns, wherever every column takes the same K split (with a wgmma tail launch within
    TOL): every M bucket (split-K with the in-kernel and the separate reduction, plain tiles, dequant +
    cuBLAS)."""
    from pieceworks.backends import fused

    hq, hk, d = heads
    n = (hq + 2 * hk) * d
    gen = torch.Generator(DEV).manual_seed(100 * m + n)
    k = 2048 + 512 + 16  # K % 32 == 16: a padded half group
    w = random_fp4(n, k, gen)
    backend = gemm_backend(decode)
    plain, roped = backend.prepare(w), backend.prepare_qkv_rope(w, hq, hk, d)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)
    cos, sin = _rope_angles(m, d // 2, gen)
    y = backend.forward(x, *plain, n)
    q, kk = fused.rope_qk(y[:, : hq * d].view(m, hq, d), y[:, hq * d : (hq + hk) * d].view(m, hk, d), cos, sin, False)
    ref = torch.cat([q.view(m, -1), kk.view(m, -1), y[:, (hq + hk) * d :]], dim=1)
    got = backend.forward_qkv_rope(x, *roped, cos, sin, hq, hk, d)
    assert got.shape == (m, n) and torch.isfinite(ref).all()
    assert not torch.equal(ref, y)  # the rope moved something
    tile, split = backend._plan(m, n, roped.weight.shape[1] * 2)
    # the rope order moves rows within a head, inside one 128-row tile: stream-K splits both orders alike
    if _mixed_k_splits(tile, m, n, roped.weight.shape[1] * 2, x, stream_k=False):
        assert rel_err(got, ref) < TOL
    else:
        assert torch.equal(got, ref)
    if split > 1 and decode == "triton":  # the separate reduction kernel (no counters) gives the same bits too
        alone = gemm_kernels.fp4_gemm(x, roped.weight, roped.weight_scale, roped.weight_scale_2, n, k, tile, split,
                                      None, rope=(cos, sin, (hq + hk) * d, d))
        assert torch.equal(alone, got)


@pytest.mark.parametrize("decode", ["cuda", "triton"])
def test_gemm_qkv_rope_cuda_graph_replay(decode):
    gen = torch.Generator(DEV).manual_seed(78)
    hq, hk, d, k, m = 32, 8, 128, 4096, 2
    n = (hq + 2 * hk) * d
    backend = gemm_backend(decode)
    w = backend.prepare_qkv_rope(random_fp4(n, k, gen), hq, hk, d)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)
    cos, sin = _rope_angles(m, d // 2, gen)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.forward_qkv_rope(x, *w, cos, sin, hq, hk, d)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward_qkv_rope(x, *w, cos, sin, hq, hk, d)
    for _ in range(3):
        x.copy_(torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen))
        c, s = _rope_angles(m, d // 2, gen)
        cos.copy_(c)
        sin.copy_(s)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, backend.forward_qkv_rope(x, *w, cos, sin, hq, hk, d))


@pytest.mark.parametrize("decode", ["cuda", "triton"])
def test_gemm_swiglu_cuda_graph_replay(decode):
    gen = torch.Generator(DEV).manual_seed(77)
    inter, k, m = 1536, 4096, 4
    backend = gemm_backend(decode)
    w = backend.prepare_gate_up(random_fp4(2 * inter, k, gen))
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.forward_swiglu(x, *w, inter)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward_swiglu(x, *w, inter)
    for _ in range(3):
        x.copy_(torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, backend.forward_swiglu(x, *w, inter))


# --- MoE -------------------------------------------------------------------------------------------


def random_moe(e: int, h: int, inter: int, gen: torch.Generator) -> MoEWeights:
    def quant(rows, cols):
        ws = [nvfp4.quantize_weight(torch.randn(rows, cols, device=DEV, generator=gen) * 0.05)
              for _ in range(e)]
        return tuple(torch.stack([q[i] for q in ws]) for i in range(3))

    gp, gs, g2 = quant(inter, h)
    up, us, u2 = quant(inter, h)
    dp, ds, d2 = quant(h, inter)
    ones = torch.ones(e, device=DEV)
    return MoEWeights(torch.cat([gp, up], 1), torch.cat([gs, us], 1), torch.stack([g2, u2], 1), ones,
                      dp, ds, d2, ones)


ROUTING = dict(top_k=4, num_expert_group=4, topk_group=2, renormalize=True, routed_scaling_factor=2.5)


def run_moe(backend, x, logits, bias, w, routing):
    return backend.forward(x, logits, bias, w, routing["top_k"], routing["num_expert_group"],
                           routing["topk_group"], routing["renormalize"], routing["routed_scaling_factor"])


def moe_backend(path: str = "cuda") -> TritonMoEBackend:
    """The Triton MoE; path "cuda": up to 64 tokens with the CUDA decode kernel's MoE modes on its k32 experts (the
    default: 128), "triton": every T on the Triton grouped GEMMs (cuda_moe_max_t 0)."""
    reason = cuda_decode_reason(torch.empty(1, device=DEV, dtype=torch.bfloat16))
    if path == "cuda" and reason:
        pytest.skip(f"the CUDA decode kernel does not run here: {reason}")
    return TritonMoEBackend(spec(), TritonTileOptions(cuda_moe_max_t=64 if path == "cuda" else 0))


def with_moe_path(ts, limit: int = 64):
    """(tokens, path) cases: both paths where T <= limit, else triton only."""
    return [(t, p) for t in ts for p in (("cuda", "triton") if t <= limit else ("triton",))]


def moe_error(tokens: int, experts: int, table=None, inter: int = 384, path: str = "triton", h: int = 1024) -> float:
    """Relative error of the Triton MoE (its shipped table, or `table`; `path` as in `moe_backend`) against the
    torch reference on random experts, tokens and routing."""
    gen = torch.Generator(DEV).manual_seed(tokens)
    w = random_moe(experts, h, inter, gen)
    backend = moe_backend(path)
    if table is not None:
        backend.table = parse_table(table)
    prepared = backend.prepare(w)
    x = torch.randn(tokens, h, device=DEV, dtype=torch.bfloat16, generator=gen)
    logits = torch.randn(tokens, experts, device=DEV, generator=gen)
    bias = torch.randn(experts, device=DEV, generator=gen) * 0.1
    y = run_moe(backend, x, logits, bias, prepared, ROUTING)
    return rel_err(y, run_moe(TorchMoEBackend(spec()), x, logits, bias, w, ROUTING))


@pytest.mark.parametrize("tokens,path", with_moe_path([1, 4, 7, 64, 65, 300, 2000]))
def test_moe_matches_reference(tokens, path):
    assert moe_error(tokens, 32, path=path) < TOL


@pytest.mark.parametrize("tokens,path", with_moe_path([1, 40, 300]))
def test_moe_intermediate_not_a_multiple_of_64(tokens, path):
    """I = 208: the backend's prepare pads the gate and up halves to 256 rows each (zero rows between them);
    the CUDA path's down GEMM reads h up to w2's padded K (512), zero past 256."""
    assert moe_error(tokens, 16, inter=208, path=path) < TOL


@pytest.mark.parametrize("tokens,path", with_moe_path([1, 9]))
def test_moe_hidden_not_a_multiple_of_512(tokens, path):
    """H = 576: the experts' K is padded to 1024 (the CUDA path pads x to it) and w2's rows to 640."""
    assert moe_error(tokens, 16, inter=128, path=path, h=576) < TOL


@pytest.mark.parametrize("perm_k", [False, True])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_moe_eight_row_tiles(tokens, perm_k):
    """The 8-row decode tile of the grouped GEMMs with and without perm_k, whatever MOE_TILES ships."""
    table = [dict(max_m=None, block_m=8, block_n=64, block_k=256, num_warps=4, num_stages=3, w_as_a=True,
                  one_dot=False, perm_k=perm_k)]
    assert moe_error(tokens, 16, table) < TOL  # path "triton": the table's tiles at every T


@pytest.mark.parametrize("tokens,path", with_moe_path([3, 20, 333]))  # 3: the 8-row decode tile
@pytest.mark.parametrize("top_k", [1, 4])
def test_moe_skewed_routing(top_k, tokens, path):
    """Every token picks the same experts (one expert holds all rows with top_k=1; at 20 tokens the CUDA path
    reads it in three blocks of 8 pairs); the rest get none."""
    gen = torch.Generator(DEV).manual_seed(top_k)
    e, h, inter = 16, 512, 256
    w = random_moe(e, h, inter, gen)
    backend = moe_backend(path)
    prepared = backend.prepare(w)
    x = torch.randn(tokens, h, device=DEV, dtype=torch.bfloat16, generator=gen)
    logits = torch.randn(tokens, e, device=DEV, generator=gen) * 0.1
    logits[:, 5 : 5 + top_k] += 20.0
    routing = dict(top_k=top_k, num_expert_group=1, topk_group=1, renormalize=False,
                   routed_scaling_factor=1.0)
    weights, ids = deepseek_route(logits, torch.empty(0, device=DEV), top_k, 1, 1, False, 1.0)
    assert set(ids.unique().tolist()) == set(range(5, 5 + top_k))
    y = run_moe(backend, x, logits, torch.empty(0, device=DEV), prepared, routing)
    ref = run_moe(TorchMoEBackend(spec()), x, logits, torch.empty(0, device=DEV), w, routing)
    assert rel_err(y, ref) < TOL


@pytest.mark.parametrize("tokens,experts,top_k,groups,topk_group,bias,renorm,dtype", [
    (1, 256, 8, 8, 4, True, True, torch.float32),      # DeepSeek-V3
    (7, 256, 8, 8, 4, True, True, torch.float32),
    (300, 256, 8, 8, 4, False, True, torch.bfloat16),
    (64, 64, 6, 1, 1, False, False, torch.float32),     # no groups
    (33, 128, 4, 4, 4, True, False, torch.float32),     # every group kept
])
def test_route_kernel_matches_torch_routing(tokens, experts, top_k, groups, topk_group, bias, renorm, dtype):
    """The Triton routing picks the same experts as `deepseek_route` with the same weights (its experts
    come sorted by score, torch's in no set order: compared after sorting by expert id)."""
    gen = torch.Generator(DEV).manual_seed(tokens + experts)
    logits = (torch.randn(tokens, experts, device=DEV, generator=gen) * 2).to(dtype)
    b = torch.rand(experts, device=DEV, generator=gen) * 0.3 if bias else torch.empty(0, device=DEV)
    args = (top_k, groups, topk_group, renorm, 2.5)
    assert route_supported(logits, b, top_k, groups, topk_group)
    w, ids = route(logits, b, *args)
    w_ref, ids_ref = deepseek_route(logits, b, *args)
    ids_s, order = ids.sort(-1)
    ids_ref_s, order_ref = ids_ref.sort(-1)
    assert torch.equal(ids_s, ids_ref_s)
    torch.testing.assert_close(w.gather(1, order), w_ref.gather(1, order_ref), rtol=1e-6, atol=0)
    # descending by biased score
    choice = logits.float().sigmoid() + (b if bias else 0)
    assert (choice.gather(1, ids).diff(dim=-1) <= 0).all()
    # inside a CUDA graph, with new logits copied in before the replay
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w_g, ids_g = route(logits, b, *args)
    logits.copy_((torch.randn(tokens, experts, device=DEV, generator=gen) * 2).to(dtype))
    graph.replay()
    assert torch.equal(ids_g, route(logits, b, *args)[1])


@pytest.mark.parametrize("tokens,block_m", [(1, 8), (4, 8), (1, 16), (64, 16), (3000, 64)])
def test_gpu_align_matches_torch_align(tokens, block_m):
    gen = torch.Generator(DEV).manual_seed(tokens)
    e, k = 256, 8
    ids = torch.randint(0, e, (tokens, k), device=DEV, generator=gen)
    ids[: tokens // 2, 0] = 3  # one heavy expert, spanning several blocks
    pairs = ids.numel()
    blocks = num_aligned_blocks(pairs, e, block_m)
    want = moe_align(ids, e, block_m)
    got = moe_kernels.align_gpu(ids, e, block_m, blocks)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    # Rows of one expert come in atomic order on the GPU: compare what order does not change.
    rows_got, rows_want = got[0].view(blocks, block_m), want[0].view(blocks, block_m)
    assert torch.equal((rows_got < pairs).sum(1), (rows_want < pairs).sum(1)), "rows per block"
    valid = rows_got < pairs
    assert torch.equal(rows_got[valid].sort().values, torch.arange(pairs, device=DEV, dtype=torch.int32))
    block_expert = got[1].view(blocks, 1).expand(blocks, block_m)[valid]
    pair_expert = ids.reshape(-1)[rows_got[valid].long()].int()
    assert torch.equal(pair_expert, block_expert), "pair in its expert's block"


@pytest.fixture
def pdl_switch():
    """Sets the process-wide PDL switch for one test (True / False) and restores it after."""
    from pieceworks.backends import pdl

    old = pdl._enabled

    def set_to(on: bool) -> None:
        if on and pdl.unsupported_reason(DEV):
            pytest.skip(pdl.unsupported_reason(DEV))
        pdl._enabled = on

    yield set_to
    pdl._enabled = old


@pytest.mark.parametrize("use_pdl", [False, True])
@pytest.mark.parametrize("tokens,path", [(1, "cuda"), (16, "cuda"), (16, "triton")])
def test_moe_cuda_graph_replay_matches_eager(tokens, path, use_pdl, pdl_switch):
    """New inputs and routing copied in before the replay; the CUDA path's kernels with and without PDL."""
    gen = torch.Generator(DEV).manual_seed(5)
    e, h, inter = 32, 1024, 384
    backend = moe_backend(path)
    w = backend.prepare(random_moe(e, h, inter, gen))
    pdl_switch(use_pdl)
    x = torch.randn(tokens, h, device=DEV, dtype=torch.bfloat16, generator=gen)
    logits = torch.randn(tokens, e, device=DEV, generator=gen)
    bias = torch.randn(e, device=DEV, generator=gen) * 0.1
    run_moe(backend, x, logits, bias, w, ROUTING)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run_moe(backend, x, logits, bias, w, ROUTING)
    x.copy_(torch.randn(tokens, h, device=DEV, dtype=torch.bfloat16, generator=gen))
    logits.copy_(torch.randn(tokens, e, device=DEV, generator=gen))  # new routing, same shapes
    graph.replay()
    torch.cuda.synchronize()
    # Rows of an expert are ordered by atomics, so allow float noise (it is exact in practice).
    assert rel_err(out, run_moe(backend, x, logits, bias, w, ROUTING)) < 1e-6
