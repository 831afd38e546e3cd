"""Weight-only NVFP4 GEMM in Triton (w4a16), for GPUs without FP4 tensor cores (Hopper, Ampere).

Weights stay 4-bit in memory and are dequantized in registers right before bf16 tensor-core dots,
so decode reads 0.5625 bytes per weight instead of bf16's 2. At load, `prepare` repacks them into the
"k32" layout (k32.py; decoded by triton_k32.py), which lets one 32-bit register op decode two
values. The tile configuration is picked per call from a table tuned on an H200 (`triton_tiles.py`),
by row count: split-K decode tiles for small M so every SM streams weights, from 17 to 1024 rows on
sm_90 the CUDA wgmma kernel (cuda_wgmma.py: the same k32 weights decoded into the register operand of
warpgroup MMAs, x by TMA), and above that a "dequant" entry that writes a transient bf16 copy of the
weight (N x K x 2 bytes) and calls torch.matmul. Where the wgmma kernel can't run, its buckets take the
tiles they replaced (`WGMMA_FALLBACK_TILES`). Nothing is autotuned at run time, so the kernels are safe
inside CUDA graphs.

Up to `cuda_decode_max_m` rows (default 16), on compute capability >= 9.0 with NVRTC loadable, the same
k32 weights go to the CUDA decode kernel instead (cuda_decode.py, `layout="k32"`; the SwiGLU and rope
epilogues included): on the H200 it takes the batch-1 Llama-3.1-8B-shaped decode step from 2.15 ms (the
Triton tiles) to 1.73-1.79 ms (docs/benchmarks.md), and, because the k32 groups hold blocks t and t + 4
(triton_k32.py), it beats the Triton tiles at 9..16 rows too.

This module imports torch only; triton is imported when a kernel is first launched.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from pieceworks.backends.base import ALL_GRAPH_MODES, Requirements
from pieceworks.backends.fp4_gemm import cuda_wgmma
from pieceworks.backends.fp4_gemm.base import Fp4GemmBackend, Fp4Weight
from pieceworks.backends.fp4_gemm.cuda_launch import (
    K32_TWO_TILE_WARPS_PER_SM,
    cuda_decode_reason,
    multiprocessors,
    plan,
)
from pieceworks.backends.fp4_gemm.interleave import interleave_gate_up, interleave_rope_rows
from pieceworks.backends.fp4_gemm.k32 import TILE_K, repack_k32
from pieceworks.backends.fp4_gemm.triton_tiles import FP4_GEMM_TILES, WGMMA_FALLBACK_TILES

COUNTERS = 1 << 14  # split-K arrival counters per backend instance and device (output tiles of one call)


@dataclass(frozen=True)
class TileConfig:
    """One bucket of a tile table (see triton_tiles.py for the meaning of each field)."""

    max_m: int | None = None
    kind: str = "fused"
    block_m: int = 16
    block_n: int = 64
    block_k: int = 256
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3
    w_as_a: bool = True
    asm: bool = True
    one_dot: bool = False
    target_ctas: int = 0
    max_split: int = 1
    two_acc: bool = False
    perm_k: bool = False
    balance_waves: bool = False
    min_split_iters: int = 2
    narrow_block_m: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("fused", "dequant", "wgmma"):
            raise ValueError(f"tile kind {self.kind!r}: use 'fused', 'dequant' or 'wgmma'")
        if self.kind == "wgmma":
            if self.block_m not in cuda_wgmma.BLOCK_MS:
                raise ValueError(f"a wgmma tile takes block_m in {cuda_wgmma.BLOCK_MS} (tokens per CTA), "
                                 f"not {self.block_m}")
            if not 2 <= self.num_stages <= cuda_wgmma.max_stages(self.block_m):
                raise ValueError(f"a wgmma tile of block_m={self.block_m} takes num_stages 2.."
                                 f"{cuda_wgmma.max_stages(self.block_m)} (shared memory), not {self.num_stages}")
            if self.narrow_block_m and not (self.narrow_block_m in cuda_wgmma.BLOCK_MS
                                            and self.narrow_block_m < self.block_m):
                raise ValueError(f"narrow_block_m={self.narrow_block_m}: 0 or a wgmma token tile in "
                                 f"{cuda_wgmma.BLOCK_MS} below block_m={self.block_m}")
        elif self.narrow_block_m:
            raise ValueError("narrow_block_m is an option of wgmma tiles")
        if self.two_acc and self.one_dot:
            raise ValueError("two_acc splits the four-dot K loop; it cannot be combined with one_dot")
        if self.perm_k and (self.one_dot or self.block_k % 256):
            raise ValueError("perm_k reorders the four-dot K loop's slots in runs of 64 units: it needs "
                             f"one_dot=False and block_k a multiple of 256 (got one_dot={self.one_dot}, "
                             f"block_k={self.block_k})")
        if self.block_k % TILE_K:
            raise ValueError(f"block_k={self.block_k} must be a multiple of {TILE_K} (the weights' storage tiles)")


def parse_table(rows: list[dict]) -> tuple[TileConfig, ...]:
    table = tuple(TileConfig(**row) for row in rows)
    bounds = [t.max_m for t in table]
    if not table or bounds[-1] is not None or any(b is None for b in bounds[:-1]):
        raise ValueError("a tile table needs ascending max_m buckets ending with max_m=None")
    if bounds[:-1] != sorted(bounds[:-1]):
        raise ValueError(f"tile table buckets out of order: {bounds}")
    return table


@dataclass(frozen=True)
class TritonTileOptions:
    """`backends.options.triton` (the Triton NVFP4 GEMM and MoE backends): tile tables to use instead of
    the shipped ones, which were tuned on an H200 (triton_tiles.py), e.g. after a sweep on another GPU.
    Each is the path of a JSON file holding a table (a list of buckets with the keys of triton_tiles.py)
    or an object with a "table" list: what `python benchmarks/fp4_gemm.py --sweep --out DIR` writes to
    DIR/gemm_sweep.json and `python benchmarks/moe.py --sweep --out DIR` to DIR/moe_bench.json."""

    gemm_tiles: str | None = None
    """The dense GEMM's table (fp4_gemm.triton), in place of FP4_GEMM_TILES."""

    moe_tiles: str | None = None
    """The fused MoE's grouped GEMMs' table (moe.triton), in place of MOE_TILES."""

    cuda_decode_max_m: int = 16
    """The dense GEMM (fp4_gemm.triton) runs up to this many rows of x with the CUDA decode kernel on the same
    k32 weights (cuda_decode.py, `layout="k32"`) where it runs: compute capability >= 9.0, NVRTC loadable,
    bf16 x; elsewhere, and above it, the Triton kernels. 0: never. On the H200 it is faster than the Triton
    decode tiles at M <= 16 on every Llama-3.1-8B and DeepSeek-V3 expert shape (docs/benchmarks.md)."""

    cuda_moe_max_t: int = 128
    """The fused MoE (moe.triton) runs its experts for up to this many tokens with the CUDA decode kernel's
    MoE modes on the same k32 experts (`moe.cuda_experts.grouped_experts`) where it runs (as above); above
    it, the Triton grouped GEMMs. 0: never. Each block of 8 (token, slot) pairs reads its expert once, so the CUDA
    path suits decode batches: on the H200, one DeepSeek-V3 layer is faster with it from 1 to 128 tokens,
    1-4% slower at 192 and 24-28% slower at 256 (docs/benchmarks.md)."""

    stream_k: bool = True
    """The dense GEMM's wgmma kernel (M = 17..1024 on sm_90) runs stream-K launches where
    `cuda_wgmma.stream_k_ctas` picks them (up to 20% faster there on the H200, docs/benchmarks.md): one CTA per SM,
    some waiting on flags that others raise, so every CTA must be resident at once. false where that cannot be
    promised (kernels of another process or stream holding SMs while they wait for this GEMM's results): K
    splits and tail launches serve those calls instead."""

    def __post_init__(self) -> None:
        if not isinstance(self.stream_k, bool):
            raise ValueError(f"backends.options.triton.stream_k={self.stream_k!r}: use true or false")
        if isinstance(self.cuda_decode_max_m, bool) or not isinstance(self.cuda_decode_max_m, int) \
                or not 0 <= self.cuda_decode_max_m <= 16:
            raise ValueError(f"backends.options.triton.cuda_decode_max_m={self.cuda_decode_max_m!r}: use 0 (never) "
                             "to 16 (the CUDA decode kernel's rows per launch)")
        if isinstance(self.cuda_moe_max_t, bool) or not isinstance(self.cuda_moe_max_t, int) \
                or not 0 <= self.cuda_moe_max_t <= 1024:
            raise ValueError(f"backends.options.triton.cuda_moe_max_t={self.cuda_moe_max_t!r}: use 0 (never) to "
                             "1024 tokens")


