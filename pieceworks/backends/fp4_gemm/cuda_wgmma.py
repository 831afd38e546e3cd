"""The NVFP4 GEMM for serving-sized M on Hopper (the "wgmma" tile kind of `fp4_gemm.triton`): k32 weights
decoded in registers straight into the A operand of warpgroup MMAs (wgmma, sm_90a), x brought into shared
memory by TMA as their B operand. This module plans and launches it; its CUDA source is
cuda_wgmma_kernel.py's. Imports torch only.

    y[M, N] = x[M, K] @ dequant(W).T      (x bf16, W in the k32 layout of `k32.repack_k32`)

Each CTA owns 128 weight rows (two storage-tile row blocks, one per warpgroup) and BM tokens (32, 64, 128
or 256, or from 128 up a multiple of 16 fitted to M: `fit_token_tile`), so each decoded weight feeds BM
tokens of tensor-core work; the decode of a wgmma group (one k16 step, or two in tiles of at most 64
tokens) overlaps the wgmmas of the group before (A in two register sets, `wgmma.wait_group 1`).

The A fragment: wgmma m64nNk16 takes A from the registers of the warpgroup's four warps, warp w holding rows
16w..16w+15 in the mma.sync m16n8k16 A layout (lane (g, t): rows g and g + 8, K columns 2t, 2t + 1, 2t + 8,
2t + 9). Lane t reads the 32-bit unit pair t (units 2t, 2t + 1) of each k32 group q of its two rows: its
slot 0 holds elements 16q + 2t, +1 and slot 1 elements 16q + 8 + 2t, +1 (`k32.element_of`), exactly that
lane's columns of the k16 step over elements 16q..16q+15; slots 2 and 3 give the step over elements
64 + 16q... So the MMA's K order is the element order and x needs no permutation.

Per stage (S in flight): x [BM tokens x 128 K] as two TMA boxes of 64 columns in the 128-byte swizzled layout
(zero fill past M and K; the last token tile of M >= BM rows loads the BM rows ending at M instead,
overlapping the tile before it, and stores only its own rows: boxes mostly past M ran slowly), the two 4 KB
unit tiles and the two 512-byte scale tiles by bulk copies (the storage tiles are contiguous), all completing
on the stage's full mbarrier. One thread of a third (producer) warpgroup issues a stage once every consumer
thread arrived on its empty mbarrier (after its warpgroup's wgmmas of that stage): no CTA-wide barrier in the
K loop, the copies of S tiles in flight under the wgmmas. The consumers' K loop has no branch (a branch, or a
register defined while a wgmma that reads it is in flight, makes ptxas serialize every wgmma: its C7513 note)
and a group's decode waits only for the wgmmas two groups back, which read the same registers; `setmaxnreg`
gives the consumers the registers of 256-token tiles. Where the output tiles alone leave SMs idle, blockIdx.z
splits K as far as one round of CTAs holds (`choose_split`) and float32 partials go to a second kernel.
Where nothing splits that way but a last round of tiles would leave SMs idle for longer than partials cost,
one CTA per SM takes an equal share of all tiles' K iterations (stream-K, `stream_k_ctas`): a tile begun
in one CTA and finished in the next ones is summed through a workspace by the CTA that holds its first K
tiles, in K order, with no second kernel. Without a workspace (`stream_k` off, or a graph captured before one
was allocated) such calls run the last round's tiles as a second launch split over K instead (`tail_split`,
`row_blocks`).

The shipped tile table runs it at M = 17..1024 (triton_tiles.py); measured on the H200 against bf16
cuBLAS, the Triton tiles and dequantize + cuBLAS, with the variants that lost (CTA pairs with x by TMA
multicast, persistent CTAs): docs/benchmarks.md.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from pieceworks.backends import nvrtc, pdl
from pieceworks.backends.fp4_gemm.cuda_launch import multiprocessors
from pieceworks.backends.fp4_gemm.cuda_wgmma_kernel import source
from pieceworks.backends.fp4_gemm.k32 import TILE_K, TILE_ROWS

ROWS = 2 * TILE_ROWS  # weight rows per CTA: one storage-tile row block per consumer warpgroup
THREADS = 384  # two consumer warpgroups and a producer warpgroup (one thread of it issues the copies)
BLOCK_MS = (32, 64, 128, 256)  # the token tiles a tile table names
FIT_STEP = 16  # a fitted token tile (`fit_token_tile`) is a multiple of this
MAX_SHARED = 227 * 1024  # dynamic shared memory per block on sm_90
# Stream-K where the last round of output tiles leaves SMs idle for more K tiles per CTA than this
# (`stream_k_ctas`). Fitted to the H200 probe of docs/benchmarks.md ("Stream-K"), forced stream-K against the
# launch without it: level at 4.8 idle K tiles (the expert down at 1024 rows), ahead from 5.8 (q/k/v at 640 rows,
# 128-token tiles; gate/up at 1024, 6.8).
STREAM_K_IDLE = 5
# `token_tile`'s narrow tile where the wide tile's CTAs run at most this many K tiles each, and at most the
# second where the fitted wide tile holds 3 stages. From the H200 A/B of triton_tiles.py's 129..256 bucket: o and
# the expert down (8 K tiles per CTA) gain on the narrow tile at every M of 144-240, q/k/v (16) and the expert
# gate/up (14) only at 208-256 tokens, the down projection (28) nowhere.
NARROW_K_TILES = (8, 16)


def stage_bytes(block_m: int) -> int:
    return block_m * TILE_K * 2 + 2 * TILE_ROWS * 64 + 2 * TILE_ROWS * 8


def max_stages(block_m: int) -> int:
    """The most stages that fit in shared memory (with their two mbarriers each)."""
    return min(8, MAX_SHARED // (stage_bytes(block_m) + 16))


@lru_cache(maxsize=None)
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def tensor_map(x: torch.Tensor, k: int, block_m: int) -> ctypes.Array:
    """CUtensorMap of x [M, k] bf16 (row stride x.stride(0)) for boxes of 64 columns x block_m rows, 128-byte
    swizzle, zero fill out of bounds (the kernel's by-value argument)."""
    lib = _libcuda()
    tm = (ctypes.c_ubyte * 128)()
    dims = (ctypes.c_uint64 * 2)(k, x.shape[0])
    strides = (ctypes.c_uint64 * 1)(x.stride(0) * 2)
    box = (ctypes.c_uint32 * 2)(64, block_m)
    elem = (ctypes.c_uint32 * 2)(1, 1)
    # BFLOAT16 = 9, interleave none, swizzle 128B = 3, L2 promotion 256B = 3, OOB fill zeros = 0
    err = lib.cuTensorMapEncodeTiled(tm, 9, 2, ctypes.c_void_p(x.data_ptr()), dims, strides, box, elem, 0, 3, 3, 0)
    nvrtc._check(lib, err, f"cuTensorMapEncodeTiled for x {tuple(x.shape)} stride {x.stride(0)}")
    return tm


def unsupported(x: torch.Tensor) -> str | None:
    """Why the wgmma GEMM can't take x, or None."""
    if x.device.type != "cuda":
        return f"the wgmma GEMM runs on CUDA devices, not {x.device.type}"
    if x.dtype != torch.bfloat16:
        return f"the wgmma GEMM takes bf16 x, not {x.dtype}"
    return device_reason(x.device)


@lru_cache(maxsize=None)
def device_reason(device: torch.device) -> str | None:
    """Why the wgmma GEMM can't run on `device` (a CUDA device), or None."""
    cap = torch.cuda.get_device_capability(device)
    if cap != (9, 0):
        return f"the wgmma GEMM is built for sm_90a (Hopper); this GPU is sm_{cap[0]}{cap[1]}"
    return nvrtc.unavailable_reason()


def gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
         n: int, k: int, block_m: int = 128, stages: int | None = None, swiglu: bool = False,
         out: torch.Tensor | None = None, split: int = 1, row_blocks: tuple[int, int] | None = None,
         stream_k: int = 0, workspace: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """y [M, n] bf16 = x [M, k] @ dequant(W).T for a k32-layout weight (uint8 [Np, Kp/2], scales
    [Np, Kp/16], `repack_k32`) and its global scale (float32 scalar tensor); with `swiglu` (a gate/up
    weight whose rows are interleaved, `interleave_gate_up`) [M, n / 2] = silu(gate) * up, rounded as the
    GEMM followed by the silu_mul op. With split > 1: the float32 partials [split, M, n] of K splits
    (`out`, if given, must be that), for a reduction kernel to sum. row_blocks (first, count): only W's
    rows [128 first, 128 (first + count)) (clipped to n); split partials are then [split, M, those rows].
    stream_k > 0: that many CTAs share the tiles' K iterations evenly (stream-K, the kernel's comment),
    with `workspace` = (float32 partials of at least `workspace_floats(stream_k)`, int32 flags of at
    least one per output tile, zeros, which every call leaves zero); calls sharing a workspace must not
    run concurrently. Some CTAs wait for others: every CTA must be resident at once (at most one per SM,
    and no other stream's kernels holding SMs while they wait for this one)."""
    if not valid_block_m(block_m):
        raise ValueError(f"block_m={block_m}: a multiple of {FIT_STEP} from 32 to 256 (tokens per CTA)")
    stages = stages or max_stages(block_m)
    if not 2 <= stages <= max_stages(block_m):
        raise ValueError(f"stages={stages}: 2..{max_stages(block_m)} fit in shared memory at block_m={block_m}")
    if split > 1 and swiglu:
        raise ValueError("split partials are summed by a second kernel, which applies the SwiGLU")
    if split > 1 and stream_k:
        raise ValueError("split and stream_k: a stream-K launch splits K itself")
    m = x.shape[0]
    if x.stride(-1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:  # what TMA needs of x
        x = x.contiguous()
    first, count = row_blocks or (0, -(-n // ROWS))
    if out is None:
        shape = (split, m, min(n, ROWS * (first + count)) - ROWS * first) if split > 1 else (m, n // 2 if swiglu else n)
        out = torch.empty(shape, dtype=torch.float32 if split > 1 else torch.bfloat16, device=x.device)
    if m == 0:
        return out
    np_, kp = weight.shape[0], weight.shape[1] * 2
    gx = -(-m // block_m)
    if stream_k:
        sms = multiprocessors(x.device)
        if stream_k > sms:
            raise ValueError(f"stream_k={stream_k}: at most one CTA per SM ({sms}): its waits need every CTA "
                             "resident")
        work, flags = workspace
        if work.numel() < workspace_floats(stream_k, block_m) or flags.numel() < gx * count:
            raise ValueError(f"the stream-K workspace ({work.numel()} floats, {flags.numel()} flags) is smaller than "
                             f"{stream_k} CTAs of block_m={block_m} over {gx * count} tiles need")
        grid = (stream_k, 1, 1)
    else:
        work = flags = out  # not read
        grid = (gx, count, split)
    kern = nvrtc.kernel(source(block_m), f"fp4_wgmma_tma<{block_m}, {stages}, {int(swiglu)}, {int(split > 1)}, "
                        f"{int(stream_k > 0)}>", x.device, suffix="a")
    kern(grid, (THREADS, 1, 1),
         [tensor_map(x, k, block_m), weight, weight_scale, weight_scale_2, out, m, n, kp // TILE_K,
          np_ // TILE_ROWS, out.stride(-2), first, gx, gx * count, work, flags], pdl.launch_options(x.device)[0],
         shared=stages * stage_bytes(block_m) + 16 * stages)
    return out


def workspace_floats(ctas: int, block_m: int = 256) -> int:
    """float32 elements of the stream-K partials of `ctas` CTAs (one tile slot each)."""
    return ctas * ROWS * block_m


def _most_splits(ctas: int, kp: int, sms: int) -> int:
    """The most K splits (at most 4, each at least 8 K tiles) that keep ctas x splits CTAs in one round."""
    return max([s for s in range(2, min(4, kp // TILE_K // 8) + 1) if ctas * s <= sms], default=1)


@lru_cache(maxsize=None)
def plan(m: int, n: int, kp: int, block_m: int, stages: int, narrow_block_m: int = 0,
         sms: int = 132) -> tuple[int, int, int, tuple[int, int], int]:
    """How a call of m rows runs: (token tile, stages, K splits, (row blocks, K splits) of the tail launch,
    stream-K CTAs), from `token_tile` and `fit_token_tile`, `choose_split`, without splits `tail_split`, and
    `stream_k_ctas` (which, where nonzero, replaces the splits and the tail launch whenever a stream-K
    workspace is at hand).
    Cached: an eager call (no graph) asks on every launch."""
    bm, st = token_tile(m, n, kp, block_m, stages, narrow_block_m, sms)
    fit = fit_token_tile(m, bm)
    if fit != bm:  # the same tiles, each with fewer padded rows, and the stages that the smaller tile fits
        bm, st = fit, max_stages(fit) if st == max_stages(bm) else st
    split = choose_split(m, n, kp, bm, sms)
    if split > 1:
        return bm, st, split, (0, 1), 0
    return bm, st, split, tail_split(m, n, kp, bm, sms), stream_k_ctas(m, n, kp, bm, sms)


def stream_k_ctas(m: int, n: int, kp: int, block_m: int, sms: int = 132) -> int:
    """CTAs of a stream-K launch (one per SM) where the output tiles' last round would leave SMs idle for
    more than STREAM_K_IDLE K tiles per CTA (about what the partials and the waits cost), else 0."""
    tiles, nkt = -(-m // block_m) * -(-n // ROWS), kp // TILE_K
    idle = (-(-tiles // sms) - tiles / sms) * nkt  # K tiles per SM the last round leaves idle
    return sms if idle > STREAM_K_IDLE and tiles * nkt >= sms else 0


def token_tile(m: int, n: int, kp: int, block_m: int, stages: int, narrow_block_m: int = 0,
               sms: int = 132) -> tuple[int, int]:
    """(block_m, stages) of a call: the bucket's tile, or where the bucket names a narrower tile
    (`narrow_block_m`), that one with its most stages where one token tile covers m, its grid holds fewer
    CTAs than the SMs, and the wide tile's CTAs would run short K loops: at most NARROW_K_TILES[0] K tiles
    each after `choose_split`, or at most NARROW_K_TILES[1] where the fitted wide tile holds 3 stages
    (208-256 tokens). The narrow tile reads and decodes every weight twice for twice the CTAs and half the
    K splits: q/k/v, o and the expert shapes at 240 rows ran 1.06-1.23x faster on it, the down projection
    (28 K tiles per CTA) 1.05-1.24x slower at 144-240 rows, q/k/v and the expert gate/up 1.03-1.08x slower
    at 144-176 (docs/benchmarks.md, "Narrow token tiles"). Past one tile the wide tile stays: `fit_token_tile` leaves it at most 15 padded
    rows per tile, and it reads the weights fewer times (M = 288: two 144-token tiles ran 1.10-1.28x faster
    than three 96-token ones)."""
    if not narrow_block_m or m > block_m or -(-n // ROWS) >= sms:
        return block_m, stages
    fit = fit_token_tile(m, block_m)
    k_tiles = kp // TILE_K // choose_split(m, n, kp, fit, sms)
    short, short_3_stages = NARROW_K_TILES
    if k_tiles <= short or (k_tiles <= short_3_stages and max_stages(fit) <= 3):
        return narrow_block_m, max_stages(narrow_block_m)
    return block_m, stages


def fit_token_tile(m: int, block_m: int) -> int:
    """The token tile that covers m rows in as many tiles as block_m does, with the fewest padded rows: the
    tile size rounded up to FIT_STEP tokens (wgmma's N takes any multiple of 8 up to 256). Only for
    block_m >= 128, where a tile's padded rows cost tensor-core work (M = 288 on 128-token tiles: 384
    rows of MMA, on 96-token tiles 288); smaller tiles are bound by the weights' bytes, and each tile size
    is one more NVRTC compile."""
    if block_m < 128:
        return block_m
    tiles = -(-m // block_m)
    fit = max(32, -(-(-(-m // tiles)) // FIT_STEP) * FIT_STEP)
    return fit if fit < block_m and -(-m // fit) == tiles else block_m


def valid_block_m(block_m: int) -> bool:
    """A token tile the kernel is built for: a multiple of 16 from 32 to 256 (BLOCK_MS and fitted tiles)."""
    return 32 <= block_m <= 256 and block_m % FIT_STEP == 0


def choose_split(m: int, n: int, kp: int, block_m: int, sms: int = 132) -> int:
    """K splits of the kernel where its output tiles alone leave SMs idle: the most that still fit one
    round (one CTA per SM), since a second, partly filled round costs as much as the first."""
    return _most_splits(-(-m // block_m) * -(-n // ROWS), kp, sms)


def tail_split(m: int, n: int, kp: int, block_m: int, sms: int = 132) -> tuple[int, int]:
    """(row blocks, splits) of a second launch for the output tiles of a last round that would leave more
    than half of the SMs idle: the last row blocks (enough to hold that round's tiles) split over K, the
    rest one launch without splits; (0, 1) where no such round exists or it cannot be split."""
    gx, gy = -(-m // block_m), -(-n // ROWS)
    rem = gx * gy % sms
    if gx * gy <= sms or rem == 0 or rem > sms // 2:
        return 0, 1
    ty = -(-rem // gx)
    splits = _most_splits(gx * ty, kp, sms)
    return (ty, splits) if splits > 1 else (0, 1)
