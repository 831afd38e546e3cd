"""SASS instructions per weight in the decode loop of the Triton NVFP4 GEMM, compiled offline for sm_90.

    python benchmarks/sass_count.py                         # the shipped table's tiles up to 16 rows
    python benchmarks/sass_count.py --tile 8,64,256,4,3,0,1,1 --show   # one tile, with its loop's SASS
    python benchmarks/sass_count.py --layouts   # search k32-style bit layouts (pure Python, no compile)

--tile is block_m,block_n,block_k,warps,stages,one_dot[,w_as_a[,two_acc[,perm_k]]] (w_as_a 0: x is the A
operand); --rope adds the q/k/v rope epilogue. Needs no GPU: Triton compiles for an sm_90 target with its
bundled ptxas, specialized as the backend launches a split-K decode call (16-byte divisible pointers
and strides, in-kernel reduction, K a multiple of 512, PTX decode). The loop is the longest backward
branch of the SASS; "per weight" divides its length by the weights a thread decodes per iteration.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import common  # noqa: F401  (puts the repository root on sys.path)

from pieceworks.backends.fp4_gemm.triton_tiles import FP4_GEMM_TILES

SIGNATURE = dict(
    x_ptr="*bf16", w_ptr="*i16", s_ptr="*i16", gs_ptr="*fp32", out_ptr="*bf16", part_ptr="*fp32",
    count_ptr="*i32", M="i32", N="i32", K="i32", Kp="i32", stride_xm="i32",
    stride_om="i32", iters="i32", num_splits="i32",
    BLOCK_M="constexpr", BLOCK_N="constexpr", BLOCK_K="constexpr", GROUP_M="constexpr", SPLIT="constexpr",
    FUSED_REDUCE="constexpr", EVEN_K="constexpr", W_AS_A="constexpr", USE_ASM="constexpr", ONE_DOT="constexpr",
    PDL="constexpr", SWIGLU="constexpr", TWO_ACC="constexpr", PERM_K="constexpr",
)
DIVISIBLE = ("x_ptr", "w_ptr", "s_ptr", "gs_ptr", "out_ptr", "part_ptr", "count_ptr", "N", "K", "Kp",
             "stride_xm", "stride_om")


# With rope: the q/k/v rope epilogue's arguments (Llama's head_dim 128).
ROPE_SIGNATURE = dict(ROPE="constexpr", cos_ptr="*fp32", sin_ptr="*fp32", stride_cos="i32", stride_sin="i32",
                      rope_cols="i32", ROPE_HALF="constexpr")


def compile_decode_kernel(block_m, block_n, block_k, num_warps, num_stages, one_dot, w_as_a=1, pdl=False,
                          two_acc=False, rope=False, perm_k=False):
    import triton  # imported here so that --help and --layouts need no triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pieceworks.backends.fp4_gemm import triton_kernels

    signature = {**SIGNATURE, **ROPE_SIGNATURE} if rope else SIGNATURE
    names = list(signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in DIVISIBLE}
    constexprs = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=1, SPLIT=True,
                      FUSED_REDUCE=True, EVEN_K=True, W_AS_A=bool(w_as_a), USE_ASM=True, ONE_DOT=bool(one_dot),
                      PDL=bool(pdl), SWIGLU=False, TWO_ACC=bool(two_acc),
                      PERM_K=bool(perm_k))
    if rope:
        constexprs.update(ROPE=True, ROPE_HALF=64)
    src = ASTSource(triton_kernels._fp4_gemm_kernel, signature, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages, launch_pdl=bool(pdl)))


def hottest_loop(sass: str) -> list[str]:
    """Instructions of the longest loop (a branch back to an earlier label) of Triton's SASS listing."""
    labels, seq = {}, []
    for line in sass.splitlines():
        text = line.strip()
        label = re.match(r"^(\.?\w+):$", text)
        if label:
            labels[label.group(1)] = len(seq)
        elif "\t" in text:
            seq.append(text.split("\t", 1)[1].rstrip(";"))
    loops = []
    for i, ins in enumerate(seq):
        target = re.search(r"BRA\s+(\S+)$", ins)
        if target and labels.get(target.group(1), i + 1) <= i:
            loops.append((labels[target.group(1)], i))
    if not loops:
        raise RuntimeError("no loop found in the SASS")
    a, b = max(loops, key=lambda p: p[1] - p[0])
    return seq[a : b + 1]


