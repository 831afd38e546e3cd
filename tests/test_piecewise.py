"""Piecewise execution on CPU: the model traced once, split at the attention ops, pieces run directly.

Same split and dispatch as on CUDA (where each piece is a CUDA graph per capture size): logits must
equal eager within fp32 rounding for every mode and many token counts, greedy tokens must be
identical, the model must trace without graph breaks and exactly once.
"""

from __future__ import annotations

import pytest
import torch

from pieceworks import Executor
from pieceworks.config import ConfigError, load_config
from pieceworks.core.batch import ForwardBatch, GraphMode
from pieceworks.executor.piecewise import default_sizes

SIZES = [4, 8, 16, 24, 32]


def make(arch: str, piecewise: bool, layers: int = 2) -> Executor:
    cfg = {
        "model": {"arch": arch, "preset": "tiny", "sizes": {"num_hidden_layers": layers}},
        "runtime": {"device": "cpu", "dtype": "float32"},
        "kv_cache": {"num_tokens": 1024, "page_size": 4},
        "cuda_graph": {"piecewise": {"enabled": "on" if piecewise else "off", "max_tokens": 32, "sizes": SIZES}},
    }
    return Executor.from_config(cfg, progress=False)


@pytest.fixture(scope="module", params=["llama", "deepseek_v3"])
def pair(request):
    torch._dynamo.reset()
    eager, pw = make(request.param, False), make(request.param, True)
    assert eager.piecewise is None and pw.piecewise is not None
    return eager, pw


def toks(n, seed):
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(ex, steps):
    """Run a script of steps [(seq index, tokens), ...] per step; returns every step's logits."""
    seqs, out = {}, []
    for step in steps:
        for i, _ in step:
            seqs.setdefault(i, ex.new_sequence())
        out.append(ex.forward(ForwardBatch([seqs[i] for i, _ in step], [t for _, t in step], return_all_logits=True)))
    for s in seqs.values():
        ex.free(s)
    return out


SCRIPTS = {
    # token counts 1..40 cover exact sizes, padding inside every bucket, and counts above max_tokens
    "extend_many_counts": [[(i, toks(n, n))] for i, n in enumerate([1, 3, 4, 5, 7, 8, 13, 16, 17, 23, 24, 31, 32, 33, 40])],
    "extend_with_prefix": [[(0, toks(9, 1))], [(0, toks(6, 2))], [(0, toks(21, 3))], [(0, toks(2, 4))]],
    "mixed": [[(0, toks(5, 5)), (1, toks(3, 6))], [(0, [7]), (2, toks(10, 7)), (1, [9])], [(2, [3]), (0, toks(4, 8))]],
    "decode": [[(0, toks(6, 9)), (1, toks(4, 10))]] + [[(0, [k]), (1, [k + 1])] for k in range(5)],
}


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_piecewise_matches_eager(pair, script):
    eager, pw = pair
    for a, b in zip(run(eager, SCRIPTS[script]), run(pw, SCRIPTS[script])):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_steps_take_their_graph_mode(pair):
    _, pw = pair
    assert pw._graph_mode(*_args(pw, [toks(13, 0)], [0])) is GraphMode.PIECEWISE
    assert pw._graph_mode(*_args(pw, [toks(33, 0)], [0])) is GraphMode.EAGER  # above max_tokens
    assert pw._graph_mode(*_args(pw, [[1], [2]], [3, 4])) is GraphMode.EAGER  # decode: no graphs on CPU
    assert [pw.piecewise.padded_size(n) for n in (1, 4, 5, 17, 32)] == [4, 4, 8, 24, 32]


def _args(ex, tokens, prefixes):
    from pieceworks.core.batch import ForwardMode

    return ForwardMode.classify([len(t) for t in tokens], prefixes), len(tokens), sum(map(len, tokens))


def test_greedy_tokens_identical(pair):
    eager, pw = pair
    prompts = [toks(n, 20 + n) for n in (3, 17, 9, 30)]
    assert pw.generate(prompts, 12, max_step_tokens=32) == eager.generate(prompts, 12, max_step_tokens=32)


def test_traced_once_without_recompiles(pair):
    _, pw = pair
    run(pw, SCRIPTS["extend_many_counts"] + SCRIPTS["mixed"])
    assert pw.piecewise.backend.num_compiles == 1


