# exp/extend-zero-pad on the GPU machine: bash benchmarks/exp/run_zero_pad.sh (carry .gpu; about 4 minutes)
source .gpu/setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python -m pytest -q -m gpu tests/gpu/test_extend_graph_gpu.py tests/gpu/test_graphs.py -k "extend_graphs_give or (full_extend and llama-bf16)" 2>&1 | tail -2
timeout 60 python -m pytest -q tests/test_backend_matrix.py --pieceworks-device cuda -k full_extend 2>&1 | tail -1
for z in 1 0 1 0; do
  echo "=== in-kernel padding zeros: $z $(date -u +%T)"
  PIECEWORKS_EXP_ZERO_PAD=$z timeout 120 python benchmarks/graphs.py --set backends.options.flashinfer.variant=fa2 \
    --extend 16,64,128,256 --context 512 --decode= --set cuda_graph.decode.enabled=off \
    --set "cuda_graph.piecewise.sizes=[16,64,128,256]" --plain off 2>&1 | grep -A8 "piecewise + logits ms" | grep "^|"
done
