"""attention.triton's decode kernel, attention.triton_all's extend kernel (at every GQA group size) and the K/V write
kernel compiled for sm_90 without a GPU (Triton's own ptxas and nvdisasm): every variant the backends launch builds,
and over an FP8 pool the decode loop reads K/V as words and converts them without Triton's e4m3 conversion or
byte-wide shared-memory staging (the SASS it was written to avoid: docs/benchmarks.md "Over an FP8 pool"). Needs triton
importable (`triton==3.6.0`, in README's test command); skips without. The kernels' numerics run on the GPU:
tests/gpu/test_triton_attention.py."""

from __future__ import annotations

import collections
import os
import subprocess

import pytest

triton = pytest.importorskip("triton", reason="triton is not installed (README's test command installs triton==3.6.0)")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from pieceworks.backends import kv_write_kernel  # noqa: E402
from pieceworks.backends.attention import triton_decode_kernel as tdk  # noqa: E402

NVDISASM = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
SM90 = GPUTarget("cuda", 90, 32)
FLOATS = ("scale_log2", "v_scale", "inv_k", "inv_v", "inv_a", "inv_b")


def compile_sm90(kernel, types: dict[str, str], constexprs: dict, **options):
    """The kernel compiled for sm_90 as a launch with 16-divisible pointers and strides would be (integer arguments
    i32 unless `types` says otherwise)."""
    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        else:
            sig[name] = types.get(name, "fp32" if name in FLOATS else "i32")
            if sig[name].startswith("*") or name.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs), target=SM90,
                          options=options)


def compile_sass(kernel, types: dict[str, str], constexprs: dict, **options) -> collections.Counter:
    """`compile_sm90`'s kernel, its SASS opcodes counted."""
    out = compile_sm90(kernel, types, constexprs, **options)
    if not os.path.exists(NVDISASM):
        pytest.skip("triton's nvdisasm is not in this install")
    path = os.path.join(out.metadata.name + ".cubin")
    with open(path, "wb") as f:
        f.write(out.asm["cubin"])
    try:
        text = subprocess.run([NVDISASM, "-c", path], capture_output=True, text=True, check=True).stdout
    finally:
        os.remove(path)
    ops = collections.Counter()
    for line in text.splitlines():
        if line.strip().startswith("/*") and "*/" in line:
            words = line.split("*/", 1)[1].split()
            if words:
                ops[(words[1] if words[0].startswith("@") and len(words) > 1 else words[0]).rstrip(";")] += 1
    return ops


def decode_types(q: str, cache: str) -> dict[str, str]:
    return {"q_ptr": q, "out_ptr": q, "kn_ptr": q, "vn_ptr": q, "k_ptr": cache, "v_ptr": cache,
            "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "table_ptr": "*i32", "lens_ptr": "*i64",
            "count_ptr": "*i32", "slot_ptr": "*i64"}


DECODE = dict(G=4, GP=16, D=128, PS=16, S=2, BLOCK_N=64, HKV=8, WRITE=True, LENS_ARE_POSITIONS=True, PDL=True)


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("q", ["*bf16", "*fp16"])
def test_fp8_decode_reads_words_without_conversions_or_byte_staging(q):
    """The backend's FP8 launch (its quantizing write, word reads, two stages): no e4m3 conversion instructions, no
    byte-wide shared-memory traffic, 16-bit tensor-core dots; Triton's `.to()` path (fp8_words=False) has both."""
    words = compile_sass(tdk._decode_kernel, decode_types(q, "*fp8e4nv"), dict(DECODE, QUANT=True, FP8_WORDS=True),
                         num_warps=4, num_stages=2)
    to = compile_sass(tdk._decode_kernel, decode_types(q, "*fp8e4nv"), dict(DECODE, QUANT=True, FP8_WORDS=False),
                      num_warps=4, num_stages=2)
    mma = "HMMA.16816.F32.BF16" if q == "*bf16" else "HMMA.16816.F32"
    assert words[mma] > 0 and to[mma] > 0
    e4m3 = [op for op in words if "E4M3" in op and "PACK" not in op]  # reads; the write packs to e4m3 (PACK)
    assert not e4m3 and words["LDS.U8"] == 0 and words["STS.U8"] == 0, (e4m3, words["LDS.U8"], words["STS.U8"])
    assert any("E4M3" in op and "UNPACK" in op for op in to) and to["LDS.U8"] > 0


def test_bf16_decode_and_kv_writes_compile():
    """The bf16 pool's decode launch (the kernel writing the step's rows) and the K/V write kernel, plain and
    quantizing, build for sm_90."""
    ops = compile_sass(tdk._decode_kernel, decode_types("*bf16", "*bf16"), dict(DECODE), num_warps=4, num_stages=2)
    assert ops["HMMA.16816.F32.BF16"] > 0
    for dst, quant in (("*bf16", False), ("*fp8e4nv", True)):
        types = {"dst_a": dst, "dst_b": dst, "src_a": "*bf16", "src_b": "*bf16", "slots": "*i64"}
        ops = compile_sass(kv_write_kernel._write_rows_kernel, types,
                           dict(WIDTH_A=1024, WIDTH_B=1024, BLOCK_A=1024, BLOCK_B=1024, QUANT=quant, PDL=True),
                           num_warps=4)
        saturating = [op for op in ops if "SATFINITE.E4M3" in op]  # quantize_kv's saturation, in the conversion
        assert bool(saturating) == quant, ops


# Query heads per KV head of GQA models the backends serve (Llama 3.2 3B: 3, Qwen2.5-7B: 7, GLM-4.5-Air: 12, ...)
GROUPS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 32, 64)
SHARED_MAX = 232448  # bytes of shared memory a block may opt into on sm_90 (227 KB)


@pytest.mark.parametrize("group", GROUPS)
def test_gqa_kernels_build_for_every_group_size(group):
    """attention.triton_all's extend kernel and attention.triton's decode kernel at every group size, as their
    launchers set them up (head_dim 128; 64 and 256 where the group is 12), build for sm_90 within its shared memory:
    before the extend kernel padded the group to a power of 2, groups of 3, 7 or 12 failed to compile."""
    from pieceworks.backends.attention import triton_extend_kernel as tek

    g, gp, block_q = tek.launch_shape(group, 1)
    assert (g, gp & (gp - 1), block_q * gp <= 128, gp < 2 * g) == (group, 0, True, True)
    types = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16", "table_ptr": "*i32",
             "qo_ptr": "*i32", "lens_ptr": "*i32"}
    for dim in (64, 128, 256) if group == 12 else (128,):
        ext = compile_sm90(tek._extend_kernel, types, dict(G=g, GP=gp, D=dim, PS=16, BLOCK_Q=block_q, BLOCK_N=64),
                           num_warps=4, num_stages=2)
        assert ext.metadata.shared <= SHARED_MAX, (dim, ext.metadata.shared)
    dec = compile_sm90(tdk._decode_kernel, decode_types("*bf16", "*bf16"),
                       dict(DECODE, G=group, GP=max(16, triton.next_power_of_2(group))), num_warps=4, num_stages=2)
    assert dec.metadata.shared <= SHARED_MAX, dec.metadata.shared
