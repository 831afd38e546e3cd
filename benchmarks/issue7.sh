#!/usr/bin/env bash
# Every measurement of issue 7 on the H200 in one device call (about 3 minutes with warm caches before
# the fp4_gemm.cuda, moe.cuda, read-ceiling and timeline steps, added in the fifteenth to eighteenth
# sessions and not yet run in this script, each run on its own; the norm_pdl_ab.py and pdl_ab.py
# experiments ran in the seventeenth and eighteenth sessions and are not repeated here):
#   bash benchmarks/issue7.sh OUTDIR        (on the device: source .gpu/setup.sh first; OUTDIR=$OUT)
# Writes OUTDIR/issue7.tar.gz (one file: the device tool returns a handful of files per call) holding
# {gemm_off,gemm_on}/gemm_bench.{md,json}, {moe_off,moe_on,moe_cuda_on,moe_triton_on}/moe_bench.{md,json},
# decode{512,4096}.{md,json}, profile_b1.txt, qkv_rope.md, cuda_gemm/cuda_decode_gemm.json,
# decode512_cuda{,_fused_norm}.{md,json}, cuda_gemm_pdl/cuda_decode_gemm.json, read_ceiling{,_pdl}.txt,
# timeline_b1.txt, and
# OUTDIR/issue7.log, the printed tables. Each step has its own time
# limit, and a failing step does not stop the others.
set -u
dest=${1:?usage: bash benchmarks/issue7.sh OUTDIR}
source "$(dirname "$0")/device_out.sh"
device_outputs issue7 "$dest"
cd "$(dirname "$0")/.."
step "GEMM, PDL off and on"
timeout 150 python benchmarks/fp4_gemm.py --ms 1,4,8,16 --out "$out/gemm_off" | tail -20
timeout 150 python benchmarks/fp4_gemm.py --ms 1,4,8,16 --pdl on --out "$out/gemm_on" | tail -20
step "MoE, PDL off and on"
timeout 200 python benchmarks/moe.py --tokens 1,4,16,64 --out "$out/moe_off" | tail -6
timeout 200 python benchmarks/moe.py --tokens 1,4,16,64 --pdl on --out "$out/moe_on" | tail -6
timeout 200 python benchmarks/moe.py --backend cuda --tokens 1,4,16,64 --pdl on --out "$out/moe_cuda_on" | tail -6
# the default moe.triton runs T <= cuda_moe_max_t (128) on the CUDA decode kernel: its Triton kernels alone
timeout 200 python benchmarks/moe.py --cuda-moe-max-t 0 --tokens 1,4,16,64 --pdl on --out "$out/moe_triton_on" | tail -6
B=(--quant nvfp4 --set cuda_graph.piecewise.enabled=off --extend '' --set backends.options.flashinfer.variant=fa2
   --decode 1,8,32 --decode-sizes 1,8,32)
for ctx in 512 4096; do
    step "decode end to end, $ctx-token context"
    timeout 200 python benchmarks/graphs.py "${B[@]}" --context "$ctx" --out "$out/decode$ctx.md" | tail -5
done
step "kernel time of a batch-1 step (PDL off: per-kernel times that add up)"
timeout 150 python benchmarks/profile_step.py --decode 1 --set quantization.format=nvfp4 \
    --set backends.options.flashinfer.variant=fa2 --set runtime.pdl=off --steps 30 > "$out/profile_b1.txt" 2>&1
grep -v Warn "$out/profile_b1.txt" | head -30
step "q/k/v GEMM with the rope fused, against GEMM + rope kernel"
timeout 120 python benchmarks/qkv_rope.py > "$out/qkv_rope.md" 2>&1
cat "$out/qkv_rope.md"
step "CUDA decode GEMM (fp4_gemm.cuda) against the Triton backend and bf16"
timeout 150 python benchmarks/cuda_decode_gemm.py --ms 1,8,16 --variants 2x2,4x2,8x2,16x2,8x1 \
    --out "$out/cuda_gemm" | grep -v "^check.*e-03$" | tail -20
timeout 150 python benchmarks/cuda_decode_gemm.py --ms 1,8,16 --variants 2x2,4x2,8x2,16x2,8x1 --pdl \
    --out "$out/cuda_gemm_pdl" | grep -v "^check.*e-03$" | tail -20
step "how fast a kernel that only reads each shape's bytes is (the per-call ceiling), PDL off and on"
timeout 120 python benchmarks/read_ceiling.py > "$out/read_ceiling.txt" 2>&1; cat "$out/read_ceiling.txt"
timeout 120 python benchmarks/read_ceiling.py --pdl > "$out/read_ceiling_pdl.txt" 2>&1; cat "$out/read_ceiling_pdl.txt"
step "decode end to end with fp4_gemm: cuda, 512-token context"
timeout 200 python benchmarks/graphs.py "${B[@]}" --context 512 --set backends.fp4_gemm=cuda \
    --out "$out/decode512_cuda.md" | tail -5
step "the same with the block's norms fused into the cuda GEMMs (fuse_norm, off by default)"
timeout 200 python benchmarks/graphs.py "${B[@]}" --context 512 --set backends.fp4_gemm=cuda \
    --set backends.options.cuda.fuse_norm=true --out "$out/decode512_cuda_fused_norm.md" | tail -5
step "kernel timeline of the batch-1 step with fp4_gemm: cuda (what each kernel adds under PDL)"
timeout 150 python benchmarks/timeline.py --decode 1 --set quantization.format=nvfp4 --set backends.fp4_gemm=cuda \
    --set backends.options.flashinfer.variant=fa2 --steps 20 > "$out/timeline_b1.txt" 2>&1
grep -v "INFO\|arn" "$out/timeline_b1.txt" | head -16
step done
