"""Programmatic dependent launch (PDL) for pieceworks' Triton kernels, on Hopper (sm_90) and newer.

Without PDL a kernel starts only once the kernel before it in the stream has finished and its writes
are flushed, so every kernel boundary of a decode step costs a launch; a decode step at batch 1 is
some 290 kernels, most of them a few microseconds long. With PDL (CUDA's programmatic stream serialization, which stream
capture records into CUDA graphs as programmatic edges) the next kernel may start while the current
one still runs; it must then synchronize itself before it reads anything the current one writes.

Every Triton kernel of the step that is launched with PDL follows one protocol (`pdl_kernels`):

1. `griddepcontrol.wait` first: it blocks until the preceding grid has completed and its writes are
   visible. Nothing an earlier kernel writes is read, and nothing is written, before it (the norm
   kernels load their norm weights first).
2. `griddepcontrol.launch_dependents` lets the next kernel start (its programs then sit in step 1).
   The short kernels (norms, rope, SiLU, K/V writes, routing) call it right after the wait; the NVFP4
   GEMMs, the MoE GEMMs and attention.triton after their main loop, so the next launch overlaps
   their epilogue. Programs waiting in step 1 next to a running issue-bound GEMM slowed it on the
   H200 (docs/benchmarks.md), hence the late trigger there. A trigger after the wait keeps at most two
   kernels in flight.

Also measured there and left out: L2 prefetches of a GEMM's weights before its wait (slower: the
prefetch stream, issued all at once, delayed the K loop's own loads).

A kernel launched with PDL that skipped step 2 could read its inputs before they are written, so the
launch option and the in-kernel protocol come from one flag (`launch_options` returns both). Kernels
of other libraries (cuBLAS, torch, FlashInfer) are ordinary launches and keep their usual ordering.

The switch is process-wide (`runtime.pdl` in the configuration: auto = on where supported, on = the
same but an error where unsupported, off); `Executor.from_config` sets it, and the last executor built
in a process decides for all. Graphs keep the setting they were captured with.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

MIN_CAPABILITY = (9, 0)

_enabled = True  # the process-wide switch; `configure` sets it


@functools.lru_cache(maxsize=None)
def _triton_has_gdc() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def unsupported_reason(device: torch.device | str) -> str | None:
    """Why PDL can't be used on `device`, or None when it can."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"PDL needs a CUDA device (this one: {device.type})"
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        return (f"PDL needs compute capability >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} "
                f"(this GPU: {cap[0]}.{cap[1]})")
    if not _triton_has_gdc():
        return "PDL needs a triton with triton.language.extra.cuda.gdc_wait (3.4 or newer)"
    return None


def mode_name(mode) -> str:
    """`runtime.pdl` as a string ('auto', 'on' or 'off' when valid), from a config Switch or a str."""
    return str(getattr(mode, "value", mode))


def configure(mode: str, device: torch.device | str) -> bool:
    """Set the process-wide switch from `runtime.pdl` ('auto', 'on' or 'off'); returns whether PDL is
    now used on `device`. 'on' raises ValueError where it is unsupported."""
    global _enabled
    mode = mode_name(mode)
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"runtime.pdl={mode!r}: use auto, on or off")
    reason = unsupported_reason(device)
    if mode == "on" and reason is not None:
        raise ValueError(f"runtime.pdl=on: {reason}; use runtime.pdl=auto or off")
    _enabled = mode != "off"
    return _enabled and reason is None


def enabled(device: torch.device | str) -> bool:
    """Whether kernels launched on `device` now use PDL."""
    return _enabled and unsupported_reason(device) is None


def launch_options(device: torch.device | str, early: bool = True) -> tuple[bool, dict]:
    """(flag, launch kwargs) for a Triton kernel following the protocol above: pass the flag as the
    kernel's `PDL` constexpr and the kwargs to the launch (`launch_pdl=True`, or nothing).

    early=False: the kernel is launched in stream order (no `launch_pdl`; it starts when the kernel before
    it has finished, and its wait returns at once) but keeps its trigger, so the kernel after it can still
    launch early. For kernels with nothing to do before their wait (attention.triton's decode)."""
    on = enabled(device)
    return on, ({"launch_pdl": True} if on and early else {})
