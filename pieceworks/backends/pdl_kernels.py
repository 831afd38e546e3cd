"""Triton helpers for programmatic dependent launch (imports triton); see `pieceworks.backends.pdl`.

Each helper takes the kernel's `PDL` constexpr and emits nothing when it is False, so kernels compiled
for GPUs older than sm_90 (where `griddepcontrol` does not exist) are unchanged.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def wait(PDL: tl.constexpr):
    """Block until the kernel before this one has completed and its writes are visible."""
    if PDL:
        tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False,
                                  pack=1)


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    """Let the next kernel's programs start (they still wait for this kernel to complete)."""
    if PDL:
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def start(PDL: tl.constexpr):
    """The opening of a small kernel: wait for the kernel before, then let the next one start. (In the
    other order a chain of small kernels would all become resident at once, each waiting on the one
    before it, and take SM room from the one that can run: measured slower on the H200.)"""
    wait(PDL)
    launch_dependents(PDL)


@triton.jit
def prefetch_l2(ptrs):
    """An L2 prefetch hint for the cache line of each pointer (no data reaches registers)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)
