"""What a model's meta skeleton will take once materialized, checked before any weight is read: rope tables
sized to the positions the executor can reach (`size_rope_tables`), and the whole skeleton against the device's
free memory (`check_fits`). `models.loader.load_model` calls both between building the skeleton and filling it."""

from __future__ import annotations

import itertools
from typing import Any

import torch

from pieceworks.core.devices import free_bytes
from pieceworks.errors import ConfigError
from pieceworks.models.base import CausalLM, context_limit


def check_fits(model: CausalLM, device: torch.device, dtype: torch.dtype, random: bool) -> None:
    """Refuse a skeleton that takes more than `device`'s free memory before any weight is read (not as the
    allocator's refusal once most of it is read)."""
    need = sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))
    free = free_bytes(device, unknown=None)
    if free is not None and need > free:
        where = "model.sizes" if random else "the checkpoint's config.json"
        smaller = ", runtime.dtype=bfloat16" if dtype == torch.float32 else ""
        fp4 = "quantization.format=nvfp4" if random else "`pieceworks quantize`"
        raise ConfigError(f"the model's weights take {need / 2**30:.2f} GiB on {device} (sizes from {where}), but "
                          f"{free / 2**30:.2f} GiB are free; use a device with more memory{smaller}, tensor "
                          f"parallelism (parallel.tensor_parallel_size) or NVFP4 weights ({fp4})")


ROPE_TABLE_BYTES = 1 << 30
"""Largest rope table (cos + sin) built for a checkpoint's max_position_embeddings when model.max_context
is not set."""


def size_rope_tables(model: CausalLM, model_cfg: Any) -> None:
    """Rope tables for the positions the executor can reach: `context_limit` (model.max_context where it is set,
    refused above max_position_embeddings or a shorter sliding window; else either), refused above
    `ROPE_TABLE_BYTES` with a ConfigError that says to set model.max_context. Only the model's meta skeleton exists
    here."""
    tables = model.rope_tables()
    limit = context_limit(model, getattr(model_cfg, "max_context", None))
    size = sum(t.table_bytes for t in tables)
    if limit < model.max_position_embeddings:
        for rotary in tables:
            rotary.limit(limit)
    elif size > ROPE_TABLE_BYTES:
        raise ConfigError(
            f"the checkpoint's max_position_embeddings ({model.max_position_embeddings}) needs rope tables of "
            f"{size / 2**30:.1f} GiB; set model.max_context to the longest sequence to serve "
            "(e.g. model.max_context=32768): the tables cover only that")
