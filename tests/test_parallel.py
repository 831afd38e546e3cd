"""Tensor and expert parallelism on CPU (gloo): N ranks equal one process.

The multi-process tests start real worker processes (`Executor.from_config` with
parallel.tensor_parallel_size=2) and compare every step's float32 logits with a single-process executor
of the same random weights, on extend, decode and mixed steps, with and without piecewise graphs (on
CPU: the traced model split at the attention ops, run directly). The loading tests build one rank's
shard in this process (no process group) and check what it reads from a checkpoint.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import signal
import time
from pathlib import Path

import pytest
import torch

from pieceworks import ConfigError, Executor
from pieceworks.config import load_config
from pieceworks.core.batch import ForwardBatch
from pieceworks.models.checkpoint import CheckpointReader
from pieceworks.models.loader import load_model
from pieceworks.parallel import message_queue
from pieceworks.parallel.layout import Part, TPLayout
from pieceworks.parallel.workers import WorkerDied

BASE = ["runtime.device=cpu", "runtime.dtype=float32", "kv_cache.num_tokens=256", "kv_cache.page_size=4"]
LLAMA = ["model.arch=llama", "model.preset=tiny", *BASE]
DEEPSEEK = ["model.arch=deepseek_v3", "model.preset=tiny", *BASE]
TP2 = ["parallel.tensor_parallel_size=2"]
QWEN3_MOE = ["model.sizes.model_type=qwen3_moe", "model.sizes.num_experts=8", "model.sizes.num_experts_per_tok=2",
             "model.sizes.moe_intermediate_size=64"]
QWEN2_MOE = ["model.sizes.model_type=qwen2_moe", "model.sizes.num_experts=8", "model.sizes.num_experts_per_tok=2",
             "model.sizes.moe_intermediate_size=64", "model.sizes.shared_expert_intermediate_size=64"]
GLM4_MOE = ["model.sizes.model_type=glm4_moe", "model.sizes.n_routed_experts=8", "model.sizes.num_experts_per_tok=2",
            "model.sizes.moe_intermediate_size=64", "model.sizes.n_group=2", "model.sizes.topk_group=1",
            "model.sizes.routed_scaling_factor=2.5", "model.sizes.attention_bias=true", "model.sizes.use_qk_norm=true"]
ERNIE_MOE = ["model.sizes.model_type=ernie4_5_moe", "model.sizes.moe_num_experts=8", "model.sizes.moe_k=2",
             "model.sizes.moe_intermediate_size=64", "model.sizes.moe_num_shared_experts=1"]
PIECEWISE = ["cuda_graph.piecewise.enabled=on", "cuda_graph.piecewise.sizes=[8,16]"]


def steps(ex: Executor) -> list[torch.Tensor]:
    """Logits of an extend (every row), a decode and a mixed step, then greedy tokens of generate."""
    a, b, c = ex.new_sequence(), ex.new_sequence(), ex.new_sequence()
    out = [ex.forward(ForwardBatch([a, b], [[1, 2, 3, 4, 5, 6], [7, 8, 9]], return_all_logits=True)),
           ex.forward(ForwardBatch([a, b], [[10], [11]])),
           ex.forward(ForwardBatch([a, c], [[12], [3, 1, 4, 1, 5]])),
           ex.forward(ForwardBatch([c, a], [[9, 2], [13]], return_all_logits=[True, False]))]
    for s in (a, b, c):
        ex.free(s)
    out.append(torch.tensor(ex.generate([[5, 6, 7], [9, 10]], max_new_tokens=4)))
    return out


def assert_same(ref: list[torch.Tensor], got: list[torch.Tensor]) -> None:
    for i, (r, g) in enumerate(zip(ref, got)):
        if r.dtype.is_floating_point:
            torch.testing.assert_close(g, r, rtol=0, atol=1e-5, msg=f"step {i}")
            assert torch.equal(g.argmax(-1), r.argmax(-1)), f"step {i}: greedy tokens differ"
        else:
            assert torch.equal(g, r), f"generated tokens differ: {g.tolist()} vs {r.tolist()}"


def shm_segments() -> set[str]:
    """The step-message queues' shared memory segments that exist now."""
    return {n for n in os.listdir("/dev/shm") if n.startswith("pieceworks-mq-")} if os.path.isdir("/dev/shm") else set()


def no_children_left() -> bool:
    deadline = time.monotonic() + 10
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    return not multiprocessing.active_children()


