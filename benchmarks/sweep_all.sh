#!/usr/bin/env bash
# Tile-table experiments in one device call (about 7 minutes with warm caches), for a branch that adds
# tile options or sweep candidates:
#   bash benchmarks/sweep_all.sh OUTDIR [GEMM_MS] [MOE_TS] [DECODE]
# (on the device: source .gpu/setup.sh first)
# GEMM_MS: tuning Ms of the GEMM sweep (default 1,16,32; a tuning M that benchmarks/fp4_gemm.py's
# BUCKETS lacks is skipped), MOE_TS: tuning Ts of the MoE sweep (default 1,16; "-" skips it), DECODE:
# the decode batch sizes (default 1,8,32). Runs the Triton GPU tests, both sweeps (their per-candidate
# lines go to the logs: the MoE sweep's JSON keeps only the table), and the decode step at 512 tokens
# with the shipped GEMM table and with the swept one, interleaved (shipped, swept, shipped, swept).
# Writes OUTDIR/sweep_all.tar.gz and OUTDIR/sweep_all.log (the printed summary). Each step has its own time limit.
set -u
dest=${1:?usage: bash benchmarks/sweep_all.sh OUTDIR [GEMM_MS] [MOE_TS] [DECODE]}
ms=${2:-1,16,32}
ts=${3:-1,16}
decode=${4:-1,8,32}
source "$(dirname "$0")/device_out.sh"
device_outputs sweep_all "$dest"
cd "$(dirname "$0")/.."
failed() { echo "   (exit $1; the end of $2:)"; tail -5 "$2" | sed 's/^/   /'; }
step "Triton GPU tests"
timeout 150 python -m pytest tests/gpu/test_triton_fp4.py -m gpu -q -x 2>&1 | tail -3
step "GEMM sweep, tuning M = $ms"
timeout 120 python benchmarks/fp4_gemm.py --sweep --sweep-m "$ms" --ms "$ms" --out "$out/g" > "$out/gemm.log" 2>&1 \
    || failed $? "$out/gemm.log"
grep -E "best|fp4 |FAILED|WRONG" "$out/gemm.log"
if [ "$ts" != - ]; then
    step "MoE sweep, tuning T = $ts"
    # --cuda-moe-max-t 0: benchmark the swept Triton tiles (by default T <= 128 runs the CUDA decode path)
    timeout 150 python benchmarks/moe.py --sweep --sweep-t "$ts" --tokens 1,4,16,64 --cuda-moe-max-t 0 --out "$out/m" \
        > "$out/moe.log" 2>&1 || failed $? "$out/moe.log"
    grep -E "best|^T=|FAILED|WRONG" "$out/moe.log"
fi
B=(--quant nvfp4 --set cuda_graph.piecewise.enabled=off --extend '' --set backends.options.flashinfer.variant=fa2
   --decode "$decode" --decode-sizes "$decode" --context 512)
for run in shipped swept shipped swept; do
    step "decode step, $run GEMM table (Executor.forward / replay ms)"
    extra=()
    [ "$run" = swept ] && extra=(--set "backends.options.triton.gemm_tiles=$out/g/gemm_sweep.json")
    timeout 120 python benchmarks/graphs.py "${B[@]}" "${extra[@]}" > "$out/decode_$run.log" 2>&1 \
        || failed $? "$out/decode_$run.log"
    grep -E "^\| [0-9]" "$out/decode_$run.log"
done
step done
