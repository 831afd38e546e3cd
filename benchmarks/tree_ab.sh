#!/usr/bin/env bash
# A library change against another tree, interleaved in one device call (other, this, other, this):
#   bash benchmarks/tree_ab.sh OTHER OUTDIR [what...]      (on the device: source .gpu/setup.sh first)
# OTHER: a directory holding the other version's pieceworks/ and benchmarks/ (carried along, e.g.
# `mkdir -p scratch/base && git archive REV pieceworks benchmarks | tar -x -C scratch/base` here, then
# `carry: ["scratch"]`). what: any of gemm (benchmarks/fp4_gemm.py, PDL off; GEMM_MS, default
# 1,8,16,32,64), moe (benchmarks/moe.py; MOE_TS, default 1,4,16,64), decode (graphs.py's standard
# decode arguments at 512 tokens; DECODE, default 1,8,32); default: all three. Writes OUTDIR/tree_ab.log.
set -u
other=${1:?usage: bash benchmarks/tree_ab.sh OTHER OUTDIR [gemm] [moe] [decode]}
dest=${2:?usage: bash benchmarks/tree_ab.sh OTHER OUTDIR [gemm] [moe] [decode]}
shift 2
whats=${*:-gemm moe decode}
source "$(dirname "$0")/device_out.sh"
device_outputs tree_ab "$dest"
cd "$(dirname "$0")/.."
ms=${GEMM_MS:-1,8,16,32,64}
ts=${MOE_TS:-1,4,16,64}
decode=${DECODE:-1,8,32}
B=(--quant nvfp4 --set cuda_graph.piecewise.enabled=off --extend '' --set backends.options.flashinfer.variant=fa2
   --decode "$decode" --decode-sizes "$decode" --context 512)
for what in $whats; do
    for round in 1 2; do
        for tree in other this; do
            dir=.; [ $tree = other ] && dir=$other
            step "$what, $tree tree, round $round"
            log="$out/${what}_${tree}_$round.log"
            case $what in
                gemm) timeout 150 python "$dir/benchmarks/fp4_gemm.py" --ms "$ms" --out "$out/g_${tree}_$round" > "$log" 2>&1
                      rc=$?; grep " fp4 " "$log" ;;
                moe) timeout 150 python "$dir/benchmarks/moe.py" --tokens "$ts" --out "$out/m_${tree}_$round" > "$log" 2>&1
                     rc=$?; grep "^T=" "$log" ;;
                decode) timeout 150 python "$dir/benchmarks/graphs.py" "${B[@]}" --out "$out/d_${tree}_$round.md" > "$log" 2>&1
                        rc=$?; grep -E "^\| [0-9]" "$log" ;;
                *) echo "unknown: $what (use gemm, moe or decode)"; rc=0 ;;
            esac
            [ "$rc" = 0 ] || { echo "   (exit $rc; the end of its output:)"; tail -3 "$log" | sed 's/^/   /'; }
        done
    done
done
step done
