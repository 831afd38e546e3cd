"""The host side of a decode-graph step (`HostStaging`): input layout, padding, and page-table copies
skipped only when the device table already holds the rows; the greedy ids a decode step leaves for the
sampler, and steps without the batch checks. CPU (no pinned memory needed)."""

from __future__ import annotations

import pytest
import torch

from pieceworks.executor.cuda_graph import HostStaging
from pieceworks.executor.inputs import page_table


def test_fill_lays_out_ids_positions_slots_and_pads():
    st = HostStaging(max_bs=8, width=4, pin=False)
    host = st.fill(4, [11, 12, 13], [5, 6, 7], [50, 61, 72], pad_slot=3)
    assert host.shape == (12,)
    assert host.view(3, 4).tolist() == [[11, 12, 13, 0], [5, 6, 7, 1], [50, 61, 72, 3]]
    # a smaller bucket afterwards uses the leading entries as its own [3, bs]
    host = st.fill(1, [9], [2], [40], pad_slot=3)
    assert host.view(3, 1).tolist() == [[9], [2], [40]]


def test_table_rows_copied_only_when_a_row_changes():
    st = HostStaging(max_bs=4, width=3, pin=False)
    seq_a, seq_b = [4, 7], [9]
    start, rows = st.table_rows([seq_a, seq_b], fill=0)
    assert start == 0 and torch.equal(rows, page_table([[4, 7], [9]], 3, fill=0))
    assert st.table_rows([seq_a, seq_b], fill=0) is None  # unchanged: no copy
    assert st.table_rows([seq_a], fill=0) is None  # a smaller bucket: its rows are already there
    seq_b.append(2)  # the sequence gained a page (the runner passes the live page lists)
    start, rows = st.table_rows([seq_a, seq_b], fill=0)
    assert start == 1 and rows.tolist() == [[9, 2, 0]]  # only the changed row is copied
    start, rows = st.table_rows([seq_a, seq_b, [1]], fill=0)  # a row the device never got
    assert start == 2 and rows.tolist() == [[1, 0, 0]]
    start, rows = st.table_rows([[5], seq_b, [6, 8, 3]], fill=0)  # rows 0 and 2: the span between
    assert start == 0 and rows.tolist() == [[5, 0, 0], [9, 2, 0], [6, 8, 3]]  # shorter row: old pages cleared
    st.forget_table()
    start, rows = st.table_rows([[5], seq_b], fill=0)  # capture overwrote the device table
    assert start == 0 and rows.tolist() == [[5, 0, 0], [9, 2, 0]]
    assert st.table.tolist()[:3] == [[5, 0, 0], [9, 2, 0], [6, 8, 3]]  # the host mirrors the device


def _tiny(**kv):
    from pieceworks import Executor

    cfg = {"model": {"arch": "llama", "preset": "tiny", "max_context": 64},
           "runtime": {"device": "cpu", "dtype": "float32"}, "kv_cache": {"num_tokens": 512, "page_size": 4, **kv}}
    return Executor.from_config(cfg, progress=False)


def test_decode_runner_host_path_matches_eager_steps():
    """EagerDecodeRunner runs DecodeGraphRunner.run's host path (buckets, padding, static inputs, staged
    page table) with an eager forward in place of the replay: its decode logits match plain eager
    steps, as sequences gain pages, finish, and change rows between steps."""
    from pieceworks.core.batch import ForwardBatch
    from pieceworks.executor.cuda_graph import EagerDecodeRunner

    graph, eager = _tiny(), _tiny()
    graph.decode_graphs = EagerDecodeRunner(graph.model, graph.table, graph.kv, graph.max_context, [1, 2, 4, 8])
    rng = torch.Generator().manual_seed(0)
    lens = [3, 9, 4, 14, 6]
    prompts = [torch.randint(0, 512, (n,), generator=rng).tolist() for n in lens]
    seqs = {}
    for ex in (graph, eager):
        seqs[ex] = [ex.new_sequence() for _ in prompts]
        for s, p in zip(seqs[ex], prompts):
            ex.forward(ForwardBatch([s], [p]))
    live = list(range(len(prompts)))
    for step in range(12):
        if step == 4:
            live.remove(1)  # a sequence leaves: rows shift
        if step == 8:
            live = live[::-1]  # another order: every row changes
        toks = [[int(x)] for x in torch.randint(0, 512, (len(live),), generator=rng)]
        got = graph.forward(ForwardBatch([seqs[graph][i] for i in live], toks))
        want = eager.forward(ForwardBatch([seqs[eager][i] for i in live], toks))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert graph.decode_graphs.staging._rows  # the FULL path ran (the table was staged)
    for ex in (graph, eager):
        for s in seqs[ex]:
            ex.free(s)
        assert ex.kv.allocator.num_free == ex.kv.allocator.capacity


