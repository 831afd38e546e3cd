# Whether full extend graphs should cover steps past 512 tokens: bash benchmarks/exp/run_extend_sizes.sh (carry .gpu;
# about 3 minutes). Piecewise and the extend graphs at the same buckets, so the padding rule sends each T to the
# extend graph; graphs.py's second tables and Executor.forward of a new prompt with and without them.
source .gpu/setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
for i in 1 2; do
  echo "=== run $i $(date -u +%T)"
  timeout 150 python benchmarks/graphs.py --set backends.options.flashinfer.variant=fa2 --extend 512,768,1024,2048 \
    --context 512 --decode= --set cuda_graph.decode.enabled=off --set "cuda_graph.piecewise.sizes=[512,768,1024,2048]" \
    --set "cuda_graph.extend.sizes=[512,768,1024,2048]" --plain off --repeats 10 2>&1 | grep -A20 "piecewise + logits ms" \
    | grep "^| [0-9]"
done
