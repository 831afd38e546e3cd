"""Every registered backend x op x named scenario against dense references (pieceworks.testing.suite)."""

from pieceworks.testing.suite import (  # noqa: F401
    test_attention,
    test_attention_fp8_kv,
    test_attention_sliding_window,
    test_attention_softcap,
    test_contract,
    test_contract_fp8_kv,
    test_contract_full_extend,
    test_cuda_graph,
    test_cuda_graph_capture,
    test_cuda_graph_full_extend,
    test_fp4_gemm,
    test_fp4_gemm_fused_epilogues,
    test_fp4_gemm_fused_norm_and_residual,
    test_graph_trace,
    test_mla,
    test_moe,
    test_shapes,
)


def test_torch_moe_with_distinct_gate_and_up_global_scales():
    """The reference keeps one global scale per expert part ([E, 2]); checkpoints need not share them."""
    import torch

    from pieceworks.backends.base import BackendSpec, ModelFacts
    from pieceworks.backends.moe.base import MoEWeights
    from pieceworks.backends.moe.torch import TorchMoEBackend
    from pieceworks.quant import nvfp4
    from pieceworks.testing import scenarios as S

    gen = torch.Generator().manual_seed(3)
    w = S.random_moe_weights(8, 64, 32, True, torch.float32, gen, torch.device("cpu"))
    w13 = torch.randn(8, 64, 64, generator=gen) * 0.1
    w13[:, 32:] *= 4  # up rows 4x larger: a different global scale than gate's
    parts = [[nvfp4.quantize_weight(w13[e, :32]), nvfp4.quantize_weight(w13[e, 32:])] for e in range(8)]
    assert all(float(g[2]) != float(u[2]) for g, u in parts)
    w = MoEWeights(torch.stack([torch.cat([g[0], u[0]]) for g, u in parts]),
                   torch.stack([torch.cat([g[1], u[1]]) for g, u in parts]),
                   torch.stack([torch.stack([g[2], u[2]]) for g, u in parts]), *w[3:])
    backend = TorchMoEBackend(BackendSpec(model=ModelFacts(fp4=True, moe_experts=8, moe_quant="nvfp4")))
    x, logits, bias = torch.randn(9, 64, generator=gen), torch.randn(9, 8, generator=gen), torch.zeros(0)
    y = backend.forward(x, logits, bias, w, 2, 1, 1, False, 1.0)
    ref = S.dense_moe(x, logits, bias, w, 2, 1, 1, False, 1.0, numerics="w4a16")
    assert float((y.double() - ref).norm() / ref.norm()) < 1e-5


def test_torch_moe_w4a4_in_bf16_within_the_suites_w4a4_tolerance():
    """The suite's MoE case as the GPU runs it (bf16, hidden 256, intermediate 128), on the CPU: w4a4 in bf16
    lands 2.6e-2 from the float64 reference (h's FP4 codes re-rounded), inside the suite's w4a4
    tolerance (5e-2) and outside the w4a16 one (2e-2), which the GPU case failed before."""
    import torch

    from pieceworks.backends.base import BackendSpec, ModelFacts, parse_options
    from pieceworks.backends.moe.torch import TorchMoEBackend
    from pieceworks.testing import scenarios as S
    from pieceworks.testing.shapes import rel_err as _rel_err

    facts = ModelFacts(arch="deepseek_v3", dtype=torch.bfloat16, fp4=True, moe_experts=8, moe_quant="nvfp4")
    errs = {}
    for numerics in ("w4a16", "w4a4"):
        impl = TorchMoEBackend(BackendSpec(device="cpu", model=facts, fp4_numerics=numerics),
                               parse_options(TorchMoEBackend, {}))
        gen = torch.Generator().manual_seed(7)
        w = S.random_moe_weights(8, 256, 128, True, torch.bfloat16, gen, torch.device("cpu"))
        x = torch.randn(11, 256, generator=gen).to(torch.bfloat16)
        logits, bias = torch.randn(11, 8, generator=gen), torch.rand(8, generator=gen) * 0.1
        args = (3, 4, 2, True, 2.5)
        y = impl.forward(x, logits, bias, impl.prepare(w), *args)
        errs[numerics] = _rel_err(y, S.dense_moe(x, logits, bias, w, *args, numerics=numerics))
    assert errs["w4a16"] < 2e-2 and errs["w4a4"] < 5e-2, errs
