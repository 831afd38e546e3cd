# exp/extend-zero-pad on the GPU machine: bash benchmarks/exp/run_zero_pad.sh (carry .gpu; about 5 minutes)
# A/B of the extend graph's extra GPU work over the whole graph + logits (main: 0.13-0.33 ms at T = 16-128 on an
# H100): in-kernel padding zeros (PIECEWORKS_EXP_ZERO_PAD=1) against out.zero_() per layer (0), and 64 against 4
# logits rows per bucket (cuda_graph.extend.max_seqs; a one-prompt step fits either).
source .gpu/setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python -m pytest -q -m gpu tests/gpu/test_extend_graph_gpu.py tests/gpu/test_graphs.py -k "extend_graphs_give or (full_extend and llama-bf16)" 2>&1 | tail -1
timeout 60 python -m pytest -q tests/test_backend_matrix.py --pieceworks-device cuda -k full_extend 2>&1 | tail -1
for run in "1 64" "0 64" "1 4" "0 4" "1 64" "0 64"; do
  set -- $run
  echo "=== zero_pad $1 max_seqs $2 $(date -u +%T)"
  PIECEWORKS_EXP_ZERO_PAD=$1 timeout 100 python benchmarks/graphs.py --set backends.options.flashinfer.variant=fa2 \
    --extend 16,64,128 --context 512 --decode= --set cuda_graph.decode.enabled=off \
    --set "cuda_graph.piecewise.sizes=[16,64,128]" --set cuda_graph.extend.max_seqs=$2 --plain off --repeats 30 \
    2>&1 | grep -A6 "piecewise + logits ms" | grep "^| [0-9]"
done
