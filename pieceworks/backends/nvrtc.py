"""Run-time compiled CUDA kernels: NVRTC compiles a source string for the device's sm, the driver API
loads the cubin and launches it (`cuLaunchKernelEx`, with the programmatic-stream-serialization
attribute for PDL when asked). ctypes only: no CUDA toolkit, no compiled extension; NVRTC comes with
torch's CUDA wheels (nvidia-cuda-nvrtc). Imports torch only.

Compiled cubins are kept on disk (NVRTC takes 0.2-0.4 s per decode-GEMM instance on the H200 machine,
at every process start otherwise; tests/gpu/test_cuda_fp4.py ran in 24 s compiling and 11 s from the
cache: docs/benchmarks.md): in `<runtime.cache_dir>/nvrtc` (`runtime.kernel_cache: false` turns it off;
`Executor.from_config` calls `configure_cache`; before any executor, `config.cache_root()`'s default), one
file per (source, name, arch, NVRTC version), written atomically. A file that cannot be read back as a cubin is compiled again and
replaced; a directory that cannot be written leaves the cache out.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from pieceworks.backends import driver

log = logging.getLogger(__name__)


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)),
                ("num_attrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


def nvrtc_library() -> ctypes.CDLL:
    """NVRTC of torch's CUDA major version (the nvidia-cuda-nvrtc wheel torch depends on, or the system's)."""
    major = int((torch.version.cuda or "0").split(".")[0])
    try:
        from torch.cuda._utils import _get_gpu_rtc_library  # finds the wheel's copy; private, hence the fallback

        return _get_gpu_rtc_library()
    except (ImportError, OSError, AttributeError):
        pass
    for name in (f"libnvrtc.so.{major}", "libnvrtc.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise OSError(f"libnvrtc.so.{major} not found: install the nvidia-cuda-nvrtc wheel matching torch's CUDA {major}")


@lru_cache(maxsize=None)
def unavailable_reason() -> str | None:
    """Why NVRTC can't compile and launch kernels here, or None."""
    if torch.version.cuda is None:
        return "this torch build has no CUDA"
    try:
        nvrtc_library()
    except OSError as e:
        return str(e)
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return f"CUDA driver library not found ({e})"
    return None


def _check(lib, err: int, what: str) -> None:
    if err:
        msg = ctypes.c_char_p()
        lib.cuGetErrorString(err, ctypes.byref(msg))
        raise RuntimeError(f"{what} failed: CUDA error {err} ({(msg.value or b'?').decode()})")


_DEFAULT = object()
_cache_dir: Any = _DEFAULT  # `configure_cache`'s setting


def configure_cache(directory: str | Path | None) -> None:
    """Keep compiled cubins in `directory` from now on (None: no disk cache). Process-wide, like
    `runtime.pdl`: the last executor built decides (from `runtime.cache_dir` and `runtime.kernel_cache`)."""
    global _cache_dir
    _cache_dir = None if directory is None else Path(directory)


def cache_dir() -> Path | None:
    """Where compiled cubins are kept (module docstring), or None when the cache is off."""
    if _cache_dir is _DEFAULT:
        from pieceworks.config import cache_root

        return cache_root() / "nvrtc"
    return _cache_dir


def nvrtc_version() -> tuple[int, int]:
    """The NVRTC library's (major, minor) version (part of the cache key)."""
    lib = nvrtc_library()
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


_ELF = b"\x7fELF"
_OPTIONS = ("-std=c++17",)  # NVRTC options besides the architecture (part of the cache key)


def compile_cubin(source: str, name: str, arch: str) -> tuple[bytes, str]:
    """`source` compiled by NVRTC for `arch` (e.g. "sm_90"): (cubin, the lowered name of `name`, e.g. a
    template instance), from the disk cache when it holds them (module docstring). Without #include lines
    in the source no CUDA toolkit is needed."""
    where = cache_dir()
    if where is None:
        return _compile(source, name, arch)[:2]
    key = hashlib.sha256("\0".join([source, name, arch, "%d.%d" % nvrtc_version(), *_OPTIONS]).encode()).hexdigest()
    path = where / f"{key}.cubin"
    try:
        data = path.read_bytes()
        lowered, _, cubin = data.partition(b"\n")
        if lowered and cubin.startswith(_ELF):
            return cubin, lowered.decode()
        log.warning("NVRTC cache: %s is not a cubin file; compiling %s again", path, name)
    except FileNotFoundError:
        pass
    except (OSError, UnicodeDecodeError) as e:
        log.warning("NVRTC cache: cannot read %s (%s); compiling %s again", path, e, name)
    cubin, lowered, _ = _compile(source, name, arch)
    try:
        where.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=where, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(lowered.encode() + b"\n" + cubin)
            os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the whole new one
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        log.debug("NVRTC cache: cannot write %s (%s); the kernel stays compiled in memory only", path, e)
    return cubin, lowered


