"""The "k32" layout of NVFP4 weights for the Triton kernels, torch side: the load-time repack, its
inverse (for tests), the tiled storage order, and the K order of `perm_k` tiles. The bit layout and
its decode are described in triton_k32.py. Imports torch only.
"""

from __future__ import annotations

import torch

from pieceworks.quant import nvfp4

GROUP = 32  # elements per k32 group (16 bytes: blocks t and t + 4 of its 128-element tile, `element_of`)
K_ALIGN = 512  # K is padded to this, a multiple of every BLOCK_K: the kernels' weight loads need no mask
# Bit positions of a code's (sign, E1, E0, m) for slots 0..3 of a 16-bit unit (triton_k32.py).
SLOT_BITS = ((15, 8, 7, 6), (12, 5, 4, 3), (9, 2, 1, 0), (11, 10, 14, 13))
# Storage tiles of the repacked weights (triton_k32.py): TILE_ROWS rows x TILE_K elements, each tile
# contiguous, tiles in (row block, K block) order. Per tile row: 64 bytes of units, 8 of scales.
TILE_ROWS = 64
TILE_K = 128

def checked_block_scales(weight_scale: torch.Tensor, k: int):
    """NVFP4 block scales [..., N, K/16] -> (magnitude uint8 [rows, K/16], zero_block, flip) for a repack:
    the e4m3 bits without their sign (what the kernels read: they take scales as non-negative), the
    blocks whose scale is zero (their codes are zeroed: the kernels' scale conversion may map a zero
    scale to any finite number) and the negative blocks (their codes change sign instead).

    Raises:
        ValueError: a block scale is NaN (e4m3 0x7F / 0xFF), which no quantizer writes.
    """
    scale_bits = weight_scale.reshape(-1, k // nvfp4.BLOCK).view(torch.uint8)
    magnitude = scale_bits & 0x7F
    nan = magnitude == 0x7F
    if bool(nan.any()):
        row, block = (int(i) for i in nan.nonzero()[0])
        raise ValueError(f"NVFP4 block scales: {int(nan.sum())} of {nan.numel()} are NaN (the first at flattened row "
                         f"{row}, block {block} of the [..., N, K/16] scale tensor {tuple(weight_scale.shape)}); "
                         "the checkpoint is corrupt: re-export it")
    zero_block = magnitude == 0
    flip = ((scale_bits & 0x80) != 0) & ~zero_block
    return magnitude, zero_block, flip


def fix_block_codes(codes: torch.Tensor, zero_block: torch.Tensor, flip: torch.Tensor | None) -> None:
    """In place on int32 codes [rows, K]: zero the codes of zero-scale blocks, flip the sign of those
    of negative blocks (`checked_block_scales`; flip None = none)."""
    codes.masked_fill_(zero_block.repeat_interleave(nvfp4.BLOCK, dim=1), 0)
    if flip is not None:
        codes ^= flip.repeat_interleave(nvfp4.BLOCK, dim=1).to(torch.int32) << 3


def encode_slots(slot_codes: list[torch.Tensor]) -> torch.Tensor:
    """Four int32 code tensors (slots 0..3, same shape) -> the 16-bit units holding them (SLOT_BITS)."""
    units = torch.zeros_like(slot_codes[0])
    for cs, bits in zip(slot_codes, SLOT_BITS):
        for bit, pos in zip((3, 2, 1, 0), bits):
            units |= ((cs >> bit) & 1) << pos
    return units


def decode_slots(units: torch.Tensor) -> list[torch.Tensor]:
    """The inverse of `encode_slots`: int32 units -> the codes of slots 0..3."""
    slots = []
    for bits in SLOT_BITS:
        code = torch.zeros_like(units)
        for bit, pos in zip((3, 2, 1, 0), bits):
            code |= ((units >> pos) & 1) << bit
        slots.append(code)
    return slots


def tile_k32(t: torch.Tensor) -> torch.Tensor:
    """Row-major [..., Np, C] (Np a multiple of TILE_ROWS; C bytes per row: Kp/2 of units or Kp/16 of
    scales) -> the storage order of `repack_k32`: each TILE_ROWS x TILE_K tile contiguous, tiles in
    (row block, K block) order. Same shape and dtype; `untile_k32` inverts it."""
    *lead, n, c = t.shape
    blocks = t.shape[-1] // _tile_cols(t)
    tiled = t.reshape(-1, n // TILE_ROWS, TILE_ROWS, blocks, c // blocks).transpose(2, 3)
    return tiled.contiguous().view(t.shape)


def untile_k32(t: torch.Tensor) -> torch.Tensor:
    """The inverse of `tile_k32`: repacked units or scales [..., Np, C] in row-major order."""
    *lead, n, c = t.shape
    blocks = t.shape[-1] // _tile_cols(t)
    rows = t.reshape(-1, n // TILE_ROWS, blocks, TILE_ROWS, c // blocks).transpose(2, 3)
    return rows.contiguous().view(t.shape)


def _tile_cols(t: torch.Tensor) -> int:
    """Bytes of one tile row of `t`: units (uint8, TILE_K / 2) or scales (1-byte, TILE_K / 16)."""
    if t.element_size() != 1 or t.shape[-2] % TILE_ROWS:
        raise ValueError(f"expected repacked k32 bytes or scales [..., N, C] with N a multiple of {TILE_ROWS}, "
                         f"got {t.dtype} {tuple(t.shape)}")
    return TILE_K // 2 if t.dtype == torch.uint8 else TILE_K // nvfp4.BLOCK


def repack_k32(weight: torch.Tensor, weight_scale: torch.Tensor, chunk_rows: int = 4096):
    """Checkpoint NVFP4 -> k32 layout (see triton_k32.py).

    Args:
        weight: uint8 [..., N, K/2], linear layout (element 2j in the low nibble of byte j).
        weight_scale: float8_e4m3fn [..., N, K/16].
        chunk_rows: rows converted at a time (bounds the temporary int32 codes).

    Returns:
        (uint8 [..., Np, Kp/2], float8_e4m3fn [..., Np, Kp/16]) with Kp = K rounded up to K_ALIGN (512)
        and Np = N rounded up to TILE_ROWS (64), stored tile by tile (`tile_k32`: each 64-row x
        128-element tile contiguous, 4 KB of units and 512 bytes of scales, K blocks of a row block
        next to each other, so a 64-row program of the decode GEMM reads one 8 KB run of weights and
        one 1 KB run of scales per 256-element K step; `untile_k32` gives the row-major view).
        Padding is zero codes and zero scales. Codes of blocks whose scale is zero are zeroed (their
        values are zero either way; the kernels' scale conversion relies on it). A negative block
        scale (ModelOpt writes amax / 6, never negative, but e4m3 has a sign) has its sign moved into
        the block's codes (every code's sign bit flipped, the scale made positive: the same values),
        since the kernels' scale conversion reads scales as non-negative.

    Raises:
        ValueError: a block scale is NaN (e4m3 0x7F / 0xFF), which no quantizer writes.
    """
    *lead, n, half_k = weight.shape
    k = half_k * 2
    kp = -(-k // K_ALIGN) * K_ALIGN
    flat = weight.reshape(-1, half_k)
    out = torch.empty((flat.shape[0], kp // 2), dtype=torch.uint8, device=weight.device)
    magnitude, zero_block, flip = checked_block_scales(weight_scale, k)
    if not bool(flip.any()):
        flip = None
    for r0 in range(0, flat.shape[0], chunk_rows):
        codes = nvfp4.unpack(flat[r0 : r0 + chunk_rows]).to(torch.int32)
        fix_block_codes(codes, zero_block[r0 : r0 + chunk_rows], None if flip is None else flip[r0 : r0 + chunk_rows])
        if kp != k:
            codes = torch.nn.functional.pad(codes, (0, kp - k))
        units = encode_slots(list(group_slots(codes)))
        out[r0 : r0 + chunk_rows] = torch.stack([units & 0xFF, units >> 8], dim=-1).flatten(1).to(torch.uint8)
    scale = magnitude.view(torch.float8_e4m3fn)
    if kp != k:
        scale = torch.cat([scale, scale.new_zeros(scale.shape[0], (kp - k) // nvfp4.BLOCK)], dim=1)
    scale = pair_scales(scale)
    n_pad = -(-n // TILE_ROWS) * TILE_ROWS
    out, scale = out.view(-1, n, kp // 2), scale.reshape(-1, n, kp // nvfp4.BLOCK)
    if n_pad != n:
        out = torch.nn.functional.pad(out, (0, 0, 0, n_pad - n))
        scale = torch.cat([scale, scale.new_zeros(scale.shape[0], n_pad - n, scale.shape[2])], dim=1)
    scale = scale.contiguous()
    for i in range(out.shape[0]):  # one matrix (expert) at a time: the copy stays one matrix's size
        out[i] = tile_k32(out[i])
        scale[i] = tile_k32(scale[i])
    return out.view(*lead, n_pad, kp // 2), scale.view(*lead, n_pad, kp // nvfp4.BLOCK)


def unpack_k32(weight: torch.Tensor, k: int, n: int | None = None) -> torch.Tensor:
    """k32 layout [..., Np, Kp/2] -> e2m1 codes uint8 [..., n, k] (the inverse of `repack_k32`, for
    tests; n defaults to Np, padding rows included)."""
    weight = untile_k32(weight)
    *lead, n_pad, half_kp = weight.shape
    n = n_pad if n is None else n
    weight = weight[..., :n, :]
    w = weight.reshape(-1, half_kp // 2, 2).to(torch.int32)
    units = (w[..., 0] | (w[..., 1] << 8)).view(w.shape[0], -1, 8)  # [rows, group, unit]
    codes = ungroup_slots(torch.stack(decode_slots(units), dim=2))  # [rows, Kp] in element order
    return codes[:, :k].to(torch.uint8).view(*lead, n, k)


def unpack_scales_k32(scale: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """k32 scales [..., Np, Kp/16] (tiled storage, `pair_scales` order) -> block scales [..., n, Kp/16] in
    row-major block order (the inverse of `repack_k32`'s scale side, for tests and references; n defaults
    to Np)."""
    rows = untile_k32(scale)
    rows = unpair_scales(rows.reshape(-1, rows.shape[-1])).view(rows.shape)
    return rows[..., : rows.shape[-2] if n is None else n, :]


def group_slots(codes: torch.Tensor):
    """Codes [rows, Kp] in element order (Kp a multiple of TILE_K) -> the four slots' codes [rows, Kp/32, 8]
    (group, unit): group t of each 128-element tile holds blocks t and t + 4 of the tile, slot j of unit u
    element 64 (j >> 1) + 16 t + 8 (j & 1) + u (`element_of`)."""
    rows, kp = codes.shape
    c = codes.view(rows, kp // TILE_K, 2, 4, 2, 8)  # [rows, tile, j >> 1, t, j & 1, u]
    c = c.permute(0, 1, 3, 2, 4, 5).reshape(rows, kp // GROUP, 4, 8)  # [rows, group, slot, u]
    return c.unbind(2)


def ungroup_slots(slots: torch.Tensor) -> torch.Tensor:
    """The inverse of `group_slots`: [rows, Kp/32, 4 (slot), 8 (unit)] -> codes [rows, Kp] in element order."""
    rows, groups = slots.shape[:2]
    c = slots.reshape(rows, groups // 4, 4, 2, 2, 8).permute(0, 1, 3, 2, 4, 5)
    return c.reshape(rows, groups * GROUP)


def element_of(group: int, slot: int, unit: int) -> int:
    """The element of K (from the start of its 128-element tile, group 0..3 of the tile) that slot `slot`
    of unit `unit` of a k32 group holds: the layout's one definition, as `group_slots` applies it."""
    return 64 * (slot >> 1) + 16 * group + 8 * (slot & 1) + unit


def pair_scales(scale: torch.Tensor) -> torch.Tensor:
    """Block scales [rows, Kp/16] in block order -> k32's order: per 128-element tile the pairs (block t,
    block t + 4), t = 0..3 (group t's two blocks: slots 0 / 1, then 2 / 3). Same shape and dtype."""
    rows, nb = scale.shape
    return scale.view(rows, nb // 8, 2, 4).transpose(2, 3).reshape(rows, nb)


def unpair_scales(scale: torch.Tensor) -> torch.Tensor:
    """The inverse of `pair_scales`: k32-ordered scales [rows, Kp/16] -> block order."""
    rows, nb = scale.shape
    return scale.view(rows, nb // 8, 4, 2).transpose(2, 3).reshape(rows, nb)


def quad_k_units(bq: int) -> torch.Tensor:
    """The k32 unit at each K position of a `perm_k` slot dot of BQ = block_k / 4 units (a multiple of
    64): `triton_k32.quad_k`'s reordering, written as the x-column index `fp4_tile_loop` gathers with.
    Position 16b + 8e + 2t + h of each 64 (a thread t of an MMA quad holds those for all b, e, h) takes
    unit 8g + 2b + h of group g = t * BQ / 32 + 2a + e."""
    if bq % 64:
        raise ValueError(f"perm_k reorders runs of 64 units; BQ={bq}")
    c = torch.arange(bq)
    return (((c // 2) % 4 * (bq // 64) + c // 64) * 2 + (c // 8) % 2) * 8 + (c // 16) % 4 * 2 + c % 2

