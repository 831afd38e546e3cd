# exp/full-extend on the GPU machine: bash benchmarks/exp/run_full_extend.sh (carry .gpu)
source .gpu/setup.sh
set -f
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python -m pytest -q tests/gpu/test_extend_graph_gpu.py -m gpu 2>&1 | tail -5
G="--set backends.options.flashinfer.variant=fa2 --extend 16,64,128,256 --mixed 256x32 --context 512 --decode= --set cuda_graph.decode.enabled=off --set cuda_graph.piecewise.sizes=[16,64,128,256,288] --plain off"
X=(--set "backends.attention={decode: triton, extend: triton_all}" --set cuda_graph.extend.enabled=on --set "cuda_graph.extend.sizes=[16,64,128,256,288]" --set cuda_graph.extend.max_seqs=33)
echo "=== FlashInfer piecewise $(date -u +%T)"
timeout 150 python benchmarks/graphs.py --attention flashinfer $G --out $OUT/ext_fi.md 2>&1 | grep "T=\|^|\|rror" | tail -12
echo "=== attention.triton + extend graphs $(date -u +%T)"
timeout 150 python benchmarks/graphs.py --attention flashinfer $G "${X[@]}" --out $OUT/ext_full.md 2>&1 | grep "T=\|^|\|rror" | tail -12
date -u +%T
