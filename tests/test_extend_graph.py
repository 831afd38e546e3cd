"""Full graphs for extend and mixed steps (`executor/extend_graph.py`) on the CPU, through the runner's host path
(`EagerExtendRunner`: the same buckets, static inputs, padding and plans, an eager forward for each replay):
logits equal the plain executor's for prompts, chunks over cached prefixes and mixed steps of several buckets;
steps past the buckets, past max_seqs or asking for every token's logits run as before; async placeholders
take the previous step's ids; the Engine's greedy outputs are unchanged."""

from __future__ import annotations

import pytest
import torch

from pieceworks import Engine, Executor, SamplingParams
from pieceworks.core.batch import ForwardBatch
from pieceworks.executor.extend_graph import EagerExtendRunner

CFG = {"model": {"arch": "llama", "preset": "tiny", "max_context": 256},
       "runtime": {"device": "cpu", "dtype": "float32"}, "kv_cache": {"num_tokens": 2048, "page_size": 4}}


def executors(sizes=(8, 16, 32), max_seqs=4):
    plain = Executor.from_config(CFG, progress=False)
    graphs = Executor.from_config(CFG, progress=False)
    graphs.extend_graphs = EagerExtendRunner(graphs.model, graphs.table, graphs.kv, graphs.max_context,
                                             list(sizes), max_seqs)
    return plain, graphs


def toks(n, seed):
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_steps_match_the_plain_executor():
    plain, graphs = executors()
    calls = []
    run = graphs.extend_graphs.run
    graphs.extend_graphs.run = lambda *a: calls.append(sum(map(len, a[2]))) or run(*a)
    seqs = {ex: [ex.new_sequence() for _ in range(5)] for ex in (plain, graphs)}
    steps = [
        ([0], [[*toks(5, 1)]]),                                   # a prompt in the 8-token bucket
        ([1, 2], [toks(13, 2), toks(3, 3)]),                      # two prompts, 16-token bucket
        ([0, 1, 2], [toks(7, 4), [9], [11]]),                     # a chunk over a prefix beside two decodes
        ([3, 4, 0, 1], [toks(20, 5), toks(6, 6), [1], [2]]),      # 32-token bucket, four sequences
        ([0, 1, 2, 3, 4], [[3], [4], [5], [6], toks(2, 7)]),      # five sequences: more than max_seqs
        ([2], [toks(40, 8)]),                                     # past the largest bucket
        ([3, 4], [[7], [8]]),                                     # decode: the extend graphs take none
        ([1], [toks(3, 10)]),                                     # back to the 8-token bucket, one sequence
    ]
    for idx, tk in steps:
        out = {ex: ex.forward(ForwardBatch([seqs[ex][i] for i in idx], tk)) for ex in (plain, graphs)}
        torch.testing.assert_close(out[graphs], out[plain], rtol=1e-5, atol=1e-5)
    assert calls == [5, 16, 9, 28, 3]
    scored = graphs.forward(ForwardBatch([seqs[graphs][4]], [toks(6, 9)], return_all_logits=True))
    assert scored.shape[0] == 6 and len(calls) == 5  # 6 logits rows: more than a bucket computes (max_seqs 4)


def test_async_placeholders_take_the_previous_ids():
    plain, graphs = executors()
    a, b = graphs.new_sequence(), graphs.new_sequence()
    pa, pb = plain.new_sequence(), plain.new_sequence()
    graphs.forward(ForwardBatch([a], [toks(6, 10)]))
    plain.forward(ForwardBatch([pa], [toks(6, 10)]))
    graphs.feed_ids(torch.tensor([42]))
    # row 0's placeholder (-1) stands for id 42, beside a new prompt in the same (mixed) step
    got = graphs.forward(ForwardBatch([a, b], [[-1], toks(5, 11)]), validate=False)
    want = plain.forward(ForwardBatch([pa, pb], [[42], toks(5, 11)]))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("async_steps", [False, True])
def test_engine_greedy_outputs_unchanged(async_steps):
    outs = []
    for with_graphs in (False, True):
        ex = Executor.from_config({**CFG, "scheduler": {"async_steps": async_steps, "max_num_batched_tokens": 24}},
                                  progress=False)
        calls = []
        if with_graphs:
            ex.extend_graphs = runner = EagerExtendRunner(ex.model, ex.table, ex.kv, ex.max_context, [8, 16, 32], 4)
            run = runner.run
            runner.run = lambda *a: calls.append(a[0]) or run(*a)
        eng = Engine(ex, tokenizer=None)
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        for i, n in enumerate((5, 30, 11)):
            eng.add_request(toks(n, 20 + i), params, str(i))
        done = {}
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = list(o.token_ids)
        outs.append(done)
    assert outs[0] == outs[1] and len(outs[0]) == 3
    assert len(calls) >= 2  # prompt chunks (24 tokens a step) and mixed steps went through the extend graphs


