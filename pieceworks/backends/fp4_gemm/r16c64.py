"""The "r16c64" layout of NVFP4 weights for the CUDA decode GEMM (cuda_decode.py), torch side: the
load-time repack and its inverse (for tests). Imports torch only.

Per 16 rows x 64 elements ("chunk"), lane L = 4g + t of a warp owns one 16-byte vector: the codes of
rows g and g + 8 for elements 16t .. 16t + 15 of the chunk (one NVFP4 block per row). Inside the
vector, 32-bit word (h, p) (h = row g / g + 8, p = 0, 1) holds two k32 units (the bit layout of
triton_k32.py, `k32.SLOT_BITS`): its low unit the codes of elements 16t + 4j + 2p, its high unit those
of 16t + 4j + 2p + 1, slot j = 0..3, so slot j of the word decodes to one bf16x2 A register of mma j.
The block scales follow the same lanes: per chunk 64 bytes, lane L's two bytes the scales of rows g and
g + 8 for block 4c + t. Chunks of a row group are contiguous, row groups one after the other.
"""

from __future__ import annotations

import torch

from pieceworks.backends.fp4_gemm.k32 import checked_block_scales, decode_slots, encode_slots, fix_block_codes
from pieceworks.quant import nvfp4

CHUNK = 64  # elements of K per chunk
ROWS = 16  # weight rows per row group (one CTA of the kernel)


def repack_decode(weight: torch.Tensor, weight_scale: torch.Tensor):
    """Checkpoint NVFP4 [N, K/2] uint8 + [N, K/16] e4m3 -> the r16c64 layout (module docstring).

    Returns (codes uint8 [R, C, 512], scales uint8 [R, C, 64]) with R = ceil(N / 16) row groups and
    C = ceil(K / 64) chunks; padding is zero codes and zero scales. Codes of zero-scale blocks are
    zeroed and negative scales' signs moved into their codes, as `k32.repack_k32` does.

    Raises:
        ValueError: K not a multiple of 16, or a NaN block scale.
    """
    n, half_k = weight.shape
    k = half_k * 2
    if k % nvfp4.BLOCK:
        raise ValueError(f"NVFP4 K must be a multiple of {nvfp4.BLOCK}, got {k}")
    magnitude, zero_block, flip = checked_block_scales(weight_scale, k)
    codes = nvfp4.unpack(weight).to(torch.int32)
    fix_block_codes(codes, zero_block, flip)
    rg, ch = -(-n // ROWS), -(-k // CHUNK)
    codes = torch.nn.functional.pad(codes, (0, ch * CHUNK - k, 0, rg * ROWS - n))
    mag = torch.nn.functional.pad(magnitude, (0, ch * 4 - k // nvfp4.BLOCK, 0, rg * ROWS - n))
    # codes[row, k]: row = 16 r + 8 h + g, k = 64 c + 16 t + 4 j + 2 p + u (u: low / high unit of a word)
    c = codes.view(rg, 2, 8, ch, 4, 4, 2, 2)  # r h g c t j p u
    units = encode_slots([c[:, :, :, :, :, j] for j in range(4)])
    units = units.permute(0, 3, 2, 4, 1, 5, 6)  # r c g t h p u
    out = torch.stack([units & 0xFF, units >> 8], dim=-1).to(torch.uint8)
    out = out.contiguous().view(rg, ch, 512)
    # scales[r, c, lane = 4 g + t, h] = scale of row 16 r + 8 h + g, block 4 c + t
    s = mag.view(rg, 2, 8, ch, 4).permute(0, 3, 2, 4, 1).contiguous().view(rg, ch, 64)
    return out, s


def unpack_decode(codes: torch.Tensor, scales: torch.Tensor, n: int, k: int):
    """The inverse of `repack_decode` (for tests): (e2m1 codes uint8 [n, k], e4m3 scales [n, k / 16])."""
    rg, ch, _ = codes.shape
    b = codes.view(rg, ch, 8, 4, 2, 2, 2, 2).to(torch.int32)  # r c g t h p u byte
    units = b[..., 0] | (b[..., 1] << 8)
    out = torch.stack([code.permute(0, 4, 2, 1, 3, 5, 6) for code in decode_slots(units)], dim=5)  # r h g c t j p u
    out = out.reshape(rg * ROWS, ch * CHUNK)[:n, :k].to(torch.uint8)
    s = scales.view(rg, ch, 8, 4, 2).permute(0, 4, 2, 1, 3).reshape(rg * ROWS, ch * 4)
    return out, s[:n, : k // nvfp4.BLOCK].contiguous().view(torch.float8_e4m3fn)
