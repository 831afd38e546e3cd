"""The Llama block with its RMSNorms and residual adds fused into the NVFP4 GEMMs (`Fp4GemmBackend.fuses_norm`).

On the CPU the torch reference backend, declared as fusing, runs the base class's default fused ops (the
rms_norm op then the GEMM; the GEMM then the add): the fused block must give the same bits as the plain
one, which checks the block's data flow (which stream value meets which norm and which add). The CUDA
kernel's own fusion is checked against these defaults in tests/gpu/test_cuda_fp4.py.
"""

from __future__ import annotations

import pytest
import torch

from pieceworks.backends.base import BackendSpec
from pieceworks.backends.fp4_gemm.torch import TorchFp4GemmBackend
from pieceworks.core.context import ForwardContext, forward_context
from pieceworks.models.base import Prenormed
from pieceworks.models.llama import Llama, LlamaArgs, LlamaBlock
from pieceworks.parallel.layout import TPLayout
from pieceworks.quant.linear import Fp4Linear


class _FusingTorchBackend(TorchFp4GemmBackend):
    """The torch reference GEMM declared as fusing the rope and the norms: the model takes its fused
    paths and the base class's defaults run them."""

    fuses_qkv_rope = True
    fuses_norm = True


class _Attention:
    """Stands in for the paged attention: out depends on q, k and v of the same token."""

    def forward(self, q, k, v, out, layer_id, scale, kv):
        rep = q.shape[1] // k.shape[1]
        out.copy_(q * 0.5 + (k * v).repeat_interleave(rep, dim=1))


ARGS = LlamaArgs.from_hf(dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                              intermediate_size=96, vocab_size=32))


def _blocks(backend, seed: int = 3, tp: TPLayout = TPLayout()) -> list[LlamaBlock]:
    gen = torch.Generator().manual_seed(seed)
    blocks = []
    for i in range(2):
        b = LlamaBlock(ARGS, i, lambda name: True, tp)
        a, m = b.self_attn, b.mlp
        for layer in (a.qkv_proj.proj, a.o_proj, m.gate_up_proj.proj, m.down_proj):
            w = torch.randn(layer.out_features, layer.in_features, generator=gen) * 0.2
            layer.load(Fp4Linear.from_float(w).fp4_weight())
            layer.prepare(backend)
        for norm in (b.input_layernorm, b.post_attention_layernorm):  # bf16 norms; the NVFP4 buffers as they are
            norm.weight.data = (1 + 0.3 * torch.randn(64, generator=gen)).to(torch.bfloat16)
        blocks.append(b)
    blocks[0].next_norm = (blocks[1].input_layernorm,)  # as Llama links its blocks
    return blocks


def _run(blocks, backend, h, cos, sin):
    """The stream after the blocks (as CausalLM.forward chains them), and each block's `norms_fused`."""
    kernels = type("Kernels", (), {"fp4_gemm": backend, "attention": _Attention()})()
    residual = None
    with forward_context(ForwardContext(kernels, None, None)):
        for b in blocks:
            h, residual = b(h, residual, cos, sin)
    assert not isinstance(residual, Prenormed)  # the last block hands over no norm inputs
    return (h if residual is None else residual + h), [b.norms_fused() for b in blocks]


@pytest.mark.parametrize("tokens", [1, 5])
def test_fused_norm_block_gives_the_plain_blocks_bits(tokens):
    gen = torch.Generator().manual_seed(tokens)
    h = torch.randn(tokens, 64, generator=gen).to(torch.bfloat16)
    ang = torch.rand(tokens, 8, generator=gen) * 30
    cos, sin = ang.cos(), ang.sin()
    plain_backend, fusing_backend = TorchFp4GemmBackend(BackendSpec()), _FusingTorchBackend(BackendSpec())
    plain, plain_flags = _run(_blocks(plain_backend), plain_backend, h, cos, sin)
    fused, fused_flags = _run(_blocks(fusing_backend), fusing_backend, h, cos, sin)
    assert plain_flags == [False, False] and fused_flags == [True, True]
    assert plain.shape == fused.shape == (tokens, 64)
    assert plain.abs().max() > 0.1  # the blocks did something
    assert torch.equal(fused, plain)


def test_tensor_parallel_shards_never_fuse_the_norms():
    """A shard's o and down projections give partial sums that the all-reduce completes before the
    residual add, which the fused block has no place for: shards run the plain block, whatever the backend."""
    fusing_backend = _FusingTorchBackend(BackendSpec())
    assert [b.norms_fused() for b in _blocks(fusing_backend)] == [True, True]
    shards = _blocks(fusing_backend, tp=TPLayout(0, 2))
    assert shards[0].self_attn.o_proj.in_features == 32  # half of the 64 columns
    assert [b.norms_fused() for b in shards] == [False, False]


def test_fused_norm_block_takes_an_unfused_blocks_output():
    """A fused block after a plain one adds the pending residual first (mixed formats or backends)."""
    gen = torch.Generator().manual_seed(9)
    h = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    ang = torch.rand(3, 8, generator=gen) * 30
    cos, sin = ang.cos(), ang.sin()
    plain_backend, fusing_backend = TorchFp4GemmBackend(BackendSpec()), _FusingTorchBackend(BackendSpec())
    mixed = [_blocks(plain_backend)[0], _blocks(fusing_backend)[1]]
    got, flags = _run(mixed, fusing_backend, h, cos, sin)
    ref, _ = _run(_blocks(plain_backend), plain_backend, h, cos, sin)
    assert flags == [False, True]
    assert torch.equal(got, ref)