def test_static_inputs_hold_the_step():
    """What the graph and a device-planned attention backend read: each sequence's query offsets and KV lengths
    (padding sequences empty), its last token's row, its page-table row."""
    _, graphs = executors()
    runner = graphs.extend_graphs
    seqs = [graphs.new_sequence() for _ in range(3)]
    graphs.forward(ForwardBatch(seqs[:1], [toks(6, 1)]))
    graphs.forward(ForwardBatch(seqs, [toks(3, 2), toks(5, 3), [7]]))  # 6 cached + 3, 5, 1 new: 9 tokens
    assert runner.index.tolist() == [0, 3, 8, 9, 9] + [9, 5, 1, 0]
    assert runner.last.tolist() == [2, 7, 8, 0]
    for i, seq in enumerate(seqs):
        assert runner.table[i, : len(seq.pages)].tolist() == seq.pages
    assert runner.inputs[1, :9].tolist() == [6, 7, 8, 0, 1, 2, 3, 4, 0]


def test_small_buckets_hold_as_many_sequences_as_tokens():
    """A bucket of t tokens holds min(t, max_seqs) sequences (each has a token of the step): its index, logits rows
    and attention plan are laid out for that many, and its logits equal the plain executor's."""
    plain, graphs = executors(sizes=(4, 16), max_seqs=6)
    runner = graphs.extend_graphs
    assert [runner.seqs(t) for t in (4, 16)] == [4, 6]
    seqs = {ex: [ex.new_sequence() for _ in range(3)] for ex in (plain, graphs)}
    for ex in (plain, graphs):
        ex.forward(ForwardBatch(seqs[ex][:1], [toks(9, 1)]))  # the 16-token bucket
    out = {ex: ex.forward(ForwardBatch(seqs[ex], [[5], toks(2, 2), [7]])) for ex in (plain, graphs)}
    torch.testing.assert_close(out[graphs], out[plain], rtol=1e-5, atol=1e-5)
    # 4 tokens over 3 sequences: query offsets [5] then KV lengths [4], the 4th sequence empty
    assert runner.index[:9].tolist() == [0, 1, 3, 4, 4] + [10, 2, 1, 0]
    assert runner.logits[4].shape[0] == 4 and runner.logits[16].shape[0] == 6


def test_steps_that_piecewise_pads_less_run_piecewise():
    """A step goes to the extend graphs only where their bucket is no larger than the piecewise size it would pad
    to (a 20-token step: extend bucket 32, piecewise 24 -> piecewise; 16 tokens: both 16 -> extend graph)."""
    from pieceworks.core.batch import ForwardMode, GraphMode

    _, graphs = executors(sizes=(16, 32))
    graphs.piecewise = type("Piecewise", (), {"covers": lambda self, n: n <= 64,
                                              "padded_size": lambda self, n: 24 if n <= 24 else 64})()
    mode = lambda n: graphs._graph_mode(ForwardMode.EXTEND, 1, n)  # noqa: E731
    assert [mode(n) for n in (16, 20, 24, 25, 32, 40)] == [GraphMode.FULL, GraphMode.PIECEWISE, GraphMode.PIECEWISE,
                                                           GraphMode.FULL, GraphMode.FULL, GraphMode.PIECEWISE]
    graphs.piecewise = None
    assert mode(20) is GraphMode.FULL and mode(40) is GraphMode.EAGER


def test_every_token_logits_in_buckets_that_compute_them():
    """A bucket of t tokens computes min(t, max_seqs) logits rows: steps asking for every token's logits (all, or per
    sequence) run there where their rows fit and return the plain executor's rows; others run as before."""
    plain, graphs = executors(sizes=(4, 8, 16), max_seqs=8)
    calls = []
    run = graphs.extend_graphs.run
    graphs.extend_graphs.run = lambda *a: calls.append(sum(map(len, a[2]))) or run(*a)
    seqs = {ex: [ex.new_sequence() for _ in range(3)] for ex in (plain, graphs)}
    steps = [([0], [toks(5, 1)], True),                            # bucket 8: 5 of its 8 rows
             ([0, 1], [toks(3, 2), toks(6, 3)], [True, False]),      # bucket 16: rows 3 + 1
             ([0, 1, 2], [[4], toks(2, 4), [6]], [False, True, True]),  # bucket 4: rows 1 + 2 + 1
             ([2], [toks(12, 6)], True),                             # 12 rows, bucket 16 computes 8: not there
             ([2], [toks(6, 5)], False)]                             # last rows only, bucket 8
    for idx, tk, every in steps:
        out = {ex: ex.forward(ForwardBatch([seqs[ex][i] for i in idx], tk, every)) for ex in (plain, graphs)}
        assert out[graphs].shape == out[plain].shape
        torch.testing.assert_close(out[graphs], out[plain], rtol=1e-5, atol=1e-5)
    assert calls == [5, 9, 4, 6]


@pytest.mark.parametrize("all_rows", [False, True, [True, False, True], [False, False, False]])
def test_the_row_count_that_routes_a_step_is_the_rows_it_gets(all_rows):
    from pieceworks.executor.inputs import logit_rows, num_logit_rows

    tokens = [toks(3, 1), [5], toks(4, 2)]
    assert num_logit_rows(tokens, all_rows) == len(logit_rows(tokens, all_rows, torch.device("cpu")))


