"""NVFP4: the E2M1 codec, block and global scales, packing, and the scale layouts kernels read.

Pure torch, CPU and CUDA, and graph-capturable where it says so (no host syncs). Every FP4 backend in
pieceworks is tested against these functions.

Format: values are E2M1 codes (4 bits: sign, 2 exponent bits, 1 mantissa bit; magnitudes
{0, 0.5, 1, 1.5, 2, 3, 4, 6}); one float8_e4m3fn scale per block of 16 consecutive elements along K;
one float32 per-tensor scale. Two codes per byte, the first element in the low nibble.
"""

from __future__ import annotations

import torch

BLOCK = 16
# float32/bfloat16's max / 2^20: a dot product of 2^20 unit activations with weights this large stays finite;
# trained weights sit many orders of magnitude below it (checkpoint weights, dense or dequantized, are held to it)
MAX_ABS = torch.finfo(torch.float32).max / 2**20
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN_SCALE = 2.0**-9  # smallest e4m3 subnormal: ModelOpt clamps block scales to it

# Rounding boundaries between neighbouring magnitudes; a value exactly on a boundary goes to the even
# code, i.e. up at the boundaries after odd codes (0.75, 1.75, 3.5) and down at the others.
_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_values(device: torch.device | str = "cpu") -> torch.Tensor:
    """[16] float32: the value of every code (codes 8..15 are the negatives of 0..7)."""
    mag = torch.tensor(_VALUES, dtype=torch.float32, device=device)
    return torch.cat([mag, -mag])


