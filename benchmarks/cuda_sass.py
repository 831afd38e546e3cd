"""SASS of the CUDA decode GEMM (backends/fp4_gemm/cuda_decode_kernel.py), compiled offline by NVRTC for sm_90.

    python benchmarks/cuda_sass.py --nvrtc /path/to/libnvrtc.so.13 "nvfp4_decode_gemm<16, 2, 1, 0, 0, 0>" ...
    python benchmarks/cuda_sass.py --source-file old_cuda_decode.py "nvfp4_decode_gemm_async<16, 4, 1, 0>"
    python benchmarks/cuda_sass.py --compare-to old_cuda_decode.py "nvfp4_decode_gemm<8, 2, 1, 0, 0, 0>" ...

Needs no GPU: NVRTC (on a CPU machine: `pip download --no-deps nvidia-cuda-nvrtc==13.0.*` and unzip;
--nvrtc names its libnvrtc.so.13, whose libnvrtc-builtins must be on LD_LIBRARY_PATH) and Triton's
bundled cuobjdump. Prints each instance's registers and its main loop (the longest backward branch holding an mma):
instructions, and per 64-element chunk with --chunks-per-iteration (the register ring's loop holds
`depth` chunks, the default 2). --source-file takes SOURCE from another copy of cuda_decode_kernel.py (an
older commit's, say: `git show REV:pieceworks/backends/fp4_gemm/cuda_decode_kernel.py > old.py`; any file
that assigns SOURCE a raw string works, and one whose SOURCE prepends DEVICE_HELPERS gets this checkout's
cuda_device.py). --compare-to FILE also compiles each instance from
FILE's SOURCE and says whether the two instruction streams are the same (addresses and the kernel's
mangled name left out, so an added defaulted template argument does not count as a difference).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pieceworks.backends import nvrtc  # noqa: E402
from pieceworks.backends.fp4_gemm import cuda_decode, cuda_device  # noqa: E402


def cuobjdump(args: list[str], cubin: bytes) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, *args, f.name], capture_output=True, text=True, check=True).stdout


def use_nvrtc(lib: str) -> None:
    """Compile with the libnvrtc.so at `lib` (e.g. an unzipped nvidia-cuda-nvrtc wheel on a CPU machine)."""
    nvrtc.nvrtc_library = lambda: ctypes.CDLL(lib)


def compiled(source: str, name: str, arch: str) -> tuple[str, str]:
    """(registers, cuobjdump -sass listing) of template instance `name` of `source` for `arch`."""
    cubin, _ = nvrtc.compile_cubin(source, name, arch)
    regs = re.search(r"REG:(\d+)", cuobjdump(["--dump-resource-usage"], cubin))
    return (regs.group(1) if regs else "?"), cuobjdump(["-sass"], cubin)


def main_loop(sass: str, mma: str = "HMMA") -> list[str]:
    """Instructions of the longest backward branch's span that holds an mma (`mma`: HMMA, or HGMMA for
    wgmma) in a cuobjdump -sass listing (the epilogue's loops hold none; the rope epilogue's is longer than
    the main loop), leaving out spans that hold an mbarrier wait."""
    seq = {}
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            seq[int(m.group(1), 16)] = m.group(2)
    loops = []
    for addr, ins in seq.items():
        target = re.search(r"BRA (0x[0-9a-f]+)$", ins)
        if target and int(target.group(1), 16) < addr:
            loops.append((int(target.group(1), 16), addr))
    body = lambda a, b: [ins for addr, ins in seq.items() if a <= addr <= b]  # noqa: E731
    # an mbarrier wait loop (SYNCS) laid out after the epilogue spans the whole kernel (exp/preload's)
    loops = [(a, b) for a, b in loops if any(i.startswith(mma) for i in body(a, b))
             and not any(i.startswith("SYNCS") for i in body(a, b))]
    if not loops:
        raise RuntimeError("no loop with an mma found in the SASS")
    a, b = max(loops, key=lambda p: p[1] - p[0])
    return [ins for addr, ins in sorted(seq.items()) if a <= addr <= b]


def source_of(path: str) -> str:
    """SOURCE of a copy of cuda_decode_kernel.py (see --source-file)."""
    found = re.search(r'SOURCE = (DEVICE_HELPERS \+ )?r"""(.*?)"""', open(path).read(), re.S)
    if not found:
        raise SystemExit(f"{path}: no SOURCE = r\"\"\"...\"\"\" found")
    # the device helpers are this checkout's cuda_device.py
    return (cuda_device.DEVICE_HELPERS if found.group(1) else "") + found.group(2)


def instructions(sass: str) -> list[str]:
    """The instructions of a cuobjdump -sass listing, without their addresses."""
    return [m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", sass)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="+", help='template instances, e.g. "nvfp4_decode_gemm<16, 2, 1, 0, 0, 0>"')
    ap.add_argument("--nvrtc", help="path of libnvrtc.so.<major> (default: the one torch finds)")
    ap.add_argument("--source-file", help="take SOURCE from this copy of cuda_decode_kernel.py")
    ap.add_argument("--chunks-per-iteration", type=int, default=2)
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--show", action="store_true", help="print the loop")
    ap.add_argument("--compare-to", help="also compile from this copy's SOURCE and compare the instructions")
    args = ap.parse_args()
    if args.nvrtc:
        use_nvrtc(args.nvrtc)
    source = source_of(args.source_file) if args.source_file else cuda_decode.SOURCE
    other = source_of(args.compare_to) if args.compare_to else None
    same = 0
    for name in args.names:
        regs, listing = compiled(source, name, args.arch)
        loop = main_loop(listing)
        print(f"{name}: {regs} registers, main loop {len(loop)} instructions, "
              f"{len(loop) / args.chunks_per_iteration:.1f} per chunk ({args.chunks_per_iteration} per iteration)")
        if args.show:
            print("\n".join("    " + ins for ins in loop))
        if other is not None:
            theirs = instructions(compiled(other, name, args.arch)[1])
            ours = instructions(listing)
            same += ours == theirs
            print(f"    {'the same instructions as' if ours == theirs else 'DIFFERENT from'} {args.compare_to} "
                  f"({len(ours)} / {len(theirs)} instructions)")
    if other is not None:
        print(f"{same} of {len(args.names)} instances: the same instructions")


if __name__ == "__main__":
    main()