def load_tile_table(path: str, option: str) -> tuple[TileConfig, ...]:
    """The tile table in the JSON file `path` (`TritonTileOptions`); ValueError naming the option, the
    file and what is wrong with it."""
    where = f"backends.options.triton.{option}"
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"{where}: cannot read {path!r} ({e.strerror or e})") from None
    except ValueError as e:
        raise ValueError(f"{where}: {path!r} is not JSON ({e})") from None
    rows = raw.get("table") if isinstance(raw, dict) else raw
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{where}: {path!r} holds no tile table: give a list of buckets (objects with the "
                         "keys of triton_tiles.py, the last with max_m null) or an object with a 'table' list")
    try:
        return parse_table(rows)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {path!r}: {e}") from None


def select_tile(table: tuple[TileConfig, ...], m: int) -> TileConfig:
    """The first bucket whose max_m >= m."""
    for tile in table:
        if tile.max_m is None or m <= tile.max_m:
            return tile
    raise AssertionError("unreachable: the last bucket is unbounded")


def choose_split_k(tile: TileConfig, m: int, n: int, k_padded: int, sms: int = 132) -> int:
    """K splits so that about `target_ctas` programs stream the weight: ceil(target / tiles), at most
    `max_split` and the BLOCK_K iterations over `min_split_iters` (every split keeps that many or
    more). Splits need not divide the iterations: their ranges differ by at most one iteration.

    With `balance_waves`, the split is the one (of those giving at least 3/4 of target_ctas
    programs) whose programs spread most evenly over `sms` multiprocessors: the largest
    (P / sms) / ceil(P / sms) for P programs, ties going to the plain choice, then to fewer splits
    (qkv of Llama-3.1-8B at M = 1: 96 tiles; 3 splits put 3 programs on some SMs and 2 on most, 4
    splits about 3 on each)."""
    if tile.kind != "fused" or tile.target_ctas <= 0:
        return 1
    tiles = -(-m // tile.block_m) * -(-n // tile.block_n)
    if tiles >= tile.target_ctas:
        return 1
    iters = k_padded // tile.block_k
    cap = max(1, min(iters // tile.min_split_iters, tile.max_split))
    plain = max(1, min(-(-tile.target_ctas // tiles), cap))
    if not tile.balance_waves:
        return plain

    def evenness(s: int) -> float:
        waves = tiles * s / sms
        return round(waves / -(-tiles * s // sms), 2)

    splits = [s for s in range(1, cap + 1) if 4 * tiles * s >= 3 * tile.target_ctas] or [plain]
    return max(splits, key=lambda s: (evenness(s), s == plain, -s))


TRITON_REQUIREMENTS = Requirements(
    devices=("cuda",), min_capability=(8, 0), modules=("triton",), install_hint="pip install triton",
)


class TritonFp4GemmBackend(Fp4GemmBackend):
    name = "triton"
    priority = 50
    graph_modes = ALL_GRAPH_MODES
    requires = TRITON_REQUIREMENTS
    numerics = ("w4a16",)
    weight_layout = "k32"
    fuses_qkv_rope = True
    Options = TritonTileOptions
    description = ("Triton w4a16: NVFP4 dequantized in registers, bf16 tensor cores (M <= cuda_decode_max_m on "
                   "sm_90+: the CUDA decode kernel on the same weights)")

    def __init__(self, spec, options=None) -> None:
        super().__init__(spec, options)
        path = self.options.gemm_tiles
        self.table = load_tile_table(path, "gemm_tiles") if path else parse_table(FP4_GEMM_TILES)
        self._plan = lru_cache(maxsize=None)(self._plan_uncached)
        self.wgmma_fallback = parse_table(WGMMA_FALLBACK_TILES)
        self._counters: dict[torch.device, torch.Tensor] = {}
        self._stream_k: dict[torch.device, torch.Tensor] = {}

    def prepare(self, w: Fp4Weight) -> Fp4Weight:
        weight, scale = repack_k32(w.weight, w.weight_scale)
        if weight.is_cuda:
            self.counters(weight.device)
            self.stream_k_workspace(weight.device)
        return Fp4Weight(weight, scale, w.weight_scale_2.float().reshape(()), w.input_scale)

    def prepare_gate_up(self, w: Fp4Weight) -> Fp4Weight:
        """`prepare` with the rows interleaved (`interleave_gate_up`) for `forward_swiglu`."""
        return self._prepare_rows(w, interleave_gate_up(w.weight.shape[0]))

    def qkv_rope_supported(self, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        """Head dims of 2 x a power of two: the rope kernel that follows the larger tiles needs it."""
        half = head_dim // 2
        return head_dim % 2 == 0 and half >= 1 and half & (half - 1) == 0

    def prepare_qkv_rope(self, w: Fp4Weight, num_heads: int, num_kv_heads: int, head_dim: int) -> Fp4Weight:
        """`prepare` with each q/k head's rope pairs side by side (`interleave_rope_rows`) for
        `forward_qkv_rope`."""
        return self._prepare_rows(w, interleave_rope_rows(num_heads, num_kv_heads, head_dim))

    def counters(self, device: torch.device) -> torch.Tensor | None:
        """This instance's split-K arrival counters on `device` (zeros; every call leaves them zero).

        Allocated at `prepare` (or the first call outside a CUDA-graph capture: a zeroing recorded
        into a graph would not run before the first replay); None while capturing without them, and
        the call then reduces with a second kernel. One instance serves one executor, whose calls run
        in order on one stream; concurrent calls must not share the counters.
        """
        counters = self._counters.get(device)
        if counters is None and not torch.cuda.is_current_stream_capturing():
            counters = self._counters[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
        return counters

    def stream_k_workspace(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This instance's stream-K workspace on `device` for the wgmma kernel (`cuda_wgmma.gemm`): float32
        partials for one CTA per SM (17 MB on 132 SMs) and `counters` as the flags; allocated like the
        counters, and only where the wgmma kernel runs (None elsewhere, with `stream_k` off, or while capturing
        without it: the calls then take their splits and tail launches)."""
        if not self.options.stream_k:
            return None
        work = self._stream_k.get(device)
        if work is None:
            if cuda_wgmma.device_reason(device) is not None or torch.cuda.is_current_stream_capturing():
                return None
            work = self._stream_k[device] = torch.empty(
                cuda_wgmma.workspace_floats(multiprocessors(device)), dtype=torch.float32, device=device)
        counters = self.counters(device)
        return None if counters is None else (work, counters)

    def plan(self, x: torch.Tensor, n: int, k_padded: int) -> tuple[TileConfig, int]:
        """(tile, K splits) of the Triton-side call for x: the table's bucket, or where it is a wgmma bucket
        that can't run for x (`cuda_wgmma.unsupported`), the bucket of WGMMA_FALLBACK_TILES."""
        sms = multiprocessors(x.device)
        tile, split_k = self._plan(x.shape[0], n, k_padded, sms)
        if tile.kind == "wgmma" and cuda_wgmma.unsupported(x):
            return self._plan(x.shape[0], n, k_padded, sms, fallback=True)
        return tile, split_k

    def _plan_uncached(self, m: int, n: int, k_padded: int, sms: int = 132,
                       fallback: bool = False) -> tuple[TileConfig, int]:
        tile = select_tile(self.wgmma_fallback if fallback else self.table, m)
        return tile, choose_split_k(tile, m, n, k_padded, sms)

    def forward(self, x, weight, weight_scale, weight_scale_2, input_scale, out_features):
        return self._gemm(x, weight, weight_scale, weight_scale_2, out_features, swiglu=False)

    def forward_qkv_rope(self, x, weight, weight_scale, weight_scale_2, input_scale, cos, sin, num_heads,
                         num_kv_heads, head_dim):
        """The GEMM with the rope of the q and k columns in its epilogue (split-K: in the reduction), each
        pair's two columns side by side in the tile, for the 8-row decode tiles and wgmma calls split over K;
        other tiles and the dequant path run the GEMM and then the rope kernel in place (its interleaved mode
        reads the pairs side by side and writes them back in checkpoint order). Same bits as `forward` followed
        by the rope_qk op wherever every column takes the same K split (a wgmma tail launch splits its last row
        blocks only, which hold other columns in the two row orders; stream-K splits each 128-row tile at its
        own K tiles, and the rope order moves rows within a head, inside one tile, so it keeps the bits)."""
        n = (num_heads + 2 * num_kv_heads) * head_dim
        rope = (cos, sin, (num_heads + num_kv_heads) * head_dim, head_dim)
        return self._gemm(x, weight, weight_scale, weight_scale_2, n, swiglu=False, rope=rope)

    def forward_swiglu(self, x, weight, weight_scale, weight_scale_2, input_scale, intermediate):
        """The GEMM with silu(gate) * up in its epilogue (split-K: in the reduction), the gate/up
        pairs of a tile side by side; the dequant path (M > 1024 in the shipped table) restores the
        checkpoint row order as it dequantizes and runs the silu_mul kernel after the matmul. Same bits
        as `forward` on this weight followed by the silu_mul op on its gate / up columns; as `forward` on
        the checkpoint-order weight too wherever every column takes the same K split (see
        `forward_qkv_rope`; the interleave moves rows across tiles, so not under stream-K)."""
        return self._gemm(x, weight, weight_scale, weight_scale_2, 2 * intermediate, swiglu=True)

    def _gemm(self, x, weight, weight_scale, weight_scale_2, n: int, swiglu: bool, rope=None):
        if x.dim() != 2 or x.shape[1] > weight.shape[-1] * 2 or n > weight.shape[-2]:
            raise ValueError(f"x {tuple(x.shape)} and N = {n} do not match the prepared weight ({weight.shape[-2]} rows "
                             f"x {weight.shape[-1] * 2} columns, padded to 64 x 512): was it prepared for another layer?")
        if x.shape[0] <= self.options.cuda_decode_max_m and cuda_decode_reason(x) is None:
            from pieceworks.backends import pdl
            from pieceworks.backends.fp4_gemm import cuda_decode

            per_sm = K32_TWO_TILE_WARPS_PER_SM if x.shape[0] > 8 else 32
            warps, depth = plan(weight.shape[0], multiprocessors(x.device), per_sm)
            return cuda_decode.decode_gemm(x, weight, weight_scale, weight_scale_2, n, warps, depth, swiglu,
                                           pdl.enabled(x.device), rope=rope, layout="k32")
        from pieceworks.backends.fp4_gemm import triton_kernels

        if x.stride(-1) != 1:
            x = x.contiguous()
        tile, split_k = self.plan(x, n, weight.shape[1] * 2)
        counters = self.counters(x.device) if split_k > 1 else None
        workspace = self.stream_k_workspace(x.device) if tile.kind == "wgmma" else None
        return triton_kernels.fp4_gemm(x, weight, weight_scale, weight_scale_2, n, x.shape[1], tile,
                                       split_k, counters, swiglu=swiglu, rope=rope, workspace=workspace)
