"""Sharding rules: which part of every weight a rank holds.

A rank holds chunk `index` of `count` equal chunks along one dimension of a full (checkpoint-shaped)
tensor: `Part`. Column-parallel linears split their output rows (dim 0), row-parallel ones their input
columns (dim 1; NVFP4 packed codes and block scales split along the same dimension, so a rank's block
scales travel with its codes and the per-tensor scales stay whole). KV heads split like query heads
when there are at least as many as ranks; with fewer, N / Hkv ranks share each KV head (a replicated
head: the rank reads the head its query heads use).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pieceworks.errors import ConfigError


@dataclass(frozen=True)
class Part:
    """Chunk `index` of `count` equal chunks of dimension `dim` of a full tensor."""

    dim: int
    index: int
    count: int

    def bounds(self, full: int) -> tuple[int, int]:
        """[start, stop) of the chunk in a dimension of length `full` (a multiple of count)."""
        assert full % self.count == 0, f"{full} does not split into {self.count} chunks"
        size = full // self.count
        return self.index * size, (self.index + 1) * size

    def full_shape(self, local: tuple[int, ...]) -> tuple[int, ...]:
        """The full tensor's shape for a chunk of shape `local`."""
        shape = list(local)
        shape[self.dim] *= self.count
        return tuple(shape)

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """The chunk of a full tensor `t` (a view)."""
        start, stop = self.bounds(t.shape[self.dim])
        return t.narrow(self.dim, start, stop - start)


@dataclass(frozen=True)
class TPLayout:
    """This rank's place in the tensor-parallel group.

    Attributes:
        rank, size: this rank and the number of ranks.
        group: name of the process group the model's collectives run on; None where the model runs
            no collectives (size 1, or a shard built for inspection without a process group).
        expert_parallel: MoE layers hold whole experts (E / size each) instead of slices of all.
    """

    rank: int = 0
    size: int = 1
    group: str | None = None
    expert_parallel: bool = False

    @property
    def sharded(self) -> bool:
        return self.size > 1

    def split(self, dim: int) -> Part | None:
        """This rank's chunk of a dimension split over all ranks; None at size 1 (the whole tensor)."""
        return Part(dim, self.rank, self.size) if self.sharded else None

    def kv_split(self, num_kv_heads: int, dim: int = 0) -> Part | None:
        """This rank's KV heads: 1/size of them, or the one head its query heads use when there are
        fewer KV heads than ranks."""
        if not self.sharded:
            return None
        if num_kv_heads >= self.size:
            return Part(dim, self.rank, self.size)
        return Part(dim, self.rank * num_kv_heads // self.size, num_kv_heads)

    def local_kv_heads(self, num_kv_heads: int) -> int:
        return max(1, num_kv_heads // self.size)

    def expert_range(self, num_experts: int) -> tuple[int, int]:
        """[first, stop) of the routed experts this rank holds (all of them without expert parallel)."""
        if not (self.sharded and self.expert_parallel):
            return 0, num_experts
        n = num_experts // self.size
        return self.rank * n, (self.rank + 1) * n


def require_divisible(key: str, value: int, size: int, what: str) -> None:
    """ConfigError unless `size` ranks split `value` evenly (`key` names the model field)."""
    if value % size:
        raise ConfigError(f"parallel.tensor_parallel_size: {size} does not divide {key}={value} ({what}); "
                          f"use a tensor_parallel_size that divides {value}")


def require_kv_heads(num_kv_heads: int, size: int) -> None:
    """KV heads split evenly (Hkv % N == 0) or are shared evenly (N % Hkv == 0)."""
    if num_kv_heads % size and size % num_kv_heads:
        raise ConfigError(f"parallel.tensor_parallel_size: {size} neither divides num_key_value_heads="
                          f"{num_kv_heads} nor is a multiple of it; KV heads are split evenly or shared by "
                          "equal numbers of ranks")


def require_fp4_block(key: str, local: int, size: int, block: int = 16) -> None:
    """An NVFP4 row-parallel linear's local input width must hold whole 16-element blocks."""
    if local % block:
        raise ConfigError(f"parallel.tensor_parallel_size: {size} leaves {local} input columns of {key} per "
                          f"rank, not a multiple of the NVFP4 block ({block}); use fewer ranks")
