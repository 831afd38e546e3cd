"""exp/full-extend probe: where an extend-graph step's time goes (run vs replay vs host prep vs logits)."""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch
from common import gpu_ms, sync, wall_ms

from pieceworks import Executor
from pieceworks.core.batch import ForwardMode

ov = ["model.arch=llama", "model.preset=llama-3.1-8b", "model.max_context=9216", "quantization.format=none",
      "runtime.device=cuda", "runtime.dtype=bfloat16", "kv_cache.num_tokens=40960",
      "backends.attention={decode: triton, extend: triton_all}", "backends.options.flashinfer.variant=fa2",
      "cuda_graph.decode.enabled=off", "cuda_graph.piecewise.sizes=[16,64,128,256]",
      "cuda_graph.extend.enabled=on", "cuda_graph.extend.sizes=[16,64,128,256]",
      f"cuda_graph.extend.max_seqs={sys.argv[1] if len(sys.argv) > 1 else 33}"]
ex = Executor.from_config(None, ov, progress=False)
eg = ex.extend_graphs
for T in (16, 64, 128, 256):
    seq = ex.new_sequence()
    toks = [torch.randint(0, ex.vocab_size, (T,)).tolist()]
    pages = ex._reserve_pages([seq], toks)
    run = lambda: eg.run(ForwardMode.EXTEND, [seq], toks, None)
    real = eg.replay
    row = {"run": wall_ms(run, 30), "replay": wall_ms(lambda: eg.graphs[T].replay(), 30),
           "replay_gpu": gpu_ms(lambda: eg.graphs[T].replay(), 30)}
    eg.replay = lambda t, m: None
    row["prep_host"] = wall_ms(run, 30, wait=False)
    eg.replay = real
    h = torch.randn(1, 4096, device="cuda",
                    dtype=torch.bfloat16)
    row["logits1"] = wall_ms(lambda: ex.model.compute_logits(h), 30)
    h33 = h.expand(eg.max_seqs, -1).contiguous()
    row["logits_maxseqs"] = wall_ms(lambda: ex.model.compute_logits(h33), 30)
    row["run_gpu"] = gpu_ms(run, 30)
    print(T, {k: round(v, 3) for k, v in row.items()}, flush=True)
    ex._release([seq], pages)
    ex.free(seq)