# ----------------------------------------------------------------------------- configuration errors
@pytest.mark.parametrize("overrides, match", [
    (LLAMA + ["parallel.tensor_parallel_size=3"], "num_attention_heads=4"),
    (LLAMA + ["parallel.tensor_parallel_size=2", "model.sizes.vocab_size=511"], "vocab_size=511"),
    (LLAMA + ["parallel.tensor_parallel_size=0"], "must be >= 1"),
    (LLAMA + ["parallel.tensor_parallel_size=2", "runtime.device=cuda:0"], "names one GPU"),
    (DEEPSEEK + ["parallel.tensor_parallel_size=4", "parallel.expert_parallel=true", "model.sizes.n_routed_experts=6"],
     "n_routed_experts=6"),
    (DEEPSEEK + ["parallel.tensor_parallel_size=4", "quantization.format=nvfp4"], "NVFP4 block"),
    (LLAMA + ["parallel.tensor_parallel_size=2", "model.sizes.model_type=olmo2"], "OLMo 2's and 3's q and k norms"),
    (LLAMA + ["parallel.tensor_parallel_size=2", "model.sizes.model_type=olmo3"], "OLMo 2's and 3's q and k norms"),
], ids=["heads", "vocab", "zero", "one-gpu", "experts", "fp4-block", "olmo2", "olmo3"])
def test_bad_parallel_config_is_a_config_error_before_any_process(overrides, match):
    with pytest.raises(ConfigError, match=match):
        Executor.from_config(None, overrides, progress=False)
    assert not multiprocessing.active_children()


def test_more_ranks_than_gpus_is_a_config_error(monkeypatch):
    from pieceworks.executor.distributed import check_layout

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cfg = load_config(None, LLAMA + TP2)
    with pytest.raises(ConfigError, match="need 2 GPUs, but 1 are visible"):
        check_layout(cfg, torch.device("cuda"))


def test_torchrun_world_size_must_match(monkeypatch):
    for k, v in {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError, match="torchrun started 4 processes"):
        Executor.from_config(None, LLAMA + TP2, progress=False)


def test_torchrun_variables_must_be_integers(monkeypatch):
    for k, v in {"RANK": "0", "WORLD_SIZE": "two", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError, match="WORLD_SIZE='two'"):
        Executor.from_config(None, LLAMA + TP2, progress=False)


# ----------------------------------------------------------------------------- sharded loading
def test_random_shards_are_slices_of_the_single_process_weights():
    cfg = load_config(None, LLAMA + ["quantization.format=nvfp4"])
    full = load_model(cfg.model, cfg.quantization, "cpu", torch.float32, progress=False)
    for rank in range(2):
        shard = load_model(cfg.model, cfg.quantization, "cpu", torch.float32, progress=False, tp=TPLayout(rank, 2))
        assert torch.equal(shard.embed_tokens.weight, Part(0, rank, 2).take(full.embed_tokens.weight))
        assert torch.equal(shard.lm_head.weight, Part(0, rank, 2).take(full.lm_head.weight))
        for name in ("weight", "weight_scale"):  # NVFP4 codes and block scales of a row-parallel linear
            got = getattr(shard.layers[1].self_attn.o_proj, name)
            want = Part(1, rank, 2).take(getattr(full.layers[1].self_attn.o_proj, name))
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(shard.layers[1].mlp.down_proj.weight_scale_2, full.layers[1].mlp.down_proj.weight_scale_2)