def _llama(backend) -> Llama:
    hf = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
              intermediate_size=96, vocab_size=32)
    model = Llama(hf, torch.bfloat16, fp4=lambda name: True)
    model.layers = torch.nn.ModuleList(_blocks(backend))
    gen = torch.Generator().manual_seed(5)
    model.embed_tokens.weight.data = torch.randn(32, 64, generator=gen).to(torch.bfloat16)
    model.lm_head.weight.data = torch.randn(32, 64, generator=gen).to(torch.bfloat16)
    model.norm.weight.data = (1 + 0.3 * torch.randn(64, generator=gen)).to(torch.bfloat16)
    return model


def test_llama_forward_with_fused_norm_blocks_gives_the_plain_bits():
    """Through `CausalLM.forward`: the last fused block hands over (stream, None), the final norm takes it."""
    ids, pos = torch.tensor([3, 1, 4, 1, 5]), torch.tensor([0, 1, 2, 3, 4])
    out = {}
    for name, backend in (("plain", TorchFp4GemmBackend(BackendSpec())), ("fused", _FusingTorchBackend(BackendSpec()))):
        model = _llama(backend)
        kernels = type("Kernels", (), {"fp4_gemm": backend, "attention": _Attention()})()
        with forward_context(ForwardContext(kernels, None, None)):
            out[name] = model(ids, pos)
        assert [b.norms_fused() for b in model.layers] == [name == "fused"] * 2
    assert out["plain"].shape == (5, 64) and out["plain"].abs().max() > 0.1
    assert torch.equal(out["fused"], out["plain"])


def test_fused_ops_refuse_the_wrong_projection():
    layer = Fp4Linear.from_float(torch.randn(32, 64))
    x, parts = torch.randn(2, 64), torch.ones(2, 4)
    with pytest.raises(RuntimeError, match="needs a gate/up projection"):
        layer.forward_norm_swiglu(x, x, parts, torch.ones(64), 1e-6)
    with pytest.raises(RuntimeError, match="needs a q/k/v projection"):
        layer.forward_norm_qkv_rope(x, x, parts, torch.ones(64), 1e-6, torch.ones(2, 4), torch.zeros(2, 4))
    layer.gate_up = True
    with pytest.raises(RuntimeError, match="needs a plain projection"):
        layer.forward_add(x, torch.zeros(2, 32))
    with pytest.raises(RuntimeError, match="needs a plain projection"):
        layer.forward_add_norm(x, torch.zeros(2, 32), torch.ones(32))


def test_norm_inputs_partials_sum_to_the_rows_sum_of_squares():
    from pieceworks.backends.fp4_gemm.base import norm_inputs, norm_parts

    s = torch.randn(3, 40).to(torch.bfloat16)
    w = torch.randn(40).to(torch.bfloat16)
    t, parts = norm_inputs(s, w)
    assert norm_parts(40) == 3 and parts.shape == (3, 3) and parts.dtype == torch.float32
    assert torch.equal(t, (s.float() * w.float()).to(torch.bfloat16))
    torch.testing.assert_close(parts.sum(1), s.float().square().sum(1))
    torch.testing.assert_close(parts[:, 2], s[:, 32:].float().square().sum(1))


def _executor(piecewise: bool):
    from pieceworks import Executor

    cfg = {
        "model": {"arch": "llama", "preset": "tiny", "sizes": {"num_hidden_layers": 3}},
        "quantization": {"format": "nvfp4"},
        "runtime": {"device": "cpu", "dtype": "float32"},
        "kv_cache": {"num_tokens": 1024, "page_size": 4},
        "backends": {"fp4_gemm": "torch"},
        "cuda_graph": {"piecewise": {"enabled": "on" if piecewise else "off", "max_tokens": 32,
                                     "sizes": [4, 8, 16, 32]}},
    }
    return Executor.from_config(cfg, progress=False)


def test_fused_norm_blocks_under_piecewise_graphs(monkeypatch):
    """The executor path with a backend that fuses the norms (the torch reference declared so: its default
    fused ops): Dynamo traces the Prenormed hand-over once, and the pieces give the eager logits."""
    from pieceworks.core.batch import ForwardBatch

    monkeypatch.setattr(TorchFp4GemmBackend, "fuses_qkv_rope", True)
    monkeypatch.setattr(TorchFp4GemmBackend, "fuses_norm", True)
    calls = []
    add_norm = TorchFp4GemmBackend.forward_add_norm

    def counted(self, *args):
        calls.append(args[0].shape[0])
        return add_norm(self, *args)

    monkeypatch.setattr(TorchFp4GemmBackend, "forward_add_norm", counted)
    torch._dynamo.reset()
    eager, pw = _executor(False), _executor(True)
    assert all(b.norms_fused() for b in eager.model.layers) and pw.piecewise is not None
    gen = torch.Generator().manual_seed(3)
    steps = [[(0, 5), (1, 12)], [(0, 1), (1, 1)], [(2, 40)], [(0, 1), (2, 1)]]
    out = {}
    calls.clear()  # the piecewise executor's warm-up (tracing) step ran them too
    for name, ex in (("eager", eager), ("pw", pw)):
        seqs, logits = {}, []
        gen.manual_seed(3)
        for step in steps:
            for i, _ in step:
                seqs.setdefault(i, ex.new_sequence())
            toks = [torch.randint(0, 200, (n,), generator=gen).tolist() for _, n in step]
            logits.append(ex.forward(ForwardBatch([seqs[i] for i, _ in step], toks, return_all_logits=True)))
        out[name] = logits
        assert len(calls) == 4 * 5, name  # o and down of 3 blocks but the last down, 4 steps
        calls.clear()
    assert pw.piecewise.backend.num_compiles == 1
    for a, b in zip(out["eager"], out["pw"]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