def e2m1_encode(x: torch.Tensor, check_finite: bool = True) -> torch.Tensor:
    """Round to the nearest E2M1 code, ties to even, saturating at +-6.

    Args:
        x: any shape, any float dtype (computed in float32).
        check_finite: raise on NaN/inf (this syncs with the device; pass False inside CUDA graphs,
            where NaN/inf then saturate to +-6 as hardware conversion does).

    Returns:
        uint8 codes in [0, 15], same shape as x. Negative inputs get the sign bit (bit 3), also when
        they round to zero, as ModelOpt's export does.

    Raises:
        ValueError: x holds NaN or inf (with check_finite).
    """
    xf = x.float()
    if check_finite and not bool(torch.isfinite(xf).all()):
        raise ValueError("e2m1_encode: input holds NaN or inf; NVFP4 has no code for them")
    mag = xf.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for i, b in enumerate(_BOUNDS):
        up = mag > b
        if i % 2 == 1:  # tie goes up to the even code
            up = up | (mag == b)
        code += up.to(torch.uint8)
    code = torch.where(torch.isnan(xf), torch.full_like(code, 7), code)
    return code | ((xf < 0).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of uint8 codes (any shape); arithmetic, no lookup table, capturable."""
    c = codes.to(torch.int32)
    exp = (c >> 1) & 3
    man = (c & 1).to(torch.float32)
    normal = (1.0 + 0.5 * man) * torch.exp2((exp - 1).to(torch.float32))
    mag = torch.where(exp == 0, 0.5 * man, normal)
    return torch.where((c & 8) != 0, -mag, mag)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] uint8 codes -> [..., K/2] uint8 bytes, element 2j in the low nibble of byte j."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack: last dimension must be even, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def decode_packed(packed: torch.Tensor) -> torch.Tensor:
    """float32 values of [..., K/2] packed bytes -> [..., K]: one lookup per byte in a 256 x 2 table that
    `e2m1_decode` builds on the bytes' device (kernels only, so capturable); 14x the speed of decoding
    the unpacked codes on a CPU."""
    byte = torch.arange(256, device=packed.device, dtype=torch.int32)
    table = torch.stack([e2m1_decode(byte & 0x0F), e2m1_decode(byte >> 4)], dim=-1)
    return torch.nn.functional.embedding(packed.int(), table).flatten(-2)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] uint8 bytes -> [..., K] uint8 codes (inverse of `pack`)."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % BLOCK:
        raise ValueError(
            f"NVFP4 needs the last dimension to be a multiple of {BLOCK}, got shape {tuple(x.shape)}"
        )
    return x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)


def weight_global_scale(w: torch.Tensor) -> torch.Tensor:
    """ModelOpt's `weight_scale_2`: float32 scalar amax(|w|) / (6 * 448)."""
    return w.detach().abs().amax().float() / (E2M1_MAX * E4M3_MAX)


def quantize_weight(
    w: torch.Tensor, weight_scale_2: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize a weight exactly as ModelOpt's NVFP4 export does.

    Args:
        w: [N, K] (or [..., K]) weight, K a multiple of 16.
        weight_scale_2: float32 scalar per-tensor scale; computed from w when None (pass the shared
            one for the parts of a fused projection).

    Returns:
        (weight uint8 [N, K/2], weight_scale float8_e4m3fn [N, K/16], weight_scale_2 float32 scalar)
    """
    wf = w.detach().float()
    ws2 = weight_global_scale(wf) if weight_scale_2 is None else weight_scale_2.float().reshape(())
    if not bool(torch.isfinite(wf).all()):
        raise ValueError("quantize_weight: weight holds NaN or inf")
    if float(ws2) == 0.0:  # all-zero tensor: any scale decodes to zeros; avoid 0/0
        ws2 = torch.tensor(1.0 / (E2M1_MAX * E4M3_MAX), device=wf.device)
    blocks = _blocks(wf)
    s = blocks.abs().amax(-1) / (E2M1_MAX * ws2)
    s[s == 0] = 1.0
    scale = s.clamp(min=E4M3_MIN_SCALE, max=E4M3_MAX).to(torch.float8_e4m3fn)
    scaled = blocks / (scale.float() * ws2).unsqueeze(-1)
    codes = e2m1_encode(scaled.reshape(wf.shape), check_finite=False)
    return pack(codes), scale, ws2.reshape(()).clone()


def quantize_activation(
    x: torch.Tensor, input_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize activations as Blackwell FP4 kernels do from a checkpoint's `input_scale`.

    gs = 1 / input_scale; per block SF = e4m3(gs * amax_b / 6) (saturating); codes =
    e2m1(x * 1 / (float(SF) / gs)); an all-zero block gets SF = 0 and zero codes. The kernels use
    approximate reciprocals (rcp.approx.ftz); here they are exact float32 divisions, so a code can differ
    where x sits within an ulp of a rounding boundary. Capturable (no host sync).

    Args:
        x: [M, K] float activations, K a multiple of 16.
        input_scale: float32 scalar (amax_act / (6 * 448)).

    Returns:
        (codes packed uint8 [M, K/2], block scales float8_e4m3fn [M, K/16], gs float32 scalar)
    """
    gs = 1.0 / input_scale.float().reshape(())
    blocks = _blocks(x.float())
    amax = blocks.abs().amax(-1)
    sf = (gs * (amax * (1.0 / E2M1_MAX))).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    sf_f = sf.float()
    out_scale = torch.where(sf_f != 0, 1.0 / (sf_f * (1.0 / gs)), torch.zeros_like(sf_f))
    codes = e2m1_encode((blocks * out_scale.unsqueeze(-1)).reshape(x.shape), check_finite=False)
    return pack(codes), sf, gs


def dequantize(
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decode NVFP4 as ModelOpt does: e2m1 * (float(scale) * global_scale). Capturable.

    Args:
        packed: [N, K/2] uint8.
        scale: [N, K/16] float8_e4m3fn, linear layout.
        global_scale: float32 scalar (weight_scale_2), or for activations 1 / gs.
        dtype: output dtype (computed in float32, cast last).

    Returns:
        [N, K] dtype.
    """
    vals = decode_packed(packed)
    per_block = scale.float() * global_scale.float()
    out = _blocks(vals) * per_block.unsqueeze(-1)
    return out.reshape(vals.shape).to(dtype)


def fake_quantize_activation(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """x rounded through NVFP4 activation quantization (w4a4 numerics), float32, same shape."""
    packed, sf, gs = quantize_activation(x, input_scale)
    return dequantize(packed, sf, 1.0 / gs)


# --- Scale layouts -------------------------------------------------------------------------------
#
# Checkpoints store block scales "linear": [N, K/16], row-major. Blackwell kernels read them tiled,
# with rows zero-padded to the tile height and columns (scale columns, i.e. groups of 16 along K)
# zero-padded to a multiple of 4. The offsets follow TensorRT-LLM's `get_sf_out_offset_128x4` and
# `get_sf_out_offset_8x4` (FlashInfer csrc/nv_internal/tensorrt_llm/kernels/quantization_utils.cuh):
#
#   128x4: [Rp/128, Cp/4, 32, 4, 4]; row m = 128*tile + 32*i + j sits at [tile, k/4, j, i, k%4]
#          (the 32x4 row block is column-major), i.e. view(Rp//128, 4, 32, Cp//4, 4)
#          .permute(0, 3, 2, 1, 4) of the padded linear layout.
#   8x4:   [Rp/8, Cp/4, 8, 4]; row m = 8*tile + i sits at [tile, k/4, i, k%4], i.e.
#          view(Rp//8, 8, Cp//4, 4).permute(0, 2, 1, 3).
#
# Leading dimensions (e.g. experts) are batched: each [R, C] matrix is padded and tiled on its own,
# one after another, as the batched offset functions do. Pure data movement: any dtype works
# (float8_e4m3fn, or uint8 views of it), the bytes are preserved, padding is zero.


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _padded(scale: torch.Tensor, row_tile: int) -> torch.Tensor:
    if scale.dim() < 2:
        raise ValueError(f"scale layouts need a [..., rows, cols] tensor, got shape {tuple(scale.shape)}")
    *lead, rows, cols = scale.shape
    rp, cp = _round_up(rows, row_tile), _round_up(cols, 4)
    if (rp, cp) == (rows, cols):
        return scale.contiguous()
    out = scale.new_zeros((*lead, rp, cp))
    out[..., :rows, :cols] = scale
    return out


def _lead_of(swizzled: torch.Tensor, rp: int, cp: int, name: str) -> tuple[int, ...]:
    if swizzled.dim() >= 2 and tuple(swizzled.shape[-2:]) == (rp, cp):
        return tuple(swizzled.shape[:-2])
    n = swizzled.numel()
    if n % (rp * cp) or (swizzled.dim() != 1 and n != rp * cp):
        raise ValueError(
            f"{name}: got shape {tuple(swizzled.shape)}, expected [..., {rp}, {cp}] or a flat "
            f"multiple of {rp * cp} (rows and cols padded to the tile); check rows/cols"
        )
    return () if n == rp * cp else (n // (rp * cp),)


def swizzle_128x4(scale: torch.Tensor, flatten: bool = False) -> torch.Tensor:
    """Linear block scales -> the 128x4 tiled layout Blackwell FP4 GEMM/MoE kernels read.

    Args:
        scale: [..., R, C] block scales (float8_e4m3fn or a uint8 view), C = K/16.
        flatten: return a 1-D buffer (what FlashInfer's `block_scale_interleave` returns).

    Returns:
        [..., Rp, Cp] (or [prod(...) * Rp * Cp] with flatten), same dtype; Rp = R rounded up to 128,
        Cp = C rounded up to 4, padding zero.
    """
    p = _padded(scale, 128)
    *lead, rp, cp = p.shape
    n = len(lead)
    t = p.view(*lead, rp // 128, 4, 32, cp // 4, 4)
    t = t.permute(*range(n), n, n + 3, n + 2, n + 1, n + 4).contiguous()
    return t.reshape(-1) if flatten else t.reshape(*lead, rp, cp)


def unswizzle_128x4(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of `swizzle_128x4`: [..., Rp, Cp] -> [..., rows, cols] linear layout.

    A flat buffer comes back as [rows, cols], or [E, rows, cols] when it holds E > 1 matrices.
    """
    rp, cp = _round_up(rows, 128), _round_up(cols, 4)
    lead = _lead_of(swizzled, rp, cp, "unswizzle_128x4")
    n = len(lead)
    t = swizzled.reshape(*lead, rp // 128, cp // 4, 32, 4, 4)
    t = t.permute(*range(n), n, n + 3, n + 2, n + 1, n + 4).contiguous()
    return t.reshape(*lead, rp, cp)[..., :rows, :cols].contiguous()


def swizzle_8x4(scale: torch.Tensor, flatten: bool = False) -> torch.Tensor:
    """Linear block scales -> the 8x4 tiled layout (TRT-LLM small-M GEMMs, `SfLayout.layout_8x4`).

    Args:
        scale: [..., R, C] block scales (float8_e4m3fn or a uint8 view), C = K/16.
        flatten: return a 1-D buffer.

    Returns:
        [..., Rp, Cp] (or flat), same dtype; Rp = R rounded up to 8, Cp = C rounded up to 4, zero
        padding.
    """
    p = _padded(scale, 8)
    *lead, rp, cp = p.shape
    n = len(lead)
    t = p.view(*lead, rp // 8, 8, cp // 4, 4).permute(*range(n), n, n + 2, n + 1, n + 3)
    t = t.contiguous()
    return t.reshape(-1) if flatten else t.reshape(*lead, rp, cp)


def unswizzle_8x4(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of `swizzle_8x4`: [..., Rp, Cp] -> [..., rows, cols]; a flat buffer as in `unswizzle_128x4`."""
    rp, cp = _round_up(rows, 8), _round_up(cols, 4)
    lead = _lead_of(swizzled, rp, cp, "unswizzle_8x4")
    n = len(lead)
    t = swizzled.reshape(*lead, rp // 8, cp // 4, 8, 4).permute(*range(n), n, n + 2, n + 1, n + 3)
    return t.contiguous().reshape(*lead, rp, cp)[..., :rows, :cols].contiguous()