@pytest.mark.parametrize("fmt", ["bf16", "fp4"])
def test_sharded_loading_reads_only_the_ranks_slices(tiny_llama_modelopt, monkeypatch, fmt):
    path = tiny_llama_modelopt.bf16_dir if fmt == "bf16" else tiny_llama_modelopt.fp4_dir
    reads: list[tuple[str, int, bool]] = []  # (name, bytes, whole tensor)
    get, get_part = CheckpointReader.get, CheckpointReader.get_part

    def whole(self, name):
        t = get(self, name)
        reads.append((name, t.numel() * t.element_size(), True))
        return t

    def part(self, name, dim, start, stop):
        t = get_part(self, name, dim, start, stop)
        reads.append((name, t.numel() * t.element_size(), False))
        return t

    monkeypatch.setattr(CheckpointReader, "get", whole)
    monkeypatch.setattr(CheckpointReader, "get_part", part)
    cfg = load_config(None, [f"model.path={path}", *BASE])
    full = load_model(cfg.model, cfg.quantization, "cpu", torch.float32, progress=False)
    full_bytes = sum(n for _, n, _ in reads)
    sharded = ("_proj.weight", "_proj.weight_scale", "embed_tokens.weight", "lm_head.weight")
    for rank in range(2):
        reads.clear()
        shard = load_model(cfg.model, cfg.quantization, "cpu", torch.float32, progress=False, tp=TPLayout(rank, 2))
        read_whole = [n for n, _, w in reads if w and n.endswith(sharded)]
        assert not read_whole, f"rank {rank} read whole tensors it holds a slice of: {read_whole[:4]}"
        rank_bytes = sum(n for _, n, _ in reads)
        assert rank_bytes < 0.55 * full_bytes, (rank, rank_bytes, full_bytes)
        want = Part(1, rank, 2).take(full.layers[0].mlp.down_proj.weight)
        assert torch.equal(shard.layers[0].mlp.down_proj.weight.view(torch.uint8), want.contiguous().view(torch.uint8))


def test_expert_parallel_rank_reads_its_own_experts(tiny_deepseek_modelopt, monkeypatch):
    read: list[str] = []
    get = CheckpointReader.get
    monkeypatch.setattr(CheckpointReader, "get", lambda self, name: read.append(name) or get(self, name))
    cfg = load_config(None, [f"model.path={tiny_deepseek_modelopt.fp4_dir}", *BASE])
    shard = load_model(cfg.model, cfg.quantization, "cpu", torch.float32, progress=False,
                       tp=TPLayout(1, 2, None, expert_parallel=True))
    experts = [m for m in shard.modules() if hasattr(m, "first_expert")]
    first, n = experts[0].first_expert, experts[0].num_experts
    assert first == n and n == experts[0].total_experts // 2
    ids = {int(name.split(".")[5]) for name in read if ".mlp.experts." in name}
    assert ids == set(range(first, first + n))


# ----------------------------------------------------------------------------- N ranks == 1 process
@pytest.fixture(scope="module")
def reference():
    """Single-process results per configuration, built once."""
    cache: dict[tuple, list[torch.Tensor]] = {}

    def get(overrides: list[str]) -> list[torch.Tensor]:
        key = tuple(overrides)
        if key not in cache:
            cache[key] = steps(Executor.from_config(None, overrides, progress=False))
        return cache[key]

    return get


@pytest.mark.parametrize("extra", [
    ["model.sizes.num_key_value_heads=1", *PIECEWISE],  # fewer KV heads than ranks: each rank reads the one
    ["model.sizes.num_key_value_heads=4", "model.sizes.tie_word_embeddings=true"],  # more: two each
    ["model.sizes.num_key_value_heads=1", "model.sizes.model_type=qwen2"],  # q/k/v biases: each rank its rows
    ["model.sizes.num_key_value_heads=4", "model.sizes.model_type=qwen3"],  # q/k norms, whole on every rank
    ["model.sizes.num_key_value_heads=4", *QWEN3_MOE],  # softmax-routed experts, their columns split
    ["model.sizes.num_key_value_heads=4", *QWEN3_MOE, "parallel.expert_parallel=true"],  # whole experts per rank
    ["model.sizes.num_key_value_heads=4", *QWEN2_MOE],  # and a gated shared expert, its columns split
    ["model.sizes.num_key_value_heads=4", *QWEN2_MOE, "parallel.expert_parallel=true"],
    # Granite's scalars (the residual one after the row-parallel sums)
    ["model.sizes.num_key_value_heads=2", "model.sizes.model_type=granite", "model.sizes.residual_multiplier=0.5",
     "model.sizes.attention_multiplier=0.1", "model.sizes.embedding_multiplier=3.0"],
    # GLM-4's q/k/v biases, interleaved rope over half of each head and sandwich norms
    ["model.sizes.num_key_value_heads=2", "model.sizes.model_type=glm4", "model.sizes.partial_rotary_factor=0.5"],
    # GLM-4.5's: grouped sigmoid routing with a shared expert after a dense layer, q/k/v biases and norms, half
    # of each head rotated; the experts' columns split, and whole experts per rank
    ["model.sizes.num_key_value_heads=2", *GLM4_MOE],
    ["model.sizes.num_key_value_heads=2", *GLM4_MOE, "parallel.expert_parallel=true"],
    # ERNIE 4.5's softmax scores chosen with a correction bias (in the model under expert parallel), interleaved rope
    ["model.sizes.num_key_value_heads=2", *ERNIE_MOE],
    ["model.sizes.num_key_value_heads=2", *ERNIE_MOE, "parallel.expert_parallel=true"],
    # Gemma 3's 4-token sliding windows in every other layer (their own rope), per-head q/k norms, GeGLU
    ["model.sizes.num_key_value_heads=2", "model.sizes.model_type=gemma3_text", "model.sizes.sliding_window=4",
     "model.sizes.sliding_window_pattern=2", "model.sizes.query_pre_attn_scalar=16"],
    # EXAONE 4's post-norm blocks, per-head q/k norms, 4-token windows in 3 of 4 layers, the full one without rope
    ["model.sizes.num_key_value_heads=2", "model.sizes.model_type=exaone4", "model.sizes.sliding_window=4",
     "model.sizes.num_hidden_layers=4"],
    # an FP8 KV pool on every rank (each its KV heads' share, the same per-layer scales)
    ["model.sizes.num_key_value_heads=2", "kv_cache.dtype=fp8"],
], ids=["kv1-piecewise", "kv4-tied-eager", "kv1-qwen2", "kv4-qwen3", "kv4-qwen3-moe", "kv4-qwen3-moe-ep",
        "kv4-qwen2-moe", "kv4-qwen2-moe-ep", "kv2-granite-partial-rope", "kv2-glm4", "kv2-glm4-moe",
        "kv2-glm4-moe-ep", "kv2-ernie-moe", "kv2-ernie-moe-ep", "kv2-gemma3", "kv2-exaone4", "kv2-fp8-kv"])
