"""triton_k32.py's claim that no layout of a 32-bit pair of k32 units decodes every slot with one shift
(or rotation) and one mask: the four bf16x2 outputs need sign, E1, E0 and m at bits 15, 8, 7, 6 of both
halves (the 0x81C081C0 mask), so four shift amounts would have to take the word's 32 bits, each once."""

from __future__ import annotations

import itertools

K32_TARGETS = [15, 8, 7, 6, 31, 24, 23, 22]  # sign, E1, E0, m of both bf16 halves
FULL = (1 << 32) - 1


def tilings(targets: list[int]) -> tuple[list, list]:
    """Sets of four shift amounts (source bit = target - amount, inside the word) and of four rotation
    amounts whose source bits cover all 32 bits of the word (8 targets x 4 = 32: each bit once)."""
    def bits(sources):
        return sum(1 << b for b in sources)

    shift = {a: bits(t - a for t in targets) for a in range(-31, 32) if all(0 <= t - a < 32 for t in targets)}
    rotate = {a: bits((t - a) % 32 for t in targets) for a in range(32)}
    found = []
    for masks in (shift, rotate):
        found.append([c for c in itertools.combinations(masks, 4)
                      if masks[c[0]] | masks[c[1]] | masks[c[2]] | masks[c[3]] == FULL])
    return found[0], found[1]


def test_the_search_finds_a_tiling_where_one_exists():
    # nibble-aligned targets (bits 3..0 of both halves' low bytes) are tiled by shifts 0, -4, -8, -12
    shifts, rotations = tilings([3, 2, 1, 0, 19, 18, 17, 16])
    assert (-12, -8, -4, 0) in shifts and rotations


def test_no_k32_layout_decodes_every_slot_with_one_shift_and_one_mask():
    assert tilings(K32_TARGETS) == ([], [])