def registers(kernel) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+)", out)
    return found.group(1) if found else "?"


def shift_mask_layouts() -> tuple[list, list]:
    """32-bit words of 8 e2m1 codes (two 16-bit halves) where each of the four bf16x2 outputs is the
    word shifted (or rotated) by one amount and masked with 0x81C081C0: the sets of shift amounts whose
    source bits tile the word exactly. Both lists come out empty: no layout decodes every slot with one
    shift and one mask (k32 needs 9 integer ops per 8 values instead of 7; see triton_k32.py)."""
    import itertools

    targets = [15, 8, 7, 6, 31, 24, 23, 22]  # sign, E1, E0, m of both bf16 halves
    shifts, rotations = [], []
    for amounts in itertools.combinations(range(-31, 32), 4):
        sources = [{t - a for t in targets} for a in amounts]
        if all(0 <= b < 32 for src in sources for b in src) and len(set().union(*sources)) == 32:
            shifts.append(amounts)
    for amounts in itertools.combinations(range(32), 4):
        if len(set().union(*({(t - a) % 32 for t in targets} for a in amounts))) == 32:
            rotations.append(amounts)
    return shifts, rotations


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tile", action="append", default=[],
                   help="block_m,block_n,block_k,num_warps,num_stages,one_dot[,w_as_a[,two_acc[,perm_k]]] "
                        "(repeatable)")
    p.add_argument("--show", action="store_true", help="print the loop's instructions")
    p.add_argument("--rope", action="store_true", help="compile with the q/k/v rope epilogue (ROPE)")
    p.add_argument("--layouts", action="store_true", help="search one-shift-one-mask decode layouts and exit")
    args = p.parse_args()
    if args.layouts:
        shifts, rotations = shift_mask_layouts()
        print(f"layouts with one shift and one mask per output: {len(shifts)} (shifts), {len(rotations)} (rotations)")
        return
    tiles = [tuple(int(v) for v in t.split(",")) for t in args.tile] or [
        (t["block_m"], t["block_n"], t["block_k"], t.get("num_warps", 4), t.get("num_stages", 3),
         int(t.get("one_dot", False)), int(t.get("w_as_a", True)), int(t.get("two_acc", False)))
        for t in FP4_GEMM_TILES if t.get("kind") == "fused" and t["block_m"] <= 16]
    print("| block_m x block_n x block_k, warps, stages, one_dot, w_as_a, two_acc | mma | loop instructions | weights per thread "
          "| per weight | registers | top ops |\n|---|---|---:|---:|---:|---:|---|")
    for tile in dict.fromkeys(tiles):
        bm, bn, bk, nw, ns, od, wa, ta, pk = (tile + (1, 0, 0)[len(tile) - 6:])[:9]
        kernel = compile_decode_kernel(bm, bn, bk, nw, ns, od, wa, two_acc=ta, rope=args.rope, perm_k=pk)
        loop = hottest_loop(kernel.asm["sass"])
        per_thread = bn * bk / (32 * nw)
        ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", i).split()[0].split(".")[0] for i in loop)
        top = ", ".join(f"{op} {n}" for op, n in ops.most_common(6))
        mma = "wgmma" if "HGMMA" in kernel.asm["sass"] else "mma.sync"
        print(f"| {bm}x{bn}x{bk}, {nw}, {ns}, {od}, {wa}, {ta} | {mma} | {len(loop)} | {per_thread:.0f} | {len(loop) / per_thread:.2f} "
              f"| {registers(kernel)} | {top} |")
        if args.show:
            print("\n".join(loop))


if __name__ == "__main__":
    main()
