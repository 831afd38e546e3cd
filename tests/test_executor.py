"""The executor: every forward mode agrees with one full prefill, bad input leaves it serving, and a
soak of random mixed steps gives every KV page back."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pieceworks import Executor
from pieceworks.core.batch import ForwardBatch, ForwardMode, GraphMode
from pieceworks.errors import BatchError, OutOfPages

TINY = {
    "llama": {"model": {"arch": "llama", "preset": "tiny"}},
    "deepseek_v3": {"model": {"arch": "deepseek_v3", "preset": "tiny"}},
}


def make(arch: str, **sections) -> Executor:
    cfg = {**TINY[arch], "runtime": {"device": "cpu", "dtype": "float32"}, **sections}
    return Executor.from_config(cfg, progress=False)


@pytest.fixture(scope="module", params=["llama", "deepseek_v3"])
def ex(request):
    return make(request.param, kv_cache={"num_tokens": 512, "page_size": 4})


def tokens(n: int, seed: int, vocab: int = 512) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_chunked_prefill_decode_and_mixed_match_one_prefill(ex):
    a, b = tokens(23, 1), tokens(14, 2)
    ref_a, ref_b = ex.score([a, b])
    # EXTEND with a cached prefix: three chunks of unequal length
    seq = ex.new_sequence()
    parts = [ex.forward(ForwardBatch([seq], [a[i:j]], return_all_logits=True)) for i, j in ((0, 9), (9, 16), (16, 23))]
    close(torch.cat(parts), ref_a)
    ex.free(seq)
    # DECODE one token at a time after a short prefill, two sequences of unequal lengths
    sa, sb = ex.new_sequence(), ex.new_sequence()
    ex.forward(ForwardBatch([sa, sb], [a[:5], b[:3]]))
    for step in range(8):
        batch = ForwardBatch([sa, sb], [[a[5 + step]], [b[3 + step]]])
        assert batch.mode is ForwardMode.DECODE
        logits = ex.forward(batch)
        close(logits[0], ref_a[5 + step])
        close(logits[1], ref_b[3 + step])
    # MIXED: sa decodes while a new sequence extends, in one batch
    sc = ex.new_sequence()
    batch = ForwardBatch([sa, sc], [[a[13]], b[:7]], return_all_logits=True)
    assert batch.mode is ForwardMode.MIXED
    logits = ex.forward(batch)
    close(logits[0], ref_a[13])
    close(logits[1:], ref_b[:7])
    # per sequence: every row of sc's chunk, sa's last row only
    logits = ex.forward(ForwardBatch([sc, sa], [b[7:11], a[14:16]], return_all_logits=[True, False]))
    assert logits.shape[0] == 5
    close(logits[:4], ref_b[7:11])
    close(logits[4], ref_a[15])
    for s in (sa, sb, sc):
        ex.free(s)
    assert ex.kv.allocator.num_free == ex.kv.allocator.capacity


def test_generate_is_continuous_batching_of_single_runs(ex):
    prompts = [tokens(n, 10 + n) for n in (3, 11, 6, 17, 5)]
    together = ex.generate(prompts, 6, max_step_tokens=16)
    alone = [ex.generate([p], 6)[0] for p in prompts]
    assert together == alone
    assert all(len(o) == 6 for o in together)
    assert ex.kv.allocator.num_free == ex.kv.allocator.capacity


def test_generate_queues_prompts_beyond_the_kv_budget():
    small = make("llama", kv_cache={"num_tokens": 48, "page_size": 4})
    prompts = [tokens(20, s) for s in range(4)]  # 4 x (20 + 8) tokens > 48: must queue
    out = small.generate(prompts, 8)
    assert out == [small.generate([p], 8)[0] for p in prompts]
    assert small.kv.allocator.num_free == small.kv.allocator.capacity


def test_generate_takes_pages_as_it_grows_and_preempts_by_recompute():
    """Admission by the pages a prompt needs now, not prompt + max_new_tokens: in a pool of 12 pages
    that holds one 20 + 8-token request's worst case (7 pages) but two prompts (5 pages each), two run
    at once; when they can't both grow, the later one is preempted and recomputed. Outputs equal
    single runs and every page comes back."""
    small = make("llama", kv_cache={"num_tokens": 48, "page_size": 4})
    prompts = [tokens(20, s) for s in range(4)]
    alone = [small.generate([p], 8)[0] for p in prompts]
    widths, starts = [], []
    forward, new_sequence = small.forward, small.new_sequence
    small.forward = lambda batch: (widths.append(len(batch.seqs)), forward(batch))[1]
    small.new_sequence = lambda *a: (starts.append(1), new_sequence(*a))[1]
    try:
        out = small.generate(prompts, 8)
    finally:
        del small.forward, small.new_sequence
    assert out == alone
    assert max(widths) == 2  # two sequences in one step: not admitted by their worst case
    assert len(starts) > len(prompts)  # some prompt was preempted and started again
    assert small.kv.allocator.num_free == small.kv.allocator.capacity


def test_sampling_is_seeded():
    e = make("llama")
    p = [tokens(5, 3)]
    a = e.generate(p, 12, temperature=0.8, top_p=0.9, seed=7)
    assert a == e.generate(p, 12, temperature=0.8, top_p=0.9, seed=7)
    assert a != e.generate(p, 12, temperature=0.8, top_p=0.9, seed=8)
    # sampled in float64: a temperature or top_p below float32's range picks the top token, as greedy does
    greedy = e.generate(p, 12)
    assert e.generate(p, 12, temperature=1e-40, seed=7) == greedy == e.generate(p, 12, top_p=1e-50, seed=7)


def _intact(ex, seq, reference_logits):
    """The pool gave nothing away and a live sequence still decodes to the same logits."""
    free = ex.kv.allocator.num_free
    out = ex.forward(ForwardBatch([seq], [[5]]))
    close(out[0], reference_logits)
    return free


@pytest.mark.parametrize("arch", ["llama"])
def test_bad_input_is_refused_and_leaves_the_executor_serving(arch):
    ex = make(arch, kv_cache={"num_tokens": 64, "page_size": 4}, model={**TINY[arch]["model"], "max_context": 40})
    ref = ex.new_sequence()
    ex.forward(ForwardBatch([ref], [tokens(6, 0)]))
    probe = ex.new_sequence()
    ex.forward(ForwardBatch([probe], [tokens(6, 0)]))
    expected = ex.forward(ForwardBatch([probe], [[5]]))[0]
    ex.free(probe)
    free_before = ex.kv.allocator.num_free
    victim = ex.new_sequence()
    cases = [
        (ForwardBatch([victim], [[1, 2, 512]]), "outside the vocabulary"),
        (ForwardBatch([victim], [[-1]]), "outside the vocabulary"),
        (ForwardBatch([victim], [[]]), "empty prompt"),
        (ForwardBatch([victim], [list(range(41))]), "exceed the context limit of 40"),
        (ForwardBatch([victim], [torch.tensor([1.0, 2.0])]), "must be a 1-D integer tensor"),
        (ForwardBatch([victim], [["a"]]), "token ids must be ints"),
        (ForwardBatch([victim, victim], [[1], [2]]), "appears twice"),
        (ForwardBatch([victim], [[1], [2]]), "1 sequences but 2 token lists"),
    ]
    for batch, needle in cases:
        with pytest.raises(BatchError, match=needle):
            ex.forward(batch)
        assert ex.kv.allocator.num_free == free_before and victim.kv_len == 0
    # a batch larger than the pool can hold: forward raises the typed OutOfPages, nothing is allocated
    others = [ex.new_sequence() for _ in range(3)]
    assert ex.pages_needed(others, [29] * 3) > ex.kv.allocator.num_free
    with pytest.raises(OutOfPages, match="more KV pages"):
        ex.forward(ForwardBatch(others, [list(range(1, 30))] * 3))
    assert ex.kv.allocator.num_free == free_before and all(s.kv_len == 0 for s in others)
    # freeing twice
    ex.free(victim)
    with pytest.raises(BatchError, match="already freed"):
        ex.free(victim)
    with pytest.raises(BatchError, match="was freed"):
        ex.forward(ForwardBatch([victim], [[1]]))
    # generate validates before doing anything
    for prompts, needle in (([[]], "empty"), ([[1, 999]], "outside the vocabulary"),
                            ([list(range(1, 39))], "exceed the context limit")):
        with pytest.raises(BatchError, match=needle):
            ex.generate(prompts, 4)
    # still serving, pool intact: the reference sequence decodes as it would have
    probe = ex.new_sequence()
    ex.forward(ForwardBatch([probe], [tokens(6, 0)]))
    close(ex.forward(ForwardBatch([probe], [[5]]))[0], expected)
    for s in (probe, ref, *others):
        ex.free(s)
    assert ex.kv.allocator.num_free == ex.kv.allocator.capacity


def test_a_failing_step_gives_its_pages_back(monkeypatch):
    ex = make("llama", kv_cache={"num_tokens": 64, "page_size": 4})
    seq = ex.new_sequence()
    ex.forward(ForwardBatch([seq], [tokens(5, 0)]))
    free, pages = ex.kv.allocator.num_free, list(seq.pages)

    def boom(*a, **k):
        raise RuntimeError("kernel failed")

    monkeypatch.setattr(ex.model, "compute_logits", boom)
    with pytest.raises(RuntimeError, match="kernel failed"):
        ex.forward(ForwardBatch([seq], [tokens(9, 1)]))
    assert ex.kv.allocator.num_free == free and seq.pages == pages and seq.kv_len == 5


@pytest.mark.slow
def test_soak_random_mixed_steps_return_every_page():
    ex = make("llama", kv_cache={"num_tokens": 256, "page_size": 4}, model={"arch": "llama", "preset": "tiny", "max_context": 96})
    rng = random.Random(0)
    live: list = []
    modes = set()
    for _ in range(2000):
        if live and rng.random() < 0.15:
            ex.free(live.pop(rng.randrange(len(live))))
            continue
        if len(live) < 6 and rng.random() < 0.3:
            live.append(ex.new_sequence())
        chosen = rng.sample(live, k=rng.randint(1, len(live))) if live else []
        if not chosen:
            continue
        toks = [[rng.randrange(512)] * (1 if s.kv_len and rng.random() < 0.7 else rng.randint(1, 9)) for s in chosen]
        batch = ForwardBatch(chosen, toks)
        try:
            logits = ex.forward(batch)
        except (BatchError, OutOfPages):  # full pool or context: refused cleanly, then make room
            ex.free(live.pop(0))
            continue
        modes.add(batch.mode)
        assert logits.shape == (len(chosen), ex.vocab_size) and torch.isfinite(logits).all()
    for s in live:
        ex.free(s)
    assert ex.kv.allocator.num_free == ex.kv.allocator.capacity
    assert modes == {ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED}


def test_page_table_pads_each_row():
    from pieceworks.executor.inputs import page_table

    rng = random.Random(3)
    for n, width in ((0, 5), (1, 1), (1, 6), (3, 7), (32, 576)):
        pages = [[rng.randrange(10_000) for _ in range(rng.randrange(width + 1))] for _ in range(n)]
        want = torch.tensor([p + [9] * (width - len(p)) for p in pages], dtype=torch.int32).reshape(n, width)
        got = page_table(pages, width, fill=9)
        assert got.dtype == torch.int32 and torch.equal(got, want)
    assert torch.equal(page_table([[], [4]], 2), torch.tensor([[0, 0], [4, 0]], dtype=torch.int32))
    with pytest.raises(ValueError, match="3 pages, more than the table's width 2"):
        page_table([[1], [1, 2, 3]], 2)
    with pytest.raises(ValueError, match="3 pages, more than the table's width 2"):
        page_table([[1, 2, 3]], 2)


def test_token_rows_match_the_per_token_rule():
    from pieceworks.executor.inputs import page_table, token_rows

    rng = random.Random(5)
    for case in range(30):
        ps = rng.choice([1, 4, 16])
        b = 1 if case % 3 == 0 else rng.randrange(2, 6)  # one sequence takes its own path
        kv_lens = [rng.randrange(0, 40) for _ in range(b)]
        tokens = [[rng.randrange(1000) for _ in range(rng.randrange(1, 9))] for _ in range(b)]
        pages = [rng.sample(range(500), -(-(k + len(t)) // ps) + rng.randrange(2)) for k, t in zip(kv_lens, tokens)]
        n = sum(map(len, tokens))
        pad_to = rng.choice([None, n, n + 5])
        table = page_table(pages, max(map(len, pages))).numpy()
        ids, positions, slots = token_rows(tokens, kv_lens, table, ps, pad_to, pad_slot=-7)
        want_pos = [p for k, t in zip(kv_lens, tokens) for p in range(k, k + len(t))]
        want_slots = [pg[p // ps] * ps + p % ps for k, t, pg in zip(kv_lens, tokens, pages) for p in range(k, k + len(t))]
        pad = (pad_to or n) - n
        assert ids.tolist() == [x for t in tokens for x in t] + [0] * pad, case
        assert positions.tolist() == want_pos + [0] * pad, case
        assert slots.tolist() == want_slots + [-7] * pad, case
        assert ids.dtype == positions.dtype == slots.dtype == np.int64


def test_step_inputs_share_one_buffer_and_match_the_separate_arrays():
    """step_inputs' token rows and page table (views of one buffer, the table 16-byte aligned after the
    rows, odd and even row counts) equal token_rows' and page_table's; a reused buffer's padding is reset."""
    from pieceworks.core.batch import Sequence
    from pieceworks.executor.inputs import page_table, step_inputs, token_rows

    rng = random.Random(8)
    for case in range(20):
        ps = rng.choice([1, 4, 16])
        seqs, tokens = [], []
        for i in range(rng.randrange(1, 5)):
            seq = Sequence(id=i)
            seq.tokens = [1] * rng.randrange(0, 40)
            tokens.append([rng.randrange(1000) for _ in range(rng.randrange(1, 8))])
            seq.pages = rng.sample(range(1, 500), -(-(seq.kv_len + len(tokens[-1])) // ps) + rng.randrange(2))
            seqs.append(seq)
        n = sum(map(len, tokens))
        pad_to = rng.choice([None, n, n + 3])
        width = max(len(s.pages) for s in seqs) + rng.randrange(3)
        meta, ids = step_inputs(ForwardMode.EXTEND, GraphMode.EAGER, seqs, tokens, ps, 0, torch.device("cpu"),
                                pad_to, width)
        table = page_table([s.pages for s in seqs], width)
        rows = token_rows(tokens, [s.kv_len for s in seqs], table.numpy(), ps, pad_to, 0)
        assert torch.equal(meta.page_table, table), case
        assert ids.tolist() == rows[0].tolist() and meta.positions.tolist() == rows[1].tolist(), case
        assert meta.slot_mapping.tolist() == rows[2].tolist(), case
        assert (meta.page_table.data_ptr() - ids.data_ptr()) % 16 == 0, case
    out = np.full((3, 6), 5, dtype=np.int64)
    token_rows([[7, 8]], [0], np.array([[3]], dtype=np.int32), 4, 6, -1, out=out)
    assert out.tolist() == [[7, 8, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0], [12, 13, -1, -1, -1, -1]]


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_close_releases_the_model_and_pool_and_refuses_later_use(arch):
    """close() frees what the executor holds, piecewise backend included (torch.compile keeps that
    backend for the life of the process: without close() the weights outlive the executor), and every
    later call says the executor is closed; a new executor of the same config runs as before."""
    import weakref

    pw = {"cuda_graph": {"piecewise": {"enabled": "on", "max_tokens": 32, "sizes": [16, 32]}}}
    ex = make(arch, kv_cache={"num_tokens": 512, "page_size": 16}, **pw)
    before = ex.generate([[1, 2, 3]], 4)
    weight = weakref.ref(ex.model.embed_tokens.weight)
    cache = weakref.ref(ex.kv.buffer)
    seq = ex.new_sequence()
    ex.close()
    assert weight() is None and cache() is None and ex.closed
    for call in (lambda: ex.generate([[1, 2, 3]], 4), ex.new_sequence, lambda: ex.free(seq),
                 lambda: ex.forward(ForwardBatch([seq], [[1]])), lambda: ex.num_free_tokens()):
        with pytest.raises(RuntimeError, match="this executor is closed"):
            call()
    ex.close()  # idempotent
    assert make(arch, kv_cache={"num_tokens": 512, "page_size": 16}, **pw).generate([[1, 2, 3]], 4) == before


def test_cpu_logits_through_cpu_matmul(ex):
    """On a CPU the logits go through `cpu_matmul.linear`: contiguous float32 [n, V], equal to F.linear up to
    float32 summation order at 1..SKINNY_ROWS rows, F.linear itself beyond."""
    from pieceworks.backends.cpu_matmul import SKINNY_ROWS

    w = ex.model.lm_head.weight
    h = torch.randn(SKINNY_ROWS + 1, w.shape[1], generator=torch.Generator().manual_seed(0))
    for n in (1, 2, 5, SKINNY_ROWS):
        out = ex.model.compute_logits(h[:n])
        assert out.is_contiguous() and out.dtype == torch.float32 and out.shape == (n, w.shape[0])
        torch.testing.assert_close(out, torch.nn.functional.linear(h[:n], w), rtol=1e-5, atol=1e-5)
    assert torch.equal(ex.model.compute_logits(h), torch.nn.functional.linear(h, w))
