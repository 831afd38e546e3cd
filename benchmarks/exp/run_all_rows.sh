# exp/extend-all-rows on the GPU machine: bash benchmarks/exp/run_all_rows.sh (carry .gpu; about 6 minutes)
# Steps that want every token's logits of some sequences (speculative verification) through the full extend graphs
# where the bucket computes that many rows, against piecewise (PIECEWORKS_EXP_ALL_ROWS=0, main's behaviour).
source .gpu/setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python -m pytest -q -m gpu tests/gpu/test_extend_graph_gpu.py 2>&1 | tail -1
timeout 150 python -m pytest -q -m gpu tests/gpu/test_engine_gpu.py 2>&1 | tail -1
for a in 1 0 1 0; do
  echo "=== all rows $a $(date -u +%T)"
  PIECEWORKS_EXP_ALL_ROWS=$a timeout 150 python benchmarks/speculative.py --task scripted --accept 0.5,0.8 --batch 1,4,16 \
    --rounds 1 --set model.arch=llama --set model.preset=llama-3.1-8b --set quantization.format=nvfp4 2>&1 | grep "^|"
done
