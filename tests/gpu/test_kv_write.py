"""The fused KV writes (the CUDA kernel and the Triton one) against `index_copy_`, on the GPU: GQA K/V pools
and MLA's latent rows, eager and captured, bound once with new slots per step."""

from __future__ import annotations

import pytest
import torch

from pieceworks.backends import kv_write, kv_write_cuda

pytestmark = pytest.mark.gpu


@pytest.fixture(params=["cuda", "triton"])
def kernel(request, monkeypatch):
    """Which fused kernel writes: the CUDA one (sm_90+, NVRTC) or the Triton one (the CUDA one refused)."""
    pytest.importorskip("triton", reason="triton is not importable here")
    if request.param == "triton":
        monkeypatch.setattr(kv_write_cuda, "unsupported", lambda *a: "forced off by the test")
    elif torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the CUDA K/V write kernel needs sm_90+")
    return request.param


def reference(dst_a, src_a, dst_b, src_b, slots):
    dst_a.index_copy_(0, slots, src_a)
    dst_b.index_copy_(0, slots, src_b)


@pytest.mark.parametrize("tokens", [1, 7, 300, 4096])
def test_gqa_rows_from_a_fused_qkv_output(tokens, kernel):
    assert kv_write._kernel() is not None
    g = torch.Generator(device="cuda").manual_seed(tokens)
    heads, dim, slots_total = 8, 128, 8192
    qkv = torch.randn(tokens, (32 + 2 * heads) * dim, device="cuda", dtype=torch.bfloat16, generator=g)
    k = qkv[:, 32 * dim: (32 + heads) * dim]  # strided views, as the model's split gives them
    v = qkv[:, (32 + heads) * dim:]
    slots = torch.randperm(slots_total - 1, device="cuda", generator=g)[:tokens] + 1
    pool = torch.randn(2, slots_total, heads * dim, device="cuda", dtype=torch.bfloat16, generator=g)
    pools = [pool, pool.clone()]
    kv_write.write_rows(pools[0][0], k, pools[0][1], v, slots)
    reference(pools[1][0], k, pools[1][1], v, slots)
    assert torch.equal(pools[0], pools[1])


def test_mla_column_slices_and_padding_slot(kernel):
    g = torch.Generator(device="cuda").manual_seed(0)
    rank, rope, tokens = 512, 64, 64
    c_kv = torch.randn(tokens, rank, device="cuda", dtype=torch.bfloat16, generator=g)
    k_pe = torch.randn(tokens, rope + 8, device="cuda", dtype=torch.bfloat16, generator=g)[:, :rope]
    slots = torch.arange(10, 10 + tokens, device="cuda")
    slots[-5:] = 0  # padded tokens all land on the reserved slot
    pool = torch.randn(256, rank + rope, device="cuda", dtype=torch.bfloat16, generator=g)
    pools = [pool, pool.clone()]
    kv_write.write_rows(pools[0][:, :rank], c_kv, pools[0][:, rank:], k_pe, slots)
    reference(pools[1][:, :rank], c_kv, pools[1][:, rank:], k_pe, slots)
    assert torch.equal(pools[0][1:], pools[1][1:])  # slot 0 holds whichever padded row won


def test_fused_write_is_capturable(kernel):
    pool = torch.zeros(2, 64, 256, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    slots = torch.tensor([3, 9, 10, 40], device="cuda")
    kv_write.write_rows(pool[0], k, pool[1], v, slots)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kv_write.write_rows(pool[0], k, pool[1], v, slots)
    pool.zero_()
    k.normal_()
    slots.copy_(torch.tensor([1, 2, 5, 63]))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(pool[0, [1, 2, 5, 63]], k) and torch.equal(pool[1, [1, 2, 5, 63]], v)
    assert int((pool != 0).any(-1).sum()) == 8


def test_bound_write_takes_new_slots_every_call_eager_and_captured(kernel):
    """`bind_rows` as the FlashInfer backend uses it between piecewise replays: bound once, then called
    with each step's slots (another tensor every time), also inside a captured graph."""
    g = torch.Generator(device="cuda").manual_seed(1)
    pool = torch.zeros(2, 128, 1024, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(16, 1024, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(16, 1024, device="cuda", dtype=torch.bfloat16, generator=g)
    write = kv_write.bind_rows(pool[0], k, pool[1], v, torch.zeros(16, dtype=torch.int64, device="cuda"))
    ref = pool.clone()
    for step in range(3):
        slots = torch.randperm(127, device="cuda", generator=g)[:16] + 1
        write(slots)
        reference(ref[0], k, ref[1], v, slots)
        assert torch.equal(pool, ref), step
    static = torch.arange(16, device="cuda") + 100
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write(static)
    static.copy_(torch.arange(16, device="cuda") * 2 + 1)
    k.normal_(generator=g)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(pool[0, static], k) and torch.equal(pool[1, static], v)
    with pytest.raises(ValueError, match="15 slots for 16"):
        write(static[:15])
