"""Every registered backend x op x named scenario against dense references (pieceworks.testing.suite)."""

from pieceworks.testing.suite import (  # noqa: F401
    test_attention,
    test_fp4_gemm,
    test_fp4_gemm_fused_epilogues,
    test_fp4_gemm_fused_norm_and_residual,
    test_mla,
    test_moe,
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
