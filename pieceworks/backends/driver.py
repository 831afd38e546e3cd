"""CUDA driver calls through ctypes for the host work at a step's head: an asynchronous copy, an event, the
stream's capture state, with their arguments packed once, on the raw current stream. Every torch call that reaches
the driver passes its dispatcher and allocator bookkeeping first; at the head of a piecewise step, where the GPU waits
for the host, two torch event calls of the plan's copy guard took 47-56 us (docs/benchmarks.md, "Where the piecewise -
whole gap goes"). Imports torch only.
"""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache

import torch

_CU_EVENT_DISABLE_TIMING = 2
LEAN = os.environ.get("PIECEWORKS_LEAN", "1") != "0"  # exp: A/B switch read by flashinfer_fast, piecewise and nvrtc
_raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)


@lru_cache(maxsize=None)
def lib() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _check(err: int, what: str) -> None:
    if err:
        msg = ctypes.c_char_p()
        lib().cuGetErrorString(err, ctypes.byref(msg))
        raise RuntimeError(f"{what} failed: CUDA error {err} ({(msg.value or b'?').decode()})")


def raw_stream(device: torch.device):
    """The current stream of `device` as a raw handle (int)."""
    if _raw is not None:
        return _raw(device.index if device.index is not None else torch.cuda.current_device())
    return torch.cuda.current_stream(device).cuda_stream


class Copy:
    """An asynchronous copy of `nbytes` to `dst` (a device tensor) from `src` (a device or pinned host tensor, or
    a device address given with each call), arguments packed once; the tensors stay referenced."""

    def __init__(self, dst: torch.Tensor, src: torch.Tensor | None, nbytes: int) -> None:
        self.keep = (dst, src)
        host = src is not None and src.device.type == "cpu"
        self.fn = lib().cuMemcpyHtoDAsync_v2 if host else lib().cuMemcpyDtoDAsync_v2
        self.dst, self.nbytes, self.stream = ctypes.c_uint64(dst.data_ptr()), ctypes.c_size_t(nbytes), ctypes.c_void_p()
        self.src = (ctypes.c_void_p if host else ctypes.c_uint64)(0 if src is None else src.data_ptr())

    def __call__(self, stream: int, src: int | None = None) -> None:
        self.stream.value = stream
        if src is not None:
            self.src.value = src
        err = self.fn(self.dst, self.src, self.nbytes, self.stream)
        if err:
            _check(err, "cuMemcpyAsync")


class Event:
    """A driver event without timing: record on a stream, synchronize, whether a stream is capturing."""

    def __init__(self) -> None:
        handle = ctypes.c_void_p()
        _check(lib().cuEventCreate(ctypes.byref(handle), _CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        self.handle, self.stream, self._status = handle, ctypes.c_void_p(), ctypes.c_int()
        self._status_ref = ctypes.byref(self._status)
        cu = lib()
        self._capturing, self._record, self._sync = cu.cuStreamIsCapturing, cu.cuEventRecord, cu.cuEventSynchronize
        self._destroy = cu.cuEventDestroy_v2

    def capturing(self, stream: int) -> bool:
        self.stream.value = stream
        err = self._capturing(self.stream, self._status_ref)
        if err:
            _check(err, "cuStreamIsCapturing")
        return self._status.value != 0

    def record(self, stream: int) -> None:
        self.stream.value = stream
        err = self._record(self.handle, self.stream)
        if err:
            _check(err, "cuEventRecord")

    def synchronize(self) -> None:
        err = self._sync(self.handle)
        if err:
            _check(err, "cuEventSynchronize")

    def __del__(self) -> None:
        try:
            self._destroy(self.handle)
        except Exception:  # interpreter shutdown
            pass


def raw_stream_of(index: int):
    """The current stream of CUDA device `index` as a raw handle (int)."""
    return _raw(index) if _raw is not None else torch.cuda.current_stream(index).cuda_stream
