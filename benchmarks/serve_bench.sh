#!/usr/bin/env bash
# `pieceworks bench` against `pieceworks serve` on one GPU: the Llama-3.1-8B shape with random weights,
# NVFP4 then bf16, at concurrency 1 / 16 / 64 (streamed HTTP on 127.0.0.1; prompts of 256-768 random
# tokens, 64-192 new tokens, ignore_eos). One device call (about 5 minutes on the H200), from the
# repository root:
#   bash benchmarks/serve_bench.sh "$OUT"
# Writes serve_bench.log (the tables) and serve_bench.tar.gz (per-run JSON, both servers' logs).
set -uo pipefail
[ -f .gpu/setup.sh ] && source .gpu/setup.sh  # fastapi, uvicorn, httpx, pydantic on the device
. benchmarks/device_out.sh
device_outputs serve_bench "${1:?usage: serve_bench.sh OUTDIR}"
port=8011
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
for fmt in nvfp4 none; do
    step "serve quantization.format=$fmt"
    python -m pieceworks.cli serve configs/llama-3.1-8b-random-fp4.yaml quantization.format=$fmt \
        --served-model-name llama-3.1-8b-$fmt --port $port --max-queue 1024 > "$out/serve_$fmt.log" 2>&1 &
    pid=$!
    up=0
    for _ in $(seq 480); do
        if python -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=2)" 2> /dev/null; then
            up=1; break
        fi
        kill -0 $pid 2> /dev/null || break
        sleep 0.5
    done
    if [ $up = 0 ]; then echo "server ($fmt) did not come up:"; tail -40 "$out/serve_$fmt.log"; kill $pid; continue; fi
    step "server up ($fmt)"
    for c in 1 16 64; do
        n=$(( c == 1 ? 16 : 4 * c ))
        timeout 150 python -m pieceworks.cli bench --url "http://127.0.0.1:$port" --num-prompts $n \
            --input-len 512 --output-len 128 --range-ratio 0.5 --max-concurrency $c --seed 0 --no-progress \
            --result-json "$out/${fmt}_c$c.json"
    done
    python -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:$port/metrics').read().decode())" \
        | grep -v '^#' | grep -v _bucket > "$out/metrics_$fmt.txt"
    kill -INT $pid
    wait $pid
    tail -5 "$out/serve_$fmt.log"
done
step done
