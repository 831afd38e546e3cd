"""Every registered backend x op x named scenario against dense references (pieceworks.testing.suite)."""

from pieceworks.testing.suite import test_attention, test_fp4_gemm, test_mla, test_moe  # noqa: F401
