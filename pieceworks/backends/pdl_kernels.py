"""Triton helpers of the PDL protocol (see pieceworks/backends/pdl.py); imports triton.

With `PDL` false every helper compiles to nothing, so the kernels also build on GPUs and Triton
versions without grid dependency control, and in Triton's CPU interpreter.
"""

from __future__ import annotations

import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older triton; pdl.enabled() is then False
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def wait(PDL: tl.constexpr):
    """Block until the preceding grid has completed and its writes are visible."""
    if PDL:
        gdc_wait()


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    """Let the next grid start once every program of this one has called this (or exited)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def enter(PDL: tl.constexpr):
    """`wait`, then `launch_dependents`: for short kernels, whose successor may as well start now."""
    wait(PDL)
    launch_dependents(PDL)
