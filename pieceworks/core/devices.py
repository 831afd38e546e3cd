"""`runtime.device` and `runtime.dtype` resolved to torch objects, shared by the executor, its
tensor-parallel launcher and the reports (each builds on the same device the same way)."""

from __future__ import annotations

import torch

from pieceworks.errors import ConfigError


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"runtime.device={name} but no CUDA device is present; use runtime.device=cpu")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def free_bytes(device: torch.device, unknown: int | None = 4 << 30) -> int | None:
    """Free bytes on `device` (the CPU's: MemAvailable), or `unknown` where the OS does not say. On a GPU the free
    memory counts this process's cached blocks too (torch's allocator holds them for its next tensors)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return unknown