SERIALIZED_WGMMA = "wgmma.mma_async instructions are serialized"  # ptxas's C7510-C7515 notes


def _compile(source: str, name: str, arch: str) -> tuple[bytes, str, str]:
    """(cubin, lowered name, NVRTC's log). A log saying ptxas serialized the kernel's wgmmas (each waits for
    the one before: a fraction of the tensor-core rate) is logged as a warning."""
    lib = nvrtc_library()
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    prog = ctypes.c_void_p()

    def check(err: int, what: str) -> None:
        if err:
            raise RuntimeError(f"NVRTC {what} of {name}: {lib.nvrtcGetErrorString(err).decode()}")

    check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", 0, None, None), "create")
    try:
        check(lib.nvrtcAddNameExpression(prog, name.encode()), "name")
        opts = [f"--gpu-architecture={arch}".encode(), *(o.encode() for o in _OPTIONS)]
        err = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, buf)
        text = buf.value.decode(errors="replace")
        if err:
            raise RuntimeError(f"NVRTC could not compile {name} for {arch}:\n{text}")
        if SERIALIZED_WGMMA in text:
            log.warning("%s: %s", name, text.strip())
        size = ctypes.c_size_t()
        check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
        cubin = ctypes.create_string_buffer(size.value)
        check(lib.nvrtcGetCUBIN(prog, cubin), "cubin")
        lowered = ctypes.c_char_p()
        check(lib.nvrtcGetLoweredName(prog, name.encode(), ctypes.byref(lowered)), "lowered name")
        return cubin.raw, lowered.value.decode(), text
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _attribute(ident: int, value: bytes) -> _LaunchAttribute:
    """A CUlaunchAttribute with `value`'s bytes at the start of its value union (copied byte for byte:
    assigning bytes to a c_char array field stops at the first zero byte, so a cluster dimension (1, 2, 1)
    would arrive as (1, 0, 0))."""
    attr = _LaunchAttribute()
    attr.id = ident
    ctypes.memmove(ctypes.addressof(attr) + _LaunchAttribute.value.offset, value, len(value))
    return attr


class Kernel:
    """One compiled kernel for one device, launched on its current stream with or without programmatic
    dependent launch (a kernel launched with PDL must `griddepcontrol.wait` before reading anything an
    earlier kernel writes; without PDL the wait returns at once)."""

    def __init__(self, source: str, name: str, device: int, suffix: str = "") -> None:
        major, minor = torch.cuda.get_device_capability(device)
        cubin, lowered = compile_cubin(source, name, f"sm_{major}{minor}{suffix}")
        self.name = name
        self.device = device
        self._libcuda = lib = ctypes.CDLL("libcuda.so.1")
        with torch.cuda.device(device):
            torch.cuda.current_stream()  # torch's context for the device (its primary one) is current here
            self._module = ctypes.c_void_p()
            _check(lib, lib.cuModuleLoadData(ctypes.byref(self._module), cubin), "cuModuleLoadData")
            self._func = ctypes.c_void_p()
            _check(lib, lib.cuModuleGetFunction(ctypes.byref(self._func), self._module, lowered.encode()),
                   "cuModuleGetFunction")
        self._pdl_attr = _attribute(_PROGRAMMATIC_STREAM_SERIALIZATION, (1).to_bytes(4, "little"))
        self._max_shared = 0  # the dynamic shared memory this kernel's limit was raised to

    def resident_blocks(self, threads: int, shared: int = 0) -> int:
        """How many CTAs of `threads` threads (and `shared` bytes of dynamic shared memory) one SM holds at
        once (the driver's occupancy calculator: registers, shared memory, warps)."""
        n = ctypes.c_int()
        _check(self._libcuda, self._libcuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(n), self._func, ctypes.c_int(threads), ctypes.c_size_t(shared)),
            f"cuOccupancyMaxActiveBlocksPerMultiprocessor({self.name})")
        return n.value

    def __call__(self, grid, block, args, pdl: bool, shared: int = 0) -> None:
        """Launch on the current stream; `shared`: bytes of dynamic shared memory (the kernel's limit is
        raised to it first, as static + dynamic above 48 KB needs)."""
        if torch.cuda.current_device() != self.device:  # launch in the device's context, on its stream
            with torch.cuda.device(self.device):
                return self(grid, block, args, pdl, shared)
        if shared > self._max_shared:
            _check(self._libcuda, self._libcuda.cuFuncSetAttribute(
                self._func, _MAX_DYNAMIC_SHARED_SIZE_BYTES, ctypes.c_int(shared)), f"cuFuncSetAttribute({self.name})")
            self._max_shared = shared
        params, ptrs = _pack(args)
        cfg = self._config(grid, block, pdl, shared)
        cfg.stream = torch.cuda.current_stream().cuda_stream
        _check(self._libcuda, self._libcuda.cuLaunchKernelEx(ctypes.byref(cfg), self._func, ptrs, None),
               f"cuLaunchKernelEx({self.name})")

    def bind(self, grid, block, args, pdl: bool) -> "BoundLaunch":
        """This kernel's launch with `args` packed once (`BoundLaunch`), for a launch repeated with the
        same arguments but a few pointers (no dynamic shared memory)."""
        return BoundLaunch(self, grid, block, args, pdl)

    def _config(self, grid, block, pdl: bool, shared: int) -> _LaunchConfig:
        cfg = _LaunchConfig()
        cfg.grid[:] = grid
        cfg.block[:] = block
        cfg.shared = shared
        if pdl:
            cfg.attrs = ctypes.pointer(self._pdl_attr)
            cfg.num_attrs = 1
        return cfg


