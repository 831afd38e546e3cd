"""The NVFP4 codec: E2M1 codes, packing, scale layouts, weight and activation quantization."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pieceworks.quant import nvfp4

MODELOPT = "needs nvidia-modelopt, the reference quantizer: pip install -e '.[test]'"

MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
FAST = settings(max_examples=60, deadline=None)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dtype != torch.uint8 else t


# --- E2M1 codes ----------------------------------------------------------------------------------


def test_decode_table():
    codes = torch.arange(16, dtype=torch.uint8)
    expected = torch.tensor(MAGNITUDES + [-m for m in MAGNITUDES])
    assert torch.equal(nvfp4.e2m1_decode(codes), expected)
    assert torch.equal(nvfp4.e2m1_values(), expected)
    assert math.copysign(1.0, float(nvfp4.e2m1_decode(torch.tensor([8], dtype=torch.uint8)))) == -1.0


@pytest.mark.parametrize("code", range(16))
def test_every_code_round_trips(code):
    value = nvfp4.e2m1_decode(torch.tensor([code], dtype=torch.uint8))
    back = int(nvfp4.e2m1_encode(value))
    # Code 8 is -0: it decodes to -0.0, and -0.0 encodes to code 0 because the sign bit follows
    # ModelOpt's `x < 0` (false for -0.0). Every other code comes back as itself.
    assert back == (0 if code == 8 else code)


def test_negative_values_that_round_to_zero_keep_the_sign():
    # ModelOpt's export sets the sign bit for any x < 0, also when |x| rounds to 0 (code 8, "-0").
    codes = nvfp4.e2m1_encode(torch.tensor([-0.1, -0.25, 0.1, 0.25, -0.0]))
    assert codes.tolist() == [8, 8, 0, 0, 0]


@pytest.mark.parametrize(
    "boundary, lower, upper, expected",
    [
        (0.25, 0.0, 0.5, 0.0),  # tie between codes 0 and 1 -> even code 0
        (0.75, 0.5, 1.0, 1.0),  # codes 1/2 -> 2
        (1.25, 1.0, 1.5, 1.0),  # codes 2/3 -> 2
        (1.75, 1.5, 2.0, 2.0),  # codes 3/4 -> 4
        (2.5, 2.0, 3.0, 2.0),  # codes 4/5 -> 4
        (3.5, 3.0, 4.0, 4.0),  # codes 5/6 -> 6
        (5.0, 4.0, 6.0, 4.0),  # codes 6/7 -> 6
    ],
)
def test_ties_go_to_even_and_neighbours_to_nearest(boundary, lower, upper, expected):
    b = torch.tensor(boundary)
    below = torch.nextafter(b, torch.tensor(-1.0))
    above = torch.nextafter(b, torch.tensor(10.0))
    for sign in (1.0, -1.0):
        x = torch.stack([b, below, above]) * sign
        got = nvfp4.e2m1_decode(nvfp4.e2m1_encode(x))
        assert got.tolist() == [sign * expected, sign * lower, sign * upper]
        assert int(nvfp4.e2m1_encode(x)[0]) % 2 == 0  # even code (the low mantissa bit is clear)


def test_saturates_at_six():
    x = torch.tensor([6.0, 6.5, 100.0, 3.0e38, -6.5, -1.0e30])
    assert nvfp4.e2m1_decode(nvfp4.e2m1_encode(x)).tolist() == [6.0, 6.0, 6.0, 6.0, -6.0, -6.0]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_inf_are_errors(bad):
    x = torch.tensor([1.0, bad])
    with pytest.raises(ValueError, match="NaN or inf"):
        nvfp4.e2m1_encode(x)
    # Without the check (inside CUDA graphs) they saturate like the hardware conversion.
    assert abs(float(nvfp4.e2m1_decode(nvfp4.e2m1_encode(x, check_finite=False))[1])) == 6.0


def test_quantize_weight_rejects_nan():
    w = torch.randn(4, 32)
    w[1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        nvfp4.quantize_weight(w)


# --- packing -------------------------------------------------------------------------------------


def test_pack_puts_the_first_element_in_the_low_nibble():
    assert nvfp4.pack(torch.tensor([[0x3, 0xA]], dtype=torch.uint8)).tolist() == [[0xA3]]
    with pytest.raises(ValueError, match="even"):
        nvfp4.pack(torch.zeros(3, dtype=torch.uint8))


@FAST
@given(
    lead=st.lists(st.integers(1, 4), min_size=0, max_size=2),
    half=st.integers(1, 40),
    seed=st.integers(0, 2**31 - 1),
)
def test_pack_unpack_inverse(lead, half, seed):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (*lead, 2 * half), generator=gen, dtype=torch.uint8)
    packed = nvfp4.pack(codes)
    assert packed.shape == (*lead, half)
    assert torch.equal(nvfp4.unpack(packed), codes)
    assert torch.equal(nvfp4.pack(nvfp4.unpack(packed)), packed)


def test_packed_bytes_decode_as_their_unpacked_codes():
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(4, 64)
    got, ref = nvfp4.decode_packed(every), nvfp4.e2m1_decode(nvfp4.unpack(every))
    assert got.shape == (4, 128) and got.dtype == torch.float32
    assert torch.equal(got, ref)
    assert torch.equal(torch.signbit(got), torch.signbit(ref))  # code 8 stays -0.0
    assert torch.equal(nvfp4.decode_packed(every[0, :0]), torch.zeros(0))


# --- scale layouts -------------------------------------------------------------------------------


def _offset_128x4(b, m, k, rows, cols):
    """TensorRT-LLM's get_sf_out_offset_128x4 (batched), restated."""
    num_k_tiles = (cols + 3) // 4
    m_tile_stride = num_k_tiles * 512
    b_stride = (rows + 127) // 128 * m_tile_stride
    return (
        b * b_stride + (m // 128) * m_tile_stride + (k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4
    )


def _offset_8x4(b, m, k, rows, cols):
    """TensorRT-LLM's get_sf_out_offset_8x4 (batched), restated."""
    num_k_tiles = (cols + 3) // 4
    m_tile_stride = num_k_tiles * 32
    b_stride = (rows + 7) // 8 * m_tile_stride
    return b * b_stride + (m // 8) * m_tile_stride + (k // 4) * 32 + (m % 8) * 4 + k % 4


LAYOUTS = {
    "128x4": (nvfp4.swizzle_128x4, nvfp4.unswizzle_128x4, _offset_128x4, 128),
    "8x4": (nvfp4.swizzle_8x4, nvfp4.unswizzle_8x4, _offset_8x4, 8),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", [(1, 1), (5, 3), (128, 4), (130, 9), (3, 17, 6)])
def test_swizzle_matches_kernel_offsets(layout, shape):
    swz, _, offset, tile = LAYOUTS[layout]
    scale = torch.randint(1, 256, shape, dtype=torch.uint8)
    flat = swz(scale, flatten=True)
    *lead, rows, cols = shape
    experts = lead[0] if lead else 1
    rp, cp = (rows + tile - 1) // tile * tile, (cols + 3) // 4 * 4
    assert flat.numel() == experts * rp * cp
    expected = torch.zeros(experts * rp * cp, dtype=torch.uint8)
    src = scale.reshape(experts, rows, cols)
    for b in range(experts):
        for m in range(rows):
            for k in range(cols):
                expected[offset(b, m, k, rows, cols)] = src[b, m, k]
    assert torch.equal(flat, expected)  # padding included: zeros where no scale lands
    assert torch.equal(swz(scale), flat.reshape(*lead, rp, cp))


@FAST
@given(
    layout=st.sampled_from(sorted(LAYOUTS)),
    experts=st.sampled_from([None, 1, 3]),
    rows=st.integers(1, 300),
    cols=st.integers(1, 20),
    fp8=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_scale_layouts_invert(layout, experts, rows, cols, fp8, seed):
    swz, unswz, _, tile = LAYOUTS[layout]
    gen = torch.Generator().manual_seed(seed)
    shape = (rows, cols) if experts is None else (experts, rows, cols)
    scale = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    if fp8:
        scale = scale.view(torch.float8_e4m3fn)
    sw = swz(scale)
    rp, cp = -(-rows // tile) * tile, -(-cols // 4) * 4
    assert sw.shape == (*shape[:-2], rp, cp) and sw.dtype == scale.dtype
    assert torch.equal(_bytes(unswz(sw, rows, cols)), _bytes(scale))
    from_flat = unswz(swz(scale, flatten=True), rows, cols)  # a flat buffer has no leading dims left
    assert torch.equal(_bytes(from_flat).reshape(shape), _bytes(scale))
    assert int(_bytes(sw).sum()) == int(_bytes(scale).sum())  # only zeros were added


def test_unswizzle_rejects_a_wrong_size():
    with pytest.raises(ValueError, match="rows/cols"):
        nvfp4.unswizzle_128x4(torch.zeros(100, dtype=torch.uint8), 5, 3)


# --- quantization --------------------------------------------------------------------------------


def _weights():
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(96, 256, generator=gen) * 0.02
    w[3, :16] = 0.0  # an all-zero block
    w[5, 40] = 0.9  # an outlier that sets the global scale
    w[7, 64:80] = 1e-7  # a block whose scale underflows e4m3 and is clamped to 2^-9
    return [w.to(torch.bfloat16), (torch.randn(33, 48, generator=gen) * 3).to(torch.bfloat16)]


@pytest.mark.filterwarnings("ignore:transformers .* is not tested:UserWarning")  # modelopt's import
@pytest.mark.filterwarnings("ignore:`torch.jit.script:DeprecationWarning")
@pytest.mark.parametrize("index", [0, 1])
def test_weight_quantization_matches_modelopt_bit_exact(index):
    NVFP4QTensor = pytest.importorskip("modelopt.torch.quantization.qtensor", reason=MODELOPT).NVFP4QTensor

    w = _weights()[index]
    packed, scale, ws2 = nvfp4.quantize_weight(w)
    ref_q, ref_scale, ref_ws2 = NVFP4QTensor.quantize(w, 16)
    assert torch.equal(packed, ref_q._quantized_data)
    assert torch.equal(_bytes(scale), _bytes(ref_scale))
    assert torch.equal(ws2, ref_ws2.reshape(()))
    ref_deq = ref_q.dequantize(dtype=torch.float32, scale=ref_scale, double_scale=ref_ws2, block_sizes={-1: 16})
    assert torch.equal(nvfp4.dequantize(packed, scale, ws2), ref_deq)


def _restated_activation_quant(x: torch.Tensor, input_scale: torch.Tensor):
    """Block by block, value by value, in float32 and the kernels' operation order; E2M1 rounding by
    nearest table entry with ties to the even code. Returns (codes uint8 [M, K], sf e4m3 [M, K/16])."""
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    table = torch.tensor(MAGNITUDES)
    gs = f32(1.0) / input_scale.float()
    codes = torch.zeros(x.shape, dtype=torch.uint8)
    sfs = torch.zeros(x.shape[0], x.shape[1] // 16, dtype=torch.float8_e4m3fn)
    for r in range(x.shape[0]):
        for b in range(0, x.shape[1], 16):
            block = x[r, b : b + 16].float()
            amax = block.abs().max()
            sf = (gs * (amax * (f32(1.0) / f32(6.0)))).clamp(max=448.0).to(torch.float8_e4m3fn)
            sfs[r, b // 16] = sf
            scale = f32(0.0) if sf.float() == 0 else f32(1.0) / (sf.float() * (f32(1.0) / gs))
            for i in range(16):
                v = block[i] * scale
                dist = (table - v.abs().clamp(max=6.0)).abs()
                best = [j for j in range(8) if dist[j] == dist.min()]
                code = min(best, key=lambda j: j % 2)  # a tie: the even code
                codes[r, b + i] = code | (8 if float(v) < 0 else 0)
    return codes, sfs


def test_activation_quantization_matches_a_restatement():
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(6, 64, generator=gen) * 2).to(torch.bfloat16)
    x[2, 16:32] = 0.0  # all-zero block: SF 0
    x[4, 5] = 40.0  # beyond what input_scale covers: SF saturates at 448, the codes at 6
    x[1, 0:16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2)  # amax 6: scale ~1, ties
    input_scale = torch.tensor(6.0 / (6 * 448))
    packed, sf, gs = nvfp4.quantize_activation(x, input_scale)
    ref_codes, ref_sf = _restated_activation_quant(x, input_scale)
    assert torch.equal(nvfp4.unpack(packed), ref_codes)
    assert torch.equal(_bytes(sf), _bytes(ref_sf))
    assert packed.shape == (6, 32) and sf.dtype == torch.float8_e4m3fn and torch.equal(gs, 1.0 / input_scale)
    assert float(sf[2, 1].float()) == 0.0 and float(sf[4, 0].float()) == 448.0
    deq = nvfp4.dequantize(packed, sf, 1.0 / gs)
    assert torch.equal(nvfp4.fake_quantize_activation(x, input_scale), deq)
