"""Programmatic dependent launch (PDL) for pieceworks' Triton kernels (Hopper and newer).

A kernel launched with PDL may start while the kernel before it on the stream still runs: its programs
become resident as soon as every program of the earlier kernel has signalled
(`griddepcontrol.launch_dependents`) or exited, and each waits in `griddepcontrol.wait` until the
earlier kernel has completed and its memory is visible. CUDA-graph capture keeps these edges, so the
decode step's graph overlaps each kernel's launch and start-up with the tail of the one before it.

The rules every pieceworks kernel launched with PDL follows (`pdl_kernels`):

- before its wait it writes nothing and reads nothing in registers: the GEMMs only issue L2 prefetch
  hints for their first weight tiles (weights are never written by a decode step, and a hint cannot
  return stale data: L2 is the GPU's point of coherence);
- small kernels (norms, rope, SiLU, K/V write, decode attention) signal their dependents right after
  their own wait, so the next kernel (typically a GEMM) starts prefetching its weights while they run;
  the GEMMs signal after their K loop, so the kernel after them cannot take SM room from their programs.

Kernels that are not ours (torch, cuBLAS, FlashInfer) neither signal nor wait: next to them a PDL
launch behaves like a plain one. `PIECEWORKS_PDL=0` in the environment turns PDL off (read at each
launch; a captured graph keeps what it was captured with); it is on where the GPU (compute capability >= 9.0) and the installed Triton support it.
"""

from __future__ import annotations

import functools
import os

import torch

ENV = "PIECEWORKS_PDL"


@functools.lru_cache(maxsize=None)
def _triton_supports_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except Exception:  # pragma: no cover - no triton or no CUDA backend
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def env_allows() -> bool:
    """False when PIECEWORKS_PDL is set to 0/false/off/no."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


@functools.lru_cache(maxsize=None)
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def enabled(device: torch.device) -> bool:
    """Whether Triton kernels on `device` launch with PDL (the `PDL` constexpr and `launch_pdl`)."""
    if device.type != "cuda" or not env_allows() or not _triton_supports_pdl():
        return False
    return _device_supports(device.index if device.index is not None else torch.cuda.current_device())


def launch_kwargs(device: torch.device) -> dict:
    """Extra launch arguments of a kernel with a `PDL: tl.constexpr = False` parameter: the constexpr
    and Triton's `launch_pdl` option when `enabled(device)`, else none."""
    return dict(PDL=True, launch_pdl=True) if enabled(device) else {}
