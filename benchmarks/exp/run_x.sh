source .gpu/setup.sh
set -f
nvidia-smi --query-gpu=name --format=csv,noheader
date -u +%T
timeout 100 python exp_ext_check.py 2>&1 | grep -v -i "warn\|jit" | tail -16
G="--set backends.options.flashinfer.variant=fa2 --extend 16,128 --mixed 256x32 --context 512 --decode= --set cuda_graph.decode.enabled=off --set cuda_graph.piecewise.sizes=[16,128,288] --plain off"
for att in flashinfer triton; do
  echo "=== $att $(date -u +%T)"
  timeout 85 python benchmarks/graphs.py --attention flashinfer $G --set backends.attention=$att --out $OUT/ext_$att.md 2>&1 | grep -v -i "warn\|jit" | grep "^|\|Capture\|rror" | tail -12
done
date -u +%T