def test_llama_tp2_equals_one_process(reference, extra):
    with Executor.from_config(None, LLAMA + extra + TP2, progress=False) as ex:
        assert ex.kv.layout.num_kv_heads == max(1, int(extra[0][-1]) // 2)
        queue = ex.groups.queue  # the workers share this host: the steps go through shared memory
        assert (queue is not None) == message_queue.usable()
        got = steps(ex)
        assert ex.piecewise is None or ex.piecewise.backend.num_compiles == 1  # the collectives add no retrace
        assert queue is None or queue.name in shm_segments()
    assert_same(reference(LLAMA + extra), got)
    assert no_children_left()
    assert queue is None or queue.name not in shm_segments()


@pytest.mark.slow
def test_llama_tp4_equals_one_process(reference):
    """Four ranks, two KV heads: each KV head is read by two ranks."""
    with Executor.from_config(None, LLAMA + ["parallel.tensor_parallel_size=4"], progress=False) as ex:
        assert ex.kv.layout.num_kv_heads == 1 and ex.model.layers[0].self_attn.num_heads == 1
        got = steps(ex)
    assert_same(reference(LLAMA), got)
    assert no_children_left()


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    """A tiny MixtralForCausalLM saved by transformers (its block_sparse_moe / w1 / w3 / w2 names)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.2)
    path = tmp_path_factory.mktemp("mixtral")
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("extra", [[], ["parallel.expert_parallel=true"]], ids=["tp", "ep"])
def test_mixtral_checkpoint_tp2_equals_one_process(reference, mixtral_dir, extra):
    """Each rank reads its slices (or its experts) of a Mixtral checkpoint through the renamed names."""
    one = [f"model.path={mixtral_dir}", *BASE]
    with Executor.from_config(None, one + extra + TP2, progress=False) as ex:
        got = steps(ex)
    assert_same(reference(one), got)
    assert no_children_left()


def test_phi3_checkpoint_tp2_equals_one_process(reference, tmp_path_factory):
    """Each rank reads its q, k, v, gate and up rows out of Phi-3's fused qkv_proj and gate_up_proj."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("phi3")
    transformers.Phi3ForCausalLM(transformers.Phi3Config(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=None, eos_token_id=2)).save_pretrained(path)
    one = [f"model.path={path}", *BASE]
    with Executor.from_config(None, one + TP2, progress=False) as ex:
        got = steps(ex)
    assert_same(reference(one), got)
    assert no_children_left()


DEEPSEEK_V2 = ["model.sizes.model_type=deepseek_v2", "model.sizes.topk_method=group_limited_greedy",
               "model.sizes.norm_topk_prob=false"]


# GLM-4.7-Flash's: its MoE layers listed (the first one sparse, which DeepSeek's rule can't say), qk_nope and v head
# sizes of their own
GLM_LITE = ["model.sizes.model_type=glm4_moe_lite", "model.sizes.mlp_layer_types=[sparse,dense,sparse]",
            "model.sizes.qk_nope_head_dim=24", "model.sizes.v_head_dim=20"]


@pytest.mark.parametrize("extra", [[*PIECEWISE], ["parallel.expert_parallel=true"], DEEPSEEK_V2,
                                   [*DEEPSEEK_V2, "parallel.expert_parallel=true"], GLM_LITE],
                         ids=["tp-piecewise", "ep", "v2-groups", "v2-groups-ep", "glm4-moe-lite"])
def test_deepseek_tp2_equals_one_process(reference, extra):
    with Executor.from_config(None, DEEPSEEK + extra + TP2, progress=False) as ex:
        got = steps(ex)
        assert ex.piecewise is None or ex.piecewise.backend.num_compiles == 1
    single = [e for e in extra if not e.startswith("parallel.")]
    assert_same(reference(DEEPSEEK + single), got)
    assert no_children_left()


@pytest.mark.parametrize("collectives", [False, True])
def test_one_rank_through_the_distributed_path_equals_one_process(reference, collectives, monkeypatch):
    """World size 1 with a process group: every step takes the leader's path (`send_step`), which has
    no follower to tell, so it builds and sends no message (and the group has no shared-memory queue);
    the collectives (each a copy of one rank) run when asked. Nothing changes the logits. Without
    `collectives` the models skip them."""
    from pieceworks.executor import distributed
    from pieceworks.executor.distributed import one_rank

    leader_steps, sends = [], []
    send_step = distributed.send_step
    monkeypatch.setattr(distributed, "send_step", lambda ex, *a: (leader_steps.append(1), send_step(ex, *a)))
    cfg = load_config(None, LLAMA + ["quantization.format=nvfp4"])
    with one_rank(Executor, cfg, progress=False, collectives=collectives) as ex:
        assert (ex.model.tp.group is not None) == collectives
        assert ex.groups.size == 1 and ex.groups.queue is None
        broadcast = ex.groups.broadcast
        ex.groups.broadcast = lambda *a, **kw: (sends.append(a), broadcast(*a, **kw))[1]
        got = steps(ex)
        assert len(leader_steps) >= 7  # 3 forward steps, 4 generate steps
        assert sends == [] and ex.sent_pages.steps == 0 and ex.sent_pages.counts == {}
        rendezvous = ex.rendezvous
        assert rendezvous is not None and os.path.isdir(rendezvous)
    assert not os.path.exists(rendezvous)  # the file store's directory goes with the executor
    for r, g in zip(reference(LLAMA + ["quantization.format=nvfp4"]), got):
        assert torch.equal(r, g)


def test_step_messages_carry_only_new_pages_and_followers_rebuild_the_lists():
    """The leader's `SentPages` against a follower's `step_seqs` over random steps (sequences that start,
    gain pages, are cut back, get freed): every step's follower page lists equal the leader's, a step in
    which no sequence gained or lost a page carries none, and freed sequences leave both sides' records."""
    import random

    from pieceworks.core.batch import Sequence
    from pieceworks.executor.distributed import SentPages, step_seqs

    rng = random.Random(0)
    sent, follower = SentPages(), {}
    live: list[Sequence] = []
    next_id = next_page = cuts = 0
    for step in range(4 * SentPages.PRUNE_EVERY):
        if len(live) < 6 and rng.random() < 0.3:  # a new sequence, with or without prefix-cached pages
            live.append(Sequence(next_id, pages=list(range(next_page, next_page + rng.randint(0, 3)))))
            next_id, next_page = next_id + 1, next_page + 3
        if live and rng.random() < 0.1:
            gone = live.pop(rng.randrange(len(live)))
            gone.freed = True
        batch = rng.sample(live, rng.randint(1, len(live))) if live else []
        grew = cut = False
        for seq in batch:
            if seq.pages and rng.random() < 0.15:  # cut back (Executor.truncate: rejected drafts)
                sent.cut(seq.id)
                del seq.pages[rng.randrange(len(seq.pages)):]
                del seq.tokens[rng.randint(0, len(seq.tokens)):]
                cut, cuts = True, cuts + 1
            seq.tokens.append(step)
            if rng.random() < 0.25:
                seq.pages.append(next_page)
                next_page, grew = next_page + 1, True
        known = set(sent.counts)
        msg = sent.message(batch, [[step]] * len(batch), False)
        if not grew and not cut and all(s.id in known for s in batch):
            assert msg[3] == [()] * len(batch)
        got = step_seqs(follower, msg)
        assert [g.pages for g in got] == [s.pages for s in batch]
        assert [g.kv_len for g in got] == [s.kv_len for s in batch]
    assert sent.steps % SentPages.PRUNE_EVERY == 0  # the last step looked for freed sequences
    assert set(follower) == set(sent.counts) == set(sent.seqs) <= {s.id for s in live}
    assert next_id - len(live) >= 5  # sequences were freed along the way
    assert cuts > 10


@pytest.fixture(scope="module")
def fp4_tp2():
    ex = Executor.from_config(None, LLAMA + ["quantization.format=nvfp4"] + TP2, progress=False)
    yield ex
    ex.close()


def test_nvfp4_llama_tp2_equals_one_process(reference, fp4_tp2):
    assert_same(reference(LLAMA + ["quantization.format=nvfp4"]), steps(fp4_tp2))


def test_torchrun_launch_equals_one_process(reference):
    """`torchrun --nproc-per-node 2`: rank 0's from_config returns the leader, rank 1 follows and exits 0."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "helpers" / "tp_torchrun.py"
    overrides = LLAMA + ["quantization.format=nvfp4"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script),
                          *overrides, *TP2], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(l for l in run.stdout.splitlines() if l.startswith("TOKENS "))
    assert json.loads(line[7:]) == reference(overrides)[-1].tolist()
    line = next(l for l in run.stdout.splitlines() if l.startswith("QUEUE "))
    sent = json.loads(line[6:])  # both ranks on this host: the step messages went through shared memory
    assert sent is None if not message_queue.usable() else sent >= 4


def test_torchrun_pieceworks_run_exits_cleanly_on_every_rank():
    """`torchrun --nproc-per-node 2 -m pieceworks.cli run ...`: the main job closes its executor, so the
    follower is told to stop and every rank exits 0 (it raised once the leader had exited unclosed)."""
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
                          "pieceworks.cli", "run", *LLAMA, *TP2, "generation.max_new_tokens=3"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "tokens/s" in run.stdout and "Traceback" not in run.stderr


def test_a_leader_never_closed_still_stops_its_followers(tmp_path):
    """A leader dropped without close (spawned workers: once collected; torchrun: when the script ends) tells
    its followers to stop through its finalizer: no worker process is left, and every torchrun rank exits 0.
    Both in fresh processes (this one's default process group may be taken by a module fixture)."""
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    spawned = tmp_path / "spawned.py"
    spawned.write_text(
        "import gc, multiprocessing, sys, time\nfrom pieceworks import Executor\n\n"
        "def main():\n    ex = Executor.from_config(None, sys.argv[1:], progress=False)\n"
        "    assert ex.generate([[5, 6, 7]], max_new_tokens=2)\n\n"
        "if __name__ == '__main__':\n    main()\n    gc.collect()\n    deadline = time.monotonic() + 10\n"
        "    while multiprocessing.active_children() and time.monotonic() < deadline:\n        time.sleep(0.1)\n"
        "    print('CHILDREN', len(multiprocessing.active_children()), flush=True)\n")
    run = subprocess.run([sys.executable, str(spawned), *LLAMA, *TP2], capture_output=True, text=True, timeout=300,
                         env=env)
    assert run.returncode == 0 and "CHILDREN 0" in run.stdout, run.stdout[-1000:] + run.stderr[-3000:]
    script = tmp_path / "unclosed.py"
    script.write_text("import sys\nfrom pieceworks import Executor\n\n"
                      "def main():\n    ex = Executor.from_config(None, sys.argv[1:], progress=False)\n"
                      "    print('TOKENS', ex.generate([[5, 6, 7]], max_new_tokens=3), flush=True)\n\nmain()\n")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script),
                          *LLAMA, *TP2], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "TOKENS" in run.stdout