class BoundLaunch:
    """A kernel launch whose arguments are packed once, for launches that repeat with the same
    arguments but one pointer (`__call__(at, tensor)`): no per-launch packing of every argument as
    `Kernel.__call__` does. The tensors of `args` stay referenced; their memory must outlive the launches."""

    def __init__(self, kernel: Kernel, grid, block, args, pdl: bool) -> None:
        self.kernel, self.args = kernel, list(args)
        self.params, self.ptrs = _pack(args)
        self.cfg = kernel._config(grid, block, pdl, 0)
        self._cfg_ref = ctypes.byref(self.cfg)
        self._launch, self._func = kernel._libcuda.cuLaunchKernelEx, kernel._func

    def __call__(self, at: int | None = None, tensor: torch.Tensor | None = None) -> None:
        """Launch; with `at` and `tensor`: argument `at` (a pointer) is `tensor`'s data this time."""
        if torch.cuda.current_device() != self.kernel.device:
            with torch.cuda.device(self.kernel.device):
                return self(at, tensor)
        if at is not None:
            self.params[at].value = tensor.data_ptr()
        cfg = self.cfg
        cfg.stream = (driver.raw_stream_of(self.kernel.device) if driver.LEAN
                      else torch.cuda.current_stream().cuda_stream)
        err = self._launch(ctypes.byref(cfg), self._func, self.ptrs, None)
        if err:
            _check(self.kernel._libcuda, err, f"cuLaunchKernelEx({self.kernel.name})")

    def on(self, stream: int, at: int, tensor: torch.Tensor) -> None:
        """`__call__(at, tensor)` on raw `stream`, the kernel's device current (the caller's word)."""
        self.params[at].value = tensor.data_ptr()
        cfg = self.cfg
        cfg.stream = stream
        err = self._launch(self._cfg_ref, self._func, self.ptrs, None)
        if err:
            _check(self.kernel._libcuda, err, f"cuLaunchKernelEx({self.kernel.name})")


def _pack(args) -> tuple[list, ctypes.Array]:
    """ctypes values of kernel arguments (tensors as their data pointers, ints as int, floats as float,
    ctypes arrays as the bytes of a by-value struct) and the array of their addresses that cuLaunchKernelEx
    takes."""
    params = []
    for a in args:
        if isinstance(a, torch.Tensor):
            params.append(ctypes.c_void_p(a.data_ptr()))
        elif isinstance(a, int):
            params.append(ctypes.c_int(a))
        elif isinstance(a, float):
            params.append(ctypes.c_float(a))
        elif isinstance(a, ctypes.Array):  # a by-value struct (a CUtensorMap), passed as its bytes
            params.append(a)
        else:
            raise TypeError(f"kernel argument of type {type(a).__name__}")
    return params, (ctypes.c_void_p * len(params))(*[ctypes.cast(ctypes.byref(p), ctypes.c_void_p) for p in params])


@lru_cache(maxsize=None)
def _kernel(source: str, name: str, device: int, suffix: str) -> Kernel:
    return Kernel(source, name, device, suffix)


def kernel(source: str, name: str, device: torch.device, suffix: str = "") -> Kernel:
    """The kernel `name` of `source` for `device`, compiled on first use (0.2-0.4 s for the decode GEMM's
    instances on the H200 machine; from the disk cache when an earlier process compiled it) and kept.
    suffix "a": for the device's arch-specific target (sm_90a: wgmma), which runs on that arch only."""
    return _kernel(source, name, device.index if device.index is not None else torch.cuda.current_device(), suffix)