def test_recorded_replays_match_eager(pair):
    """The replay path on CPU: pieces captured with stand-in graphs (each replay reruns the piece on its
    captured tensors). A size's first step replays through the traced code and records it; later steps
    of that size run the recording only, and every step's logits match eager."""
    from pieceworks.testing.graphs import stand_in_capture

    eager = pair[0]
    ex = make(eager.cfg.model.arch, True)
    stand_in_capture(ex.piecewise)
    traced_steps = []
    real_run = ex.piecewise._run
    ex.piecewise._run = lambda size: traced_steps.append(size) or real_run(size)
    steps = SCRIPTS["extend_many_counts"] + SCRIPTS["mixed"] + SCRIPTS["extend_with_prefix"]
    for a, b in zip(run(eager, steps), run(ex, steps)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert sorted(traced_steps) == sorted(ex.piecewise.programs) == SIZES  # each size traced once, recorded
    assert ex.piecewise.backend.num_compiles == 1


def test_identical_layers_give_identical_pieces():
    torch._dynamo.reset()
    for arch, layers in (("llama", 6), ("deepseek_v3", 5)):
        ex = make(arch, True, layers=layers)
        d = ex.piecewise.describe()
        assert d["compiles"] == 1
        assert d["splitting_ops"] == layers and d["pieces"] == layers + 1
        # first piece (embedding + first layer's pre-attention), last piece (head), and the
        # between-layer piece(s); DeepSeek-V3 adds one for the dense->MoE boundary
        assert d["unique_pieces"] == (3 if arch == "llama" else 4), d


def test_default_schedule():
    sizes = default_sizes(2048)
    assert sizes[:8] == [4, 8, 12, 16, 20, 24, 28, 32]
    assert sizes[8:10] == [48, 64] and 256 in sizes and 288 in sizes and 576 in sizes and 1280 in sizes
    assert sizes[-1] == 2048 and sizes == sorted(set(sizes))
    assert default_sizes(10) == [4, 8, 10]


@pytest.mark.parametrize("override, needle", [
    ("cuda_graph.piecewise.max_tokens=0", "max_tokens: 0 must be >= 1"),
    ("cuda_graph.piecewise.sizes=[16,8]", "strictly ascending"),
    ("cuda_graph.piecewise.sizes=[]", "the list is empty"),
    ("cuda_graph.decode.batch_sizes=[0,1]", "must hold positive integers"),
    ("cuda_graph.piecewise.sizes=[16,4096]", r"4096 is above cuda_graph.piecewise.max_tokens \(2048\)"),
    ("cuda_graph.extend.sizes=[]", "cuda_graph.extend.sizes: the list is empty"),
    ("cuda_graph.extend.sizes=[64,16]", "cuda_graph.extend.sizes: .* strictly ascending"),
    ("cuda_graph.extend.max_seqs=0", "cuda_graph.extend.max_seqs: 0 must be >= 1"),
])
def test_bad_graph_config(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config({"model": {"arch": "llama"}}, [override])


def test_decode_batch_sizes_above_the_kv_pool():
    cfg = {"model": {"arch": "llama", "preset": "tiny"}, "runtime": {"device": "cpu"},
           "kv_cache": {"num_tokens": 64, "page_size": 16}, "cuda_graph": {"decode": {"batch_sizes": [1, 8]}}}
    with pytest.raises(ConfigError, match="8 sequences can't be in the KV pool at once .it has 4 pages"):
        Executor.from_config(cfg, progress=False)


def test_a_build_that_fails_after_the_piecewise_runner_leaves_nothing_alive(monkeypatch):
    """torch.compile keeps the traced model (and so the KV pool) for the process's life: a build that fails after
    the piecewise runner compiled releases it, as close() does."""
    import gc

    from pieceworks.executor import build
    from pieceworks.executor.kv_cache import KVPool

    def fail(*args, **kwargs):
        raise ConfigError("cuda_graph.extend: refused by the test")

    monkeypatch.setattr(build, "extend_graph_runner", fail)
    cfg = {"model": {"arch": "llama", "preset": "tiny", "sizes": {"num_hidden_layers": 1}},
           "runtime": {"device": "cpu"}, "kv_cache": {"num_tokens": 256},
           "cuda_graph": {"piecewise": {"enabled": "on", "sizes": [8]}}}
    gc.collect()
    before = sum(isinstance(o, KVPool) for o in gc.get_objects())
    for _ in range(2):
        with pytest.raises(ConfigError, match="refused by the test"):
            Executor.from_config(cfg, progress=False)
    gc.collect()
    assert sum(isinstance(o, KVPool) for o in gc.get_objects()) == before


def test_capture_steps_larger_than_the_context_keep_positions_inside_it():
    """A capture size may exceed the model's positions (tiny: 512; several sequences share a step); the
    warm-up and capture steps' positions wrap at max_context instead of indexing past the rope table
    (on CUDA that was a device-side assert that poisoned the process)."""
    cfg = {"model": {"arch": "llama", "preset": "tiny", "sizes": {"num_hidden_layers": 1}},
           "runtime": {"device": "cpu", "dtype": "float32"}, "kv_cache": {"num_tokens": 2048, "page_size": 16},
           "cuda_graph": {"piecewise": {"enabled": "on", "max_tokens": 1024, "sizes": [16, 1024]}}}
    ex = Executor.from_config(cfg, progress=False)
    assert ex.max_context == 512 and ex.piecewise.max_context == 512
    ex.piecewise._dummy_step(1024, "direct")  # what each capture size's warm-up runs on CUDA
    assert ex.piecewise.static_pos[:1024].max().item() == 511


def test_ids_and_positions_arrive_in_one_copy_or_two(pair):
    """`step_inputs` hands the runner its token ids and positions as neighbouring rows of one buffer,
    copied into the static rows at once; separate tensors take one copy each. Same static inputs, same
    hidden states."""
    import dataclasses

    from pieceworks.core.batch import ForwardMode

    _, pw = pair
    seq, tokens = pw.new_sequence(), [toks(13, 5)]
    new = pw._reserve_pages([seq], tokens)
    try:
        meta, ids = pw.prepare_step(ForwardMode.EXTEND, GraphMode.PIECEWISE, [seq], tokens, 16)
        assert meta.positions.data_ptr() == ids.data_ptr() + 8 * 16  # neighbours: the one-copy path
        kernels, out = pw.table.step(ForwardMode.EXTEND, GraphMode.PIECEWISE), []
        for m, i in ((meta, ids), (dataclasses.replace(meta, positions=meta.positions.clone()), ids.clone())):
            pw.piecewise.static.fill_(-1)
            out.append(pw.run_model(kernels, m, i).clone())
            assert torch.equal(pw.piecewise.static_ids[:16], ids) and torch.equal(pw.piecewise.static_pos[:16],
                                                                                  meta.positions)
        assert torch.equal(out[0], out[1])
    finally:
        pw._release([seq], new)
        pw.free(seq)


@pytest.mark.parametrize("safe_for_mixed", [False, True])
def test_no_backend_safe_under_piecewise_runs_those_steps_eagerly(monkeypatch, caplog, safe_for_mixed):
    """An attention backend that is not safe inside piecewise graphs, and no other: with the graphs switched
    on the executor builds no piecewise runner, warns with the reason, and its extend and mixed steps run
    eagerly with the eager results; with a backend safe for extend but not mixed steps, only the mixed
    steps do."""
    import logging

    from pieceworks.backends.attention.torch import TorchAttentionBackend
    from pieceworks.backends.hookspecs import hookimpl
    from pieceworks.backends.registry import Registry
    from pieceworks.core.batch import ForwardMode
    from pieceworks.executor import build

    class NotPiecewise(TorchAttentionBackend):
        name, priority = "notpw", 90
        graph_modes = frozenset({GraphMode.EAGER, GraphMode.FULL})

    class ExtendOnly(TorchAttentionBackend):
        name, priority = "extendonly", 80
        forward_modes = frozenset({ForwardMode.EXTEND})
        graph_modes = frozenset({GraphMode.PIECEWISE})

    class Plugin:
        @hookimpl
        def pieceworks_register_backends(self):
            return [NotPiecewise, ExtendOnly] if safe_for_mixed else [NotPiecewise]

    def registry(_cfg):
        reg = Registry(disabled=("pieceworks.torch",), autoload=False)
        reg.register_plugin(Plugin(), "test")
        return reg.load()

    monkeypatch.setattr(build, "load_registry", registry)
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="pieceworks.executor"):
        ex = make("llama", True)
    from pieceworks import report

    with report.console.capture() as shown:  # what `pieceworks run` prints of the graph setup
        report.print_graph_config(ex.cfg, ex.device, ex)
    line = " ".join(shown.get().split())
    if not safe_for_mixed:
        assert ex.piecewise is None
        assert any("cuda_graph.piecewise" in r.getMessage() and "run eagerly" in r.getMessage() for r in caplog.records)
        assert "piecewise (extend/mixed): off (no backend safe in piecewise graphs" in line
    else:
        assert ex.piecewise is not None
        assert ex._graph_mode(*_args(ex, [toks(13, 0)], [0])) is GraphMode.PIECEWISE
        assert ex._graph_mode(*_args(ex, [toks(5, 0), [1]], [0, 4])) is GraphMode.EAGER  # mixed
        assert "piecewise (extend/mixed): on" in line and "mixed steps run eagerly" in line
    monkeypatch.undo()
    eager = make("llama", False)
    for script in ("extend_many_counts", "mixed"):
        for a, b in zip(run(eager, SCRIPTS[script]), run(ex, SCRIPTS[script])):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