def test_killed_worker_is_reported_and_nothing_hangs(fp4_tp2):
    queue = fp4_tp2.groups.queue
    seq = fp4_tp2.new_sequence()
    fp4_tp2.forward(ForwardBatch([seq], [[1, 2, 3]]))
    os.kill(fp4_tp2.workers.procs[0].pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerDied, match=r"worker rank 1 .*signal 9"):
        fp4_tp2.forward(ForwardBatch([seq], [[4]]))
    assert time.monotonic() - t0 < 30
    assert seq.kv_len == 3 and len(seq.pages) == 1  # the failed step took nothing
    with pytest.raises(RuntimeError, match="closed"):
        fp4_tp2.forward(ForwardBatch([seq], [[4]]))
    assert no_children_left()
    assert queue is None or queue.name not in shm_segments()


def test_speculative_engine_tp2_equals_one_process(monkeypatch):
    """Drafts that are mostly rejected cut the leader's sequences back by a page almost every step (and the next
    step takes one again): the followers' page lists follow (`SentPages.cut`), so two ranks give the greedy
    tokens of one process without speculation."""
    from pieceworks import Engine, SamplingParams
    from pieceworks.engine.speculative import NgramIndex

    monkeypatch.setattr(NgramIndex, "propose", lambda self, req, k: [7] * k)
    prompts = [[5, 6, 7, 8, 9], [9, 10, 11], list(range(20, 33))]
    params = SamplingParams(temperature=0, max_tokens=12)
    with Engine.from_config(None, LLAMA, progress=False) as one:
        want = [o.token_ids for o in one.generate(prompts, params)]
    spec = ["speculative.method=ngram", "speculative.num_speculative_tokens=3"]
    with Engine.from_config(None, LLAMA + TP2 + spec, progress=False) as two:
        got = [o.token_ids for o in two.generate(prompts, params)]
        assert two.stats()["num_draft_tokens"] > 0
    assert got == want
    assert no_children_left()