def test_speculative_steps_keep_the_greedy_outputs():
    """n-gram drafts verified through the extend graphs (every drafting row's logits): the Engine's greedy outputs
    equal those without drafts."""
    prompts = [toks(8, 30) * 2, toks(5, 31) * 3]
    outs = []
    for spec in (False, True):
        cfg = {**CFG, "scheduler": {"max_num_batched_tokens": 32}}
        if spec:
            cfg["speculative"] = {"method": "ngram", "num_speculative_tokens": 3, "max_batch": None}
        ex = Executor.from_config(cfg, progress=False)
        calls = []
        ex.extend_graphs = runner = EagerExtendRunner(ex.model, ex.table, ex.kv, ex.max_context, [8, 16, 32], 16)
        run = runner.run
        runner.run = lambda *a: calls.append(a[4] if len(a) > 4 else False) or run(*a)
        eng = Engine(ex, tokenizer=None)
        outs.append([o.token_ids for o in eng.generate(prompts, SamplingParams(temperature=0, max_tokens=12))])
        if spec:
            assert any(c is not False and any(c) for c in calls)  # verification steps went through the graphs
    assert outs[0] == outs[1]


def test_bad_extend_graph_settings_are_refused_on_any_device():
    from pieceworks.config import ConfigError

    for bad, says in (({"sizes": [64, 16]}, "ascending"), ({"sizes": [0, 16]}, "positive"), ({"max_seqs": 0}, "max_seqs")):
        with pytest.raises(ConfigError, match=says):
            Executor.from_config({**CFG, "cuda_graph": {"extend": {"enabled": "on", **bad}}}, progress=False)


def test_auto_leaves_extend_graphs_off_under_tensor_parallelism(caplog):
    import logging

    from pieceworks.config import load_config
    from pieceworks.executor.build import extend_graph_runner

    ex = Executor.from_config(CFG, progress=False)
    auto, on = (load_config(CFG, [f"cuda_graph.extend.enabled={v}"]).cuda_graph.extend for v in ("auto", "on"))
    with caplog.at_level(logging.INFO, logger="pieceworks"):
        assert extend_graph_runner(auto, ex.model, ex.table, ex.kv, ex.max_context, False, True) is None
        assert extend_graph_runner(on, ex.model, ex.table, ex.kv, ex.max_context, False, True) is None  # no CUDA
    said = [r.getMessage() for r in caplog.records]
    assert any("tensor parallelism" in m for m in said) and any("need CUDA" in m for m in said), said


def test_the_graph_report_says_whether_extend_graphs_run_and_why_not():
    from pieceworks import report
    from pieceworks.backends.attention.torch import TorchAttentionBackend
    from pieceworks.backends.base import BackendSpec
    from pieceworks.backends.hookspecs import hookimpl
    from pieceworks.backends.registry import Registry
    from pieceworks.config import load_config

    class FullExtend(TorchAttentionBackend):  # declares full_extend: the registry puts it in (extend, FULL)
        name, priority, full_extend = "fullext", -1, True

    class Plugin:
        @hookimpl
        def pieceworks_register_backends(self):
            return [FullExtend]

    def said(overrides=(), cuda=True, table=None, ex=None):
        cfg = load_config({"model": {"arch": "llama"}}, list(overrides))
        return report._extend_graphs(cfg, cuda, table, ex)

    reg = Registry(autoload=False)
    reg.register_plugin(Plugin(), "test")
    cfg = load_config({"model": {"arch": "llama"}}, [])
    with_it = reg.load().resolve(cfg.backends, BackendSpec(), ("attention",))
    without = Registry(autoload=False).load().resolve(cfg.backends, BackendSpec(), ("attention",))
    assert said(table=with_it) == ("on, 6 token buckets [16, 32, 64, 128, ..., 512] (up to max_context), up to 64 "
                                   "sequences")
    assert said(table=without).startswith("off (no attention backend is safe in full graphs for extend steps")
    assert said(cuda=False, table=with_it) == "off (need CUDA)"
    assert said(["cuda_graph.extend.enabled=off"], table=with_it) == "off"
    assert said(["parallel.tensor_parallel_size=2"], table=with_it).startswith("off (auto leaves them off under tensor")
    _, graphs = executors()
    assert said(ex=graphs, table=graphs.table) == "on, 3 token buckets [8, 16, 32], up to 4 sequences"


def test_triton_all_refuses_an_fp8_pool():
    from dataclasses import replace

    from pieceworks.backends.attention.triton import TritonAttentionBackend
    from pieceworks.backends.base import BackendSpec, ModelFacts

    ok = ModelFacts(dtype=torch.bfloat16, num_heads=32, num_kv_heads=8, head_dim=128)
    cuda = dict(device="cuda", capability=(9, 0), modules=frozenset({"triton"}))
    assert TritonAttentionBackend.check(BackendSpec(**cuda, model=ok)) == []
    reasons = TritonAttentionBackend.check(BackendSpec(**cuda, model=replace(ok, kv_fp8=True)))
    assert any("bf16 / fp16 pools only" in r for r in reasons)
