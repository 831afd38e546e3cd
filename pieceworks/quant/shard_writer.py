"""Write a safetensors checkpoint tensor by tensor, in shards of bounded size.

`safetensors.torch.save_file` needs every tensor of a file in memory at once. The quantizer knows
every output tensor's name, dtype and shape before it computes any of them, so this writer lays the
files out up front (headers with final offsets, shards assigned in the order tensors will be
produced) and writes each tensor's bytes at its offset as soon as it exists. Memory stays at one
tensor; the files are byte-compatible with safetensors (little-endian, header padded to 8 bytes,
tensors within a file ordered by decreasing element size so every tensor is aligned).

Files are written under temporary names and renamed when `close` has checked that every planned
tensor was written, so an interrupted run never leaves a checkpoint that looks complete.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_CODES = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


@dataclass(frozen=True)
class TensorSpec:
    """One output tensor: name, dtype, shape (known before its values are)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


class ShardedWriter:
    """Plan shards for `specs` (in production order) and accept their tensors one at a time.

    Args:
        out_dir: an existing directory.
        specs: every tensor that will be written, in the order they will be produced.
        max_shard_bytes: a shard is closed before it would exceed this many bytes of tensor data
            (a single larger tensor gets a shard of its own).

    Files: `model.safetensors` when everything fits one shard, else
    `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`, named as `transformers`
    names them.
    """

    def __init__(self, out_dir: Path, specs: list[TensorSpec], max_shard_bytes: int):
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.out_dir = Path(out_dir)
        shards: list[list[TensorSpec]] = [[]]
        size = 0
        for spec in specs:
            if spec.dtype not in _CODES:
                raise ValueError(f"{spec.name}: dtype {spec.dtype} cannot be stored in safetensors here")
            if shards[-1] and size + spec.nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(spec)
            size += spec.nbytes
        n = len(shards)
        self.filenames = (
            [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        )
        self._where: dict[str, tuple[int, int, TensorSpec]] = {}  # name -> (shard, absolute offset, spec)
        self._written: set[str] = set()
        self._total = sum(s.nbytes for s in specs)
        self._files: list[Path] = []
        self._published: list[Path] = []
        self._open: tuple[int, object] | None = None
        try:
            for i, shard in enumerate(shards):
                path = self._tmp(i)
                header, offsets = self._layout(shard)
                data_start = len(header)
                self._files.append(path)
                with open(path, "wb") as f:
                    f.write(header)
                    f.truncate(data_start + sum(s.nbytes for s in shard))
                for spec in shard:
                    self._where[spec.name] = (i, data_start + offsets[spec.name], spec)
        except BaseException:
            self.abort()
            raise

    def _tmp(self, i: int) -> Path:
        return self.out_dir / f".{self.filenames[i]}.partial"

    @staticmethod
    def _layout(shard: list[TensorSpec]) -> tuple[bytes, dict[str, int]]:
        """The file header (length-prefixed, padded) and each tensor's offset in the data area."""
        order = sorted(shard, key=lambda s: (-s.dtype.itemsize, s.name))
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offsets, pos = {}, 0
        for s in order:
            header[s.name] = {
                "dtype": _CODES[s.dtype],
                "shape": list(s.shape),
                "data_offsets": [pos, pos + s.nbytes],
            }
            offsets[s.name] = pos
            pos += s.nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        return struct.pack("<Q", len(blob)) + blob, offsets

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write one planned tensor (CPU or not; copied to CPU). dtype and shape must match the plan."""
        if name not in self._where:
            raise ValueError(f"{name}: not in the planned output tensors")
        if name in self._written:
            raise ValueError(f"{name}: written twice")
        shard, offset, spec = self._where[name]
        if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise ValueError(
                f"{name}: planned {spec.dtype} {list(spec.shape)}, got {tensor.dtype} {list(tensor.shape)}"
            )
        if self._open is None or self._open[0] != shard:
            self._close_open()
            self._open = (shard, open(self._files[shard], "r+b"))
        f = self._open[1]
        f.seek(offset)
        raw = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        f.write(raw.numpy().tobytes())
        self._written.add(name)

    def _close_open(self) -> None:
        if self._open is not None:
            self._open[1].close()
            self._open = None

    def close(self) -> list[str]:
        """Check that every planned tensor was written, publish the files and the index.

        Returns:
            the shard file names.
        """
        self._close_open()
        missing = [n for n in self._where if n not in self._written]
        if missing:
            raise ValueError(f"{len(missing)} planned tensor(s) were never written, e.g. {missing[0]}")
        for i, path in enumerate(self._files):
            path.replace(self.out_dir / self.filenames[i])
            self._published.append(self.out_dir / self.filenames[i])
        if len(self.filenames) > 1:
            index = {
                "metadata": {"total_size": self._total},
                "weight_map": {n: self.filenames[s] for n, (s, _, _) in self._where.items()},
            }
            self._published.append(self.out_dir / INDEX_FILE)
            self._published[-1].write_text(json.dumps(index, indent=2) + "\n")
        return list(self.filenames)

    def abort(self) -> None:
        """Remove the files this writer created, partial or published (after an error; also when `close`
        failed part-way)."""
        try:
            self._close_open()
        except OSError:  # the buffered bytes hit the same full disk; the file goes anyway
            self._open = None
        for path in self._files + self._published:
            path.unlink(missing_ok=True)