def test_a_worker_gone_before_generate_is_named_not_masked_by_the_cleanup():
    """generate's cleanup frees its sequences; the failed step closed the executor, which holds no pages any more:
    the error that reaches the caller is the step's WorkerDied, not a free's "this executor is closed"."""
    ex = Executor.from_config(None, LLAMA + TP2, progress=False)
    os.kill(ex.workers.procs[0].pid, signal.SIGKILL)
    with pytest.raises(WorkerDied, match=r"worker rank 1 .*signal 9"):
        ex.generate([[1, 2, 3]], 4)
    assert ex.closed and no_children_left()


@pytest.mark.parametrize("how, code, says", [("SIGTERM", 143, ""), ("SIGINT to the process group", 130, "interrupted")])
def test_a_signal_mid_run_ends_the_tensor_parallel_run_cleanly(tmp_path, how, code, says):
    """SIGTERM unwinds like Ctrl-C (the workers stopped, the rendezvous directory removed); Ctrl-C in a terminal
    reaches the workers too, which leave it to the leader: exit 130 with "interrupted", no worker traceback."""
    import subprocess

    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    cmd = [sys.executable, "-m", "pieceworks.cli", "run", "model.arch=llama", "model.preset=tiny", "runtime.device=cpu",
           *TP2, "model.sizes.max_position_embeddings=8192", "kv_cache.num_tokens=8192",
           "generation.max_new_tokens=6000"]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("pieceworks-tp-*")) and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(4)  # the workers built, generating
        assert p.poll() is None, p.communicate()
        if how == "SIGTERM":
            p.send_signal(signal.SIGTERM)
        else:
            os.killpg(p.pid, signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == code, err[-3000:]
    assert "Traceback" not in err and err.strip().endswith(says), err[-3000:]
    assert not list(tmp_path.glob("pieceworks-tp-*"))  # the rendezvous went with the run


def _env_worker(rank: int, name: str, want: str, status) -> None:
    """A worker that reports ready where the environment variable `name` holds `want` (else an error naming it)."""
    got = os.environ.get(name)
    status.send(("ready",) if got == want else ("error", f"rank {rank}: {name}={got!r}, the leader's is {want!r}"))


def test_workers_take_the_leaders_environment_of_each_launch(monkeypatch):
    """Workers fork from a server started at the first launch: each launch's workers still see the environment as it
    is when that launch starts."""
    from pieceworks.parallel.workers import WorkerGroup

    for value in ("first", "second"):
        monkeypatch.setenv("PIECEWORKS_TEST_LAUNCH", value)
        group = WorkerGroup(_env_worker, 3, ("PIECEWORKS_TEST_LAUNCH", value))
        try:
            group.wait_ready(60)
        finally:
            group.stop()
