#!/usr/bin/env bash
# The block-scale formats of the Triton NVFP4 kernels (backends.options.triton.scales: bf16 multipliers or
# e4m3 bytes) against each other in one device call, interleaved (e4m3, bf16, e4m3, bf16):
#   bash benchmarks/scales_ab.sh OUTDIR [GEMM_MS] [MOE_TS] [DECODE]     (on the device: source .gpu/setup.sh)
# GEMM_MS (default 1,16,32): benchmarks/fp4_gemm.py --ms, PDL off; MOE_TS (default 1,16; "-" skips):
# benchmarks/moe.py --tokens; DECODE (default 1,8,32; "-" skips): decode batch sizes of graphs.py at 512
# tokens. Writes OUTDIR/scales_ab.log (the printed tables) and OUTDIR/scales_ab.tar.gz (every output).
set -u
dest=${1:?usage: bash benchmarks/scales_ab.sh OUTDIR [GEMM_MS] [MOE_TS] [DECODE]}
ms=${2:-1,16,32}
ts=${3:-1,16}
decode=${4:-1,8,32}
source "$(dirname "$0")/device_out.sh"
device_outputs scales_ab "$dest"
cd "$(dirname "$0")/.."
B=(--quant nvfp4 --set cuda_graph.piecewise.enabled=off --extend '' --set backends.options.flashinfer.variant=fa2
   --decode "$decode" --decode-sizes "$decode" --context 512)
for round in 1 2; do
    for s in e4m3 bf16; do
        step "GEMM, scales $s (round $round)"
        timeout 150 python benchmarks/fp4_gemm.py --ms "$ms" --scales "$s" --out "$out/gemm_${s}_$round" \
            > "$out/gemm_${s}_$round.log" 2>&1 || echo "   (exit $?)"
        grep -E " fp4 " "$out/gemm_${s}_$round.log"
    done
done
if [ "$ts" != - ]; then
    for s in e4m3 bf16 e4m3 bf16; do
        step "MoE, scales $s"
        timeout 150 python benchmarks/moe.py --tokens "$ts" --scales "$s" --out "$out/moe_$s" 2>&1 | grep -E "^T="
    done
fi
if [ "$decode" != - ]; then
    for s in e4m3 bf16 e4m3 bf16; do
        step "decode step, scales $s (Executor.forward / replay ms)"
        timeout 150 python benchmarks/graphs.py "${B[@]}" --set "backends.options.triton.scales=$s" \
            > "$out/decode_$s.log" 2>&1 || echo "   (exit $?)"
        grep -E "^\| [0-9]" "$out/decode_$s.log"
    done
fi
step done