def test_greedy_ids_of_a_decode_runner_step_are_the_logits_argmax():
    """A step through the decode runner leaves `Executor.greedy_ids`: the argmax of each returned row
    (`greedy_token_ids`, computed in the graph on CUDA, here in its eager stand-in), for the real rows
    of a padded bucket; any other step leaves None."""
    from pieceworks.core.batch import ForwardBatch
    from pieceworks.executor.cuda_graph import EagerDecodeRunner, greedy_token_ids

    ex = _tiny()
    ex.decode_graphs = EagerDecodeRunner(ex.model, ex.table, ex.kv, ex.max_context, [1, 4])
    seqs = [ex.new_sequence() for _ in range(3)]
    for i, s in enumerate(seqs):
        ex.forward(ForwardBatch([s], [[5 + i, 9, 2]]))
        assert ex.greedy_ids is None  # an extend step: eager, no graph
    logits = ex.forward(ForwardBatch(seqs, [[1], [2], [3]]))  # 3 rows in the bucket of 4
    assert ex.greedy_ids is not None and ex.greedy_ids.tolist() == logits.argmax(-1).tolist()
    assert torch.equal(ex.greedy_ids, greedy_token_ids(logits))
    for s in seqs:
        ex.free(s)


def test_engine_greedy_outputs_identical_through_the_decode_runner():
    """The Engine's greedy tokens with decode steps through the runner (whose greedy ids the sampler
    copies instead of computing) equal those of plain eager steps."""
    from pieceworks import Engine, SamplingParams
    from pieceworks.executor.cuda_graph import EagerDecodeRunner

    graph, eager = Engine(_tiny(), tokenizer=None), Engine(_tiny(), tokenizer=None)
    ex = graph.executor
    ex.decode_graphs = EagerDecodeRunner(ex.model, ex.table, ex.kv, ex.max_context, [1, 2, 4, 8])
    rng = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=rng).tolist() for n in (3, 11, 6, 17, 2)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (9, 4, 14, 7, 12)]
    outs = {}
    for eng in (graph, eager):
        ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
        final = {}
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    final[o.request_id] = o.token_ids
        outs[eng] = [final[i] for i in ids]
    assert outs[graph] == outs[eager]
    assert [len(t) for t in outs[graph]] == [9, 4, 14, 7, 12]
    assert ex.decode_graphs.staging._rows  # decode steps went through the runner


def test_forward_without_validation_runs_the_same_step():
    """`validate=False` (the Engine's steps) skips only the batch checks: the same logits and sequence
    state as a checked step; a checked step still refuses a bad batch."""
    from pieceworks.core.batch import ForwardBatch
    from pieceworks.errors import BatchError

    a, b = _tiny(), _tiny()
    sa, sb = a.new_sequence(), b.new_sequence()
    for toks in ([4, 8, 15, 16], [23], [42]):
        got = a.forward(ForwardBatch([sa], [toks]), validate=False)
        want = b.forward(ForwardBatch([sb], [toks]))
        assert torch.equal(got, want) and sa.tokens == sb.tokens and sa.pages == sb.pages
    with pytest.raises(BatchError, match="outside the vocabulary"):
        b.forward(ForwardBatch([sb], [[10**6]]))
