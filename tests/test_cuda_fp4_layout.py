"""The CUDA decode GEMM's weight layout and plan, on the CPU (the kernel itself: tests/gpu/test_cuda_fp4.py)."""

from __future__ import annotations

import pytest
import torch

from pieceworks.backends.base import BackendSpec, ModelFacts
from pieceworks.backends.fp4_gemm import cuda_decode, r16c64
from pieceworks.backends.fp4_gemm.base import Fp4Weight
from pieceworks.backends.fp4_gemm.cuda import CudaDecodeOptions, CudaFp4GemmBackend
from pieceworks.backends.fp4_gemm.cuda_decode import resident_cap
from pieceworks.backends.fp4_gemm.cuda_launch import plan
from pieceworks.quant import nvfp4


def random_weight(n, k, gen):
    w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    s = (torch.rand(n, k // 16, generator=gen) * 4 + 0.01).to(torch.float8_e4m3fn)
    return w, s


@pytest.mark.parametrize("n,k", [(16, 64), (48, 256), (40, 208), (24, 4160)])
def test_repack_round_trip(n, k):
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w, s = random_weight(n, k, gen)
    codes, scales = r16c64.repack_decode(w, s)
    assert codes.shape == (-(-n // 16), -(-k // 64), 512) and scales.shape == (-(-n // 16), -(-k // 64), 64)
    c, sc = r16c64.unpack_decode(codes, scales, n, k)
    assert torch.equal(c, nvfp4.unpack(w))
    assert torch.equal(sc.view(torch.uint8), s.view(torch.uint8))
    # padding rows and K are zero codes and zero scales
    full_c, full_s = r16c64.unpack_decode(codes, scales, codes.shape[0] * 16, codes.shape[1] * 64)
    assert int(full_c[n:].sum()) == 0 and int(full_c[:, k:].sum()) == 0
    assert int(full_s.view(torch.uint8)[n:].sum()) == 0 and int(full_s.view(torch.uint8)[:, k // 16 :].sum()) == 0


def test_repack_values_match_dequant():
    """Zero-scale blocks lose their codes, negative scales move their sign into the codes: the values
    e2m1 * scale are unchanged."""
    gen = torch.Generator().manual_seed(1)
    w, s = random_weight(32, 128, gen)
    sf = s.float()
    sf[0, 1] = 0.0
    sf[3, 2] = -1.5
    s = sf.to(torch.float8_e4m3fn)
    codes, scales = r16c64.repack_decode(w, s)
    c, sc = r16c64.unpack_decode(codes, scales, 32, 128)
    got = nvfp4.e2m1_decode(c) * sc.float().repeat_interleave(16, 1)
    ref = nvfp4.e2m1_decode(nvfp4.unpack(w)) * sf.repeat_interleave(16, 1)
    assert torch.equal(got, ref)
    assert int(sc.view(torch.uint8)[3, 2]) & 0x80 == 0  # the kernel reads scales as non-negative
    assert int(c[0, 16:32].sum()) == 0


def test_repack_refuses_nan_scale():
    gen = torch.Generator().manual_seed(2)
    w, s = random_weight(16, 64, gen)
    s.view(torch.uint8)[2, 1] = 0x7F
    with pytest.raises(ValueError, match="NaN"):
        r16c64.repack_decode(w, s)


def test_plan_keeps_the_grid_resident():
    # 132 SMs, 32 warps each: 256 CTAs (4096 rows) take 16 warps each, 384 (6144 rows) 8, 1792 (28672 rows) 2
    assert plan(4096, 132) == (16, 2)
    assert plan(6144, 132) == (8, 2)
    assert plan(28672, 132) == (2, 2)
    assert plan(16, 132) == (16, 2)
    assert plan(7168, 132) == (8, 2)  # 448 CTAs
    assert plan(16 * 132 * 64, 132) == (2, 2)  # more than fit: the fewest warps
    # the k32 reading's two token tiles count 24 warps per SM: q/k/v, o, down and the expert gate_up 8 warps,
    # the expert down 4, gate_up 2 (the fastest of 2 / 4 / 8 / 16 at M = 16 on the H200)
    from pieceworks.backends.fp4_gemm.cuda_launch import K32_TWO_TILE_WARPS_PER_SM as k32
    assert [plan(n, 132, k32)[0] for n in (6144, 4096, 28672, 7168)] == [8, 8, 2, 4]


class _Occupancy:
    """Stands in for an nvrtc.Kernel: CTAs per SM from a register count, as the occupancy calculator counts
    (registers allocated per warp in units of 8 per thread, 64 Ki per SM, 64 warps)."""

    def __init__(self, registers: int) -> None:
        self.registers = registers

    def resident_blocks(self, threads: int) -> int:
        warps = threads // 32
        return min(65536 // (warps * 32 * -(-self.registers // 8) * 8), 64 // warps)


def test_register_cap_only_where_the_grid_would_not_stay_resident():
    # q/k/v (384 CTAs of 8 warps) at 68 registers: 3 CTAs per SM, 396 >= 384: no cap
    assert resident_cap(_Occupancy(68), 8, 384, 132) == 0
    # the DeepSeek expert down (448 CTAs of 8 warps): 396 < 448, so 4 CTAs per SM (64 registers)
    assert resident_cap(_Occupancy(68), 8, 448, 132) == 4
    # o (256 CTAs of 16 warps) at 64 registers: 2 per SM, resident
    assert resident_cap(_Occupancy(64), 16, 256, 132) == 0
    # 91 registers (96 allocated), 1792 CTAs of 2 warps: 10 per SM, 1320 < 1792: capped at 14 per SM (73 registers)
    assert resident_cap(_Occupancy(91), 2, 1792, 132) == 14
    # never below 64 registers (32 / warps CTAs per SM), even where the grid still would not fit
    assert resident_cap(_Occupancy(91), 8, 2000, 132) == 4


def test_unavailable_on_cpu_with_reason():
    reasons = CudaFp4GemmBackend.check(BackendSpec.for_device("cpu", fp4_numerics="w4a16"))
    assert reasons and "cuda" in reasons[0]


def test_refuses_non_bf16_models_and_pre_hopper_gpus():
    facts = ModelFacts(dtype=torch.float16, fp4=True)
    reasons = CudaFp4GemmBackend.check(BackendSpec(device="cuda", capability=(9, 0), model=facts))
    assert any("bf16" in r for r in reasons)
    reasons = CudaFp4GemmBackend.check(BackendSpec(device="cuda", capability=(8, 9),
                                                   model=ModelFacts(dtype=torch.bfloat16, fp4=True)))
    assert any("compute capability >= 9.0" in r for r in reasons)


def test_options_validated():
    assert CudaDecodeOptions().decode_max_m == 64
    assert CudaDecodeOptions(decode_max_m=12).decode_max_m == 12
    for bad in (-1, 300):
        with pytest.raises(ValueError, match="decode_max_m"):
            CudaDecodeOptions(decode_max_m=bad)
    assert CudaDecodeOptions().fuse_norm is False
    with pytest.raises(ValueError, match="fuse_norm"):
        CudaDecodeOptions(fuse_norm="yes")
    spec = BackendSpec(device="cuda", capability=(9, 0))
    assert not CudaFp4GemmBackend(spec).fuses_norm
    assert CudaFp4GemmBackend(spec, CudaDecodeOptions(fuse_norm=True)).fuses_norm


def test_fused_norm_falls_back_to_the_unfused_ops_where_the_kernel_does_not_serve():
    """Runs on the CPU: with fuse_norm off, or M above decode_max_m, the norm / add ops run the base class's
    defaults (the rms_norm op, then the GEMM path) before any kernel; a mismatched residual is refused."""
    from pieceworks.backends.fp4_gemm.base import Fp4GemmBackend

    spec = BackendSpec(device="cuda", capability=(9, 0))
    calls = []

    class Probe(CudaFp4GemmBackend):
        def forward_swiglu(self, x, *args):
            calls.append(("swiglu", tuple(x.shape)))
            return x

    s = torch.randn(3, 64).to(torch.bfloat16)
    nw = torch.ones(64, dtype=torch.bfloat16)
    t, parts = s.clone(), torch.ones(3, 4)
    off = Probe(spec)
    off.forward_norm_swiglu(s, t, parts, nw, 1e-6, None, None, None, None, 16)
    big = Probe(spec, CudaDecodeOptions(fuse_norm=True, decode_max_m=2))
    big.forward_norm_swiglu(s, t, parts, nw, 1e-6, None, None, None, None, 16)
    assert calls == [("swiglu", (3, 64))] * 2
    assert Fp4GemmBackend.forward_norm_swiglu is not CudaFp4GemmBackend.forward_norm_swiglu
    on = CudaFp4GemmBackend(spec, CudaDecodeOptions(fuse_norm=True))
    gen = torch.Generator().manual_seed(6)
    w, sc = random_weight(48, 256, gen)
    codes, scales = r16c64.repack_decode(w, sc)
    x = torch.randn(2, 256).to(torch.bfloat16)
    with pytest.raises(ValueError, match="does not match the output"):
        on.forward_add(x, codes, scales, torch.tensor(1.0), torch.tensor(1.0), 48,
                       torch.zeros(2, 40).to(torch.bfloat16))


def test_mismatched_shapes_refused_before_any_launch():
    """Runs on the CPU: the checks come before the kernel is compiled or launched."""
    gen = torch.Generator().manual_seed(4)
    w, s = random_weight(48, 256, gen)
    codes, scales = r16c64.repack_decode(w, s)
    backend = CudaFp4GemmBackend(BackendSpec(device="cuda", capability=(9, 0)))
    gs = torch.tensor(1.0)
    x = torch.randn(2, 256).to(torch.bfloat16)
    with pytest.raises(ValueError, match="do not match the prepared weight"):
        backend.forward(torch.randn(2, 320).to(torch.bfloat16), codes, scales, gs, gs, 48)  # K too large
    with pytest.raises(ValueError, match="do not match the prepared weight"):
        backend.forward(x, codes, scales, gs, gs, 64)  # N beyond the 48 rows
    with pytest.raises(ValueError, match="do not match the prepared weight"):
        backend.forward(x, codes, scales, gs, gs, 16)  # N of another weight
    with pytest.raises(ValueError, match="bf16"):
        backend.forward(x.float(), codes, scales, gs, gs, 48)


def test_no_rows_no_launch():
    """M = 0 returns an empty output without compiling or launching anything (the kernel would read row -1)."""
    codes = torch.zeros(1, 1, 512, dtype=torch.uint8)
    scales = torch.zeros(1, 1, 64, dtype=torch.uint8)
    y = cuda_decode.decode_gemm(torch.zeros(0, 64, dtype=torch.bfloat16), codes, scales, torch.tensor(1.0), 16)
    assert y.shape == (0, 16) and y.dtype == torch.bfloat16


def test_launch_attribute_values_keep_their_zero_bytes():
    """nvrtc's launch attributes hold every byte of their value: a cluster dimension (1, 2, 1) is not cut at
    the first zero byte into (1, 0, 0) (the driver refused that launch); the PDL attribute is 1."""
    import ctypes

    from pieceworks.backends import nvrtc

    attr = nvrtc._attribute(4, b"".join(d.to_bytes(4, "little") for d in (1, 2, 1)))
    raw = ctypes.string_at(ctypes.addressof(attr), ctypes.sizeof(attr))
    assert raw[:4] == (4).to_bytes(4, "little")
    assert raw[8:20] == bytes([1, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0]) and raw[20:] == bytes(len(raw) - 20)
    pdl = nvrtc._attribute(nvrtc._PROGRAMMATIC_STREAM_SERIALIZATION, (1).to_bytes(4, "little"))
    assert ctypes.string_at(ctypes.addressof(pdl), 12) == bytes([6, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0])


# --- the decode kernel on the Triton backend's k32 weights (layout="k32") ------------------------------------


def test_k32_lane_addresses_give_the_fragments_the_kernel_multiplies():
    """The k32 mode's addressing (cuda_decode_kernel.py, L 1), followed in torch on `repack_k32`'s bytes: lane
    (g, t) of CTA b reads, for K block kb, the 16-byte vector at U4 index ((b >> 2) * nchunks + kb) * 256 +
    (16 (b & 3) + g) * 4 + t (+ 32 for row g + 8) and the 2-byte scale pair at the same u16 index; slot J of its
    word p must be the codes of that row's elements 128 kb + e and e + 1 (low and high unit), e = 64 (J >> 1) +
    16 t + 8 (J & 1) + 2 p, and the pair's low / high byte the scales of blocks 8 kb + t / + t + 4 (slots 0, 1 /
    2, 3). The kernel reads x for slot J at 16 t + 64 (J >> 1) + 8 (J & 1) (its xp and LOAD_X offsets), whose
    elements 2 p, 2 p + 1 are the B halves: every mma k slot pairs a weight with its own x element."""
    from pieceworks.backends.fp4_gemm.k32 import decode_slots, element_of, repack_k32

    gen = torch.Generator().manual_seed(21)
    n, k = 128, 384  # two row blocks, three K blocks (Kp = 512: a fourth, all padding)
    w, s = random_weight(n, k, gen)
    codes, scales = repack_k32(w, s)
    ref = torch.nn.functional.pad(nvfp4.unpack(w), (0, 512 - k))
    ref_s = torch.nn.functional.pad(s.view(torch.uint8), (0, 512 // 16 - k // 16))
    nchunks = codes.shape[1] // 64
    flat = codes.reshape(-1)
    sflat = scales.view(torch.uint8).reshape(-1)
    checked = 0
    for b in range(n // 16):
        for kb in range(nchunks):
            for g in range(8):
                for t in range(4):
                    for half in (0, 1):
                        idx = ((b >> 2) * nchunks + kb) * 256 + (16 * (b & 3) + g) * 4 + t + 32 * half
                        row = 64 * (b >> 2) + 16 * (b & 3) + g + 8 * half
                        vec = flat[16 * idx : 16 * idx + 16].to(torch.int32)
                        units = vec[0::2] | (vec[1::2] << 8)  # 8 units: word p = units 2p (low), 2p + 1 (high)
                        slots = decode_slots(units)
                        for j in range(4):
                            for p in range(4):
                                e = 128 * kb + 16 * t + 64 * (j >> 1) + 8 * (j & 1) + 2 * p  # the kernel's x
                                assert e == 128 * kb + element_of(t, j, 2 * p)
                                assert int(slots[j][2 * p]) == int(ref[row, e])
                                assert int(slots[j][2 * p + 1]) == int(ref[row, e + 1])
                        pair = sflat[2 * idx : 2 * idx + 2]
                        assert int(pair[0]) == int(ref_s[row, 8 * kb + t])
                        assert int(pair[1]) == int(ref_s[row, 8 * kb + t + 4])
                        checked += 1
    assert checked == (n // 16) * nchunks * 64


def test_k32_decode_gemm_arguments_checked_before_any_launch():
    """Runs on the CPU: the checks come before the kernel is compiled or launched."""
    from pieceworks.backends.fp4_gemm.k32 import repack_k32

    gen = torch.Generator().manual_seed(5)
    w, s = random_weight(64, 512, gen)
    codes, scales = repack_k32(w, s)
    gs = torch.tensor(1.0)
    x = torch.randn(2, 512).to(torch.bfloat16)
    with pytest.raises(ValueError, match="layout"):
        cuda_decode.decode_gemm(x, codes, scales, gs, 64, layout="k64")
    with pytest.raises(ValueError, match="do not fit the k32 weight"):
        cuda_decode.decode_gemm(torch.randn(2, 640).to(torch.bfloat16), codes, scales, gs, 64, layout="k32")
    with pytest.raises(ValueError, match="do not fit the k32 weight"):
        cuda_decode.decode_gemm(x, codes, scales, gs, 80, layout="k32")
    rc, rs = r16c64.repack_decode(w, s)
    with pytest.raises(ValueError, match="k32 codes must be"):
        cuda_decode.decode_gemm(x, rc, rs, gs, 64, layout="k32")


def test_triton_backend_cuda_decode_option_and_reasons():
    from pieceworks.backends.base import parse_options
    from pieceworks.backends.fp4_gemm.cuda_launch import cuda_decode_reason
    from pieceworks.backends.fp4_gemm.triton import TritonFp4GemmBackend, TritonTileOptions

    assert TritonTileOptions().cuda_decode_max_m == 16
    assert parse_options(TritonFp4GemmBackend, {"cuda_decode_max_m": 0}).cuda_decode_max_m == 0
    for bad in (-1, 17, True, 4.0, "8"):
        with pytest.raises(ValueError, match="cuda_decode_max_m"):
            TritonTileOptions(cuda_decode_max_m=bad)
    assert "CUDA devices" in cuda_decode_reason(torch.zeros(1, 8, dtype=torch.bfloat16))
    assert "bf16" in cuda_decode_reason(torch.zeros(1, 8))


def test_triton_backend_refuses_a_weight_of_another_shape():
    """Before either path (the CUDA decode kernel or the Triton kernels) would read past the weight."""
    from pieceworks.backends.fp4_gemm.triton import TritonFp4GemmBackend

    gen = torch.Generator().manual_seed(6)
    w, s = random_weight(64, 512, gen)
    backend = TritonFp4GemmBackend(BackendSpec(device="cuda", capability=(9, 0)))
    gs = torch.tensor(1.0)
    p = backend.prepare(Fp4Weight(w, s, gs, gs))
    with pytest.raises(ValueError, match="do not match the prepared weight"):
        backend.forward(torch.randn(1, 1024).to(torch.bfloat16), *p, 64)
    with pytest.raises(ValueError, match="do not match the prepared weight"):
        backend.forward(torch.randn(1, 512).to(torch.bfloat16), *p, 128)
